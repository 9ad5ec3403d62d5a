"""OpenAI's generation routes: /v1/completions and /v1/chat/completions.

Each request is admitted (RouteContext.admit), prepared off the event loop (prompts tokenized, the chat
template rendered), handed to the engine as one Fanout of its prompts, and answered by a responder in the
route's own JSON shape, streamed or whole.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from nanoserve.server.chat import ChatResponder
from nanoserve.server.completions import CompletionResponder, engine_max_tokens, prompt_logprobs_wanted
from nanoserve.server.context import APIError, RouteContext, off_loop, respond
from nanoserve.server.openapi import ERRORS, streamed
from nanoserve.server.prompts import completion_prompts
from nanoserve.server.protocol import ChatCompletionRequest, CompletionRequest
from nanoserve.server.schemas import ChatResponse, CompletionResponse
from nanoserve.server.turn import prepare_turn


async def complete(ctx: RouteContext, body: CompletionRequest, request: Request):
    """/v1/completions: one or more prompts (text or token ids), each sampled n times."""
    ctx.admit(body)
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens 0 generates nothing; it is only meaningful with echo (to score the "
                            "prompt); send max_tokens >= 1", param="max_tokens")
    engine = ctx.host.serving()  # read per request: a restart may bring a new engine
    tokenizer = engine.tokenizer
    prompts = await off_loop(completion_prompts, body, tokenizer, engine.model_config.vocab_size,
                             engine.max_model_len)
    ids = [p[1] for p in prompts]
    longest = max(ids, key=len)
    params = body.sampling_params(engine_max_tokens(body, ctx.room_for(engine, longest)), body.logprobs,
                                  prompt_logprobs_wanted(body))
    rid = ctx.request_id(body, "cmpl")
    fanout = await ctx.fanout(engine, ids, params, rid, body)
    responder = CompletionResponder(body, fanout, [p[0] for p in prompts], tokenizer, ctx.model_name, rid,
                                    ctx.metrics)
    return await respond(responder, body, request)


async def chat_complete(ctx: RouteContext, body: ChatCompletionRequest, request: Request):
    """/v1/chat/completions: the messages rendered with the chat template; tool calls read by the turn's parser."""
    turn = await prepare_turn(ctx, body, "chatcmpl", request)
    responder = ChatResponder(body, turn.fanout, turn.tokenizer, ctx.model_name, turn.rid, ctx.metrics, turn.parser,
                              turn.prompt_text)
    return await respond(responder, body, request)


def add_routes(routes: APIRouter, ctx: RouteContext) -> None:
    """The two routes on `routes` (the app's own router); their bodies are the functions above."""

    @routes.post("/v1/completions", responses={**ERRORS, **streamed(CompletionResponse)})
    async def completions(body: CompletionRequest, request: Request):
        return await complete(ctx, body, request)

    @routes.post("/v1/chat/completions", responses={**ERRORS, **streamed(ChatResponse)})
    async def chat(body: ChatCompletionRequest, request: Request):
        return await chat_complete(ctx, body, request)
