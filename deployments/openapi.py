"""The OpenAPI schema of routes that read their own body (for the size limit, strict parsing and
OpenAI-shaped errors before FastAPI would): FastAPI sees no body parameter there, so the schema it
builds says nothing of the body. ``document_bodies`` adds each route's pydantic model as its JSON
request body, so ``/docs`` shows it and a schema fuzzer (``foreserve chaos``'s ``fuzz``) generates it."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"


def document_bodies(app: FastAPI, bodies: dict[tuple[str, str], type[BaseModel]]) -> None:
    """``bodies``: (path, method) -> the model of its JSON body."""

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        keys, defs = models_json_schema([(model, "validation") for model in bodies.values()], ref_template=REF)
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        for (path, method), model in bodies.items():
            schema["paths"][path][method]["requestBody"] = {
                "required": True, "content": {"application/json": {"schema": keys[(model, "validation")]}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
