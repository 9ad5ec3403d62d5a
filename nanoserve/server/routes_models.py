"""/v1/models: the one model this server serves, as OpenAI's model list and model card."""

from __future__ import annotations

from fastapi import APIRouter

from nanoserve.server.context import RouteContext
from nanoserve.server.openapi import ERRORS, ok
from nanoserve.server.schemas import ModelCard, ModelList


def model_card(ctx: RouteContext) -> dict:
    """The served model's card; max_model_len is the engine's now (a restart may change it)."""
    return {"id": ctx.model_name, "object": "model", "created": 0, "owned_by": "nanoserve", "root": ctx.model_name,
            "parent": None, "max_model_len": ctx.host.serving().max_model_len}


def add_routes(routes: APIRouter, ctx: RouteContext) -> None:
    """/v1/models and /v1/models/{id} on `routes` (the app's own router)."""

    @routes.get("/v1/models", responses=ok(ModelList))
    async def models():
        return {"object": "list", "data": [model_card(ctx)]}

    @routes.get("/v1/models/{model_id:path}", responses={**ERRORS, **ok(ModelCard)})
    async def model(model_id: str):
        ctx.check_model(model_id)
        return model_card(ctx)
