"""OpenAI-compatible request/response schemas and the error shape (no FastAPI or Ray here)."""
