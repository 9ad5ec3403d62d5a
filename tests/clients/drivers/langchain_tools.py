"""langchain-openai's structured output (both methods) and bind_tools against a base_url, streamed and not.

Run by the clients' environment: `python langchain_tools.py BASE_URL MODEL OUT.json`; writes what langchain parsed.
"""

import json
import sys
from typing import Literal

from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

base, model, out = sys.argv[1:4]


class Pet(BaseModel):
    """A pet."""

    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog"]


class get_weather(BaseModel):  # noqa: N801 - langchain names the tool after the class
    """The weather in a city now."""

    city: str = Field(max_length=30)  # bounded: random weights never close an unbounded string
    unit: Literal["celsius", "fahrenheit"]


chat = ChatOpenAI(model=model, base_url=base, api_key="unused", temperature=0, max_tokens=200, max_retries=0,
                  timeout=60)
question = [("user", "Describe a pet.")]
results = {}
for method in ("json_schema", "function_calling"):
    structured = chat.with_structured_output(Pet, method=method)
    results[method] = structured.invoke(question).model_dump()
    results[f"{method}/stream"] = [p.model_dump() for p in structured.stream(question)][-1]

weather = [("user", "What is the weather in Paris?")]
for choice in ("any", "get_weather"):
    bound = chat.bind_tools([get_weather], tool_choice=choice)
    message = bound.invoke(weather)
    results[f"bind_tools/{choice}"] = message.tool_calls
    streamed = None
    for chunk in bound.stream(weather):
        streamed = chunk if streamed is None else streamed + chunk
    results[f"bind_tools/{choice}/stream"] = streamed.tool_calls
auto = chat.bind_tools([get_weather]).invoke(weather)  # auto: this model may or may not call
results["bind_tools/auto"] = {"content": auto.content, "tool_calls": auto.tool_calls}
with open(out, "w") as f:
    json.dump(results, f)
