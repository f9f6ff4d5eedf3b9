"""Ray Serve deployments: ingress, predictor, engine server (one class, two tiers), builder.

Not built yet: this package arrives with issue #4 (the Ray Serve application).
"""
