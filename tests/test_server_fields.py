"""Every declared field of every request model is honoured or refused, never accepted and ignored.

For each field of the protocol models the walk sends a baseline request and the same request with that field set
to a value that asks for something, then requires one of two things: the engine's request (prompt ids, sampling
params, user, id) or the response changed, or the server answered 400. A field this table does not know fails
the test, so a field added to protocol.py must say which it is.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import httpx
import pytest

from nanoserve import EngineConfig
from nanoserve.server.messages_protocol import CountTokensRequest, MessagesRequest
from nanoserve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    ResponseFormat,
    StreamOptions,
    TokenizeRequest,
)
from nanoserve.server.responses_protocol import ResponsesRequest
from nanoserve.server.serve import Server

CHANGES, REFUSED = "changes", "refused"
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}}}}]
CUSTOM_TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"

# (value, what it must do, extra fields both arms carry)
COMMON = {
    "model": ("other", REFUSED, {}),  # 404: not the served model
    "temperature": (0.7, CHANGES, {}),
    "top_p": (0.5, CHANGES, {}),
    "top_k": (5, CHANGES, {}),
    "min_p": (0.1, CHANGES, {}),
    "repetition_penalty": (1.2, CHANGES, {}),
    "presence_penalty": (0.5, CHANGES, {}),
    "frequency_penalty": (0.5, CHANGES, {}),
    "seed": (3, CHANGES, {}),
    "min_tokens": (2, CHANGES, {}),
    "stop": (["zz"], CHANGES, {}),
    "stop_token_ids": ([5], CHANGES, {}),
    "ignore_eos": (True, CHANGES, {}),
    "skip_special_tokens": (False, CHANGES, {}),
    "include_stop_str_in_output": (True, CHANGES, {}),
    "logit_bias": ({"5": 1.0}, CHANGES, {}),
    "allowed_token_ids": ([5, 6, 7], CHANGES, {}),
    "bad_words": (["the"], CHANGES, {}),
    "prompt_logprobs": (1, CHANGES, {}),
    "n": (2, CHANGES, {}),
    "best_of": (3, REFUSED, {}),
    "stream": (True, CHANGES, {}),
    "stream_options": ({"include_usage": True}, CHANGES, {"stream": True}),
    "user": ("alice", CHANGES, {}),
    "session_id": ("agent-7", CHANGES, {}),
    "cache_salt": ("tenant-a", CHANGES, {}),
    "request_id": ("my-request", CHANGES, {}),
    "add_special_tokens": (None, CHANGES, {}),  # per route below: the non-default for that route
    "truncate_prompt_tokens": (2, CHANGES, {}),
    "truncation_side": ("right", CHANGES, {"truncate_prompt_tokens": 2}),
    "return_token_ids": (True, CHANGES, {}),
    "return_tokens_as_token_ids": (True, CHANGES, {"logprobs": 1}),
    "response_format": ({"type": "json_object"}, CHANGES, {}),
    "structured_outputs": ({"choice": ["yes", "no"]}, CHANGES, {}),
    "guided_json": ({"type": "object"}, CHANGES, {}),
    "guided_regex": ("[0-9]+", CHANGES, {}),
    "guided_choice": (["yes", "no"], CHANGES, {}),
    "guided_grammar": ('start: "yes" | "no"', CHANGES, {}),
    "guided_whitespace_pattern": ("", REFUSED, {}),  # alone it shapes nothing; with guided_json see below
    "use_beam_search": (True, CHANGES, {"n": 2}),  # n beams, ranked (tests/test_beam_search.py)
    "length_penalty": (2.0, REFUSED, {}),  # it ranks beams: alone it asks for nothing
    "kv_transfer_params": ({"do_remote_prefill": True}, REFUSED, {}),  # no KV connector
}
COMPLETION = {
    **COMMON,
    "prompt": ("A different prompt", CHANGES, {}),
    "max_tokens": (3, CHANGES, {}),
    "logprobs": (1, CHANGES, {}),
    "logprob_token_ids": ([5, 6], CHANGES, {"logprobs": 1}),
    "echo": (True, CHANGES, {}),
    "add_special_tokens": (False, CHANGES, {}),
    "return_tokens_as_token_ids": (True, CHANGES, {"logprobs": 1}),
}
CHAT = {
    **COMMON,
    "messages": ([{"role": "user", "content": "Something else"}], CHANGES, {}),
    "max_tokens": (3, CHANGES, {}),
    "max_completion_tokens": (3, CHANGES, {"max_tokens": None}),
    "logprobs": (True, CHANGES, {}),
    "top_logprobs": (2, CHANGES, {"logprobs": True}),
    "logprob_token_ids": ([5, 6], CHANGES, {"logprobs": True}),
    "kv_transfer_params": ({"prompt_token_ids": [1, 5, 6]}, CHANGES, {}),  # a prompt a router tokenized
    "add_generation_prompt": (False, CHANGES, {}),
    "continue_final_message": (True, CHANGES, {"add_generation_prompt": False, "messages": [
        {"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "I like"}]}),
    "chat_template": (CUSTOM_TEMPLATE, CHANGES, {}),
    "chat_template_kwargs": ({"not_in_the_template": 1}, REFUSED, {}),
    "documents": ([{"title": "t", "text": "x"}], REFUSED, {}),
    "add_special_tokens": (True, CHANGES, {}),
    "return_tokens_as_token_ids": (True, CHANGES, {"logprobs": True}),
    "tools": (TOOLS, CHANGES, {}),  # this model's template renders none: they reach it as a system prompt
    "tool_choice": ("required", CHANGES, {"tools": TOOLS}),
    "parallel_tool_calls": (False, CHANGES, {"tools": TOOLS, "tool_choice": "required"}),
    "echo": (True, CHANGES, {"continue_final_message": True, "add_generation_prompt": False, "messages": [
        {"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "I like"}]}),
    "return_prompt_text": (True, CHANGES, {}),
}
# continuous_usage_stats refines include_usage (vLLM's rule), so alone it would do nothing: it is refused;
# with include_usage it puts usage on every chunk, with include_usage: false none (tests/test_vllm_conformance.py)
STREAM_OPTIONS = {"include_usage": (True, CHANGES, {}), "continuous_usage_stats": (True, REFUSED, {})}
MESSAGE = {
    "role": ("system", CHANGES, {}),
    "content": ("Another question", CHANGES, {}),
    "name": ("bob", REFUSED, {}),  # this model's template renders no names
    # a template that renders no tool calls gets them written into the message text (nanoserve.tools.prompt)
    "tool_calls": ([{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}], CHANGES,
                   {"role": "assistant"}),
    "tool_call_id": ("c", REFUSED, {}),  # on a user message; on a tool message it must answer an earlier call
}
RESPONSE_FORMAT = {
    "type": ("json_object", CHANGES, {}),
    # beside type "text" a schema is refused (it would be ignored); with type "json_schema", tests/test_structured.py
    "json_schema": ({"name": "n", "schema": {"type": "object"}}, REFUSED, {}),
}
TOKENIZE = {
    "model": ("other", REFUSED, {}),  # 404: not the served model
    "prompt": ("Other words", CHANGES, {}),
    "messages": ([{"role": "user", "content": "Bye"}], CHANGES, {"prompt": None, "messages": [
        {"role": "user", "content": "Hi"}]}),
    "add_special_tokens": (False, CHANGES, {}),
    "add_generation_prompt": (False, CHANGES, {"prompt": None, "messages": [{"role": "user", "content": "Hi"}]}),
    "return_token_strs": (True, CHANGES, {}),
    **{name: (value, expect, {"prompt": None, "messages": [{"role": "user", "content": "Hi"}], **extra})
       for name, (value, expect, extra) in {
           "continue_final_message": (True, CHANGES, {"add_generation_prompt": False, "messages": [
               {"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "I like"}]}),
           "chat_template": (CUSTOM_TEMPLATE, CHANGES, {}),
           "chat_template_kwargs": ({"not_in_the_template": 1}, REFUSED, {}),
           "tools": (TOOLS, CHANGES, {}),
           "media_io_kwargs": ({"image": {}}, REFUSED, {}),
           "mm_processor_kwargs": ({"x": 1}, REFUSED, {}),
       }.items()},
}
DETOKENIZE = {"model": ("other", REFUSED, {}), "tokens": ([5, 6], CHANGES, {})}


@pytest.fixture(scope="module")
def bos_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint with a tokenizer that prepends BOS, as Llama's does, so add_special_tokens shows."""
    out = tmp_path_factory.mktemp("tiny-bos")
    shutil.copytree(tiny_checkpoint("llama"), out, dirs_exist_ok=True)
    spec = json.loads((out / "tokenizer.json").read_text())
    bos = {"id": "<|im_start|>", "type_id": 0}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": bos}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": bos}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B",
                                                                                               "type_id": 0}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


