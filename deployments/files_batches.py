"""OpenAI's Files and Batch API on the ingress: ``/v1/files`` and ``/v1/batches`` (batches are
foreserve batch jobs, Ray Jobs on Ray Data through the app's offline pool; ``app/batch/api.py``).
Each file and batch belongs to the key that created it: another key gets 404 for it."""

from __future__ import annotations

import asyncio

from fastapi import Request, Response
from pydantic import ValidationError

from app.api import errors
from app.batch.api import BatchCreate, BatchStore
from app.config import AppConfig
from deployments.http_app import HttpEdge, app


class FilesAndBatches(HttpEdge):
    """The routes; the class that inherits them sets ``config``, ``api_keys`` and ``batches``."""

    config: AppConfig
    batches: BatchStore

    @app.post("/v1/files")
    async def create_file(self, request: Request) -> dict:
        owner = self._authorize(request)
        limit = self.config.ingress.max_file_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise errors.too_large(limit)
        try:
            form = await request.form(max_files=1, max_part_size=limit)
        except Exception as exc:  # noqa: BLE001 - a malformed multipart body is the client's
            raise errors.bad_request(f"Expected a multipart form with `file` and `purpose`: {exc}") from None
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise errors.bad_request("Missing the `file` part.", param="file")
        content = await upload.read()
        file = await asyncio.to_thread(self.batches.add_file, upload.filename or "", content, str(form.get("purpose", "")),
                                       owner)
        return file.model_dump()

    @app.get("/v1/files/{file_id}")
    async def get_file(self, file_id: str, request: Request) -> dict:
        owner = self._authorize(request)
        return (await asyncio.to_thread(self.batches.get_file, file_id, owner)).model_dump()

    @app.get("/v1/files/{file_id}/content")
    async def file_content(self, file_id: str, request: Request) -> Response:
        owner = self._authorize(request)
        content = await asyncio.to_thread(self.batches.file_content, file_id, owner)
        return Response(content, media_type="application/octet-stream")

    @app.post("/v1/batches")
    async def create_batch(self, request: Request) -> dict:
        owner = self._authorize(request)
        data = await self._json(request, self.config.ingress.max_body_bytes)
        try:
            body = BatchCreate.model_validate(data)
        except ValidationError as exc:
            raise errors.from_validation_error(exc) from None
        return (await asyncio.to_thread(self.batches.create, body, owner)).model_dump()

    @app.get("/v1/batches")
    async def list_batches(self, request: Request, limit: int = 20) -> dict:
        owner = self._authorize(request)
        return await asyncio.to_thread(self.batches.list, max(1, min(limit, 100)), owner)

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(self, batch_id: str, request: Request) -> dict:
        owner = self._authorize(request)
        return (await asyncio.to_thread(self.batches.get, batch_id, owner)).model_dump()

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(self, batch_id: str, request: Request) -> dict:
        owner = self._authorize(request)
        return (await asyncio.to_thread(self.batches.cancel, batch_id, owner)).model_dump()
