"""POST /v1/chat/completions: n choices, logprobs, usage on every chunk when asked (continuous_usage_stats), and
tool calls read out of each choice's text by the request's parser (nanoserve.tools.parsers), streamed as
`delta.tool_calls` pieces. vLLM's extensions: echo (the last message's content in front of the reply when it
is the reply's own role, for prefill-style continuation), return_token_ids and return_prompt_text."""

from __future__ import annotations

import time

from nanoserve.server.fanout import Choice, Fanout, sse
from nanoserve.server.protocol import ChatCompletionRequest
from nanoserve.server.responses import chat_logprobs, prompt_logprobs_json, token_namer, usage
from nanoserve.tools.parsers import Arguments, CallStart, Content, joined, whole_reply


class ChatResponder:
    def __init__(self, body: ChatCompletionRequest, fanout: Fanout, tokenizer, model: str, rid: str, metrics,
                 parser=None, prompt_text: str = ""):
        """`parser` makes each choice's tool-call parser (None: the reply is text); `prompt_text` is what the
        chat template rendered (returned with return_prompt_text)."""
        self.body, self.fanout, self.model, self.rid, self.metrics = body, fanout, model, rid, metrics
        self.parser, self.prompt_text = parser, prompt_text
        self.echoed = echoed_content(body)
        self.name = token_namer(tokenizer, body.return_tokens_as_token_ids)
        self.created = int(time.time())
        self.base = {"id": rid, "object": "chat.completion.chunk", "created": self.created, "model": model}

    async def whole(self) -> dict:
        async for _, out in self.fanout.outputs():
            if out.outputs[0].finish_reason is not None:
                self.metrics.observe(out)
        body = {"id": self.rid, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [self._choice_json(c) for c in self.fanout.choices], "usage": usage(*self.fanout.usage_counts()),
                "service_tier": None, "system_fingerprint": None, "prompt_logprobs": None, "prompt_token_ids": None,
                "kv_transfer_params": None,  # vLLM's fields, null when not asked for (clients read them)
                **self._prompt_fields(), **self.fanout.timing_field()}
        if self.body.prompt_logprobs is not None:
            scored = self.fanout.prompt_logprobs[0]
            body["prompt_logprobs"] = prompt_logprobs_json(scored.entries(), self.name) if scored else None
        return body

    def stream(self):
        return sse(self._events())

    async def _events(self):
        for i, choice in enumerate(self.fanout.choices):  # every choice opens with its role, before any text
            first = self._chunk(choice, {"role": "assistant", "content": ""}, None, None)
            yield {**first, **self._prompt_fields()} if i == 0 else first
        if self.echoed:
            for choice in self.fanout.choices:
                yield self._chunk(choice, {"content": self.echoed}, None, None)
        parsers = {choice.index: self.parser() for choice in self.fanout.choices} if self.parser else None
        async for choice, out in self.fanout.outputs():
            c = choice.completion
            if c.finish_reason is not None:
                self.metrics.observe(out)
            if parsers is None:
                if out.delta_text or c.finish_reason is not None:
                    yield self._chunk(choice, {"content": out.delta_text}, self._new_logprobs(choice),
                                      c.finish_reason)
                continue
            parser = parsers[choice.index]
            events = parser.feed(out.delta_text) if out.delta_text else []
            if c.finish_reason is not None:
                events += parser.finish()
            for event in events:
                if isinstance(event, CallStart):
                    choice.called_tools = True
                yield self._chunk(choice, _delta(event), self._new_logprobs(choice), None)
            if c.finish_reason is not None:
                reason = "tool_calls" if choice.called_tools and c.finish_reason == "stop" else c.finish_reason
                yield self._chunk(choice, {}, self._new_logprobs(choice), reason)
        options = self.body.stream_options
        if options is not None and options.include_usage:
            yield {**self.base, "choices": [], "usage": usage(*self.fanout.usage_counts()),
                   **self.fanout.timing_field()}

    def _prompt_fields(self) -> dict:
        """vLLM's top-level prompt fields, on the whole response or the first chunk. A batch's prompts are one per
        conversation, so it has none there (as vLLM's batch route: its choices carry their token ids)."""
        fields = {}
        if self.body.return_token_ids and len(self.fanout.prompts) == 1:
            fields["prompt_token_ids"] = list(self.fanout.prompts[0])
        if self.body.return_prompt_text:
            fields["prompt_text"] = self.prompt_text
        return fields

    def _chunk(self, choice: Choice, delta: dict, logprobs, finish_reason) -> dict:
        item = {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.body.return_token_ids:
            item["token_ids"] = self.fanout.new_token_ids(choice)
        chunk = {**self.base, "choices": [item]}
        options = self.body.stream_options
        if options is not None and options.include_usage and options.continuous_usage_stats:
            generated = len(choice.completion.token_ids) if choice.completion is not None else 0
            chunk["usage"] = usage(len(self.fanout.prompts[choice.prompt]), generated)
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
        message, reason = {"role": "assistant", "content": c.text}, c.finish_reason
        if self.parser is not None:
            parser = self.parser()
            content, calls = joined(whole_reply(parser, c.text))
            message["content"] = (content or "") if parser.forced else content  # forced: "" as vLLM answers
            if calls:
                message["tool_calls"] = calls
                reason = "tool_calls" if reason == "stop" else reason
        if self.echoed:
            message["content"] = self.echoed + (message["content"] or "")
        out = {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": reason,
               "stop_reason": c.stop_reason, "token_ids": None}
        if self.body.return_token_ids:
            out["token_ids"] = list(c.token_ids)
        return out


def echoed_content(body: ChatCompletionRequest) -> str:
    """What echo puts in front of the reply: the last message's text when it is the reply's own role (assistant),
    as vLLM does; else nothing."""
    if not body.echo or not body.messages or body.messages[-1].role != "assistant":
        return ""
    content = body.messages[-1].content
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content)
    return content or ""


def _delta(event) -> dict:
    """One parser event as a streamed chunk's delta (OpenAI's shape for content and tool-call pieces)."""
    if isinstance(event, Content):
        return {"content": event.text}
    if isinstance(event, CallStart):
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    assert isinstance(event, Arguments)
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
