"""vLLM's beam search (`use_beam_search`, `n` beams): the search against transformers' own beam search on the same
weights, over a live server driven by the openai SDK; the ranking rules (length penalty, end tokens) on a
scripted distribution; and the fields it has no use for refused by name."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
import torch

from nanoserve.beam_search import BeamSearchParams, beam_search
from nanoserve.sampler import TokenLogprobs
from tests.helpers import tiny_server_running, wait_until

PROMPT = [1, 415, 2936, 9060, 285, 1142, 28705]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def server(ckpt):
    with tiny_server_running(ckpt, {"max_model_len": 128}) as s:
        yield s


@pytest.fixture(scope="module")
def transformers_beams(ckpt) -> list[list[int]]:
    """transformers' 3 best beams of 4 tokens after PROMPT, best first (no end token: min_new_tokens masks it)."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), num_beams=3, num_return_sequences=3, max_new_tokens=4,
                             min_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    return [seq[len(PROMPT):].tolist() for seq in out.sequences]


def test_the_offline_beams_are_transformers_beams(ckpt, transformers_beams):
    from nanoserve import LLM, BeamSearchParams

    llm = LLM(model=str(ckpt), max_model_len=128, kv_cache_gib=0.01)
    (out,) = llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(beam_width=3, max_tokens=4,
                                                                              ignore_eos=True))
    assert [s.tokens[len(PROMPT):] for s in out.sequences] == transformers_beams
    assert [s.tokens[:len(PROMPT)] for s in out.sequences] == [PROMPT] * 3  # vLLM's: the prompt's tokens first
    scores = [s.cum_logprob for s in out.sequences]
    assert scores == sorted(scores, reverse=True) and all(len(s.logprobs) == 4 for s in out.sequences)
    assert out.sequences[0].text == llm.get_tokenizer().decode(out.sequences[0].tokens)
    with pytest.raises(Exception, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=3, temperature=0.7)


def test_the_beams_are_transformers_beams_on_the_same_weights(server, transformers_beams):
    """No end token within reach: the n best sequences of 4 tokens, best first, over the openai SDK."""
    want = transformers_beams
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=3, temperature=0,
                                    extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True})
    assert [c.token_ids for c in got.choices] == want
    assert all(c.model_extra["prompt_token_ids"] == PROMPT for c in got.choices)  # return_token_ids: both ids
    assert [c.index for c in got.choices] == [0, 1, 2] and all(c.finish_reason == "length" for c in got.choices)
    assert got.usage.completion_tokens == 12 and got.usage.prompt_tokens == len(PROMPT)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}], n=2,
                                          max_tokens=3, extra_body={"use_beam_search": True, "ignore_eos": True})
    assert len(chat.choices) == 2 and all(c.message.role == "assistant" for c in chat.choices)
    assert wait_until(lambda: server.engine.kv.num_used == 0 and not server.engine.has_unfinished())


def test_fields_a_beam_search_has_no_use_for_are_refused_by_name(server):
    base = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "n": 2, "use_beam_search": True}
    for field, value in (("top_p", 0.5), ("temperature", 0.7), ("stream", True), ("logprobs", 1), ("stop", ["x"]),
                         ("seed", 3)):
        r = httpx.post(server.url + "/v1/completions", json={**base, field: value}, timeout=60)
        assert r.status_code == 400 and f"{field} does not apply to beam search" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={**base, "n": 11}, timeout=60)
    assert r.status_code == 400 and "--max-logprobs" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={**base, "use_beam_search": False, "length_penalty": 2.0})
    assert r.status_code == 400 and "use_beam_search" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={**base, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text


def _scripted(table: dict[tuple[int, ...], dict[int, float]]):
    """A Step over a fixed next-token distribution per generated prefix (the prompt is [0])."""
    async def step(prompts, alternatives, allowed):
        out = []
        for ids in prompts:
            dist = sorted(table[tuple(ids[1:])].items(), key=lambda kv: -kv[1])
            out.append(TokenLogprobs(dist[0][0], dist[0][1], tuple(dist[:alternatives])))
        return out
    return step


def test_the_ranking_divides_by_length_and_an_end_token_finishes_a_beam():
    end = 9
    lp = math.log
    table = {(): {5: lp(0.6), end: lp(0.4)}, (5,): {6: lp(0.5), 7: lp(0.5)}, (5, 6): {8: lp(1.0)},
             (5, 7): {8: lp(1.0)}}
    params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=1.0)
    best = asyncio.run(beam_search(_scripted(table), [0], params, {end}))
    # [end] scores log 0.4 / 1 = -0.92; [5, 6, 8] scores log 0.3 / 3 = -0.40: the long one wins per token
    assert [(b.tokens, b.finish_reason) for b in best] == [([5, 6, 8], "length"), ([5, 7, 8], "length")]
    shortest = asyncio.run(beam_search(_scripted(table), [0], BeamSearchParams(2, 3, length_penalty=0.0), {end}))
    assert [(b.tokens, b.finish_reason, b.stop_reason) for b in shortest][0] == ([], "stop", end)
