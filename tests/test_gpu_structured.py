"""Structured outputs on CUDA (skipped without CUDA): the bitmask crosses to the device and is unpacked there;
with CUDA graphs replaying the decode steps, a crowd of constrained and unconstrained rows gets the tokens eager
execution gives, and every constrained output holds."""

from __future__ import annotations

import re

import pytest

from tests.test_engine_crowd import MIXED, make
from tests.test_structured import CONSTRAINED

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama")


def tokens(outputs):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs]


def test_cuda_constrained_crowd_replays_as_eager(ckpt):
    crowd = [*MIXED, *CONSTRAINED]
    cuda = {"device": "cuda", "dtype": "float32", "kv_cache_gib": 0.05}
    eager = make(ckpt, **cuda).generate([p for p, _ in crowd], [s for _, s in crowd], use_tqdm=False)
    llm = make(ckpt, **cuda, cuda_graphs=True, max_num_seqs=16)
    replayed = llm.generate([p for p, _ in crowd], [s for _, s in crowd], use_tqdm=False)
    assert tokens(replayed) == tokens(eager)
    text = [o.outputs[0].text for o in replayed[len(MIXED):]]
    assert text[1] in ("red", "green") and re.fullmatch("[0-9]{3,8}", text[2])
    assert llm.engine.stats().as_dict()["capture"]["replays"] > 0
    llm.engine.audit()
