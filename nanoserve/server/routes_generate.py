"""OpenAI's generation routes: /v1/completions and /v1/chat/completions; vLLM's /v1/chat/completions/batch (many
conversations, one choice each) and /invocations (SageMaker's route: either request, told apart by its body).

Each request is admitted (RouteContext.admit), prepared off the event loop (prompts tokenized, the chat
template rendered), handed to the engine as one Fanout of its prompts, and answered by a responder in the
route's own JSON shape, streamed or whole.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from nanoserve.errors import NanoserveError
from nanoserve.server.beam import chat_with_beams, complete_with_beams
from nanoserve.server.chat import ChatResponder
from nanoserve.server.completions import CompletionResponder, engine_max_tokens, prompt_logprobs_wanted
from nanoserve.server.context import (
    APIError,
    RouteContext,
    not_json_message,
    off_loop,
    rendered_off_loop,
    respond,
    validated,
)
from nanoserve.server.openapi import ERRORS, streamed
from nanoserve.server.prompts import completion_prompts, rendered_chat
from nanoserve.server.protocol import ChatCompletionRequest, CompletionRequest
from nanoserve.server.schemas import ChatResponse, CompletionResponse
from nanoserve.server.turn import prepare_turn


async def complete(ctx: RouteContext, body: CompletionRequest, request: Request):
    """/v1/completions: one or more prompts (text or token ids), each sampled n times."""
    ctx.admit(body)
    if body.use_beam_search:
        return await complete_with_beams(ctx, body, request)
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
    if body.use_beam_search:
        ctx.admit(body)
        return await chat_with_beams(ctx, body, request)
    turn = await prepare_turn(ctx, body, "chatcmpl", request)
    responder = ChatResponder(body, turn.fanout, turn.tokenizer, ctx.model_name, turn.rid, ctx.metrics, turn.parser,
                              turn.prompt_text)
    return await respond(responder, body, request)


class BatchChatRequest(BaseModel):
    """vLLM's batch chat request: a chat request whose `messages` is a list of conversations."""

    model_config = ConfigDict(extra="allow")
    messages: list[list[dict[str, Any]]] = Field(min_length=1, max_length=1024)


# what the batch route refuses (vLLM's limits), and why: each asks for something a batch of whole answers lacks
BATCH_REFUSED = {"tools": "tool use is not batched; send each conversation with tools on /v1/chat/completions",
                 "n": "a batch answers each conversation once (n 1); send n on /v1/chat/completions",
                 "echo": "echo belongs to one conversation; send it on /v1/chat/completions",
                 "prompt_logprobs": "prompt logprobs belong to one conversation; ask on /v1/chat/completions",
                 "return_prompt_text": "a rendered prompt belongs to one conversation; ask on /v1/chat/completions"}
# the values of each refused field that ask for nothing (prompt_logprobs 0 asks for the prompt's own tokens)
_ASKS_NOTHING = {"tools": (None, []), "n": (None, 1), "echo": (None, False), "prompt_logprobs": (None,),
                 "return_prompt_text": (None, False)}


def _same(value, quiet) -> bool:
    """Equal and of the same type, so 0 is not False and True is not 1."""
    return type(value) is type(quiet) and value == quiet


async def batch_chat_complete(ctx: RouteContext, batch: BatchChatRequest, request: Request):
    """/v1/chat/completions/batch: every conversation rendered and admitted as one request of several prompts;
    the answer is one chat completion whose choice i answers conversation i (streamed too, each chunk naming its
    choice, where vLLM answers whole only)."""
    fields = batch.model_dump(exclude_unset=True)
    for name, why in BATCH_REFUSED.items():
        if not any(_same(fields.get(name), quiet) for quiet in _ASKS_NOTHING[name]):
            raise APIError(400, f"{name} is not supported on the batch route: {why}", param=name)
    bodies = [validated(ChatCompletionRequest, {**fields, "messages": conversation}, "messages", i)
              for i, conversation in enumerate(batch.messages)]
    for body in bodies:
        ctx.admit(body)
        ctx.check_template_trusted(body.chat_template)
    engine = ctx.host.serving()
    ids = []
    for i, body in enumerate(bodies):
        try:
            ids.append((await rendered_off_loop(request, rendered_chat, body, engine.tokenizer, None,
                                                engine.max_model_len))[1])
        except NanoserveError as e:
            raise APIError(400, f"conversation {i}: {e}", param=f"messages.{i}") from None
    first = bodies[0]
    limit = first.token_limit()
    params = first.sampling_params(limit if limit is not None else ctx.room_for(engine, max(ids, key=len)),
                                   first.chat_logprobs())
    rid = ctx.request_id(first, "chatcmpl")
    fanout = await ctx.fanout(engine, ids, params, rid, first)
    responder = ChatResponder(first, fanout, engine.tokenizer, ctx.model_name, rid, ctx.metrics)
    return await respond(responder, first, request)


async def invocation(ctx: RouteContext, request: Request):
    """/invocations: a chat request (it has `messages`) or a completion request (it has `prompt`)."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise APIError(400, not_json_message(raw, getattr(e, "pos", None), getattr(e, "msg", None))) from None
    if isinstance(data, dict) and "messages" in data:
        return await chat_complete(ctx, validated(ChatCompletionRequest, data), request)
    if isinstance(data, dict) and "prompt" in data:
        return await complete(ctx, validated(CompletionRequest, data), request)
    raise APIError(400, "an /invocations body is a chat completion request (with messages) or a completion "
                        "request (with prompt); this one has neither")


INVOCATION_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "description": "a /v1/chat/completions body (with messages) or a /v1/completions body (with "
                                     "prompt)"}}}}}


def add_routes(routes: APIRouter, ctx: RouteContext) -> None:
    """The routes on `routes` (the app's own router); their bodies are the functions above."""

    @routes.post("/v1/completions", responses={**ERRORS, **streamed(CompletionResponse)})
    async def completions(body: CompletionRequest, request: Request):
        return await complete(ctx, body, request)

    @routes.post("/v1/chat/completions", responses={**ERRORS, **streamed(ChatResponse)})
    async def chat(body: ChatCompletionRequest, request: Request):
        return await chat_complete(ctx, body, request)

    @routes.post("/v1/chat/completions/batch", responses={**ERRORS, 200: {"model": ChatResponse}},
                 summary="vLLM's batch chat: messages is a list of conversations; choice i answers conversation i "
                         "(whole or streamed; no tools or n)")
    async def chat_batch(body: BatchChatRequest, request: Request):
        return await batch_chat_complete(ctx, body, request)

    @routes.post("/invocations", responses={**ERRORS, **streamed(ChatResponse)}, openapi_extra=INVOCATION_BODY,
                 summary="SageMaker's route (vLLM's): a chat completion or a completion, told apart by its body")
    async def invocations(request: Request):
        return await invocation(ctx, request)
