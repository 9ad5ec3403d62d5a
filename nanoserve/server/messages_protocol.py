"""Anthropic's Messages request (POST /v1/messages, /v1/messages/count_tokens), field by field, and its
translation into the chat request every turn API shares (turn.py).

Each field is honoured or refused with a 400 that says why, as on the OpenAI routes. The anthropic SDK (2.x) no
longer takes sampling parameters in `messages.create`, so `temperature`, `top_p`, `top_k` and vLLM's sampling
extensions arrive as body fields (`extra_body`); they are honoured there. Fields of newer SDKs that ask nothing of
a local server (`inference_geo`, `diagnostics`, ...) are not declared: they are named in one warning and ignored.
Images and documents are refused: this is a text model.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from nanoserve.server.protocol import (
    INT64,
    MAX_ID_CHARS,
    MAX_USER_CHARS,
    ChatCompletionRequest,
    Number,
    TokenIds,
)

# name -> (values that ask for nothing, why any other value is refused and what to do instead)
MESSAGES_UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "container": ((None,), "code-execution containers are not available on this server"),
    "mcp_servers": ((None, []), "MCP servers are not reached from this server; call their tools from the client"),
    "context_management": ((None,), "context management (clearing old tool results) is not supported; trim the "
                                    "conversation on the client"),
    "speed": ((None, "standard"), "there is one speed here; send 'standard' or none"),
    "service_tier": ((None, "auto", "standard_only"), "there is one service tier here; send 'auto' or none"),
}
STOP_REASONS = {"length": "max_tokens"}  # the engine's finish reason -> stop_reason, where not end_turn


class SystemBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # the prefix cache is automatic: every prefix is cached


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class Tool(BaseModel):
    """A client tool. A server tool (web search, code execution: its `type` names it) is refused."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool | None = None


class Thinking(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    budget_tokens: StrictInt | None = None


class JsonFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: JsonFormat | None = None
    effort: str | None = None


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: str | None = Field(default=None, max_length=MAX_USER_CHARS)  # Anthropic's documented bound


class _MessagesBody(BaseModel):
    """What count_tokens and create share: the conversation and what shapes its prompt."""

    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[SystemBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: dict[str, Any] | None = None  # automatic prompt caching: the prefix cache does it always
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's, as on the chat route
    # the reply's format and effort: create honours or refuses them; they do not change the prompt count_tokens
    # counts (the schema is enforced by the grammar, never written into the prompt)
    output_config: OutputConfig | None = None

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or ())

    def refusal(self) -> tuple[str, str] | None:
        if self.thinking is not None and self.thinking.type != "disabled":
            return "thinking", ("this server does not separate reasoning into thinking blocks; send thinking "
                                "{'type': 'disabled'} or none")
        for name, (idle, why) in getattr(self, "unsupported", {}).items():
            if getattr(self, name, None) not in idle:
                return name, f"{name} is not supported: {why}"
        return None

    def client_tools(self) -> list[Tool] | None:
        """The tools as client tools; a server tool raises ValueError naming it."""
        if self.tools is None:
            return None
        tools = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type")
            if kind not in (None, "custom"):
                raise ValueError(f"tools[{i}] is the server tool {kind!r}, which this server does not run; declare "
                                 "a client tool (name, description, input_schema) and run it yourself")
            tools.append(Tool.model_validate(tool))
        return tools

    def chat_messages(self) -> list[dict]:
        """The conversation as chat messages: the system prompt first, tool results as tool messages."""
        out: list[dict] = []
        if self.system:
            text = self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system)
            out.append({"role": "system", "content": text})
        for i, message in enumerate(self.messages):
            out.extend(_chat_messages(message, i))
        return out

    def chat_fields(self) -> dict:
        """The chat request's fields for this conversation: messages, tools and tool_choice."""
        fields: dict[str, Any] = {"messages": self.chat_messages()}
        tools = self.client_tools()
        if tools:
            fields["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                                  "parameters": t.input_schema}} for t in tools]
        choice = self.tool_choice
        if choice is not None:
            if choice.type == "tool" and not choice.name:
                raise ValueError("tool_choice {'type': 'tool'} names the tool: send {'type': 'tool', 'name': ...}")
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
                choice.type, {"type": "function", "function": {"name": choice.name}})
            if choice.disable_parallel_tool_use is not None and tools:
                fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        if self.chat_template_kwargs is not None:
            fields["chat_template_kwargs"] = self.chat_template_kwargs
        return fields


