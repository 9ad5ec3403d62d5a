"""`nanoserve bench spec`: speculative decoding off and on (an ngram and a suffix arm) over tasks where the answer repeats the prompt, and one
where it does not, with llama.cpp's prompt lookup on the same file beside them.

Each task is one chat request, greedy, on the loaded model; arms interleaved task by task and repeat by repeat.
A stream's speed is its tokens after the first over the time after the first (decode alone, as in bench
throughput); acceptance comes from the engine's counters. The command fails when speculation changed a byte of
any answer. A mixed arm runs every task four times at once, in every arm.
"""

from __future__ import annotations

import statistics
import time

import torch

from nanoserve.bench.common import print_table, write_results
from nanoserve.flags import add_engine_flags, engine_flags

PARAGRAPH = ("Teh lighthouse keeper climed the stairs every evening at dusk, lit the grate lamp, and wrote the "
             "wether in a leather book that had belonged to his grandfather. On clear nights he could see the "
             "lights of three villages along the coast, and he knew each of them by the way it flickered.")
CODE = '''def summarize(orders):
    count = 0
    for order in orders:
        if order.paid:
            count += order.amount
    average = count / max(len(orders), 1)
    return {"count": count, "average": average}
'''
DOCUMENT = ("The museum opens at nine in the morning and closes at six in the evening, except on Mondays, when it "
            "is closed all day. Tickets cost twelve euros for adults and six euros for students. Children under "
            "ten enter for free. Guided tours leave from the main hall every hour on the hour.")
TASKS = {
    "copy-edit": f"Fix the spelling mistakes in this paragraph and return the whole corrected paragraph:\n\n{PARAGRAPH}",
    "rename": f"Rename the variable `count` to `total` in this code. Return the whole code:\n\n{CODE}",
    "quote": f"Document:\n{DOCUMENT}\n\nQuote, word for word, every sentence of the document that says when the "
             "museum is open or what tickets cost.",
    "json-fill": 'Fill in this JSON template from the text and return the JSON only.\nTemplate: {"name": "", '
                 '"age": 0, "city": "", "job": ""}\nText: Maria Lopez is a 34 year old architect who lives in '
                 "Valencia.",
    "free story": "Write a short story about a dragon who learns to bake bread.",
}
GROUNDED = ("copy-edit", "rename", "quote", "json-fill")
DEFAULT_SPECS = ('{"method": "ngram", "num_speculative_tokens": 15, "prompt_lookup_max": 4, "prompt_lookup_min": 2}',
                 # the request's own tokens only: a cache of earlier answers would hold this very answer from the
                 # second repeat on, and measure the cache rather than the method
                 '{"method": "suffix", "num_speculative_tokens": 15, "suffix_decoding_max_cached_requests": 0}')


def add_parser(sub) -> None:
    p = sub.add_parser("spec", help="speculative decoding off and on over copy-heavy and free tasks, beside "
                                    "llama.cpp's prompt lookup")
    p.add_argument("--spec", action="append", help="the speculative_config of an arm with speculation (repeat "
                                                    "for more arms; default: an ngram and a suffix arm)")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-llama-cpp", action="store_true")
    p.add_argument("--skip-mixed", action="store_true")
    p.add_argument("--out", default="bench-results")
    add_engine_flags(p)


def _decode_rate(output) -> float:
    m, n = output.metrics, len(output.outputs[0].token_ids)
    return (n - 1) / (m.finished_time - m.first_token_time) if n > 1 else 0.0


def _prompts(llm) -> dict[str, list[int]]:
    tok = llm.get_tokenizer()
    return {name: tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True) for name, text in TASKS.items()}


def _nanoserve(llm, prompt: list[int], max_tokens: int) -> tuple[float, tuple[int, ...], dict]:
    from nanoserve import SamplingParams

    before = dict(llm.engine.stats().features.get("speculative") or {})
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=max_tokens),
                       use_tqdm=False)[0]
    after = llm.engine.stats().features.get("speculative") or {}
    counts = {k: after[k] - before.get(k, 0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
              if k in after}
    return _decode_rate(out), tuple(out.outputs[0].token_ids), counts


def _llama_cpp(llm, prompt: list[int], max_tokens: int, eos: int) -> float:
    first, made = None, 0
    for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        made += 1
        if first is None:
            first = time.perf_counter()
        if made == max_tokens or token == eos:
            break
    return (made - 1) / (time.perf_counter() - first) if made > 1 else 0.0


def _peers(path, threads: int, skip: bool) -> dict:
    """llama.cpp plain and with its prompt-lookup draft, on the same file; {} without it."""
    from nanoserve.optional import available, left_out

    if skip or not path.is_file():
        return {}
    if not available("llama_cpp"):
        print(left_out("llama.cpp", "llama_cpp"))
        return {}
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    def make(draft=None):
        return llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=4096,
                               verbose=False, draft_model=draft)

    return {"llama.cpp": make(), "llama.cpp prompt lookup": make(LlamaPromptLookupDecoding(num_pred_tokens=4))}


