"""Where nanoserve answered differently from vLLM's own OpenAI-server tests, now as vLLM does (vLLM 0.33's
request models, tests/vllm_request_fields.json): return_token_ids, truncation_side, the seed's int64 range, any
chat role the template renders, echo on chat, usage only with include_usage, logprobs -1 within --max-logprobs,
a type error that names what the field takes, and prompt_tokens_details behind its flag."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers import tiny_server_running

GREEDY = {"model": "tiny", "temperature": 0, "max_tokens": 6, "ignore_eos": True}
CHAT = {**GREEDY, "messages": [{"role": "user", "content": "Hello there"}]}
COMPLETION = {**GREEDY, "prompt": "Once upon a time"}
DROPS_OTHER_ROLES = ("{% for m in messages %}{% if m.role in ['system', 'user', 'assistant'] %}<{{ m.role }}>"
                     "{{ m.content }}{% endif %}{% endfor %}<assistant>")


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with tiny_server_running(tiny_checkpoint("llama"), trust_request_chat_template=True) as s:
        yield s


@pytest.fixture(scope="module")
def open_server(tiny_checkpoint):
    """--max-logprobs -1 (no limit), --enable-prompt-tokens-details and --no-enable-prefix-caching."""
    with tiny_server_running(tiny_checkpoint("llama"), {"max_logprobs": -1, "enable_prefix_caching": False},
                             prompt_tokens_details=True) as s:
        yield s


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def stream(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def tokenize(server, **body) -> list[int]:
    return post(server, "/tokenize", {"model": "tiny", **body}).json()["tokens"]


def refused(response: httpx.Response, *needles: str) -> str:
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert all(n in message for n in needles), message
    return message


def test_return_token_ids_on_completions_whole_and_streamed(server):
    whole = post(server, "/v1/completions", {**COMPLETION, "return_token_ids": True}).json()
    choice = whole["choices"][0]
    assert choice["prompt_token_ids"] == tokenize(server, prompt=COMPLETION["prompt"])
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"] == 6
    assert post(server, "/detokenize", {"tokens": choice["token_ids"]}).json()["prompt"] == choice["text"]
    chunks = [c["choices"][0] for c in stream(server, "/v1/completions", {**COMPLETION, "return_token_ids": True})
              if c["choices"]]
    assert chunks[0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    assert post(server, "/v1/completions", COMPLETION).json()["choices"][0]["token_ids"] is None  # vLLM's null


def test_return_token_ids_on_chat_whole_and_streamed(server):
    whole = post(server, "/v1/chat/completions", {**CHAT, "return_token_ids": True}).json()
    assert whole["prompt_token_ids"] == tokenize(server, messages=CHAT["messages"])
    ids = whole["choices"][0]["token_ids"]
    assert len(ids) == 6
    chunks = stream(server, "/v1/chat/completions", {**CHAT, "return_token_ids": True})
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]] == ids


def test_truncation_side_picks_the_end_truncate_prompt_tokens_cuts(server):
    text = "one two three four five six seven eight"
    ids = tokenize(server, prompt=text)
    kept = {}
    for side in ("left", "right", None):
        body = {**COMPLETION, "prompt": text, "truncate_prompt_tokens": 3, "return_token_ids": True}
        if side:
            body["truncation_side"] = side
        kept[side] = post(server, "/v1/completions", body).json()["choices"][0]["prompt_token_ids"]
    assert kept["right"] == ids[:3] and kept["left"] == ids[-3:] and kept[None] == ids[-3:]
    long = " ".join(["word"] * 300)
    fit = post(server, "/v1/completions", {**COMPLETION, "prompt": long, "max_tokens": 1,
                                           "truncate_prompt_tokens": -1, "return_token_ids": True}).json()
    assert len(fit["choices"][0]["prompt_token_ids"]) == 127  # max_model_len 128, one left for the output
    refused(post(server, "/v1/completions", {**COMPLETION, "truncate_prompt_tokens": 129}), "max_model_len 128")
    refused(post(server, "/v1/completions", {**COMPLETION, "truncation_side": "right"}), "truncate_prompt_tokens")


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1])
def test_a_seed_outside_int64_is_refused_with_the_range(server, seed):
    refused(post(server, "/v1/completions", {**COMPLETION, "seed": seed}), "seed", "int64", str(2**63 - 1))


def test_a_seed_at_the_ends_of_int64_is_taken(server):
    for seed in (2**63 - 1, -(2**63)):
        assert post(server, "/v1/completions", {**COMPLETION, "temperature": 1.0, "seed": seed}).status_code == 200


def test_any_chat_role_the_template_renders_is_passed_to_it(server):
    messages = [{"role": "my-custom-role", "content": "Speak like a pirate."}, *CHAT["messages"]]
    r = post(server, "/v1/chat/completions", {**CHAT, "messages": messages, "return_prompt_text": True})
    assert r.status_code == 200, r.text
    assert "my-custom-role" in r.json()["prompt_text"] and "Speak like a pirate." in r.json()["prompt_text"]
    dropped = post(server, "/v1/chat/completions", {**CHAT, "messages": messages, "chat_template": DROPS_OTHER_ROLES})
    refused(dropped, "'my-custom-role'", "does not render")


def test_echo_on_chat_puts_the_last_assistant_message_in_front_whole_and_streamed(server):
    messages = [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "My favourite is"}]
    body = {**CHAT, "messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    plain = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    echoed = post(server, "/v1/chat/completions", {**body, "echo": True}).json()["choices"][0]["message"]["content"]
    assert echoed == "My favourite is" + plain
    chunks = stream(server, "/v1/chat/completions", {**body, "echo": True})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == echoed
    after_user = post(server, "/v1/chat/completions", {**CHAT, "echo": True}).json()["choices"][0]["message"]
    assert after_user["content"] == post(server, "/v1/chat/completions", CHAT).json()["choices"][0]["message"][
        "content"]  # the last message is the user's: nothing of the reply's role to echo


def test_usage_is_streamed_only_with_include_usage(server):
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        assert not any("usage" in c for c in stream(server, path, body))
        refused(post(server, path, {**body, "stream": True, "stream_options": {"continuous_usage_stats": True}}),
                "include_usage")
        quiet = stream(server, path, {**body, "stream_options": {"include_usage": False, "continuous_usage_stats": True}})
        assert quiet and not any(c.get("usage") for c in quiet)  # vLLM's rule: usage only where it is asked for
        last = stream(server, path, {**body, "stream_options": {"include_usage": True}})
        assert [("usage" in c) for c in last] == [False] * (len(last) - 1) + [True]


def test_logprobs_minus_one_is_the_whole_vocabulary_within_max_logprobs(server, open_server):
    refused(post(server, "/v1/completions", {**COMPLETION, "logprobs": -1}), "whole vocabulary", "--max-logprobs 20")
    refused(post(server, "/v1/completions", {**COMPLETION, "logprobs": 21}), "--max-logprobs 20")
    refused(post(server, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": -1}), "--max-logprobs")
    vocab = open_server.engine.model_config.vocab_size
    short = {"max_tokens": 2}
    # keyed by id: in the completions shape alternatives are keyed by text, and some tokens share one
    top = post(open_server, "/v1/completions", {**COMPLETION, **short, "logprobs": -1,
                                                "return_tokens_as_token_ids": True}).json()
    assert [len(t) for t in top["choices"][0]["logprobs"]["top_logprobs"]] == [vocab, vocab]
    chat = post(open_server, "/v1/chat/completions", {**CHAT, **short, "logprobs": True, "top_logprobs": -1}).json()
    assert [len(c["top_logprobs"]) for c in chat["choices"][0]["logprobs"]["content"]] == [vocab, vocab]
    prompt = post(open_server, "/v1/completions", {**COMPLETION, **short, "prompt_logprobs": -1}).json()
    assert len(prompt["choices"][0]["prompt_logprobs"][1]) == vocab
    echoed = post(open_server, "/v1/completions", {**COMPLETION, **short, "echo": True, "logprobs": -1,
                                                   "return_tokens_as_token_ids": True}).json()
    tops = echoed["choices"][0]["logprobs"]["top_logprobs"]
    assert tops[0] is None and {len(t) for t in tops[1:]} == {vocab}  # the echoed prompt's positions too


def test_a_wrong_type_names_what_the_field_takes(server):
    refused(post(server, "/v1/chat/completions", {**CHAT, "logprobs": "true"}),
            'logprobs: must be true or false (a JSON boolean), not the string "true"')
    refused(post(server, "/v1/completions", {**COMPLETION, "logprobs": "2"}), 'logprobs: must be an integer')


def test_prompt_tokens_details_follow_their_flag_alone(server, open_server):
    """vLLM's rule: without --enable-prompt-tokens-details no details; with it, cached_tokens in every usage,
    0 while the prefix cache is off (never a missing field that reads as 'not measured')."""
    assert "prompt_tokens_details" not in post(server, "/v1/completions", COMPLETION).json()["usage"]
    last = stream(server, "/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}})[-1]
    assert "prompt_tokens_details" not in last["usage"]
    for _ in range(2):  # the second would find the first's blocks, were the cache on
        usage = post(open_server, "/v1/completions", COMPLETION).json()["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    last = stream(open_server, "/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}})[-1]
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_return_prompt_text_is_what_the_template_rendered(server):
    whole = post(server, "/v1/chat/completions", {**CHAT, "return_prompt_text": True}).json()
    assert whole["prompt_text"].endswith("Hello there<|im_end|>\n<|im_start|>assistant\n")
    first = stream(server, "/v1/chat/completions", {**CHAT, "return_prompt_text": True})[0]
    assert first["prompt_text"] == whole["prompt_text"]


def test_session_id_is_kept_with_the_request(server):
    body = {**COMPLETION, "max_tokens": 60, "session_id": "agent-7"}
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for _ in r.iter_lines():
            rows = httpx.get(server.url + "/health").json()["rows"]
            if rows:
                break
    assert rows and rows[0]["session_id"] == "agent-7"


def _ids_of(entries) -> dict[int, float]:
    return {int(e.token.removeprefix("token_id:")): e.logprob for e in entries}


def test_logprob_token_ids_score_exactly_those_ids_with_the_whole_vocabularys_numbers(open_server):
    """vLLM's logprob_token_ids, driven by the openai SDK: each generated position's alternatives are the asked
    ids and the sampled token, in place of the top N, with the numbers logprobs over the whole vocabulary gives."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=open_server.url + "/v1", api_key="none", max_retries=0)
    asked = [17, 3, 40]
    base = dict(model="tiny", messages=CHAT["messages"], max_tokens=2, temperature=0, logprobs=True)
    extra = {"return_tokens_as_token_ids": True, "ignore_eos": True}
    whole = client.chat.completions.create(**base, top_logprobs=-1, extra_body=extra).choices[0].logprobs.content
    picked = client.chat.completions.create(**base, top_logprobs=5, extra_body={**extra, "logprob_token_ids": asked})
    positions = picked.choices[0].logprobs.content
    assert len(positions) == len(whole) == 2
    for p, w in zip(positions, whole):
        sampled, full, got = int(p.token.removeprefix("token_id:")), _ids_of(w.top_logprobs), _ids_of(p.top_logprobs)
        assert p.token == w.token and p.logprob == w.logprob
        assert list(got) == ([sampled] if sampled not in asked else []) + asked  # the top 5 are not asked for
        assert got == {t: full[t] for t in got}
    streamed = client.chat.completions.create(**base, stream=True, extra_body={**extra, "logprob_token_ids": asked})
    seen = [_ids_of(c.top_logprobs) for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
            for c in chunk.choices[0].logprobs.content]
    assert seen == [_ids_of(p.top_logprobs) for p in positions]
    legacy = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=2, temperature=0,
                                       logprobs=0, extra_body={**extra, "logprob_token_ids": asked})
    for sampled, top in zip(legacy.choices[0].logprobs.tokens, legacy.choices[0].logprobs.top_logprobs):
        assert set(top) == {sampled, *(f"token_id:{t}" for t in asked)}


