"""Where a chat parts with the prefix cache on and off, turn by turn, on the default model.

Usage: python scripts/prefix-parity.py [auto|none]   (the --quantization of both engines)

Both arms continue each turn from the cache-off answer, so every turn is compared on the same history. For a
turn whose greedy answers differ it prints the token where they part and whether that passes vLLM's "logprobs
close" rule (each arm's token among the other's top 5), with the parting token's logprob in each arm.
"""

from __future__ import annotations

import sys

from nanoserve import LLM, SamplingParams
from nanoserve.workload import pick_prompts


def main(quantization: str) -> None:
    arms = {cached: LLM(enable_prefix_caching=cached, quantization=quantization) for cached in (True, False)}
    tokenizer = arms[True].engine.tokenizer
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=5)
    history: list[dict] = []
    for turn, question in enumerate(pick_prompts(8), start=1):
        history.append({"role": "user", "content": question})
        ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
        on, off = (arms[c].generate([ids], params, use_tqdm=False)[0].outputs[0] for c in (True, False))
        a, b = list(on.token_ids), list(off.token_ids)
        if a == b:
            print(f"{quantization} turn {turn}: identical")
        else:
            i = next(i for i, (s, t) in enumerate(zip(a, b)) if s != t)
            top_on, top_off = dict(on.logprobs.entries()[i].top), dict(off.logprobs.entries()[i].top)
            close = a[i] in top_off and b[i] in top_on
            print(f"{quantization} turn {turn}: parts at token {i}, {'close' if close else 'NOT close'} "
                  f"(the cache-on token's logprob {top_on[a[i]]:.4f} on, {top_off.get(a[i], float('nan')):.4f} off)")
        history.append({"role": "assistant", "content": tokenizer.decode(b, skip_special_tokens=True)})


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "auto")
