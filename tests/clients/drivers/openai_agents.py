"""The OpenAI Agents SDK against the live server: an agent with one function tool, run to completion over the
Responses API (OpenAIResponsesModel on an AsyncOpenAI client pointed at the server).

The first turn must call the tool (tool_choice names it); the SDK then runs it, sends its output back, and
resets tool_choice, so the next turn answers in text and the run ends.
Run by the clients' environment: `python openai_agents.py BASE_URL MODEL OUT.json`.
"""

import asyncio
import json
import sys
from typing import Literal

from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

base, model, out = sys.argv[1:4]
set_tracing_disabled(True)  # the SDK would otherwise export its traces to OpenAI
calls = []


@function_tool  # strict, the SDK's default: enforced under the second turn's tool_choice auto too
def get_weather(city: Literal["Paris", "Rome"]) -> str:
    """The weather in a city."""
    calls.append(city)
    return f"Sunny in {city}, 21C"


client = AsyncOpenAI(base_url=base, api_key="unused", max_retries=0)
agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
              model=OpenAIResponsesModel(model=model, openai_client=client),
              # The tiny random model never ends a reply by itself, and the SDK ends a run with an error on an
              # incomplete response (as on OpenAI): a stop string (vLLM's field, through extra_body) ends the text
              # turn. "n" never occurs in the call's arguments ({"city": "Paris" | "Rome"}).
              model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=64,
                                           extra_body={"stop": ["n"]}))
result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
with open(out, "w") as f:
    json.dump({"final_output": result.final_output, "calls": calls,
               "items": [item.type for item in result.new_items],
               "responses": [r.response_id for r in result.raw_responses]}, f)