class CountTokensRequest(_MessagesBody):
    """POST /v1/messages/count_tokens: the prompt create would send, counted."""


class MessagesRequest(_MessagesBody):
    unsupported: ClassVar[dict[str, tuple[tuple, str]]] = MESSAGES_UNSUPPORTED
    max_tokens: StrictInt = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: StrictBool = False
    metadata: Metadata | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    # vLLM's sampling extensions, as body fields (extra_body)
    min_p: Number | None = None
    seed: StrictInt | None = Field(default=None, ge=INT64[0], le=INT64[1])
    repetition_penalty: Number | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    min_tokens: StrictInt | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: StrictBool | None = None
    request_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_USER_CHARS)
    session_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None
    speed: Any = None
    service_tier: Any = None
    # vLLM's Messages fields that are its chat request's too: the chat request honours or refuses them
    mm_payload: Any = None
    return_mm_kwargs: Any = None
    watermarking: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    vllm_xargs: Any = None

    SAMPLING: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
                                           "presence_penalty", "frequency_penalty", "min_tokens", "stop_token_ids",
                                           "ignore_eos", "request_id", "cache_salt", "session_id", "mm_payload",
                                           "return_mm_kwargs", "watermarking", "kv_transfer_params",
                                           "ec_transfer_params", "vllm_xargs")

    def refusal(self) -> tuple[str, str] | None:
        if self.output_config is not None and self.output_config.effort is not None:
            return "output_config.effort", ("output_config.effort sets how long a reasoning model thinks; this "
                                            "server's models do not reason separately, so send no effort")
        if self.temperature is not None and not 0 <= self.temperature <= 2:
            return "temperature", f"temperature must be in [0, 2], got {self.temperature}"
        return super().refusal()

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request of this turn (ValueError names a part that cannot be one)."""
        fields = self.chat_fields()
        fields |= {"model": self.model, "max_tokens": self.max_tokens, "stream": self.stream,
                   "stop": self.stop_sequences}
        fields |= {name: getattr(self, name) for name in self.SAMPLING if getattr(self, name) is not None}
        if self.metadata is not None and self.metadata.user_id is not None:
            fields["user"] = self.metadata.user_id
        if self.output_config is not None and self.output_config.format is not None:
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": self.output_config.format.json_schema}}
        return ChatCompletionRequest.model_validate(fields)


def _chat_messages(message: Message, i: int) -> list[dict]:
    """One Anthropic message as chat messages: a user turn's tool results become tool messages (before its
    text, as Anthropic orders them), an assistant turn's tool_use blocks its tool_calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts, calls, results = [], [], []
    for j, block in enumerate(message.content):
        kind = block.get("type")
        where = f"messages[{i}].content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and message.role == "assistant":
            calls.append({"id": _string(block, "id", where), "type": "function", "function": {
                "name": _string(block, "name", where), "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result" and message.role == "user":
            results.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", where),
                            "content": _result_text(block, where)})
        elif kind in ("image", "document", "search_result"):
            raise ValueError(f"{where} is a {kind} block; this model takes text only")
        elif kind in ("thinking", "redacted_thinking"):
            raise ValueError(f"{where} is a {kind} block; this server's models do not think in separate blocks, "
                             "so send the reply's text without it")
        else:
            raise ValueError(f"{where} is a {kind!r} block, which a {message.role} message cannot carry here "
                             "(text; tool_use in assistant turns; tool_result in user turns)")
    out = results
    if texts or calls or not results:
        turn: dict[str, Any] = {"role": message.role, "content": "\n".join(texts) if texts or not calls else None}
        if calls:
            turn["tool_calls"] = calls
        out = [*results, turn]
    return out


def _string(block: dict, key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where} needs its {key!r} (a string)")
    return value


def _result_text(block: dict, where: str) -> str:
    """A tool_result's content as text (a string, or text blocks); an error result says so to the model."""
    content = block.get("content", "")
    if isinstance(content, list):
        if any(part.get("type") != "text" for part in content):
            raise ValueError(f"{where} holds a non-text block; this model takes text only")
        content = "\n".join(part.get("text", "") for part in content)
    if not isinstance(content, str):
        raise ValueError(f"{where}.content must be a string or text blocks")
    return f"Error: {content}" if block.get("is_error") else content