@pytest.fixture(scope="module")
def server(bos_checkpoint):
    s = Server(EngineConfig(model=str(bos_checkpoint), max_model_len=512, kv_cache_gib=0.02), port=0,
               served_model_name="tiny", trust_request_chat_template=True).start()
    yield s
    s.stop()


@pytest.fixture
def seen(server, monkeypatch):
    """What reached the engine: (prompt ids, sampling params, (user, cache salt, session id), request id) per
    add_request."""
    engine, calls = server.engine, []
    real = engine.add_request

    def spy(prompt, params=None, request_id=None, arrival_time=None, user=None, cache_salt=None, session_id=None,
            streamed=True, trace_origin=None):
        calls.append((list(prompt) if not isinstance(prompt, str) else prompt, repr(params),
                      (user, cache_salt, session_id), request_id))
        return real(prompt, params, request_id=request_id, arrival_time=arrival_time, user=user,
                    cache_salt=cache_salt, session_id=session_id, streamed=streamed, trace_origin=trace_origin)

    monkeypatch.setattr(engine, "add_request", spy)
    return calls


_VOLATILE = re.compile(r'"(created|id|cached_tokens)":\s*("[^"]*"|\d+)')  # cached_tokens: what ran before


def exchange(server, seen, path: str, body: dict) -> tuple:
    """The response (status and body, ids and times blanked) and what the engine was asked to run."""
    seen.clear()
    r = httpx.post(server.url + path, json=body, timeout=60)
    text = _VOLATILE.sub(r'"\1": _', _unframed(r.text) if body.get("stream") else r.text)
    return r.status_code, text, [(p, params, user, rid if body.get("request_id") else None)
                                 for p, params, user, rid in seen]


