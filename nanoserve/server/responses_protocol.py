"""OpenAI's Responses request (POST /v1/responses), field by field, and its translation into the chat request every
turn API shares (turn.py).

Each field is honoured or refused with a 400 that says why. `input` is a string or a list of items (messages with
text parts, `function_call`, `function_call_output`); with `previous_response_id` the stored conversation comes
first. Built-in tools, reasoning, stored prompts and conversations are refused with the reason.
Fields of newer SDKs that ask nothing of a local server are not declared: one warning names them.
"""

from __future__ import annotations

import secrets
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from nanoserve.server.protocol import (
    INT64,
    MAX_ID_CHARS,
    MAX_USER_CHARS,
    TEXT_ONLY,
    ChatCompletionRequest,
    Number,
    TokenIds,
)

# name -> (values that ask for nothing, why any other value is refused and what to do instead)
RESPONSES_UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "conversation": ((None,), "the Conversations API is not served; chain turns with previous_response_id"),
    "prompt": ((None,), "stored prompt templates are not served; send the instructions and input"),
    "max_tool_calls": ((None,), "a limit on built-in tool calls applies to tools this server does not run"),
    "truncation": ((None, "disabled"), "the conversation is never cut to fit: a prompt over the context is refused; "
                                       "send truncation 'disabled' or none"),
    "service_tier": ((None, "auto", "default"), "there is one service tier here; send 'auto' or none"),
    "context_management": ((None, []), "context management is not supported; trim the input on the client"),
    "prompt_cache_retention": ((None, "in_memory"), "cached prefixes live in memory while the server runs; send "
                                                    "'in_memory' or none"),
    "previous_input_messages": ((None, []), "harmony-format messages are gpt-oss's, which this server does not "
                                            "render; send the conversation as input items, or chain with "
                                            "previous_response_id"),
}
# vLLM's Responses fields that are its chat request's too: passed to the chat request as they are, so each is
# honoured or refused there exactly as on /v1/chat/completions
CHAT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
               "frequency_penalty", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "cache_salt", "session_id",
               "parallel_tool_calls", "chat_template_kwargs", "logit_bias", "skip_special_tokens",
               "include_stop_str_in_output", "structured_outputs", "include_reasoning",
               "spaces_between_special_tokens", "priority", "kv_transfer_params", "ec_transfer_params",
               "mm_processor_kwargs", "media_io_kwargs", "mm_payload", "return_mm_kwargs", "vllm_xargs",
               "watermarking")
METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 64, 512  # OpenAI's bounds for metadata
OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the one `include` that has something to add here
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for top_logprobs
RESPONSES_UNSUPPORTED_TOOLS = "built-in tools (web search, file search, computer use, code interpreter, ...)"


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # low and high ask a reasoning model to say less or more


