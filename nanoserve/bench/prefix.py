"""`nanoserve bench prefix`: what automatic prefix caching saves, with the cache on and off in one run.

(a) A chat of N turns on one engine: each turn's prompt is the whole conversation so far, so without the cache
turn 8 prefills turns 1-7 again. Time to first token per turn, the arms interleaved turn by turn.
(b) Many requests sharing one long system prompt, all arriving at once: output throughput and TTFT p50/p99.
llama.cpp (llama-cpp-python on the same GGUF) stands beside them: its `generate` reuses the longest common
prefix of the sequence it evaluated last, so its chat arm is timed with that reuse and with a reset context;
it serves one sequence at a time, so its shared-prompt arm runs the requests one after another.
Each repeat starts every cache empty (reset_prefix_cache, a fresh llama.cpp context).
"""

from __future__ import annotations

import statistics
import time

import torch

from nanoserve.bench.common import print_table, write_results
from nanoserve.bench.peers import LlamaCppArm, llama_cpp_arm
from nanoserve.bench.throughput import model_path
from nanoserve.flags import add_engine_flags, engine_flags
from nanoserve.stats import percentiles
from nanoserve.workload import pick_prompts

ON, OFF, CPP, CPP_RESET = "nanoserve cache on", "nanoserve cache off", "llama.cpp (prefix reuse)", "llama.cpp reset"


def add_parser(sub) -> None:
    p = sub.add_parser("prefix", help="prefix caching on vs off: a multi-turn chat and a shared system prompt")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--answer-tokens", type=int, default=48, help="tokens each chat answer runs to")
    p.add_argument("--shared-requests", type=int, default=64)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--output-len", type=int, default=32, help="tokens per shared-prompt request")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-llama-cpp", action="store_true")
    p.add_argument("--out", default="bench-results")
    add_engine_flags(p)


def first_token_seconds(engine, ids: list[int], params) -> tuple[float, list[int]]:
    """Seconds from submitting `ids` to its first token, and the whole answer (run to its end, untimed)."""
    start = time.perf_counter()
    rid = engine.add_request(ids, params)
    ttft, answer = None, []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                if ttft is None and out.outputs[0].token_ids:
                    ttft = time.perf_counter() - start
                answer = list(out.outputs[0].token_ids)
    return ttft, answer


