"""Training the length predictor: dataset, training loop, pipeline, metrics, retraining, feedback collection."""
