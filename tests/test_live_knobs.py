"""Live knobs (nanoserve/live_knobs.py): flags that change at the next step with no restart, checked as at
start, logged with who asked; over HTTP behind the API key."""

from __future__ import annotations

import re

import httpx
import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.errors import ConfigError


def test_a_live_max_num_seqs_shows_in_the_next_steps_running_count_with_no_restart(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint("llama")), max_model_len=256, kv_cache_gib=0.02, max_num_seqs=4)
    engine = llm.engine
    runner = engine.runner
    engine.set_live({"max_num_seqs": 1}, "test")
    for i in range(4):
        engine.add_request([5, 6, 7 + i], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.scheduler_stats().running == 1
    (change,) = engine.set_live({"max_num_seqs": 3}, "test")
    assert (change.name, change.old, change.new, change.who, change.step) == \
        ("max_num_seqs", 1, 3, "test", runner.steps + 1)
    engine.step()
    assert engine.scheduler_stats().running == 3 and engine.runner is runner  # the same engine, no restart
    assert engine.stats().flags["max_num_seqs"] == 3
    while engine.has_unfinished():
        engine.step()
    assert [c.new for c in engine.knobs.log] == [1, 3]


def test_a_live_change_is_checked_as_at_start_and_only_live_flags_change(tiny_checkpoint):
    engine = LLM(model=str(tiny_checkpoint("llama")), max_model_len=256, kv_cache_gib=0.02, max_num_seqs=4).engine
    for changes, says in (({"block_size": 32}, "cannot change while the engine runs"),
                          ({"max_num_seqs": 0}, "max_num_seqs"),
                          ({"max_num_seqs": "2"}, "takes an integer"),
                          ({"max_num_seqs": 8}, "goes live up to 4"),
                          ({"max_step_ms": "fast"}, "takes a number or null"),
                          ({"max_num_seqs": True}, "takes an integer, got True; max_num_seqs goes live from 1 to 4"),
                          ({"max_step_ms": float("inf")}, r"in \[0, 60000\].*got inf")):
        with pytest.raises(ConfigError, match=says):
            engine.set_live(changes, "test")
    assert engine.config.max_num_seqs == 4 and not engine.knobs.log  # nothing half-applied
    engine.set_live({"max_step_ms": 40}, "test")
    assert engine.step_budget.max_step_ms == 40 and engine.stats().features["step_budget"]["target_ms"] == 40


def test_knobs_change_over_http_behind_the_key_and_say_who_asked(tiny_checkpoint):
    from tests.helpers import tiny_server_running, wait_until

    with tiny_server_running(tiny_checkpoint("llama"), {"max_num_seqs": 4}, api_key="k") as server:
        key = {"Authorization": "Bearer k"}
        assert httpx.post(server.url + "/knobs", json={"max_num_seqs": 2}).status_code == 401
        r = httpx.post(server.url + "/knobs", json={"max_num_seqs": 2}, headers=key, timeout=30)
        assert r.status_code == 200 and r.json()["changed"][0]["who"].startswith("http 127.0.0.1")
        assert wait_until(lambda: httpx.get(server.url + "/health", headers=key, timeout=30)
                          .json()["flags"]["max_num_seqs"] == 2)  # the next snapshot publishes it
        refused = httpx.post(server.url + "/knobs", json={"dtype": "float16"}, headers=key, timeout=30)
        assert refused.status_code == 400 and "live: max_num_seqs" in refused.json()["error"]["message"]
        assert httpx.post(server.url + "/knobs", content=b"[1]", headers=key, timeout=30).status_code == 400
        log = httpx.get(server.url + "/knobs", headers=key, timeout=30).json()
        assert "max_step_ms" in log["live"] and [c["new"] for c in log["log"]] == [2]


def test_speculation_turns_on_and_off_live_and_changes_no_output(tiny_checkpoint):
    """Speculation switched on mid-generation, then off: the outputs are those of an engine that never
    speculated, and drafts were made while it was on."""
    path = str(tiny_checkpoint("llama"))
    prompts = [[3 + (i + j) % 7 for j in range(30 + 5 * i)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(model=path, max_model_len=256, kv_cache_gib=0.02)
            .generate(prompts, params, use_tqdm=False)]
    engine = LLM(model=path, max_model_len=256, kv_cache_gib=0.02).engine
    ids = [engine.add_request(p, params) for p in prompts]
    outputs = {}

    def run(steps: int) -> None:
        for _ in range(steps):
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids

    run(5)
    engine.set_live({"speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                            "prompt_lookup_min": 1}}, "test")
    run(6)
    drafted = engine.stats().features["speculative"]["num_accepted_tokens"]
    engine.set_live({"speculative_config": None}, "test")
    assert "speculative" not in engine.stats().features and engine.scheduler.drafter is None
    while engine.has_unfinished():
        run(1)
    assert drafted > 0 and [outputs[i] for i in ids] == want
    assert [c.name for c in engine.knobs.log] == ["speculative_config"] * 2


def test_the_log_level_changes_live_for_every_engine_logger_and_a_bad_one_is_refused(tiny_checkpoint):
    import logging

    logger = logging.getLogger("nanoserve")
    before = logger.level
    engine = LLM(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01).engine
    try:
        with pytest.raises(ConfigError, match="log_level takes one of DEBUG"):
            engine.set_live({"log_level": "loud", "max_num_seqs": 2}, "test")
        assert engine.config.max_num_seqs == 64 and not engine.knobs.log  # a bad part refuses the whole change
        old = logging.getLevelName(logger.getEffectiveLevel())
        (change,) = engine.set_live({"log_level": "debug"}, "test")
        assert (change.name, change.old, change.new) == ("log_level", old, "DEBUG")
        assert logging.getLogger("nanoserve.engine").isEnabledFor(logging.DEBUG)
        assert engine.knobs.as_dict()["log_level"] == "DEBUG" == engine.stats().features["live"]["log_level"]
    finally:
        logger.setLevel(before)


def test_a_prefix_cache_reset_over_http_is_logged_with_who_asked(tiny_checkpoint):
    from tests.helpers import tiny_server_running

    with tiny_server_running(tiny_checkpoint("llama"), api_key="k") as server:
        key = {"Authorization": "Bearer k"}
        assert httpx.post(server.url + "/v1/completions", headers=key, timeout=30,
                          json={"prompt": [5 + i for i in range(40)], "max_tokens": 2}).status_code == 200
        r = httpx.post(server.url + "/reset_prefix_cache", headers=key, timeout=30)
        assert r.status_code == 200 and r.json()["blocks_forgotten"] == 2
        (change,) = httpx.get(server.url + "/knobs", headers=key, timeout=30).json()["log"]
        assert change["name"] == "prefix_cache" and change["who"].startswith("http 127.0.0.1")
        assert (change["old"], change["new"]) == ("2 blocks named", "reset")


def test_the_stall_thresholds_change_live_and_judge_the_next_step(tiny_checkpoint):
    """A step twice the p99 is no stall at the default factor 3, and is one once the factor is 1.5."""
    engine = LLM(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01).engine
    watch = engine.stalls
    for _ in range(40):
        watch.step(0.1, 4, 0, 0, running=4, now=None)
    assert not watch.step(0.2, 4, 0, 0, running=4)
    (change,) = engine.set_live({"stall_factor": 1.5}, "test")
    assert (change.old, change.new) == (3.0, 1.5) and watch.factor == 1.5
    assert watch.step(0.2, 4, 0, 0, running=4) and watch.latest[-1]["kind"] == "step"
    engine.set_live({"stall_drop_fraction": 0.8}, "test")
    assert engine.stats().features["stalls"]["drop_fraction"] == 0.8
    with pytest.raises(ConfigError, match="stall_factor must be > 1"):
        engine.set_live({"stall_factor": 0.5}, "test")


# A bad value for every live knob, as raw JSON (Python's json reads 1e999 as inf, and NaN / Infinity literals),
# with the text the 400 must name: the knob and the value it got.
BAD_KNOBS = (
    (b'{"max_step_ms": 1e999}', "max_step_ms", "inf"),
    (b'{"max_step_ms": -Infinity}', "max_step_ms", "-inf"),
    (b'{"max_step_ms": NaN}', "max_step_ms", "nan"),
    (b'{"max_step_ms": 1e306}', "max_step_ms", "1e+306"),
    (b'{"max_step_ms": true}', "max_step_ms", "True"),
    (b'{"max_num_seqs": 1e999}', "max_num_seqs", "inf"),
    (b'{"max_num_seqs": true}', "max_num_seqs", "True"),
    (b'{"max_num_seqs": 2.5}', "max_num_seqs", "2.5"),
    (b'{"max_num_batched_tokens": NaN}', "max_num_batched_tokens", "nan"),
    (b'{"max_num_batched_tokens": false}', "max_num_batched_tokens", "False"),
    (b'{"stall_factor": 1e999}', "stall_factor", "inf"),
    (b'{"stall_factor": NaN}', "stall_factor", "nan"),
    (b'{"stall_factor": true}', "stall_factor", "True"),
    (b'{"stall_drop_fraction": Infinity}', "stall_drop_fraction", "inf"),
    (b'{"stall_drop_fraction": NaN}', "stall_drop_fraction", "nan"),
    (b'{"speculative_config": {"method": "suffix", "suffix_decoding_max_spec_factor": 1e999}}',
     "suffix_decoding_max_spec_factor", "inf"),
    (b'{"speculative_config": {"method": "suffix", "suffix_decoding_max_spec_factor": NaN}}',
     "suffix_decoding_max_spec_factor", "nan"),
    (b'{"speculative_config": {"method": "ngram", "num_speculative_tokens": 1e999}}', "num_speculative_tokens", "inf"),
    (b'{"speculative_config": true}', "speculative_config", "True"),
    (b'{"log_level": 10}', "log_level", "10"),
    (b'{"max_num_seqs": 2, "max_step_ms": 1e999}', "max_step_ms", "inf"),  # one bad value refuses the whole change
    (b'{"log_level": "DEBUG", "stall_factor": NaN}', "stall_factor", "nan"),
    (b'{"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}, "stall_factor": 1e999}',
     "stall_factor", "inf"),
)


def test_every_live_knob_refuses_a_bad_value_with_a_400_and_changes_nothing(tiny_checkpoint):
    """Infinity, NaN, a boolean or an out-of-range number for any live knob is a 400 naming the knob and the
    value, and applies nothing (the other knobs of the same change included): the flags, the log and /health
    are as before, and a streamed decode with a prompt's prefill beside it runs as before."""
    import threading

    from tests.helpers import tiny_server_running

    with tiny_server_running(tiny_checkpoint("llama"), {"max_num_seqs": 4}) as server:
        def state():
            health = httpx.get(server.url + "/health", timeout=30)
            return health.status_code, health.json()["flags"], httpx.get(server.url + "/knobs", timeout=30).json()

        before = state()
        for body, knob, value in BAD_KNOBS:
            r = httpx.post(server.url + "/knobs", content=body, headers={"content-type": "application/json"},
                           timeout=30)
            message = r.json()["error"]["message"] if r.status_code == 400 else r.text
            assert r.status_code == 400 and knob in message and value in message, (body, r.status_code, message)
            assert state() == before, body
        assert before[0] == 200
        long_prompt = {"prompt": [5 + i % 50 for i in range(100)], "max_tokens": 4}
        streamed, beside = [], []

        def stream():
            with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
                    "prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True, "stream": True}) as r:
                streamed.extend([r.status_code, *r.iter_lines()])

        reader = threading.Thread(target=stream)
        reader.start()
        beside.append(httpx.post(server.url + "/v1/completions", json=long_prompt, timeout=60).status_code)
        reader.join(timeout=60)
        assert streamed[0] == 200 and "data: [DONE]" in streamed and beside == [200]
        assert state()[0] == 200


@pytest.mark.parametrize("flags, says", [
    ({"max_step_ms": float("inf")}, "max_step_ms must be"), ({"max_step_ms": float("nan")}, "max_step_ms must be"),
    ({"max_step_ms": 10 ** 400}, "max_step_ms must be"), ({"max_step_ms": True}, "max_step_ms takes a number"),
    ({"stall_factor": float("inf")}, "stall_factor must be"), ({"kv_cache_gib": float("inf")}, "kv_cache_gib must"),
    ({"distributed_timeout": float("nan")}, "distributed_timeout must"), ({"max_num_seqs": True}, "takes an integer"),
    ({"max_num_seqs": "8"}, "max_num_seqs takes an integer"), ({"gpu_memory_utilization": float("nan")}, "in (0, 1]"),
])
def test_engine_config_refuses_infinite_nan_and_boolean_numbers(flags, says):
    from nanoserve import EngineConfig

    with pytest.raises(ConfigError, match=re.escape(says)):
        EngineConfig(**flags)


@pytest.mark.parametrize("value", ["inf", "nan", "-inf", "1e999"])
def test_the_command_line_refuses_an_infinite_or_nan_max_step_ms(value, capsys):
    from nanoserve.cli import build_parser

    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["serve", "tiny", f"--max-step-ms={value}"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "--max-step-ms" in err and "finite" in err, err