class Reasoning(BaseModel):
    model_config = ConfigDict(extra="allow")
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_obfuscation: StrictBool | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    unsupported: ClassVar[dict[str, tuple[tuple, str]]] = RESPONSES_UNSUPPORTED
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number | None = None
    top_p: Number | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    store: StrictBool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    safety_identifier: str | None = Field(default=None, max_length=64)  # OpenAI's documented bound
    prompt_cache_key: str | None = None  # a routing hint: every prefix here shares one cache anyway
    reasoning: Reasoning | None = None
    # vLLM's sampling extensions
    top_k: StrictInt | None = None
    min_p: Number | None = None
    seed: StrictInt | None = Field(default=None, ge=INT64[0], le=INT64[1])
    repetition_penalty: Number | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    min_tokens: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: StrictBool | None = None
    request_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_USER_CHARS)
    session_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    chat_template_kwargs: dict[str, Any] | None = None
    background: StrictBool | None = None  # answered at once, queued; read back with GET, stopped with cancel
    conversation: Any = None
    prompt: Any = None
    include: list[str] | None = None  # OUTPUT_LOGPROBS only: nothing else is produced here
    max_tool_calls: Any = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    truncation: Any = None
    service_tier: Any = None
    context_management: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: dict[str, Any] | None = None  # mode implicit (the only cache here) is what runs
    previous_input_messages: Any = None
    # vLLM's: the rendered prompt and the raw reply, text and token ids, on the response
    enable_response_messages: StrictBool = False
    # vLLM's chat fields (CHAT_FIELDS): the chat request honours or refuses them
    logit_bias: Any = None
    skip_special_tokens: Any = None
    include_stop_str_in_output: Any = None
    structured_outputs: Any = None
    include_reasoning: Any = None
    spaces_between_special_tokens: Any = None
    priority: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None
    mm_payload: Any = None
    return_mm_kwargs: Any = None
    vllm_xargs: Any = None
    watermarking: Any = None

    SAMPLING: ClassVar[tuple[str, ...]] = CHAT_FIELDS

    @field_validator("metadata")
    @classmethod
    def _metadata_in_bounds(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        """OpenAI's bounds (keys of 64 characters, values of 512): metadata is kept with a stored response."""
        for key, value in (metadata or {}).items():
            if len(key) > METADATA_KEY_CHARS:
                raise ValueError(f"a key is {len(key):,} characters; keys take at most {METADATA_KEY_CHARS}")
            if len(value) > METADATA_VALUE_CHARS:
                raise ValueError(f"the value of {key!r} is {len(value):,} characters; values take at most "
                                 f"{METADATA_VALUE_CHARS}")
        return metadata

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or ())

    def refusal(self) -> tuple[str, str] | None:
        for name, (idle, why) in self.unsupported.items():
            if getattr(self, name, None) not in idle:
                return name, f"{name} is not supported: {why}"
        if self.background and self.store is False:
            return "background", ("background needs store: a background response is read back with GET "
                                  "/v1/responses/{id}; send store true (the default)")
        refused = self._logprobs_refusal()
        if refused is not None:
            return refused
        reasoning = self.reasoning
        if reasoning is not None and (reasoning.effort not in (None, "none") or reasoning.summary is not None
                                      or reasoning.generate_summary is not None):
            return "reasoning", ("this model does not reason in separate items; send reasoning {'effort': 'none'} "
                                 "or none")
        options = self.prompt_cache_options or {}
        if options.get("mode", "implicit") != "implicit" or options.get("comparison_response_id") is not None:
            return "prompt_cache_options", ("prompt_cache_options: the prefix cache here is implicit (every request "
                                            "shares it, with no breakpoints or comparisons); send mode 'implicit' "
                                            "or none")
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options apply to a streamed response; send stream: true too"
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            return "stream_options.include_obfuscation", ("stream_options.include_obfuscation: deltas are not "
                                                          "padded against length side channels here; send false")
        if self.temperature is not None and not 0 <= self.temperature <= 2:
            return "temperature", f"temperature must be in [0, 2], got {self.temperature}"
        return None

    def wants_logprobs(self) -> bool:
        return OUTPUT_LOGPROBS in (self.include or ())

    def _logprobs_refusal(self) -> tuple[str, str] | None:
        """include names only the output text's logprobs; top_logprobs counts their alternatives, so it needs
        them; and they are given of a text reply, not of one whose tokens are partly tool calls."""
        for value in self.include or ():
            if value != OUTPUT_LOGPROBS:
                return "include", (f"include {value!r} is not supported: no reasoning, tool sources, images or "
                                   f"encrypted content are produced here; {OUTPUT_LOGPROBS!r} is the one it takes")
        if self.top_logprobs and not self.wants_logprobs():
            return "top_logprobs", (f"top_logprobs counts the alternatives of the output text's logprobs, which come "
                                    f"with include [{OUTPUT_LOGPROBS!r}]; send that too")
        if self.wants_logprobs() and self.tools and self.tool_choice != "none":
            return "include", ("the output text's logprobs are given for a text reply, and with tools the reply's "
                               "tokens may be calls: send tool_choice 'none', or ask /v1/chat/completions with "
                               "logprobs")
        return None

    def tool_fields(self) -> dict:
        """tools and tool_choice as the chat request's (ValueError names a tool this server cannot run)."""
        fields: dict[str, Any] = {}
        if self.tools:
            tools = []
            for i, tool in enumerate(self.tools):
                if tool.get("type") != "function":
                    raise ValueError(f"tools[{i}] is a {tool.get('type')!r} tool; {RESPONSES_UNSUPPORTED_TOOLS} are "
                                     "not run by this server: declare a function tool and run it yourself")
                f = FunctionTool.model_validate(tool)
                tools.append({"type": "function", "function": f.model_dump(exclude={"type"}, exclude_none=True)})
            fields["tools"] = tools
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise ValueError("tool_choice names a function as {'type': 'function', 'name': ...}; other choices "
                                 f"({choice.get('type')!r}) name tools this server does not run")
            choice = {"type": "function", "function": {"name": choice["name"]}}
        if choice is not None:
            fields["tool_choice"] = choice
        return fields

    def input_items(self) -> list[dict]:
        """This request's input as items, as the store keeps them: a string is one user message, and a message's
        string content one text part (input_text; output_text for the assistant)."""
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        return [_as_item(item) for item in items]

    def to_chat(self, history: list[dict]) -> ChatCompletionRequest:
        """The chat request of this turn: `instructions`, the stored conversation's items `history`, then this
        request's input. ValueError names an item that cannot be one."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else [])
        messages += input_messages(history + self.input_items())
        fields: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream,
                                  "max_completion_tokens": self.max_output_tokens, **self.tool_fields()}
        fields |= {name: getattr(self, name) for name in self.SAMPLING if getattr(self, name) is not None}
        if not self.tools:  # OpenAI's own responses carry it whatever the tools: without tools it asks nothing
            fields.pop("parallel_tool_calls", None)
        user = self.user or self.safety_identifier
        if user is not None:
            fields["user"] = user
        if self.request_id is not None:
            fields["request_id"] = self.request_id
        if self.wants_logprobs():
            fields |= {"logprobs": True, "top_logprobs": self.top_logprobs or 0}
        form = self.text.format if self.text is not None else None
        if form is not None and form.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        elif form is not None and form.type == "json_schema":
            if form.json_schema is None:
                raise ValueError("text.format json_schema needs its 'schema'")
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": form.name or "output", "schema": form.json_schema, "strict": form.strict}}
        return ChatCompletionRequest.model_validate(fields)


def input_messages(given: list[dict]) -> list[dict]:
    """Responses input items as chat messages: function calls join the assistant turn before them, function
    outputs become tool messages."""
    messages: list[dict] = []
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            messages.append({"role": _role(item, where), "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _text(item.get("output"), where)})
        elif kind == "reasoning":
            raise ValueError(f"{where} is a reasoning item; this model does not reason in separate items, so send "
                             "the conversation without it")
        else:
            raise ValueError(f"{where} is a {kind!r} item; this server takes messages, function_call and "
                             f"function_call_output items ({RESPONSES_UNSUPPORTED_TOOLS} are not run here)")
    return messages


# each item type's keys the prompt or the item listing reads: only these are kept (and stored)
KEPT_KEYS = {"message": ("id", "type", "role", "content", "status"),
             "function_call": ("id", "type", "call_id", "name", "arguments", "status"),
             "function_call_output": ("id", "type", "call_id", "output", "status")}
PART_KEYS = ("type", "text", "refusal")


def _as_item(item: dict) -> dict:
    """An input item as it is rendered and stored: its type's KEPT_KEYS only (the rest of what a client sends
    along, such as annotations echoed back, is read by nothing), a message's string content as one text part.
    Another type is left as it came, for input_messages to refuse."""
    kind = item.get("type", "message")
    keys = KEPT_KEYS.get(kind)
    if keys is None:
        return item
    kept = {key: item[key] for key in keys if key in item} | {"type": kind}
    if kept.get("status") not in (None, "in_progress", "completed", "incomplete"):
        del kept["status"]
    text = "output" if kind == "function_call_output" else "content"
    if kind == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        kept["content"] = [{"type": part, "text": item["content"]}]
    elif isinstance(kept.get(text), list):
        kept[text] = [{key: p[key] for key in PART_KEYS if key in p} if isinstance(p, dict) else p
                      for p in kept[text]]
    return kept


def _role(item: dict, where: str) -> str:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise ValueError(f"{where}.role must be user, assistant, system or developer, got {role!r}")
    return role


def _text(content, where: str) -> str:
    """A string, or input_text / output_text / refusal parts, as text; other parts are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise ValueError(f"{where}.content[{j}] is a {kind!r} part; {TEXT_ONLY}: send input_text parts")
    return "\n".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where} needs its {key!r} (a string)")
    return value
