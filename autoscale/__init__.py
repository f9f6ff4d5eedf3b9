"""Autoscaling: what replicas report (signals.py), the online/offline rules and the app-level
ElasticPolicy that Ray Serve runs (policy.py), and the decision log (decisions.py).

Capacity planning in modelled time lives in ``planning/``.
"""