def run_chat(arms: dict, llama_cpp: LlamaCppArm | None, turns: int, answer_tokens: int) -> dict:
    """TTFT per turn for each arm; each arm keeps its own conversation (the answers are compared after)."""
    from nanoserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=answer_tokens, ignore_eos=True)
    questions = pick_prompts(turns)
    names = [*arms, *([CPP, CPP_RESET] if llama_cpp else [])]
    history = {name: [] for name in names}
    ttft = {name: [] for name in names}
    prompt_lens = []
    for llm in arms.values():
        llm.engine.reset_prefix_cache()
    if llama_cpp is not None:
        llama_cpp.llm.reset()
    tokenizer = next(iter(arms.values())).engine.tokenizer
    for question in questions:
        for name in names:
            history[name].append({"role": "user", "content": question})
            ids = tokenizer.apply_chat_template(history[name], add_generation_prompt=True, tokenize=True)
            if name in arms:
                seconds, answer = first_token_seconds(arms[name].engine, ids, params)
            else:
                if name == CPP_RESET:
                    llama_cpp.llm.reset()
                seconds, answer = llama_cpp.first_token_and_answer(ids, answer_tokens)
            ttft[name].append(seconds)
            history[name].append({"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)})
            if name == names[0]:
                prompt_lens.append(len(ids))
    same = len({str(history[n]) for n in arms}) == 1
    return {"ttft": ttft, "prompt_tokens": prompt_lens, "answers_identical": same}


def run_shared(arms: dict, llama_cpp: LlamaCppArm | None, n: int, system_tokens: int, output_len: int) -> dict:
    from nanoserve import SamplingParams

    tokenizer = next(iter(arms.values())).engine.tokenizer
    text = " ".join(pick_prompts(64))
    system = (tokenizer.encode(text, add_special_tokens=False) * 8)[:system_tokens]
    questions = [tokenizer.encode(f" Question {i}: {q}", add_special_tokens=False)
                 for i, q in enumerate(pick_prompts(n))]
    prompts = [system + q for q in questions]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, logprobs=TOP)
    out = {}
    for name, llm in arms.items():
        llm.engine.reset_prefix_cache()
        before = llm.engine.stats().prefix_cache
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        ttfts = [r.metrics.first_token_time - r.metrics.arrival_time for r in results]
        after = llm.engine.stats().prefix_cache
        queries, hits = after.queries - before.queries, after.hits - before.hits
        out[name] = {"tok_s": n * output_len / wall, "seconds": wall, "ttft": ttfts,
                     "hit_rate": hits / queries if queries else 0.0,
                     "outputs": [r.outputs[0] for r in results]}
    if llama_cpp is not None:
        llama_cpp.llm.reset()
        start = time.perf_counter()
        ttfts = []
        for ids in prompts:  # one after another, all arrived at `start`; each reuses the system prompt before it
            waited = time.perf_counter() - start
            seconds, _ = llama_cpp.first_token_and_answer(ids, output_len)
            ttfts.append(waited + seconds)
        wall = time.perf_counter() - start
        out[CPP] = {"tok_s": n * output_len / wall, "seconds": wall, "ttft": ttfts, "hit_rate": None}
    return out


TOP = 5  # logprobs kept per token, for the "logprobs close" verdict


def verdicts(a: list, b: list) -> dict:
    """vLLM's "logprobs close" rule between two arms' greedy outputs: identical, or at the first token where
    they part each arm's token is among the other's top-5 (numerics, not a wrong token), or not close."""
    counts = {"identical": 0, "close": 0, "not close": 0}
    for x, y in zip(a, b):
        xs, ys = list(x.token_ids), list(y.token_ids)
        if xs == ys:
            counts["identical"] += 1
            continue
        i = next(i for i, (s, t) in enumerate(zip(xs, ys)) if s != t)
        xe, ye = x.logprobs.entries()[i], y.logprobs.entries()[i]
        ok = xs[i] in dict(ye.top) and ys[i] in dict(xe.top)
        counts["close" if ok else "not close"] += 1
    return counts


def _median_lists(runs: list[list[float]]) -> list[float]:
    return [statistics.median(values) for values in zip(*runs)]


def main(args) -> int:
    from nanoserve import LLM

    flags = engine_flags(args)
    arms = {ON: LLM(**{**flags, "enable_prefix_caching": True}), OFF: LLM(**{**flags, "enable_prefix_caching": False})}
    engine = arms[ON].engine
    llama_cpp = llama_cpp_arm(model_path(engine), torch.get_num_threads(), n_ctx=4096, skip=args.skip_llama_cpp)
    chats, shared = [], []
    for _ in range(args.repeats):  # both workloads each repeat, every arm inside each, caches emptied first
        chats.append(run_chat(arms, llama_cpp, args.turns, args.answer_tokens))
        shared.append(run_shared(arms, llama_cpp, args.shared_requests, args.system_tokens, args.output_len))

    names = list(chats[0]["ttft"])
    ttft = {name: _median_lists([c["ttft"][name] for c in chats]) for name in names}
    chat_rows = []
    for turn in range(args.turns):
        row = {"turn": turn + 1, "prompt tokens": chats[0]["prompt_tokens"][turn]}
        for name in names:
            row[f"{name} TTFT ms"] = 1000 * ttft[name][turn]
        row["off / on"] = ttft[OFF][turn] / ttft[ON][turn]
        chat_rows.append(row)
    print_table(f"(a) chat of {args.turns} turns, {args.answer_tokens}-token answers: time to first token per "
                f"turn (median of {args.repeats})", chat_rows, list(chat_rows[0]))
    shared_rows = []
    for name in shared[0]:
        runs = [s[name] for s in shared]
        p50s = [percentiles(r["ttft"], 0.5)[0] for r in runs]
        p99s = [percentiles(r["ttft"], 0.99)[0] for r in runs]
        hit = runs[0]["hit_rate"]
        shared_rows.append({"arm": name, "output tok/s": statistics.median(r["tok_s"] for r in runs),
                            "seconds": statistics.median(r["seconds"] for r in runs),
                            "TTFT p50 ms": 1000 * statistics.median(p50s), "TTFT p99 ms": 1000 * statistics.median(p99s),
                            "prefix hit rate": None if hit is None else f"{hit:.1%}"})
    print_table(f"(b) {args.shared_requests} requests sharing a {args.system_tokens}-token system prompt, "
                f"{args.output_len} tokens each, all arriving at once (median of {args.repeats})", shared_rows,
                list(shared_rows[0]))
    chat_same = sum(c["answers_identical"] for c in chats)
    shared_verdicts = [verdicts(s[ON]["outputs"], s[OFF]["outputs"]) for s in shared]
    identical = chat_same == len(chats) and all(v["identical"] == args.shared_requests for v in shared_verdicts)
    for s in shared:  # not JSON
        for arm in (ON, OFF):
            del s[arm]["outputs"]
    ratio_chat = ttft[OFF][-1] / ttft[ON][-1]
    ratio_shared = shared_rows[0]["output tok/s"] / shared_rows[1]["output tok/s"]
    print(f"\nturn {args.turns}: TTFT {ratio_chat:.1f}x lower with the cache (target 5x); shared prompt: "
          f"{ratio_shared:.1f}x the throughput (target 2x)")
    print(f"cache on vs off: chats with every answer identical {chat_same} of {len(chats)}; shared-prompt "
          f"outputs per repeat {shared_verdicts} (close: they part at a near-tie, each token in the other's top {TOP})")
    payload = {"chat": chat_rows, "shared": shared_rows, "identical": identical, "chats_identical": chat_same,
               "shared_verdicts": shared_verdicts, "turn_ratio": ratio_chat,
               "shared_ratio": ratio_shared, "llama_cpp": llama_cpp.version if llama_cpp else None,
               "chat_runs": [c["ttft"] for c in chats]}
    path = write_results(args.out, "prefix", payload, chat_rows, args)
    print(f"wrote {path}")
    return 0
