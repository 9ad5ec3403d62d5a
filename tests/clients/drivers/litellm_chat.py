"""Chat through litellm's OpenAI-compatible providers ("openai/" and "hosted_vllm/" with api_base).

Run by the clients' environment: `python litellm_chat.py BASE_URL MODEL OUT.json`; writes each answer's text.
"""

import json
import sys

import litellm

base, model, out = sys.argv[1:4]
MESSAGES = [{"role": "user", "content": "Name three colours."}]
KINDS = {"greedy": dict(temperature=0), "seeded": dict(temperature=0.9, seed=7)}

results = {}
for provider in ("openai", "hosted_vllm"):
    for kind, sampling in KINDS.items():
        kw = dict(model=f"{provider}/{model}", api_base=base, api_key="unused", messages=MESSAGES, max_tokens=12,
                  num_retries=0, timeout=60, **sampling)
        plain = litellm.completion(**kw)
        chunks = list(litellm.completion(stream=True, stream_options={"include_usage": True}, **kw))
        results[f"{provider}/{kind}"] = {
            "plain": plain.choices[0].message.content,
            "finish_reason": plain.choices[0].finish_reason,
            "completion_tokens": plain.usage.completion_tokens,
            "streamed": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
            "streamed_usage": [c.usage.completion_tokens for c in chunks if getattr(c, "usage", None)],
        }
with open(out, "w") as f:
    json.dump(results, f)
