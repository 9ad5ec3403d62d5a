"""The vllm: metric family under vLLM's names, types and buckets, with the values vLLM's own metrics test expects
of ten identical requests (its _get_expected_values), read with prometheus_client's parser as a scraper reads
them."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nanoserve.iteration_stats import INTER_TOKEN_LATENCY_BUCKETS, REQUEST_LATENCY_BUCKETS, one_two_five
from nanoserve.server.serve import DataParallel
from tests.helpers import tiny_server_running, wait_until

# vLLM's EXPECTED_METRICS_V1 (tests/entrypoints/instrumentator/test_metrics.py), every one of them
EXPECTED = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:num_kv_cache_total_blocks", "vllm:num_prefix_cached_blocks", "vllm:num_prefix_cached_tokens",
            "vllm:prefix_cache_usage_perc", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
            "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
            "vllm:iteration_tokens_total", "vllm:cache_config_info", "vllm:request_success_total",
            "vllm:admission_rejections_total",
            *[f"vllm:{name}_{part}" for name in (
                "request_prompt_tokens", "request_generation_tokens", "request_params_n", "request_params_max_tokens",
                "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                "request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
                "request_decode_time_seconds") for part in ("sum", "bucket", "count")]]
REQUESTS, MAX_TOKENS = 10, 10


@pytest.fixture(scope="module")
def scraped(tiny_checkpoint):
    """The families after ten identical completions of ten tokens each, and the prompt's length."""
    with tiny_server_running(tiny_checkpoint("llama"), {"max_model_len": 256}) as server:
        ids = server.engine.tokenizer.encode("Hello my name is Robert and I love magic. " * 4)  # a few blocks
        for _ in range(REQUESTS):
            r = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": ids, "max_tokens": MAX_TOKENS, "ignore_eos": True})
            assert r.status_code == 200
        # the snapshot /metrics reads is taken after the step's outputs are handed on: wait for the last one
        assert wait_until(lambda: families(server).get("vllm:request_success") and sample(
            families(server), "vllm:request_success", "vllm:request_success_total", finished_reason="length")
            == REQUESTS, timeout=10)
        text = httpx.get(server.url + "/metrics").text
    return text, {f.name: f for f in text_string_to_metric_families(text)}, len(ids)


def families(server) -> dict:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}


def sample(families, family: str, name: str, **labels) -> float:
    values = [s.value for s in families[family].samples
              if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(values) == 1, (name, labels, values)
    return values[0]


def test_every_metric_vllm_expects_is_exported(scraped):
    text, _, _ = scraped
    missing = [name for name in EXPECTED if name not in text]
    assert not missing, missing


def test_the_counts_are_what_vllm_expects_of_ten_identical_requests(scraped):
    _, families, prompt = scraped
    expected = {  # vLLM's _get_expected_values
        "vllm:time_to_first_token_seconds": [("_count", REQUESTS)],
        "vllm:inter_token_latency_seconds": [("_count", REQUESTS * (MAX_TOKENS - 1))],
        "vllm:e2e_request_latency_seconds": [("_count", REQUESTS)],
        "vllm:request_queue_time_seconds": [("_count", REQUESTS)],
        "vllm:request_inference_time_seconds": [("_count", REQUESTS)],
        "vllm:request_prefill_time_seconds": [("_count", REQUESTS)],
        "vllm:request_decode_time_seconds": [("_count", REQUESTS)],
        "vllm:request_prompt_tokens": [("_sum", REQUESTS * prompt), ("_count", REQUESTS)],
        "vllm:request_generation_tokens": [("_sum", REQUESTS * MAX_TOKENS), ("_count", REQUESTS)],
        "vllm:request_params_n": [("_count", REQUESTS)],
        "vllm:request_params_max_tokens": [("_sum", REQUESTS * MAX_TOKENS), ("_count", REQUESTS)],
        "vllm:iteration_tokens_total": [("_sum", REQUESTS * (prompt + MAX_TOKENS)), ("_count", REQUESTS * MAX_TOKENS)],
        "vllm:prompt_tokens": [("_total", REQUESTS * prompt)],
        "vllm:generation_tokens": [("_total", REQUESTS * MAX_TOKENS)],
    }
    for family, checks in expected.items():
        for suffix, value in checks:
            assert sample(families, family, family + suffix, model_name="tiny", engine="0") == value, family + suffix
    assert sample(families, "vllm:request_success", "vllm:request_success_total", finished_reason="length") == REQUESTS
    assert sample(families, "vllm:request_success", "vllm:request_success_total", finished_reason="abort") == 0
    # the prompt was the same ten times: nine found it cached, and computed only what the cache did not hold
    computed = sample(families, "vllm:request_prefill_kv_computed_tokens", "vllm:request_prefill_kv_computed_tokens_sum")
    hits = sample(families, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
    assert hits > 0 and computed == REQUESTS * prompt - hits


def test_histograms_have_vllms_buckets_and_add_up(scraped):
    _, families, _ = scraped
    for family, bounds in (("vllm:e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS),
                           ("vllm:inter_token_latency_seconds", INTER_TOKEN_LATENCY_BUCKETS),
                           ("vllm:request_prompt_tokens", one_two_five(256))):
        buckets = [s for s in families[family].samples if s.name == family + "_bucket"]
        assert [float(s.labels["le"]) for s in buckets] == [*map(float, bounds), float("inf")]
        counts = [s.value for s in buckets]
        assert counts == sorted(counts) and counts[-1] == sample(families, family, family + "_count")
    assert families["vllm:request_params_n"].type == "histogram"
    (info,) = families["vllm:cache_config_info"].samples  # the pool as endpoint pickers read it
    tokens = int(info.labels["num_gpu_blocks"]) * int(info.labels["block_size"])
    assert int(info.labels["kv_cache_size_tokens"]) == tokens > 0
    assert float(info.labels["kv_cache_max_concurrency"]) == round(tokens / 256, 2)  # max_model_len 256
    assert families["vllm:num_requests_waiting_by_reason"].type == "gauge"
    assert families["vllm:prompt_tokens"].type == "counter"


def test_a_replica_each_has_its_own_series(tiny_checkpoint):
    with tiny_server_running(tiny_checkpoint("llama"), data_parallel=DataParallel(2)) as server:
        for salt in ("a", "b", "c", "d"):
            httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": f"{salt} hello", "max_tokens": 3, "ignore_eos": True, "cache_salt": salt})
        assert wait_until(lambda: sum(s.value for s in families(server)["vllm:generation_tokens"].samples) == 12,
                          timeout=20)
        scraped = families(server)
    per_engine = {s.labels["engine"]: s.value for s in scraped["vllm:generation_tokens"].samples}
    assert set(per_engine) == {"0", "1"} and sum(per_engine.values()) == 12
    counts = {s.labels["engine"]: s.value for s in scraped["vllm:e2e_request_latency_seconds"].samples
              if s.name.endswith("_count")}
    assert sum(counts.values()) == 4