def _unframed(sse: str) -> str:
    """A stream with consecutive text-only chunks joined: a reader that falls behind gets several steps' deltas
    in one chunk (server/collector.py), so how the text was framed depends on timing, and what it says does not."""
    events = [e[len("data: "):] for e in sse.split("\n\n") if e.startswith("data: ")]
    out: list = []
    for event in events:
        chunk = json.loads(event) if event != "[DONE]" else event
        if out and _text_only(out[-1]) and _text_only(chunk, last_may_finish=True) \
                and out[-1]["choices"][0].get("index") == chunk["choices"][0].get("index"):
            _append_text(out[-1], chunk)
        else:
            out.append(chunk)
    return "\n".join(c if isinstance(c, str) else json.dumps(c) for c in out)


def _text_only(chunk, last_may_finish: bool = False) -> bool:
    if not isinstance(chunk, dict) or chunk.get("usage") or len(chunk.get("choices", ())) != 1:
        return False
    choice = chunk["choices"][0]
    if choice.get("logprobs") is not None or (choice.get("finish_reason") is not None and not last_may_finish):
        return False
    return "text" in choice or set(choice.get("delta", {})) == {"content"}


def _append_text(into: dict, chunk: dict) -> None:
    old, new = into["choices"][0], chunk["choices"][0]
    if "text" in old:
        old["text"] += new["text"]
    else:
        old["delta"]["content"] += new["delta"]["content"]
    old["finish_reason"] = new.get("finish_reason")


def walk(server, seen, path, base, table, model_cls, nest=None):
    fields = set(model_cls.model_fields) - set(getattr(model_cls, "unsupported", {}))
    unknown = sorted(fields - set(table))
    assert not unknown, f"{model_cls.__name__} fields without a row in the walk: {unknown}"
    silent = []
    baseline = nest(base, {}) if nest is not None else base
    assert exchange(server, seen, path, baseline) == exchange(server, seen, path, baseline), "not deterministic"
    for name in sorted(fields):
        value, expect, extra = table[name]
        plain = {**base, **extra}
        varied = {**plain, name: value}
        if nest is not None:
            plain, varied = nest(plain, {}), nest(plain, {name: value})
        plain, varied = _drop_nones(plain), _drop_nones(varied)
        a, b = exchange(server, seen, path, plain), exchange(server, seen, path, varied)
        assert a[0] == 200, (name, a)
        if expect == REFUSED:
            assert 400 <= b[0] < 500, (name, b)
        elif b[0] != 200:  # a refusal is not what "changes" means
            silent.append(f"{name} (answered {b[0]})")
        elif a == b:
            silent.append(name)
    assert not silent, f"accepted and ignored (no change in the engine request or the response): {silent}"


