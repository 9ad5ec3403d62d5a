"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF): real text, and transformers as the oracle."""

from __future__ import annotations

import pytest
import torch

from nanoserve import SamplingParams
from nanoserve.model.loader import default_model_path

from .test_model_oracle import RecordingSampler, full_prefill_logits


@pytest.fixture(scope="module")
def hf_default():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def test_answers_the_capital_of_france(default_llm):
    out = default_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=32),
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
    default_llm.engine.audit()


def test_logits_and_greedy_match_transformers_gguf_loader(default_llm_dense, hf_default):
    llm = default_llm_dense
    ids = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colours."}], add_generation_prompt=True, tokenize=True
    )
    with torch.inference_mode():
        theirs = hf_default(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(full_prefill_logits(llm, ids), theirs, rtol=1e-3, atol=1e-3)

    recorder = RecordingSampler(llm.engine)
    llm.engine.runner.sampler = recorder
    try:
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    finally:
        llm.engine.runner.sampler = recorder.inner
    tokens = list(out.outputs[0].token_ids)
    with torch.inference_mode():
        steps = hf_default(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1]
        generated = hf_default.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16,
                                        do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    torch.testing.assert_close(torch.cat(recorder.seen), steps, rtol=1e-3, atol=1e-3)
    assert tokens == generated


def test_streamed_chat_text_has_no_replacement_characters(default_llm):
    engine = default_llm.engine
    ids = default_llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write one sentence with an emoji and the word 東京."}],
        add_generation_prompt=True, tokenize=True,
    )
    rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=40))
    deltas, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                deltas.append(out.delta_text)
                final = out
    assert "".join(deltas) == final.outputs[0].text
    assert all("\ufffd" not in d for d in deltas)
    assert final.outputs[0].text == default_llm.tokenizer.decode(final.outputs[0].token_ids)
