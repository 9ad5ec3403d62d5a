"""litellm and langchain-openai chatting with the live server: streamed and not, greedy and seeded, and
langchain's .batch; every answer must be the engine's offline chat answer for the same conversation."""

from __future__ import annotations

import json

from nanoserve import SamplingParams

from .support import HERE, MODEL, run_client

DRIVERS = HERE / "drivers"
GREEDY = SamplingParams(temperature=0, max_tokens=12)
SEEDED = SamplingParams(temperature=0.9, seed=7, max_tokens=12)


def offline_chat(offline, question: str, params: SamplingParams):
    return offline.chat([{"role": "user", "content": question}], params, use_tqdm=False)[0].outputs[0]


def run_driver(client_env, live, tmp_path, name: str) -> dict:
    out = tmp_path / f"{name}.json"
    mark = live.recorder.mark()
    run_client([client_env / "bin" / "python", DRIVERS / f"{name}.py", f"{live.url}/v1", MODEL, out],
               tmp_path, timeout=180, live=live, mark=mark)
    return json.loads(out.read_text())


def test_litellm_chat_streamed_and_not_equals_offline(client_env, live, offline, tmp_path):
    got = run_driver(client_env, live, tmp_path, "litellm_chat")
    expected = {"greedy": offline_chat(offline, "Name three colours.", GREEDY),
                "seeded": offline_chat(offline, "Name three colours.", SEEDED)}
    assert set(got) == {f"{p}/{k}" for p in ("openai", "hosted_vllm") for k in expected}
    for key, answer in got.items():
        want = expected[key.split("/")[1]]
        assert answer["plain"] == answer["streamed"] == want.text, key
        assert answer["finish_reason"] == want.finish_reason, key
        assert answer["completion_tokens"] == len(want.token_ids), key
        assert answer["streamed_usage"] == [len(want.token_ids)], key


def test_langchain_invoke_stream_and_batch_equal_offline(client_env, live, offline, tmp_path):
    got = run_driver(client_env, live, tmp_path, "langchain_chat")
    first = got["questions"][0]
    assert got["invoke"] == got["stream"] == offline_chat(offline, first, GREEDY).text
    assert got["seeded_invoke"] == got["seeded_stream"] == offline_chat(offline, first, SEEDED).text
    assert got["batch"] == [offline_chat(offline, q, GREEDY).text for q in got["questions"]]


def test_litellm_through_its_anthropic_provider_reaches_the_messages_api(client_env, live, offline, tmp_path):
    """litellm's "anthropic/" provider speaks POST /v1/messages: the same answer as the offline chat, streamed
    and not, and a named tool's call read back as an OpenAI tool call."""
    mark = live.recorder.mark()
    got = run_driver(client_env, live, tmp_path, "litellm_anthropic")
    want = offline.chat([{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Name three colours."}], GREEDY, use_tqdm=False)[0]
    assert got["plain"] == got["streamed"] == want.outputs[0].text
    assert got["finish_reason"] == "length" and got["completion_tokens"] == len(want.outputs[0].token_ids)
    assert got["prompt_tokens"] == len(want.prompt_token_ids)
    assert got["tool_finish_reason"] == "tool_calls"
    assert got["tool_call"]["name"] == "get_weather" and got["tool_call"]["arguments"]["city"] in ("Paris", "Rome")
    assert len(live.recorder.since(mark, "/v1/messages")) == 3 and not live.recorder.since(mark, "/v1/chat/completions")
