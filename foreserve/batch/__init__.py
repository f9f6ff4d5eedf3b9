"""The batch job: ``python -m foreserve.batch.job INPUT --output DIR`` runs in a Ray cluster (the
Jobs client in ``app.batch.jobs`` submits it); its stages are Ray Data actors (``stages``)."""
