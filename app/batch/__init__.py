"""Offline batch jobs: the job driver, Ray Data stages, row io, the Ray Jobs client and the Files/Batch API objects."""
