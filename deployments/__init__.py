"""Ray Serve deployments: ingress (OpenAI API), engine server (one class, two pools), the shared
length predictor, the KV-aware request router, Prometheus metrics and the app builder."""
