"""The operator's routes: /health, /metrics, /reset_prefix_cache, /version and the request timelines
(/requests, /requests/{request_id}); no model, no OpenAI shape."""

from __future__ import annotations

import dataclasses
import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from nanoserve.errors import ConfigError, shown
from nanoserve.server.access import WITHHELD
from nanoserve.server.context import APIError, RouteContext, not_json_message, server_version
from nanoserve.server.openapi import ERRORS, NOT_KEPT, ok
from nanoserve.server.schemas import Version

# POST /knobs reads its body itself; declaring it documents it, and tells the guard the route takes one
KNOBS_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": {"type": "object", "description": "live flags to change, e.g. {\"max_num_seqs\": 8}"}}}}}


def add_routes(routes: APIRouter, ctx: RouteContext) -> None:
    """The routes probes, scrapers and operators call, over the host and the metrics."""
    host, metrics = ctx.host, ctx.metrics

    @routes.get("/health", summary="The engine's stats snapshot (flags, scheduler, KV pool, paged read, rows); "
                                   "503 with the reason while it is stopped, failing repeatedly, or failed to load. "
                                   "On a server with an API key, a caller without it gets the status and reason only",
                responses={503: {"description": "The snapshot, with status stopped, unhealthy or failed and the "
                                                "reason"}})
    async def health(request: Request):
        state = host.health()
        body = {"status": state.status, "reason": state.reason}
        if request.state.authorized:
            if state.detail:
                body["reason"] = f"{state.reason}; {state.detail}"
            body |= {"failed_steps_total": host.failures.total, **host.stats().as_dict()}
        else:
            body["snapshot"] = WITHHELD
        return JSONResponse(body, status_code=200 if state.ok else 503)

    @routes.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics (text/plain)",
                responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @routes.post("/reset_prefix_cache", responses={401: ERRORS[401], 503: ERRORS[503]},
                 summary="Forget every cached KV block's name (vLLM's route); requests running keep their blocks. "
                         "Guarded by the API key.")
    async def reset_prefix_cache(request: Request):
        who = f"http {request.client.host if request.client else '?'}"
        forgotten = await host.reset_prefix_cache(who)
        return {"reset": True, "blocks_forgotten": forgotten}

    @routes.get("/knobs", responses={401: ERRORS[401]},
                summary="The flags that change live (at the next step, with no restart) and the log of changes: "
                        "when, at which step, who asked, old and new. Guarded by the API key")
    async def knobs():
        return await host.knobs()

    @routes.post("/knobs", responses={400: ERRORS[400], 401: ERRORS[401], 503: ERRORS[503]}, openapi_extra=KNOBS_BODY,
                 summary="Change live flags, e.g. {\"max_num_seqs\": 8}: checked as at start, in force from the "
                         "next step, logged as asked over HTTP. A flag that needs a restart is refused with the "
                         "live ones listed. Guarded by the API key")
    async def set_knobs(request: Request):
        changes = await _json_object(request)
        who = f"http {request.client.host if request.client else '?'}"
        try:
            done = await host.set_live(changes, who)
        except ConfigError as e:
            raise APIError(400, str(e)) from None
        return {"changed": [dataclasses.asdict(c) for c in done]}

    @routes.get("/requests", responses={401: ERRORS[401], 503: ERRORS[503]},
                summary="Live and recently finished sequences (the latest 1,000), a line each: status, queue time, "
                        "TTFT, TPOT, total time, tokens, cached tokens, preemptions, drafts kept; ?match=text keeps "
                        "those whose id, status or finish reason contains it. Guarded by the API key")
    async def requests_table(match: str = ""):
        """`?match=text`: only the sequences whose id, status or finish reason contains it."""
        return {"requests": await host.request_rows(match)}

    @routes.get("/requests/{request_id}", responses={401: ERRORS[401], 503: ERRORS[503],
                                                     404: NOT_KEPT},
                summary="A request's timeline, one per sequence: its spans (queued, each prefill chunk with its "
                        "cached tokens, decode runs with the rows they shared, preemptions), figures, sampling "
                        "parameters, prompt and answer, and its KV blocks while live. Guarded by the API key")
    async def request_timeline(request_id: str):
        found = await host.request_timeline(request_id)
        if not found:
            raise APIError(404, f"no request {shown(request_id)} is live or among the latest finished; "
                                "GET /requests lists the ones kept", "not_found_error")
        return {"request_id": request_id, "sequences": found}

    @routes.api_route("/ping", methods=["GET", "POST"], responses={503: {"description": "Not serving, and why"}},
                      summary="SageMaker's health check (vLLM's route): 200 while the engine serves, else 503 with "
                              "the reason")
    async def ping():
        state = host.health()
        return JSONResponse({"status": state.status, "reason": state.reason}, status_code=200 if state.ok else 503)

    @routes.get("/load", summary="The generation requests in flight, from arrival to the answer's last byte "
                                 "(vLLM's route, which routers poll): {\"server_load\": N}")
    async def load():
        return {"server_load": ctx.load.in_flight}

    @routes.get("/version", responses=ok(Version))
    async def version():
        return {"version": server_version()}


async def _json_object(request: Request) -> dict:
    """The body as a JSON object, or a 400 saying what to send."""
    try:
        body = json.loads(await request.body() or b"null")
    except json.JSONDecodeError as e:
        raise APIError(400, not_json_message(e.doc, e.pos, e.msg) + '; send a JSON object of flags to change, '
                            'e.g. {"max_num_seqs": 8}') from None
    except ValueError:  # not UTF-8
        body = None
    if not isinstance(body, dict) or not body:
        raise APIError(400, 'send a JSON object of flags to change, e.g. {"max_num_seqs": 8}')
    return body
