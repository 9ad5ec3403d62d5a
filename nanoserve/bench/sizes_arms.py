"""One arm of `nanoserve bench sizes` in a process of its own: load a GGUF file, then time what a user sees.

Run as `python -m nanoserve.bench.sizes_arms '{"engine": ..., "path": ..., ...}'`; prints one JSON line. A fresh
process per arm and round, so its load time is a cold start's and its resident memory is its own: the load in
seconds, resident memory after loading and its peak, single-stream decode tok/s (after the first token),
prefill tok/s over one prompt, and the total tok/s of concurrent streams (llama.cpp's as llama-server's slots run
them: llama_cpp_slots.py). Prompts are random token
ids (a fixed seed), the same for both engines; prefix caching is off so every repeat computes its prompt.
"""

from __future__ import annotations

import json
import random
import sys
import time


def _status_mib(key: str) -> float:
    """VmRSS or VmHWM of this process, in MiB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab) for _ in range(length)] for _ in range(count)]


def _huge_pages_moved(llm, started: float) -> dict:
    """Waits for the background move of the packed weights onto huge pages (kernels/pages.py), so the speeds
    after it are the engine's steady ones: seconds from the load's start until it finished (load_s is when the
    engine serves, this when it serves at full speed), and the share the kernel moved."""
    fused = llm.engine.runner.loaded.fused
    mover = None if fused is None else fused.huge_pages
    if mover is None:
        return {}
    mover.done.wait()
    return {"huge_pages_s": time.perf_counter() - started, "huge_pages_moved": mover.moved / max(mover.total, 1)}


def run_nanoserve(spec: dict) -> dict:
    import torch

    from nanoserve import LLM, SamplingParams

    torch.set_num_threads(spec["threads"])
    from nanoserve.kernels.fused import load

    load()  # the kernels' one-time build per machine (cached in the user's home) is not a model's load
    kv_gib = spec["kv_cache_gib"] or _kv_gib_needed(spec)
    started = time.perf_counter()
    llm = LLM(model=spec["path"], max_model_len=spec["prompt_tokens"] + spec["decode_tokens"] + 64,
              kv_cache_gib=kv_gib, enable_prefix_caching=False)
    loaded = time.perf_counter() - started
    out = {"load_s": loaded, "rss_after_load_mib": _status_mib("VmRSS"),
           "kv_pool_mib": llm.engine.runner.cache.nbytes / 2**20}
    out.update(_huge_pages_moved(llm, started))
    vocab = llm.engine.model_config.vocab_size

    def seconds(prompts, tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t

    short = _prompts(vocab, 1, 16, spec["seed"])
    seconds(short, 4)  # warm-up
    out["rss_after_decode_mib"] = _status_mib("VmRSS")
    n = spec["decode_tokens"]
    out["decode_tok_s"] = (n - 1) / (seconds(short, n) - seconds(short, 1))
    long = _prompts(vocab, 1, spec["prompt_tokens"], spec["seed"] + 1)
    out["prefill_tok_s"] = spec["prompt_tokens"] / seconds(long, 1)
    for streams in spec["streams"]:
        crowd = _prompts(vocab, streams, 16, spec["seed"] + 2)
        out[f"streams_{streams}_tok_s"] = streams * spec["batch_tokens"] / seconds(crowd, spec["batch_tokens"])
    out["peak_rss_mib"] = _status_mib("VmHWM")
    return out


def _kv_gib_needed(spec: dict) -> float:
    """A float32 KV pool holding the largest of the workloads at once (with a block's slack a sequence): a pool
    too small for 32 streams would time the scheduler's waiting, not the engine (a 3B model's 0.25 GiB held 14 of
    them)."""
    from nanoserve.model.gguf import read_gguf_header

    config = read_gguf_header(spec["path"]).config
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    streams = max(spec["streams"], default=0)
    tokens = max(spec["prompt_tokens"] + spec["decode_tokens"] + 64, streams * (16 + spec["batch_tokens"] + 32))
    return tokens * per_token / 2**30


def run_llama_cpp(spec: dict) -> dict:
    import llama_cpp

    from nanoserve.bench.llama_cpp_slots import slots_tok_s

    threads = spec["threads"]
    started = time.perf_counter()
    llm = llama_cpp.Llama(model_path=spec["path"], n_threads=threads, n_threads_batch=threads,
                          n_ctx=spec["prompt_tokens"] + spec["decode_tokens"] + 64,
                          n_batch=spec["prompt_tokens"], verbose=False)
    loaded = time.perf_counter() - started
    out = {"load_s": loaded, "rss_after_load_mib": _status_mib("VmRSS"), "version": llama_cpp.__version__,
           "kv_pool_mib": _llama_cpp_kv_mib(llm)}
    vocab = llm.n_vocab()

    def seconds(prompt: list[int], tokens: int) -> float:
        t = time.perf_counter()
        made = 0
        for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            made += 1
            if made == tokens:
                break
        return time.perf_counter() - t

    (short,) = _prompts(vocab, 1, 16, spec["seed"])
    seconds(short, 4)  # warm-up
    out["rss_after_decode_mib"] = _status_mib("VmRSS")
    n = spec["decode_tokens"]
    out["decode_tok_s"] = (n - 1) / (seconds(short, n) - seconds(short, 1))
    (long,) = _prompts(vocab, 1, spec["prompt_tokens"], spec["seed"] + 1)
    llm.reset()
    t = time.perf_counter()
    llm.eval(long)
    out["prefill_tok_s"] = spec["prompt_tokens"] / (time.perf_counter() - t)
    for streams in spec["streams"]:
        crowd = _prompts(vocab, streams, 16, spec["seed"] + 2)
        out[f"streams_{streams}_tok_s"] = slots_tok_s(llm, crowd, spec["batch_tokens"], threads)
    out["peak_rss_mib"] = _status_mib("VmHWM")
    llm.close()
    return out


def _llama_cpp_kv_mib(llm) -> float:
    """llama.cpp's KV cache for its context: K and V of every layer in float16 (its default cache type)."""
    meta = llm.metadata
    layers, heads = int(meta["llama.block_count"]), int(meta["llama.attention.head_count"])
    kv_heads = int(meta.get("llama.attention.head_count_kv", heads))
    dim = int(meta["llama.embedding_length"]) // heads
    return 2 * layers * llm.n_ctx() * kv_heads * dim * 2 / 2**20


ENGINES = {"nanoserve": run_nanoserve, "llama.cpp": run_llama_cpp}


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    print(json.dumps(ENGINES[spec["engine"]](spec)), flush=True)
