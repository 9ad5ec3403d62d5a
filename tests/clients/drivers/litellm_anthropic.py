"""Chat through litellm's Anthropic provider ("anthropic/" with api_base): litellm turns an OpenAI-shaped call
into Anthropic's POST /v1/messages and reads the answer back.

Run by the clients' environment: `python litellm_anthropic.py BASE_URL MODEL OUT.json`; writes each answer.
"""

import json
import sys

import litellm

base, model, out = sys.argv[1:4]
base = base.removesuffix("/v1")  # the provider adds /v1/messages itself
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"enum": ["Paris", "Rome"]}}}}}

kw = dict(model=f"anthropic/{model}", api_base=base, api_key="unused", messages=MESSAGES, max_tokens=12,
          temperature=0, num_retries=0, timeout=60)
plain = litellm.completion(**kw)
chunks = list(litellm.completion(stream=True, **kw))
called = litellm.completion(**{**kw, "max_tokens": 40}, tools=[WEATHER],
                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
call = called.choices[0].message.tool_calls[0]
results = {
    "plain": plain.choices[0].message.content,
    "finish_reason": plain.choices[0].finish_reason,
    "prompt_tokens": plain.usage.prompt_tokens,
    "completion_tokens": plain.usage.completion_tokens,
    "streamed": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
    "tool_finish_reason": called.choices[0].finish_reason,
    "tool_call": {"name": call.function.name, "arguments": json.loads(call.function.arguments)},
}
with open(out, "w") as f:
    json.dump(results, f)