def _drop_nones(body: dict) -> dict:
    return {k: v for k, v in body.items() if v is not None}


# greedy, so the same request always gets the same bytes and only the varied field can make a difference
COMPLETION_BASE = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
CHAT_BASE = {"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4,
             "temperature": 0}


def test_every_completion_field_is_honoured_or_refused(server, seen):
    walk(server, seen, "/v1/completions", COMPLETION_BASE, COMPLETION, CompletionRequest)


def test_every_chat_field_is_honoured_or_refused(server, seen):
    walk(server, seen, "/v1/chat/completions", CHAT_BASE, CHAT, ChatCompletionRequest)


def test_every_stream_option_is_honoured(server, seen):
    for path, base in (("/v1/completions", COMPLETION_BASE), ("/v1/chat/completions", CHAT_BASE)):
        walk(server, seen, path, {**base, "stream": True}, STREAM_OPTIONS, StreamOptions,
             nest=lambda body, options: {**body, "stream_options": options})


def test_every_message_field_is_honoured_or_refused(server, seen):
    def nest(body, fields):
        message = {"role": "user", "content": "Hi there", **fields}
        if message["role"] == "assistant":
            return {**body, "messages": [{"role": "user", "content": "weather?"}, message]}
        return {**body, "messages": [message]}

    walk(server, seen, "/v1/chat/completions", CHAT_BASE, MESSAGE, ChatMessage, nest=nest)


def test_every_response_format_field_is_honoured(server, seen):
    walk(server, seen, "/v1/chat/completions", CHAT_BASE, RESPONSE_FORMAT, ResponseFormat,
         nest=lambda body, fields: {**body, "response_format": {"type": "text", **fields}})


VLLM = json.loads((Path(__file__).with_name("vllm_request_fields.json")).read_text())


@pytest.mark.parametrize("key,cls", [("completion", CompletionRequest), ("chat", ChatCompletionRequest),
                                     ("tokenize_prompt", TokenizeRequest), ("tokenize_messages", TokenizeRequest),
                                     ("detokenize", DetokenizeRequest), ("responses", ResponsesRequest),
                                     ("messages", MessagesRequest), ("count_tokens", CountTokensRequest)])
def test_every_vllm_request_field_is_declared_so_the_walk_proves_it(key, cls):
    """vLLM's request models (tests/vllm_request_fields.json, read from a vLLM wheel by scripts/vllm-fields.py):
    every field there is declared here, so the walks above prove it honoured or refused; none falls through to
    the warning that fields of neither OpenAI nor vLLM get."""
    missing = sorted(set(VLLM[key]) - set(cls.model_fields))
    assert not missing, f"vLLM {VLLM['vllm']}'s {key} fields that nanoserve does not declare: {missing}"


def test_every_tokenize_and_detokenize_field_is_honoured(server, seen):
    walk(server, seen, "/tokenize", {"prompt": "Hello world"}, TOKENIZE, TokenizeRequest)
    walk(server, seen, "/detokenize", {"tokens": [1, 2, 3]}, DETOKENIZE, DetokenizeRequest)


@pytest.mark.parametrize("cls,path,base", [(CompletionRequest, "/v1/completions", COMPLETION_BASE),
                                           (ChatCompletionRequest, "/v1/chat/completions", CHAT_BASE)],
                         ids=["completions", "chat"])
def test_every_unsupported_field_is_refused_unless_it_asks_for_nothing(server, seen, cls, path, base):
    for name, (idle, why) in cls.unsupported.items():
        r = httpx.post(server.url + path, json={**base, name: "something"}, timeout=60)
        assert r.status_code == 400 and f"{name} is not supported: {why}" == r.json()["error"]["message"], name
        assert r.json()["error"]["param"] == name
        for value in idle:
            assert httpx.post(server.url + path, json={**base, name: value}, timeout=60).status_code == 200, name
    assert server.engine.kv.num_used == 0
