"""Tools in the prompt: through the chat template where it renders them, in nanoserve's own words where not.

A template that reads `tools` gets them as OpenAI sends them. A template that does not (the default model's)
would drop them, so the tools are described in the system message instead, in the Hermes format that `auto`
then parses: `<tools>` with one JSON signature per line, and calls written as `<tool_call>` blocks. Likewise an
assistant turn's `tool_calls` that the template does not render are written into its text as `<tool_call>`
blocks, so an agent's history reaches the model instead of being dropped.
"""

from __future__ import annotations

import json
from typing import Any

from nanoserve.tools.parsers import CLOSE, OPEN
from nanoserve.tools.spec import ToolRequest

TOOL_PROMPT = """# Tools

You may call one or more of these functions to answer. Their signatures are inside <tools></tools>:
<tools>
{signatures}
</tools>

To call a function, write a JSON object with its name and arguments inside <tool_call></tool_call>:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}
</tool_call>"""


def tool_prompt(tools: ToolRequest) -> str:
    signatures = "\n".join(json.dumps(f.as_tool(), ensure_ascii=False) for f in tools.functions)
    return TOOL_PROMPT.format(signatures=signatures)


def with_tool_prompt(messages: list[dict], tools: ToolRequest) -> list[dict]:
    """The conversation with the tools described in its system message (one is added when there is none)."""
    text = tool_prompt(tools)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{text}" if first["content"] else text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def template_arguments(message: dict) -> dict:
    """An assistant message whose tool calls' arguments are objects, as chat templates expect (Hugging Face's
    convention); OpenAI sends them as JSON text. Text that is not JSON stays text."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                fn = {**fn, "arguments": json.loads(fn["arguments"])}
            except ValueError:
                pass
            call = {**call, "function": fn}
        out.append(call)
    return {**message, "tool_calls": out}


def written_calls(message: dict) -> dict:
    """An assistant message with its tool calls written into its text as `<tool_call>` blocks."""
    blocks = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function", call) if isinstance(call, dict) else {}
        arguments: Any = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        blocks.append(f"{OPEN}\n{json.dumps({'name': fn.get('name'), 'arguments': arguments}, ensure_ascii=False)}"
                      f"\n{CLOSE}")
    text = "\n".join(filter(None, [message.get("content") or "", *blocks]))
    return {k: v for k, v in {**message, "content": text}.items() if k != "tool_calls"}
