"""vLLM's tokenizer routes: /tokenize, /detokenize and /tokenizer_info, so a client can count and split
tokens as this server does."""

from __future__ import annotations

from fastapi import APIRouter, Request

from nanoserve.server.context import APIError, RouteContext, off_loop, rendered_off_loop
from nanoserve.server.openapi import ERRORS, ok
from nanoserve.server.prompts import chat_prompt
from nanoserve.server.protocol import DetokenizeRequest, TokenizeRequest
from nanoserve.server.schemas import DetokenizeResponse, TokenizeResponse, TokenizerInfo


def add_routes(routes: APIRouter, ctx: RouteContext) -> None:
    """The routes over the serving engine's tokenizer (read per request: a restart may bring a new one)."""
    host = ctx.host

    @routes.post("/tokenize", responses={**ERRORS, **ok(TokenizeResponse)})
    async def tokenize(body: TokenizeRequest, request: Request):
        engine = host.serving()
        tokenizer = engine.tokenizer
        ctx.check_model(body.model)
        if body.messages is not None:
            ctx.check_template_trusted(body.chat_template)
            chat = body.as_chat()
            ids = await rendered_off_loop(request, chat_prompt, chat, tokenizer, chat.tool_request())
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await off_loop(tokenizer.encode, body.prompt, add_special_tokens=special)
        strs = [tokenizer.token_piece(t) for t in ids] if body.return_token_strs else None  # vocabulary strings
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs}

    @routes.post("/detokenize", responses={**ERRORS, **ok(DetokenizeResponse)})
    async def detokenize(body: DetokenizeRequest):
        ctx.check_model(body.model)
        engine = host.serving()
        tokenizer, vocab = engine.tokenizer, engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @routes.get("/tokenizer_info", responses=ok(TokenizerInfo))
    async def tokenizer_info():
        """vLLM's route: what a client needs to tokenize as this server does (lm-eval's remote tokenizer)."""
        engine = host.serving()
        tokenizer = engine.tokenizer
        return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
                "eos_token": tokenizer.eos_token, "pad_token": None, "model_max_length": engine.max_model_len,
                "chat_template": tokenizer.chat_template}
