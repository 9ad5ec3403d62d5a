"""`nanoserve bench prefill`: a prefill chunk that continues a sequence, read the split way or in one masked call.

A chunk whose past is already in the cache (a later chunk of a long prompt, or a prompt whose head the prefix
cache served) attends to that past and to itself. `nanoserve.attention.prefill` splits the two and merges them by
log-sum-exp; the other arm is one attention call over [past, chunk] with a causal mask. Both arms run in one
process on one engine, interleaved repeat by repeat (their order alternating); their first tokens are
compared by vLLM's logprobs-close rule (the command fails if any is not close).

(a) one layer's prefill attention (gather included) by past and chunk length, at the loaded model's attention
shape and at Llama-8B's (32 heads, 8 kv heads, head_dim 128);
(b) the engine end to end: a long prompt prefilled in chunks (cold), a new turn after a cached history, and a
crowd of questions sharing a cached system prompt.
"""

from __future__ import annotations

import statistics
import time

import torch

from nanoserve.attention import prefill
from nanoserve.attention.prefill import forced_split, prefill_attention, share_pasts
from nanoserve.bench.common import print_table, write_results
from nanoserve.bench.prefix import TOP, verdicts
from nanoserve.flags import add_engine_flags, engine_flags
from nanoserve.model.batch import PrefillSegment
from nanoserve.timing import best_seconds

ARMS = {"split": True, "masked": False}