def test_logprob_token_ids_are_refused_where_they_would_score_nothing(server):
    asked = {"logprob_token_ids": [3, 5]}
    refused(post(server, "/v1/chat/completions", {**CHAT, **asked}), "logprob_token_ids", "logprobs")
    refused(post(server, "/v1/completions", {**COMPLETION, **asked, "logprobs": 1, "echo": True, "max_tokens": 0}),
            "max_tokens 0")
    refused(post(server, "/v1/completions", {**COMPLETION, "logprobs": 0, "logprob_token_ids": [10 ** 7]}),
            "outside this model's vocabulary")
    refused(post(server, "/v1/completions", {**COMPLETION, "logprobs": 0, "logprob_token_ids": list(range(129))}),
            "at most 128")


def test_bad_input_is_named_whole(server):
    """Every bad logit_bias key at once, a missing prompt by name, vLLM's 'out of vocabulary'."""
    refused(post(server, "/v1/completions", {**COMPLETION, "logit_bias": {"bad1": 1, "7": 1, "bad2": 1}}),
            "'bad1'", "'bad2'")
    refused(post(server, "/v1/completions", {**COMPLETION, "prompt": None}), "prompt must be given and non-empty")
    refused(post(server, "/v1/completions", {**COMPLETION, "prompt": [1, 10 ** 8]}), "out of vocabulary")
    refused(post(server, "/v1/completions", {**COMPLETION, "prompt": ""}), "prompt")


