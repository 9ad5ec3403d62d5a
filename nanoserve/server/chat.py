"""POST /v1/chat/completions: n choices, logprobs, usage on every chunk when asked (continuous_usage_stats)."""

from __future__ import annotations

import time

from nanoserve.server.fanout import Choice, Fanout, sse
from nanoserve.server.protocol import ChatCompletionRequest
from nanoserve.server.responses import chat_logprobs, prompt_logprobs_json, token_namer, usage


class ChatResponder:
    def __init__(self, body: ChatCompletionRequest, fanout: Fanout, tokenizer, model: str, rid: str, metrics):
        self.body, self.fanout, self.model, self.rid, self.metrics = body, fanout, model, rid, metrics
        self.name = token_namer(tokenizer, body.return_tokens_as_token_ids)
        self.created = int(time.time())
        self.base = {"id": rid, "object": "chat.completion.chunk", "created": self.created, "model": model}

    async def whole(self) -> dict:
        async for _, out in self.fanout.outputs():
            if out.outputs[0].finish_reason is not None:
                self.metrics.observe(out)
        body = {"id": self.rid, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [self._choice_json(c) for c in self.fanout.choices], "usage": usage(*self.fanout.usage_counts())}
        if self.body.prompt_logprobs is not None:
            scored = self.fanout.prompt_logprobs[0]
            body["prompt_logprobs"] = prompt_logprobs_json(scored.entries(), self.name) if scored else None
        return body

    def stream(self):
        return sse(self._events())

    async def _events(self):
        for choice in self.fanout.choices:  # every choice opens with its role, before any text
            yield self._chunk(choice, {"role": "assistant", "content": ""}, None, None)
        async for choice, out in self.fanout.outputs():
            c = choice.completion
            if c.finish_reason is not None:
                self.metrics.observe(out)
            if out.delta_text or c.finish_reason is not None:
                yield self._chunk(choice, {"content": out.delta_text}, self._new_logprobs(choice), c.finish_reason)
        options = self.body.stream_options
        if options is not None and options.include_usage:
            yield {**self.base, "choices": [], "usage": usage(*self.fanout.usage_counts())}

    def _chunk(self, choice: Choice, delta: dict, logprobs, finish_reason) -> dict:
        chunk = {**self.base, "choices": [{"index": choice.index, "delta": delta, "logprobs": logprobs,
                                           "finish_reason": finish_reason}]}
        options = self.body.stream_options
        if options is not None and options.continuous_usage_stats:
            generated = len(choice.completion.token_ids) if choice.completion is not None else 0
            chunk["usage"] = usage(len(self.fanout.prompts[0]), generated)
        return chunk

    def _new_logprobs(self, choice: Choice) -> dict | None:
        """Logprobs of every token since the last chunk: tokens whose text was held back keep theirs."""
        if self.body.chat_logprobs() is None:
            return None
        entries = choice.completion.logprobs.entries(choice.sent_logprobs)
        choice.sent_logprobs += len(entries)
        return chat_logprobs(entries, self.name)

    def _choice_json(self, choice: Choice) -> dict:
        c = choice.completion
        logprobs = chat_logprobs(c.logprobs.entries(), self.name) if self.body.chat_logprobs() is not None else None
        return {"index": choice.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