def _mixed(llms: dict, prompts: dict, max_tokens: int) -> dict:
    """Every task four times at once, per arm: output tok/s (and the same answers in both)."""
    from nanoserve import SamplingParams

    work = [{"prompt_token_ids": p} for p in prompts.values() for _ in range(4)]
    rates, answers = {}, {}
    for arm, llm in llms.items():
        start = time.perf_counter()
        outs = llm.generate(work, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
        answers[arm] = [tuple(o.outputs[0].token_ids) for o in outs]
        rates[arm] = sum(len(a) for a in answers[arm]) / (time.perf_counter() - start)
    return {"rates": rates, "identical": len({tuple(a) for a in answers.values()}) == 1}


def main(args) -> int:
    from nanoserve import LLM
    from nanoserve.bench.throughput import model_path

    flags, specs = engine_flags(args), args.spec or list(DEFAULT_SPECS)
    llms = {"off": LLM(**{**flags, "speculative_config": None}),
            **{arm: LLM(**{**flags, "speculative_config": spec}) for arm, spec in zip(_arms(specs), specs)}}
    prompts = _prompts(llms["off"])
    peers = _peers(model_path(llms["off"].engine), torch.get_num_threads(), args.skip_llama_cpp)
    eos = llms["off"].get_tokenizer().eos_token_id
    rates = {task: {arm: [] for arm in [*llms, *peers]} for task in TASKS}
    counts, answers = {task: {arm: [] for arm in llms} for task in TASKS}, {task: {} for task in TASKS}
    for r in range(args.repeats):
        for task, prompt in prompts.items():
            order = list(llms) if r % 2 == 0 else list(reversed(llms))
            for arm in order:
                rate, tokens, c = _nanoserve(llms[arm], prompt, args.max_tokens)
                rates[task][arm].append(rate)
                answers[task].setdefault(arm, tokens)
                counts[task][arm].append(c)
            for arm, peer in peers.items():
                rates[task][arm].append(_llama_cpp(peer, prompt, args.max_tokens, eos))
    rows = [_row(task, rates[task], counts[task], answers[task], peers) for task in TASKS]
    print_table(f"speculative decoding, single stream, greedy, {args.max_tokens} tokens at most "
                f"({args.repeats} repeats, arms interleaved, medians; speculation: {'; '.join(specs)})", rows,
                list(rows[0]))
    mixed = None if args.skip_mixed else _mixed(llms, prompts, args.max_tokens)
    if mixed:
        off = mixed["rates"]["off"]
        print(f"mixed ({4 * len(TASKS)} requests at once): off {off:.1f} tok/s, " + ", ".join(
            f"{arm} {rate:.1f} tok/s ({rate / off:.2f}x)" for arm, rate in mixed["rates"].items() if arm != "off")
            + f"; same answers: {mixed['identical']}")
    path = write_results(args.out, "spec", {"rows": rows, "rates": rates, "counts": counts, "mixed": mixed}, rows,
                         args)
    print(f"wrote {path}")
    changed = [row["task"] for row in rows if not row["identical"]] + ([] if not mixed or mixed["identical"]
                                                                         else ["mixed"])
    if changed:
        print(f"speculation changed the answer of: {', '.join(changed)}")
        return 1
    return 0


def _arms(specs: list[str]) -> list[str]:
    """Each speculation arm's name: its method, numbered where two arms share one."""
    from nanoserve.speculative.config import SpeculativeConfig

    methods = [SpeculativeConfig.parse(spec).method for spec in specs]
    return [m if methods.count(m) == 1 else f"{m} {methods[:i + 1].count(m)}" for i, m in enumerate(methods)]


def _row(task: str, rates: dict, counts: dict, answers: dict, peers: dict) -> dict:
    med = {arm: statistics.median(v) for arm, v in rates.items()}
    row = {"task": task, "grounded": task in GROUNDED, "tokens": len(answers["off"]), "off_tok_s": med["off"]}
    for arm, arm_counts in counts.items():
        if arm == "off":
            continue
        drafted = sum(c.get("num_draft_tokens", 0) for c in arm_counts)
        kept = sum(c.get("num_accepted_tokens", 0) for c in arm_counts)
        drafts = sum(c.get("num_drafts", 0) for c in arm_counts)
        row.update({f"{arm}_tok_s": med[arm], f"{arm}_speedup": med[arm] / med["off"] if med["off"] else None,
                    f"{arm}_acceptance": kept / drafted if drafted else None,
                    f"{arm}_mean_accepted_length": 1 + kept / drafts if drafts else None})
    row["identical"] = len({answers[arm] for arm in counts}) == 1
    if peers:
        plain, lookup = med["llama.cpp"], med["llama.cpp prompt lookup"]
        row.update({"llama_cpp_tok_s": plain, "llama_cpp_lookup_tok_s": lookup,
                    "llama_cpp_lookup_speedup": lookup / plain if plain else None})
    return row
