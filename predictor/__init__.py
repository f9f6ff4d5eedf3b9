"""Output-length prediction: buckets, the predictor interface and its implementations."""