def test_a_chat_prompt_a_router_already_tokenized_is_used_verbatim(server):
    """vLLM's kv_transfer_params.prompt_token_ids (the decode stage of a split prefill, or a router that
    tokenized): the ids are the prompt, whatever the messages say; KV transfer itself is refused."""
    ids = {"return_token_ids": True, "max_tokens": 4}
    baseline = post(server, "/v1/chat/completions", {**CHAT, **ids}).json()
    forwarded = post(server, "/v1/chat/completions", {
        **CHAT, **ids, "messages": [{"role": "user", "content": "unrelated"}],
        "kv_transfer_params": {"prompt_token_ids": baseline["prompt_token_ids"]}}).json()
    assert forwarded["prompt_token_ids"] == baseline["prompt_token_ids"]
    assert forwarded["choices"][0]["token_ids"] == baseline["choices"][0]["token_ids"]
    refused(post(server, "/v1/chat/completions", {**CHAT, "kv_transfer_params": {"do_remote_prefill": True}}),
            "do_remote_prefill", "no KV connector")
    refused(post(server, "/v1/chat/completions", {**CHAT, "kv_transfer_params": {"prompt_token_ids": [1, 10 ** 9]}}),
            "out of vocabulary")
    refused(post(server, "/v1/completions", {**COMPLETION, "kv_transfer_params": {"prompt_token_ids": [1]}}),
            "send the ids as the prompt")


def test_usage_as_the_openai_sdk_reads_it(server, open_server):
    """prompt_tokens_details only under its flag (0 with the cache off), and a stream asked for no usage gets
    none, continuous_usage_stats or not: read through the openai SDK, as vLLM's tests read them."""
    openai = pytest.importorskip("openai")
    plain, detailed = (openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
                       for s in (server, open_server))
    asked = dict(model="tiny", prompt="Once upon a time", max_tokens=2, temperature=0)
    assert plain.completions.create(**asked).usage.prompt_tokens_details is None
    assert detailed.completions.create(**asked).usage.prompt_tokens_details.cached_tokens == 0
    quiet = list(plain.completions.create(**asked, stream=True,
                                          stream_options={"include_usage": False, "continuous_usage_stats": True}))
    assert quiet and all(chunk.usage is None for chunk in quiet)
    with pytest.raises(openai.BadRequestError, match="include_usage"):
        plain.completions.create(**asked, stream=True, stream_options={"continuous_usage_stats": True})
