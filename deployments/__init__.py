"""Ray Serve deployments: ingress, predictor, engine server (one class, two tiers), builder.

So far: the length-predictor deployment (predictor.py). The rest arrives with issue #4.
"""
