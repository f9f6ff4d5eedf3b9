"""Ray Serve deployments: ingress, predictor, engine server (one class, two tiers), builder.

So far: the length-predictor deployment (predictor.py) and the engine server (engine_server.py).
The ingress, the KV-aware router and the builder arrive with the rest of issue #4.
"""
