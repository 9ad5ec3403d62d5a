"""POST /v1/completions: prompts in every accepted shape, n choices each, echo with the prompt's logprobs, and
vLLM's return_token_ids (each choice's prompt ids, and its generated ids, streamed as they come)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from nanoserve.server.fanout import Choice, Fanout, sse
from nanoserve.server.protocol import CompletionRequest
from nanoserve.server.responses import completion_logprobs, prompt_logprobs_json, token_namer, usage


@dataclass
class _Echo:
    """What echo adds in front of a choice's text: the prompt itself, and its logprobs when asked."""

    texts: list[str]  # per prompt
    only: bool  # max_tokens 0: the prompt is the whole answer, nothing is generated


def engine_max_tokens(body: CompletionRequest, room: int) -> int:
    """max_tokens for the engine; echo with max_tokens 0 scores the prompt and keeps no generated token."""
    if body.max_tokens == 0:
        return 1
    return body.max_tokens if body.max_tokens is not None else room


def prompt_logprobs_wanted(body: CompletionRequest) -> int | None:
    """Echo with logprobs needs the prompt's logprobs (vLLM: prompt_logprobs = logprobs); the wider of the two
    asks wins, and -1 (the whole vocabulary) is the widest."""
    if body.echo and body.logprobs is not None:
        asks = (body.logprobs, body.prompt_logprobs or 0)
        return -1 if -1 in asks else max(asks)
    return body.prompt_logprobs


class CompletionResponder:
    def __init__(self, body: CompletionRequest, fanout: Fanout, prompt_texts: list[str], tokenizer, model: str,
                 rid: str, metrics):
        self.body, self.fanout, self.model, self.rid, self.metrics = body, fanout, model, rid, metrics
        self.echo = _Echo(prompt_texts, body.max_tokens == 0) if body.echo else None
        self.name = token_namer(tokenizer, body.return_tokens_as_token_ids)
        self.created = int(time.time())

    async def whole(self) -> dict:
        async for _, out in self.fanout.outputs():
            self._observe(out)
        choices = [self._choice_json(c) for c in self.fanout.choices]
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage(*self._usage()), "service_tier": None, "system_fingerprint": None,
                "kv_transfer_params": None,  # vLLM's fields, null when not asked for (clients read them)
                **self.fanout.timing_field()}

    def stream(self):
        return sse(self._events())

    async def _events(self):
        async for choice, out in self.fanout.outputs():
            self._observe(out)
            if self.echo is not None and not choice.started:
                yield self._chunk(choice, *self._echo_piece(choice), None)
            c = choice.completion
            if self.echo is not None and self.echo.only:
                if c.finish_reason is not None:
                    yield self._chunk(choice, "", None, c.finish_reason)
                continue
            if out.delta_text or c.finish_reason is not None:
                yield self._chunk(choice, out.delta_text, self._new_logprobs(choice), c.finish_reason)
        options = self.body.stream_options
        if options is not None and options.include_usage:
            yield {**self._base(), "choices": [], "usage": usage(*self._usage()), **self.fanout.timing_field()}

    # ---- pieces -------------------------------------------------------------------------------------
    def _base(self) -> dict:
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model}

    def _chunk(self, choice: Choice, text: str, logprobs, finish_reason) -> dict:
        item = {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.body.return_token_ids:  # the prompt's ids on a choice's first chunk, then the new ids on each
            if not choice.started:
                item["prompt_token_ids"] = list(self.fanout.prompts[choice.prompt])
            item["token_ids"] = [] if self.echo is not None and self.echo.only else self.fanout.new_token_ids(choice)
        choice.started = True
        chunk = {**self._base(), "choices": [item]}
        choice.sent_chars += len(text)
        options = self.body.stream_options
        if options is not None and options.include_usage and options.continuous_usage_stats:
            generated = 0 if self.echo is not None and self.echo.only else len(choice.completion.token_ids)
            chunk["usage"] = usage(len(self.fanout.prompts[choice.prompt]), generated)
        return chunk

    def _echo_piece(self, choice: Choice) -> tuple[str, dict | None]:
        """The prompt text (and its logprobs) that start an echoed choice."""
        text = self.echo.texts[choice.prompt]
        logprobs = None
        if self.body.logprobs is not None:
            ids, entries = self._prompt_part(choice.prompt)
            logprobs = completion_logprobs(ids, entries, self.name, offset=choice.sent_chars)
        return text, logprobs

    def _prompt_part(self, prompt: int) -> tuple[list[int], list]:
        ids = self.fanout.prompts[prompt]
        scored = self.fanout.prompt_logprobs[prompt]
        entries = scored.entries() if scored is not None else [None] * len(ids)
        return ids, entries

    def _new_logprobs(self, choice: Choice) -> dict | None:
        """Logprobs of every token since the last chunk: tokens whose text was held back keep theirs."""
        if self.body.logprobs is None:
            return None
        c = choice.completion
        entries = c.logprobs.entries(choice.sent_logprobs)
        ids = c.token_ids[choice.sent_logprobs: choice.sent_logprobs + len(entries)]
        choice.sent_logprobs += len(entries)
        return completion_logprobs(ids, entries, self.name, offset=choice.sent_chars)

    def _choice_json(self, choice: Choice) -> dict:
        c = choice.completion
        text, ids = c.text, list(c.token_ids)
        entries = c.logprobs.entries() if c.logprobs is not None else None
        if self.echo is not None:
            if self.echo.only:  # the one token the engine sampled is not part of the answer
                text, ids, entries = "", [], ([] if entries is not None else None)
            p_ids, p_entries = self._prompt_part(choice.prompt)
            text, ids = self.echo.texts[choice.prompt] + text, p_ids + ids
            entries = p_entries + entries if entries is not None else None
        out = {"index": choice.index, "text": text,
               "logprobs": completion_logprobs(ids, entries, self.name) if self.body.logprobs is not None else None,
               "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
               "prompt_logprobs": None, "prompt_token_ids": None, "token_ids": None}  # vLLM's, null when not asked
        if self.body.return_token_ids:
            out["prompt_token_ids"] = list(self.fanout.prompts[choice.prompt])
            out["token_ids"] = [] if self.echo is not None and self.echo.only else list(c.token_ids)
        if self.body.prompt_logprobs is not None:
            scored = self.fanout.prompt_logprobs[choice.prompt]
            out["prompt_logprobs"] = prompt_logprobs_json(scored.entries(), self.name) if scored else None
        return out

    def _usage(self) -> tuple[int, int, int | None]:
        prompt, completion, cached = self.fanout.usage_counts()
        return (prompt, 0, cached) if self.echo is not None and self.echo.only else (prompt, completion, cached)

    def _observe(self, out) -> None:
        if out.outputs[0].finish_reason is not None:
            self.metrics.observe(out)
