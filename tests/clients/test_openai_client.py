"""The official openai client against the live server, on what vLLM-style clients rely on: n completions per
request with a seed, several prompts per request, echo with prompt logprobs, usage on every streamed chunk.
Each answer is compared with the engine's offline answer for the same request. Runs in the main environment."""

from __future__ import annotations

import pytest

from nanoserve import SamplingParams

from .support import MODEL, engine_prompt_logprobs

PROMPTS = ["Once upon a time", "The capital of France is", "def fib(n):"]
SAME_ENGINE = 1e-5  # the server and the offline engine run the same kernels in differently shaped batches


@pytest.fixture
def client(live):
    from openai import OpenAI

    return OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def offline_texts(offline, prompt, params: SamplingParams) -> list[str]:
    return [c.text for c in offline.generate(prompt, params, use_tqdm=False)[0].outputs]


def test_n3_seeded_completions_are_distinct_reproducible_and_offline(client, offline, live):
    kw = dict(model=MODEL, prompt=PROMPTS[0], n=3, seed=5, temperature=1.0, max_tokens=12,
              extra_body={"ignore_eos": True})
    mark = live.recorder.mark()
    try:
        first, again = client.completions.create(**kw), client.completions.create(**kw)
    except Exception as e:
        pytest.fail(f"{e}\n{live.recorder.failures(mark)}")
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    assert len(set(texts)) == 3, texts
    assert first.usage.completion_tokens == 36
    expected = offline_texts(offline, PROMPTS[0], SamplingParams(n=3, seed=5, temperature=1.0, max_tokens=12,
                                                                 ignore_eos=True))
    assert texts == expected
    streamed = ["", "", ""]
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts


def test_n3_seeded_chat_is_distinct_and_reproducible(client, offline, live):
    messages = [{"role": "user", "content": "Tell me a story."}]
    kw = dict(model=MODEL, messages=messages, n=3, seed=5, temperature=1.0, max_tokens=12,
              extra_body={"ignore_eos": True})
    mark = live.recorder.mark()
    try:
        first, again = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    except Exception as e:
        pytest.fail(f"{e}\n{live.recorder.failures(mark)}")
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices] and len(set(texts)) == 3, texts
    params = SamplingParams(n=3, seed=5, temperature=1.0, max_tokens=12, ignore_eos=True)
    assert texts == [c.text for c in offline.chat(messages, params, use_tqdm=False)[0].outputs]


@pytest.mark.parametrize("form", ["strings", "token_lists"])
def test_batched_prompts_answer_one_choice_per_prompt_in_order(client, offline, live, form):
    tok = offline.get_tokenizer()
    prompts = PROMPTS if form == "strings" else [tok.encode(p) for p in PROMPTS]
    mark = live.recorder.mark()
    try:
        r = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=8,
                                      extra_body={"ignore_eos": True})
    except Exception as e:
        pytest.fail(f"{e}\n{live.recorder.failures(mark)}")
    assert [c.index for c in r.choices] == [0, 1, 2]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert [c.text for c in r.choices] == [offline_texts(offline, p, greedy)[0] for p in prompts]
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS)
    assert r.usage.completion_tokens == 8 * len(PROMPTS)


def test_batched_prompts_with_n_number_choices_prompt_major(client, offline, live):
    mark = live.recorder.mark()
    try:
        r = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, seed=3, temperature=1.0, max_tokens=6,
                                      extra_body={"ignore_eos": True})
    except Exception as e:
        pytest.fail(f"{e}\n{live.recorder.failures(mark)}")
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    params = SamplingParams(n=2, seed=3, temperature=1.0, max_tokens=6, ignore_eos=True)
    expected = [t for p in PROMPTS[:2] for t in offline_texts(offline, p, params)]
    assert [c.text for c in r.choices] == expected


def test_echo_with_logprobs_and_no_new_tokens_returns_the_prompts_logprobs(client, offline, live):
    text = "The quick brown fox jumps over the lazy dog"
    ids = offline.get_tokenizer().encode(text)
    mark = live.recorder.mark()
    try:
        r = client.completions.create(model=MODEL, prompt=text, echo=True, max_tokens=0, logprobs=1)
    except Exception as e:
        pytest.fail(f"{e}\n{live.recorder.failures(mark)}")
    choice = r.choices[0]
    lp = choice.logprobs
    assert choice.text == text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert "".join(lp.tokens) == text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(engine_prompt_logprobs(offline, ids)[1:], abs=SAME_ENGINE)
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert 1 <= len(top) <= 2 and top.get(token, logprob) == pytest.approx(logprob)
        assert max(top.values()) >= logprob - SAME_ENGINE
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0


def test_echo_of_token_lists_covers_prompt_and_generated_tokens(client, offline, live):
    """lm-eval's loglikelihood request: several token-id prompts, echo, one new token, logprobs=1."""
    tok = offline.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    mark = live.recorder.mark()
    try:
        r = client.completions.create(model=MODEL, prompt=prompts, echo=True, max_tokens=1, logprobs=1,
                                      temperature=0)
    except Exception as e:
        pytest.fail(f"{e}\n{live.recorder.failures(mark)}")
    assert [c.index for c in r.choices] == [0, 1, 2]
    for ids, choice in zip(prompts, r.choices, strict=True):
        generated = offline_texts(offline, ids, SamplingParams(temperature=0, max_tokens=1))[0]
        assert choice.text == tok.decode(ids) + generated
        got = choice.logprobs.token_logprobs
        assert len(got) == len(ids) + 1 and got[0] is None
        assert got[1:len(ids)] == pytest.approx(engine_prompt_logprobs(offline, ids)[1:], abs=SAME_ENGINE)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_continuous_usage_stats_put_usage_on_every_chunk(client, offline, live, route):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    mark = live.recorder.mark()
    try:
        if route == "completions":
            chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                                    stream=True, stream_options=opts, extra_body={"ignore_eos": True}))
        else:
            chunks = list(client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0, stream=True,
                stream_options=opts, extra_body={"ignore_eos": True}))
    except Exception as e:
        pytest.fail(f"{e}\n{live.recorder.failures(mark)}")
    assert all(c.usage is not None for c in chunks), [c.usage for c in chunks]
    prompt_tokens = {c.usage.prompt_tokens for c in chunks}
    assert len(prompt_tokens) == 1
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    assert not chunks[-1].choices  # the closing usage chunk of include_usage