def add_parser(sub) -> None:
    p = sub.add_parser("prefill", help="CPU: a chunk that continues a sequence, split read vs one masked call")
    p.add_argument("--long-tokens", type=int, default=6144, help="the chunked prompt's length")
    p.add_argument("--history-tokens", type=int, default=2048, help="cached history before the new turn")
    p.add_argument("--turn-tokens", type=int, default=64, help="the new turn's tokens")
    p.add_argument("--crowd", type=int, default=64, help="questions sharing the system prompt")
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--question-tokens", type=int, default=16)
    p.add_argument("--layer-grid", nargs="+", default=["512x64", "2048x64", "2048x512", "4096x512"],
                   metavar="PASTxCHUNK", help="the (a) table's past and chunk lengths")
    p.add_argument("--no-llama-8b", action="store_true", help="leave the Llama-8B attention shape out of (a)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="bench-results")
    add_engine_flags(p)


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


def layer_rows(shapes: dict, grid: list[tuple[int, int]], dtype, repeats: int, block_size: int) -> list[dict]:
    """ms per call of one layer's prefill attention, each arm's best of `repeats`, the arms alternating."""
    rows = []
    for name, (heads, kv_heads, dim) in shapes.items():
        for past, chunk in grid:
            times = _time_layer(heads, kv_heads, dim, past, chunk, dtype, repeats, block_size)
            split_ms, masked_ms = (1000 * min(times[a]) for a in ARMS)
            rows.append({"shape": name, "past": past, "chunk": chunk, "split ms": split_ms,
                         "masked ms": masked_ms, "masked / split": masked_ms / split_ms})
    return rows


def _time_layer(heads, kv_heads, dim, past, chunk, dtype, repeats, block_size) -> dict[str, list[float]]:
    """Seconds per call of each arm on a random pool with the chunk's past scattered over it."""
    g = torch.Generator().manual_seed(0)
    blocks = -(-(past + chunk) // block_size)
    k_cache = torch.randn(blocks + 1, block_size, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(k_cache.shape, generator=g).to(dtype)
    table = (torch.randperm(blocks, generator=g) + 1).tolist()
    q = torch.randn(chunk, heads, dim, generator=g).to(dtype)
    k = torch.randn(chunk, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(k.shape, generator=g).to(dtype)
    segs = (PrefillSegment(0, chunk, past),)
    pasts = share_pasts(segs, [table], block_size, "cpu")
    times = {arm: [] for arm in ARMS}
    for r in range(repeats):
        for arm in (ARMS if r % 2 == 0 else reversed(list(ARMS))):
            times[arm].append(best_seconds(lambda a=arm: prefill_attention(
                q, k, v, segs, pasts, k_cache, v_cache, dim**-0.5, split=ARMS[a]), 1))
    return times


def _first_tokens(engine, prompts: list[list[int]]) -> tuple[float, list]:
    """Seconds until every prompt has its first (greedy) token, and each prompt's output (with its top 5)."""
    from nanoserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, logprobs=TOP)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return time.perf_counter() - start, [done[i] for i in ids]


def scenarios(args, vocab: int) -> dict:
    """name -> (prompts to cache first, untimed; prompts timed)."""
    long = _ids(args.long_tokens, vocab, 1)
    history = _ids(args.history_tokens, vocab, 2)
    system = _ids(args.system_tokens, vocab, 3)
    crowd = [system + _ids(args.question_tokens, vocab, 100 + i) for i in range(args.crowd)]
    return {
        f"{args.long_tokens}-token prompt, cold, chunked": ([], [long]),
        f"{args.turn_tokens}-token turn after {args.history_tokens} cached": (
            [history], [history + _ids(args.turn_tokens, vocab, 4)]),
        f"{args.crowd} questions on a cached {args.system_tokens}-token prompt": ([system], crowd),
    }


def engine_rows(llm, args) -> tuple[list[dict], dict]:
    engine = llm.engine
    chunk = engine.config.max_num_batched_tokens
    runs: dict = {}
    verdict = {"identical": 0, "close": 0, "not close": 0}
    for r in range(args.repeats):
        for name, (warm, timed) in scenarios(args, engine.model_config.vocab_size).items():
            firsts = {}
            for arm in (ARMS if r % 2 == 0 else reversed(list(ARMS))):
                engine.reset_prefix_cache()
                with forced_split(ARMS[arm]):
                    if warm:
                        _first_tokens(engine, warm)
                    seconds, firsts[arm] = _first_tokens(engine, timed)
                runs.setdefault(name, {a: [] for a in ARMS})[arm].append(seconds)
            for key, count in verdicts(firsts["split"], firsts["masked"]).items():
                verdict[key] += count
    rows = []
    for name, times in runs.items():
        split_ms, masked_ms = (1000 * statistics.median(times[a]) for a in ARMS)
        rows.append({"workload": name, "step budget": chunk, "split ms": split_ms, "masked ms": masked_ms,
                     "masked / split": masked_ms / split_ms})
    return rows, verdict


def main(args) -> int:
    from nanoserve import LLM

    if prefill._FLASH_LSE is None:
        print("this torch has no CPU flash kernel that returns its log-sum-exp, so only the masked read runs here")
        return 2
    llm = LLM(**{**engine_flags(args), "enable_prefix_caching": True})
    engine = llm.engine
    cfg = engine.model_config
    shapes = {f"loaded model ({cfg.num_heads}/{cfg.num_kv_heads}/{cfg.head_dim})":
              (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)}
    if not args.no_llama_8b:
        shapes["Llama-8B (32/8/128)"] = (32, 8, 128)
    grid = [tuple(int(n) for n in cell.split("x")) for cell in args.layer_grid]
    layers = layer_rows(shapes, grid, engine.runner.dtype, args.repeats, engine.config.block_size)
    print_table(f"(a) one layer's prefill attention of a continuing chunk, {str(engine.runner.dtype)[6:]}, "
                f"best of {args.repeats}", layers, list(layers[0]))
    rows, verdict = engine_rows(llm, args)
    print_table(f"(b) the engine: time until every prompt has its first token, {cfg.num_layers} layers "
                f"(median of {args.repeats})", rows, list(rows[0]))
    print(f"\nfirst tokens, split against masked, by vLLM's logprobs-close rule (top {TOP}), all repeats: {verdict}")
    path = write_results(args.out, "prefill", {"layers": layers, "engine": rows, "first_tokens": verdict},
                         rows, args)
    print(f"wrote {path}")
    return 1 if verdict["not close"] else 0
