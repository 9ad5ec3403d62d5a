"""The requests the load generators send: builtin chat prompts, synthetic token prompts, the sampled settings.

Shared by the benchmarks, the console's load and A/B screens, and the A/B run (nanoserve/ab.py).
"""

from __future__ import annotations

import random

SAMPLED = {"temperature": 0.8, "top_p": 0.95}  # a sampled request's settings (plus its own seed)

REAL_PROMPTS = (
    "What is the capital of France?",
    "Explain photosynthesis to a ten-year-old.",
    "Write a haiku about the sea.",
    "Give me three tips for a job interview.",
    "What is the difference between a list and a tuple in Python?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "How do I boil an egg so the yolk stays soft?",
    "Translate 'good morning, how are you?' into Spanish.",
    "Why is the sky blue?",
    "Write a short email asking a colleague to review my report.",
    "List five fruits that are high in vitamin C.",
    "What does HTTP stand for, and what is it used for?",
    "Suggest a name for a small bakery.",
    "How many days are there in a leap year, and why?",
    "Describe a cat to someone who has never seen one.",
    "What are the primary colours?",
    "Write a limerick about a programmer.",
    "Explain what a neural network is in one paragraph.",
    "Give me a recipe for a simple tomato soup.",
    "What is the tallest mountain in the world?",
    "How does a bicycle stay upright?",
    "Write a motivational sentence for a Monday morning.",
    "What is the boiling point of water at sea level in Fahrenheit?",
    "Name three famous painters and one work by each.",
)


def pick_prompts(n: int) -> list[str]:
    """`n` chat prompts, the builtin ones in turn."""
    return [REAL_PROMPTS[i % len(REAL_PROMPTS)] for i in range(n)]


DATASETS = ("builtin", "synthetic", "shared-prefix")
PREFIX_GROUPS = 8  # the shared-prefix dataset's distinct system prompts
QUESTION_LEN = 16  # ... and each request's own tokens after its group's prefix


def make_bodies(num_prompts: int, dataset: str, input_len: int, output_len: int, prompt_seed: int, vocab: int,
                sampled: bool = False) -> list[dict]:
    """Streamed request bodies: builtin chat prompts, synthetic token prompts, or shared-prefix ones
    (PREFIX_GROUPS system prompts of `input_len` tokens, each request one of them plus QUESTION_LEN tokens of its
    own, the groups interleaved: what prefix-aware routing is for); greedy, or seeded sampling.

    Every request runs to `output_len` tokens (ignore_eos), so runs of the same shape do the same work.
    """
    rng = random.Random(prompt_seed)
    prompts = pick_prompts(num_prompts)
    if dataset == "shared-prefix":
        prefixes = [[rng.randrange(100, vocab) for _ in range(input_len)] for _ in range(PREFIX_GROUPS)]
    bodies = []
    for i in range(num_prompts):
        if dataset == "builtin":
            body = {"messages": [{"role": "user", "content": prompts[i]}]}
        elif dataset == "shared-prefix":
            body = {"prompt": prefixes[rng.randrange(PREFIX_GROUPS)] +
                    [rng.randrange(100, vocab) for _ in range(QUESTION_LEN)]}
        else:
            body = {"prompt": [rng.randrange(100, vocab) for _ in range(input_len)]}
        body.update(max_tokens=output_len, temperature=0, ignore_eos=True, stream=True,
                    stream_options={"include_usage": True})
        if sampled:
            body.update(SAMPLED, seed=prompt_seed * 100_003 + i)
        bodies.append(body)
    return bodies
