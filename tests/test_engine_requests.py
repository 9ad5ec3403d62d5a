"""Refusals, aborts and finish reasons: every bad input is a clear error that leaves no blocks held."""

from __future__ import annotations

import pytest

from nanoserve import LLM, EngineConfig, SamplingParams
from nanoserve.errors import CheckpointError, ConfigError, RequestError


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01, max_num_batched_tokens=64)


def assert_pool_clean(llm):
    engine = llm.engine
    engine.audit()
    assert engine.kv.num_free == engine.kv.num_usable
    assert not engine.scheduler.waiting and not engine.scheduler.running


BAD_REQUESTS = [
    ("x " * 200, SamplingParams(max_tokens=4), "max_model_len"),
    ("hello", SamplingParams(max_tokens=128), "max_tokens"),
    ("", SamplingParams(), "empty"),
    ([], SamplingParams(), "empty"),
    ([1, 2, 10**9], SamplingParams(), "vocabulary"),
    ([1, -5], SamplingParams(), "vocabulary"),
    (42, SamplingParams(), "prompt must be"),
    ("hi", SamplingParams(stop_token_ids=[10**9]), "stop_token_ids"),
    ("hi", "not params", "SamplingParams"),
]


@pytest.mark.parametrize("prompt,params,needle", BAD_REQUESTS)
def test_bad_request_is_refused_before_allocation(llm, prompt, params, needle):
    with pytest.raises(RequestError, match=needle):
        llm.engine.add_request(prompt, params)
    assert_pool_clean(llm)
    out = llm.generate(["still works"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3
    assert_pool_clean(llm)


def test_length_refusal_names_the_numbers_and_the_fix(llm):
    ids = list(range(100, 200))
    with pytest.raises(RequestError) as e:
        llm.engine.add_request(ids, SamplingParams(max_tokens=50))
    msg = str(e.value)
    assert "100" in msg and "50" in msg and "128" in msg and "at most 28" in msg


def test_max_tokens_none_fills_to_max_model_len(llm):
    out = llm.generate([[5] * 120], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"
    assert_pool_clean(llm)


def test_a_bad_request_in_a_batch_queues_none_of_it(llm):
    with pytest.raises(RequestError):
        llm.generate(["fine", "x " * 300], SamplingParams(max_tokens=4))
    assert_pool_clean(llm)


def test_duplicate_request_id_refused(llm):
    engine = llm.engine
    engine.add_request("a", SamplingParams(max_tokens=2), request_id="dup")
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("b", SamplingParams(max_tokens=2), request_id="dup")
    while engine.has_unfinished():
        engine.step()
    assert_pool_clean(llm)


@pytest.mark.parametrize("when", ["waiting", "mid-prefill", "decoding"])
def test_abort_at_any_point_returns_blocks(llm, when):
    engine = llm.engine
    rid = engine.add_request("a b c d e f g h " * 10, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    other = engine.add_request("keep going", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    steps = {"waiting": 0, "mid-prefill": 1, "decoding": 4}[when]
    for _ in range(steps):
        engine.step()
    if when == "mid-prefill":
        req = engine.sequences(rid)[0]
        assert 0 < req.num_computed < req.num_tokens, "the prompt should be part-way through its chunks"
    assert engine.abort(rid)
    assert not engine.abort(rid)
    engine.audit()
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals[rid].outputs[0].finish_reason == "abort"
    assert finals[other].outputs[0].finish_reason == "length"
    assert_pool_clean(llm)
    assert not engine.abort("no-such-request")


def test_finish_reasons(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = llm.generate(["The"], greedy)[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 12
    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    by_token = llm.generate(["The"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                   stop_token_ids=[stop_id]))[0].outputs[0]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == stop_id
    assert by_token.token_ids == base.token_ids[: first + 1]
    assert_pool_clean(llm)


def test_stop_string_ends_the_request_and_is_not_emitted(llm):
    base = llm.generate(["The"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0].text
    stop = base[len(base) // 2 : len(base) // 2 + 3]
    if not stop.strip():
        pytest.fail(f"the reference text {base!r} gives no usable stop string")
    out = llm.generate(["The"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == base[: base.index(stop)]
    assert_pool_clean(llm)


def test_eos_ends_the_request_unless_ignored_or_held_by_min_tokens(llm):
    tok = llm.tokenizer
    base = llm.generate(["The"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    target = base.token_ids[2]
    first = base.token_ids.index(target)
    saved = tok.eos_token_ids
    tok.eos_token_ids = frozenset({target})  # the model's own greedy token becomes its end-of-sequence
    try:
        ended = llm.generate(["The"], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
        ignored = llm.generate(["The"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
        held = llm.generate(["The"], SamplingParams(temperature=0, max_tokens=6, min_tokens=6))[0].outputs[0]
    finally:
        tok.eos_token_ids = saved
    assert ended.finish_reason == "stop" and ended.stop_reason is None
    assert ended.token_ids == base.token_ids[: first + 1]
    assert ignored.token_ids == base.token_ids and ignored.finish_reason == "length"
    assert held.finish_reason == "length" and len(held.token_ids) == 6 and target not in held.token_ids
    assert_pool_clean(llm)


@pytest.mark.parametrize("flags,needle", [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"block_size": 12}, "power of two"),
    ({"max_num_batched_tokens": 4, "max_num_seqs": 8}, "max_num_batched_tokens"),
    ({"dtype": "int8"}, "dtype"),
    ({"device": "tpu"}, "device"),
    ({"kv_cache_gib": -1}, "kv_cache_gib"),
])
def test_bad_engine_flags_are_refused(flags, needle):
    with pytest.raises(ConfigError, match=needle):
        EngineConfig(**flags)


def test_unknown_flag_lists_known_ones():
    with pytest.raises(ConfigError, match="known flags"):
        EngineConfig.from_flags(max_batch=3)


def test_max_model_len_beyond_the_pool_is_refused(tiny_checkpoint):
    with pytest.raises(ConfigError, match="kv-cache-gib"):
        LLM(model=str(tiny_checkpoint("llama")), max_model_len=512, kv_cache_gib=0.0001)


def test_missing_model_path(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        LLM(model=str(tmp_path / "nope"))


def test_directory_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        LLM(model=str(tmp_path))


def _checkpoint_with_config(tmp_path, tiny_checkpoint, edit) -> str:
    """A copy of the tiny llama checkpoint whose config.json has been changed by `edit(cfg)`."""
    import json
    import shutil

    dst = tmp_path / "edited"
    shutil.copytree(tiny_checkpoint("llama"), dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize("edit,needle", [
    (lambda c: c.update(architectures=["GPT2LMHeadModel"]), "LlamaForCausalLM"),  # names what is supported
    (lambda c: c.pop("hidden_size"), "hidden_size"),
    (lambda c: c.update(intermediate_size=96), "does not match"),
    (lambda c: c.update(num_key_value_heads=3), "multiple of"),
    (lambda c: c.update(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}),
     "'dynamic' is not implemented"),
], ids=["architecture", "missing-key", "weights-vs-config", "kv-heads", "rope-type"])
def test_bad_checkpoint_config_is_refused(tmp_path, tiny_checkpoint, edit, needle):
    with pytest.raises(CheckpointError, match=needle):
        LLM(model=_checkpoint_with_config(tmp_path, tiny_checkpoint, edit))


def test_max_model_len_beyond_the_models_positions_is_refused(tiny_checkpoint):
    with pytest.raises(ConfigError, match="trained for"):
        LLM(model=str(tiny_checkpoint("llama")), max_model_len=1024, kv_cache_gib=0.01)


def test_the_warm_up_step_stays_inside_a_short_rope_table(tiny_checkpoint):
    """CUDA sizes the KV pool after a warm-up step at the full token budget; with --max-model-len below that
    budget the rope table is shorter than the step, and the warm-up must not index past it (on the CPU here,
    where the same code would raise IndexError)."""
    from nanoserve.engine import Engine
    from nanoserve.runner.sizing import warm_up

    engine = Engine(EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=64, kv_cache_gib=0.01,
                                 max_num_batched_tokens=300))
    assert engine.runner.model.rope.cos.shape[0] == 64
    warm_up(engine.runner)
