"""`nanoserve bench grammar`: what structured outputs cost, and why llguidance.

(a) Compile time per constraint, cold (each schema made distinct so no cache answers), and the mask per token
while walking a valid output of it: llguidance (what the engine uses) and xgrammar beside it when installed,
both on the loaded model's tokenizer.
(b) A decode step with N constrained rows against N unconstrained ones, arms interleaved: step ms, the mask's own
ms per step (measured inside the sampler), and the ratio. Constrained rows write a JSON object whose one string
is at least 3,000 characters long (JSON output, which cannot end before the step count); unconstrained rows
ignore EOS.
"""

from __future__ import annotations

import json
import statistics
import time

from nanoserve.bench.common import print_table, write_results
from nanoserve.flags import add_engine_flags, engine_flags
from nanoserve.optional import available, left_out

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "role", "tags", "address"],
}
PERSON_VALUE = {"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "poetry"],
                "address": {"city": "London", "zip": "12345"}}
WIDE = {"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer", "boolean"]} for i in range(40)},
        "required": [f"field_{i}" for i in range(40)]}
WIDE_VALUE = {f"field_{i}": (i if i % 3 == 0 else f"v{i}" if i % 3 == 1 else True) for i in range(40)}
LONG_STRING = {"type": "object", "properties": {"text": {"type": "string", "minLength": 3000}}, "required": ["text"]}


def add_parser(sub) -> None:
    p = sub.add_parser("grammar", help="structured outputs: compile time, mask per token, step cost by rows")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--steps", type=int, default=32, help="decode steps per arm and repeat")
    p.add_argument("--compiles", type=int, default=5, help="distinct copies of each schema compiled")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench-results")
    add_engine_flags(p)


def _distinct(schema: dict, i: int) -> dict:
    return {**schema, "title": f"copy {i}"}


def _llguidance(tokenizer, vocab: int, eos: list[int]):
    import llguidance

    started = time.perf_counter()
    lltok = llguidance.LLTokenizer(tokenizer.hf.to_str(), n_vocab=vocab, eos_token=eos)
    setup = time.perf_counter() - started

    def compile_one(schema):
        return llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))

    def walk(matcher, ids):
        import llguidance.torch as lt

        mask, times = lt.allocate_token_bitmask(1, vocab), []
        for token in ids:
            t = time.perf_counter()
            lt.fill_next_token_bitmask(matcher, mask, 0)
            times.append(time.perf_counter() - t)
            assert matcher.consume_token(token), matcher.get_error()
        return times

    return setup, compile_one, walk


def _xgrammar(tokenizer, vocab: int, eos: list[int]):
    import xgrammar

    started = time.perf_counter()
    encoded = [""] * vocab
    for text, i in tokenizer.hf.get_vocab(with_added_tokens=True).items():
        if i < vocab:
            encoded[i] = text
    info = xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=eos)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - started

    def compile_one(schema):
        return xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))

    def walk(matcher, ids):
        mask, times = xgrammar.allocate_token_bitmask(1, vocab), []
        for token in ids:
            t = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            times.append(time.perf_counter() - t)
            assert matcher.accept_token(token)
        return times

    return setup, compile_one, walk


def compile_rows(engine, compiles: int) -> list[dict]:
    tokenizer, vocab = engine.tokenizer, engine.model_config.vocab_size
    eos = sorted(tokenizer.eos_token_ids)
    backends = {"llguidance": _llguidance}
    if available("xgrammar"):
        backends["xgrammar"] = _xgrammar
    else:
        print(left_out("xgrammar", "xgrammar"))
    rows = []
    for backend, make in backends.items():
        setup, compile_one, walk = make(tokenizer, vocab, eos)
        for name, schema, value in (("person (nested, enum, pattern)", PERSON, PERSON_VALUE),
                                    ("wide (40 required fields)", WIDE, WIDE_VALUE)):
            times, matcher = [], None
            for i in range(compiles):
                t = time.perf_counter()
                matcher = compile_one(_distinct(schema, i))
                times.append(time.perf_counter() - t)
            ids = tokenizer.encode(json.dumps(value), add_special_tokens=False) + eos[:1]
            masks = walk(matcher, ids)
            rows.append({"backend": backend, "schema": name, "tokenizer setup ms": 1000 * setup,
                         "compile ms (median)": 1000 * statistics.median(times), "tokens walked": len(ids),
                         "mask us per token (median)": 1e6 * statistics.median(masks),
                         "mask us per token (max)": 1e6 * max(masks)})
    return rows


def _decode_steps(engine, rows: int, steps: int, constrained: bool) -> tuple[list[float], float]:
    """Wall seconds of each step in which all `rows` rows decode, and the mask seconds spent in them."""
    from nanoserve import SamplingParams

    if constrained:
        params = SamplingParams(temperature=1.0, seed=1, max_tokens=steps + 1,
                                structured_outputs={"json": LONG_STRING})
    else:
        params = SamplingParams(temperature=1.0, seed=1, max_tokens=steps + 1, ignore_eos=True)
    for i in range(rows):
        engine.add_request(f"Write the letter {i}:", params)
    times, mask_before = [], engine.grammars.stats.mask_seconds
    while engine.has_unfinished():
        running = engine.scheduler.running
        decoding = len(running) == rows and not engine.scheduler.waiting and all(r.output_ids for r in running)
        started = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - started)
    return times, engine.grammars.stats.mask_seconds - mask_before


def step_rows(engine, row_counts: list[int], steps: int, repeats: int) -> list[dict]:
    out = []
    for rows in row_counts:
        arms = {"unconstrained": [], "constrained": []}
        mask_total, mask_steps = 0.0, 0
        for r in range(repeats):
            for arm in (("unconstrained", "constrained") if r % 2 == 0 else ("constrained", "unconstrained")):
                times, mask = _decode_steps(engine, rows, steps, arm == "constrained")
                arms[arm].extend(times)
                if arm == "constrained":
                    mask_total, mask_steps = mask_total + mask, mask_steps + len(times)
        plain, constrained = (1000 * statistics.median(arms[a]) for a in ("unconstrained", "constrained"))
        out.append({"rows": rows, "unconstrained step ms": plain, "constrained step ms": constrained,
                    "constrained / unconstrained": constrained / plain,
                    "mask ms per step": 1000 * mask_total / max(mask_steps, 1), "steps timed": len(arms["constrained"])})
    return out


def main(args) -> int:
    from nanoserve import LLM

    flags = engine_flags(args)
    llm = LLM(**{**flags, "max_num_seqs": max(*args.rows, flags["max_num_seqs"])})
    engine = llm.engine
    compiles = compile_rows(engine, args.compiles)
    print_table(f"(a) compile and mask per token on {engine.model_config.vocab_size:,} tokens", compiles,
                list(compiles[0]))
    steps = step_rows(engine, args.rows, args.steps, args.repeats)
    print_table(f"(b) decode step with N constrained rows (JSON) vs N unconstrained, median over "
                f"{args.repeats} interleaved repeats", steps, list(steps[0]))
    path = write_results(args.out, "grammar", {"compile": compiles, "steps": steps}, steps, args)
    print(f"wrote {path}")
    return 0
