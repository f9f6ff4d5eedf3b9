"""Autoscaling and capacity planning.

signals.py (what replicas report, per pool), policy.py (online/offline rules and the app-level
ElasticPolicy that Ray Serve runs), decisions.py (the decision log and metrics), capacity.py (one
replica on the engine's simulator), planner.py (``foreserve plan``), day.py (the simulated day),
calibrate.py (the cost model against this CPU).
"""
