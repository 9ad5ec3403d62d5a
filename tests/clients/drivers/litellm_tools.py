"""litellm's tools and response_format through its OpenAI-compatible providers, streamed and not.

Run by the clients' environment: `python litellm_tools.py BASE_URL MODEL OUT.json`; writes the calls it parsed.
"""

import json
import sys

import litellm

base, model, out = sys.argv[1:4]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]

results = {}
for provider in ("openai", "hosted_vllm"):
    kw = dict(model=f"{provider}/{model}", api_base=base, api_key="unused", messages=MESSAGES, max_tokens=150,
              num_retries=0, timeout=60, temperature=0, tools=TOOLS, tool_choice="required")
    plain = litellm.completion(**kw)
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in plain.choices[0].message.tool_calls]
    chunks = list(litellm.completion(stream=True, **kw))
    rebuilt = litellm.stream_chunk_builder(chunks, messages=MESSAGES)
    streamed = [{"name": c.function.name, "arguments": c.function.arguments}
                for c in rebuilt.choices[0].message.tool_calls]
    results[provider] = {"calls": calls, "finish_reason": plain.choices[0].finish_reason, "streamed": streamed,
                         "streamed_finish_reason": rebuilt.choices[0].finish_reason}
    schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 30}}, "required": ["name"],
        "additionalProperties": False}}}
    answer = litellm.completion(**{**kw, "tools": None, "tool_choice": None, "response_format": schema})
    results[provider]["json"] = answer.choices[0].message.content
with open(out, "w") as f:
    json.dump(results, f)
