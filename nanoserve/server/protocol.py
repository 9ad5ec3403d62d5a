"""The request bodies nanoserve accepts, field by field, and the error body it answers with.

Every declared field is either honoured (it reaches SamplingParams, the prompt, the engine request or the
response) or listed in UNSUPPORTED, where any value but its do-nothing one is refused with a 400 saying what to do
instead. Fields that belong to neither OpenAI's nor vLLM's request schema are kept out of the request and named
in one warning in the log (vLLM's behaviour: newer clients send newer fields). tests/test_server_fields.py walks
every declared field and proves which of the two it is.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from nanoserve.errors import shown
from nanoserve.sampling import MAX_N, SamplingParams
from nanoserve.structured.params import StructuredOutputsParams
from nanoserve.tools.spec import ToolRequest, tool_request


def _number(value: Any) -> Any:
    """JSON numbers only: true is not 1 and "0.7" is not 0.7."""
    if isinstance(value, (bool, str)):
        raise ValueError("must be a number")
    return value


Number = Annotated[float, BeforeValidator(_number)]
TokenIds = list[StrictInt]
INT64 = (-(2**63), 2**63 - 1)  # the seed's range, as vLLM (and torch's generator) takes it
TEXT_ONLY = "this model takes text only"
# The free strings a request leaves behind it (its row in /health, its timeline, the data-parallel status, a
# stored response): `user` and `cache_salt` up to Anthropic's documented 256 for metadata.user_id (OpenAI documents
# none for `user`, 64 for safety_identifier); request_id and session_id up to 200 (a uuid with room to spare).
MAX_USER_CHARS = 256
MAX_ID_CHARS = 200

# name -> (values that ask for nothing, why any other value is refused and what to do instead)
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "suffix": ((None, ""), "suffix (text inserted after the completion) is not supported; append it yourself"),
    "spaces_between_special_tokens": ((None, True), "special tokens are always decoded with their spaces"),
    "logits_processors": ((None,), "custom logits processors are not supported; use logit_bias, "
                                   "allowed_token_ids or bad_words"),
    "priority": ((None, 0), "request priorities are not supported; requests are served in arrival order"),
    "mm_processor_kwargs": ((None,), TEXT_ONLY),
    "prompt_embeds": ((None,), "prompt embeddings are not supported; send text or token ids"),
    "vllm_xargs": ((None,), "extra engine arguments per request are not supported"),
    # vLLM 0.33's newer fields (tests/vllm_request_fields.json)
    "watermarking": ((None, False), "watermarking is not supported"),
    "return_weight_versions": ((None, False), "this server's weights never change while it serves, so there are "
                                              "no weight versions to return"),
    "routed_experts_prompt_start": ((None, 0), "routed-expert data belongs to mixture-of-experts models, which "
                                               "nanoserve does not serve"),
    "return_token_offsets": ((None, False), "token offsets come from vLLM's render endpoints, which nanoserve does "
                                            "not have; /tokenize with return_token_strs gives each token's text"),
    "mm_payload": ((None, "tensors"), TEXT_ONLY),
    "return_mm_kwargs": ((None,), TEXT_ONLY),
    "ec_transfer_params": ((None,), "encoder-cache transfer between servers is not supported"),
    "repetition_detection": ((None,), "repetition detection is not supported; use stop strings, "
                                      "repetition_penalty or max_tokens"),
    "thinking_token_budget": ((None, -1), "a thinking budget needs a reasoning parser, which this server does not "
                                          "have"),
    "stream_interval": ((None, 1), "every step's tokens are streamed as they come; a coarser interval is not "
                                   "supported"),
}
CHAT_UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    **UNSUPPORTED,
    "functions": ((None, []), "function calling is not supported; describe the functions in a system message"),
    "function_call": ((None, "none"), "function calling is not supported; send no function_call"),
    "audio": ((None,), "this model writes text only"),
    "media_io_kwargs": ((None,), TEXT_ONLY),
    "include_reasoning": ((None, True), "this server does not separate reasoning from the answer, so there is none "
                                        "to leave out"),
    "modalities": ((None, ["text"]), "this model writes text only; send modalities ['text'] or none"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "reasoning_effort": ((None,), "reasoning effort is not supported by this server"),
    "web_search_options": ((None,), "web search is not supported"),
    "store": ((None, False), "nanoserve stores no completions"),
    "metadata": ((None,), "metadata tags stored completions, which nanoserve does not keep"),
    "service_tier": ((None, "auto", "default"), "there is one service tier here; send 'auto' or none"),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # usage (so far) on every chunk, as vLLM sends it


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema: the schema is enforced whatever `strict` says."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format json_schema goes with type 'json_schema' (and only with it): send "
                             "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}")
        return self

    def constraint(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.json_schema.json_schema)
        return None


# vLLM's older per-field names for structured outputs -> the StructuredOutputsParams field each sets
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class _Request(BaseModel):
    """Fields shared by both routes; names follow OpenAI's API, with vLLM's extensions."""

    model_config = ConfigDict(extra="allow")
    unsupported: ClassVar[dict[str, tuple[tuple, str]]] = UNSUPPORTED
    model: str | None = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt = 0
    min_p: Number = 0.0
    repetition_penalty: Number = 1.0
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    seed: StrictInt | None = None
    min_tokens: StrictInt = 0
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    logit_bias: dict[str, Number] | None = None
    allowed_token_ids: TokenIds | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: StrictInt | None = Field(default=None, ge=-1)  # -1: the whole vocabulary (--max-logprobs)
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    best_of: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    session_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)  # vLLM's: kept with it
    request_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    add_special_tokens: StrictBool | None = None
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=-1)  # -1: as many as fit (vLLM's)
    truncation_side: Literal["left", "right"] | None = None  # left (default) keeps the last tokens
    return_tokens_as_token_ids: StrictBool = False
    return_token_ids: StrictBool | None = None  # the prompt's and each choice's token ids in the response
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's StructuredOutputsParams fields
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # vLLM's: the request shares cached blocks only with requests of the same salt
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_USER_CHARS)
    # vLLM's: each generated position's alternatives are exactly these ids (a scorer's label set), in place of the
    # top N; needs logprobs
    logprob_token_ids: list[StrictInt] | None = None
    # vLLM's beam search (server/beam.py): n beams, ranked by cumulative logprob / length ** length_penalty
    use_beam_search: StrictBool = False
    length_penalty: Number = 1.0
    # UNSUPPORTED fields, declared so the schema names them and their refusal is documented
    suffix: Any = None
    spaces_between_special_tokens: Any = None
    logits_processors: Any = None
    priority: Any = None
    # vLLM's: of its keys only prompt_token_ids (a chat prompt a router already rendered) means anything here
    kv_transfer_params: dict[str, Any] | None = None
    mm_processor_kwargs: Any = None
    prompt_embeds: Any = None
    vllm_xargs: Any = None
    watermarking: Any = None
    return_weight_versions: Any = None
    routed_experts_prompt_start: Any = None
    return_token_offsets: Any = None
    mm_payload: Any = None
    return_mm_kwargs: Any = None
    ec_transfer_params: Any = None
    repetition_detection: Any = None
    thinking_token_budget: Any = None
    stream_interval: Any = None

    @field_validator("seed")
    @classmethod
    def _seed_in_int64(cls, seed: int | None) -> int | None:
        if seed is not None and not INT64[0] <= seed <= INT64[1]:
            raise ValueError(f"must be an integer within int64 [{INT64[0]}, {INT64[1]}], got {seed}")
        return seed

    def refusal(self) -> tuple[str, str] | None:
        """(field, message) for the first unsupported field set to something it cannot do, else None."""
        for name, (idle, why) in self.unsupported.items():
            if getattr(self, name, None) not in idle:
                return name, f"{name} is not supported: {why}"
        refused = self._kv_transfer_refusal()
        if refused is not None:
            return refused
        if self.use_beam_search:
            return self._beam_refusal()
        if self.length_penalty != 1:
            return "length_penalty", "length_penalty ranks the beams of a beam search; send use_beam_search true too"
        if self.logprob_token_ids and self.token_limit() == 0:
            return "logprob_token_ids", ("logprob_token_ids are scored at generated positions, and max_tokens 0 "
                                         "generates none; use prompt_logprobs for the prompt")
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options only apply to a streamed response; send stream: true too"
        if self.stream_options is not None and self.stream_options.continuous_usage_stats \
                and "include_usage" not in self.stream_options.model_fields_set:
            # vLLM's rule: usage on every chunk only of a stream that reports usage. Said with include_usage: false
            # that is a stream without usage, as asked; said alone it would silently give none.
            return "stream_options.continuous_usage_stats", ("continuous_usage_stats puts usage on every chunk of a "
                                                             "stream that reports usage; send include_usage: true "
                                                             "too (include_usage: false streams no usage)")
        given = [name for name in ("response_format", "structured_outputs", *GUIDED) if self._asks(name)]
        if len(given) > 1:
            return given[1], (f"{' and '.join(given)} each constrain the output; send one of them")
        if self.guided_whitespace_pattern is not None and not any(getattr(self, name) is not None for name in GUIDED):
            return "guided_whitespace_pattern", ("guided_whitespace_pattern shapes a guided_json output; send it "
                                                 "with guided_json (or use structured_outputs.whitespace_pattern)")
        if self.truncation_side is not None and self.truncate_prompt_tokens is None:
            return "truncation_side", ("truncation_side says which end truncate_prompt_tokens cuts; send it with "
                                       "truncate_prompt_tokens")
        if self.best_of not in (None, self.n):
            return "best_of", (f"best_of={self.best_of} with n={self.n} is not supported: every completion is "
                               "returned; send best_of equal to n, or none")
        return None

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or ())

    def forwarded_prompt_ids(self) -> list[int] | None:
        """kv_transfer_params' prompt_token_ids: the chat prompt as a router (or a prefill stage) already
        tokenized it, used verbatim in place of rendering the messages, as vLLM does."""
        return (self.kv_transfer_params or {}).get("prompt_token_ids")

    def _kv_transfer_refusal(self) -> tuple[str, str] | None:
        params = self.kv_transfer_params or {}
        other = sorted(set(params) - {"prompt_token_ids"})
        if other:
            return "kv_transfer_params", (f"kv_transfer_params {', '.join(other)} ask for KV transfer between "
                                          "servers, and no KV connector is built here (a prefill server's blocks "
                                          "cannot be taken up); prompt_token_ids is the one key it takes")
        ids = params.get("prompt_token_ids")
        if ids is None:
            return None
        if not isinstance(self, ChatCompletionRequest):
            return "kv_transfer_params", ("kv_transfer_params.prompt_token_ids stands in for a rendered chat "
                                          "prompt; on /v1/completions send the ids as the prompt")
        if not isinstance(ids, list) or not ids or any(type(i) is not int or i < 0 for i in ids):
            return "kv_transfer_params", ("kv_transfer_params.prompt_token_ids must be a non-empty list of token "
                                          "ids (integers >= 0)")
        return None

    def _beam_refusal(self) -> tuple[str, str] | None:
        for name, quiet in BEAM_QUIET.items():
            if name in self.model_fields_set and getattr(self, name, None) not in quiet:
                return name, (f"{name} does not apply to beam search, which ranks beams by the model's raw "
                              "logprobs and answers whole; leave it out, or drop use_beam_search")
        return None

    def _asks(self, name: str) -> bool:
        value = getattr(self, name)
        return value is not None and not (name == "response_format" and value.type == "text")

    def constraint(self) -> StructuredOutputsParams | dict | None:
        """The output's constraint, from whichever field gave it (refusal() has made sure only one did)."""
        if self.response_format is not None and self.response_format.type != "text":
            return self.response_format.constraint()
        if self.structured_outputs is not None:
            return self.structured_outputs
        guided = {field: getattr(self, name) for name, field in GUIDED.items() if getattr(self, name) is not None}
        if guided and self.guided_whitespace_pattern is not None:
            guided["whitespace_pattern"] = self.guided_whitespace_pattern
        return guided or None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
                        ) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, min_tokens=self.min_tokens,
            max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            structured_outputs=self.constraint(), logprob_token_ids=self.logprob_token_ids or None,
        )


# the fields a beam search has no use for (it ranks beams by raw logprobs and answers whole), with the values that
# ask nothing of it; set to anything else, each is refused by name
BEAM_QUIET = {"temperature": (0, 1), "top_p": (1,), "top_k": (0, -1), "min_p": (0,), "repetition_penalty": (1,),
              "presence_penalty": (0,), "frequency_penalty": (0,), "seed": (None,), "min_tokens": (0,),
              "stop": (None, []), "logit_bias": (None, {}), "bad_words": (None, []), "prompt_logprobs": (None,),
              "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (False,), "stream": (False,),
              "response_format": (None,), "structured_outputs": (None,), "guided_json": (None,),
              "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,), "tools": (None, []),
              "logprob_token_ids": (None, []), "stream_options": (None,)}


PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of lists of token ids"


class CompletionRequest(_Request):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: StrictInt | None = Field(default=16, ge=0)
    logprobs: StrictInt | None = Field(default=None, ge=-1)  # -1: the whole vocabulary (--max-logprobs)
    echo: StrictBool = False

    def token_limit(self) -> int | None:
        return self.max_tokens

    @model_validator(mode="before")
    @classmethod
    def _prompt_shape(cls, data: Any) -> Any:
        """Name the accepted shapes, and never read true/false as a token id."""
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if prompt is None and isinstance(data, dict):
            raise ValueError(f"prompt must be given and non-empty: {PROMPT_SHAPES} (prompt_embeds are not "
                             "supported)")
        if isinstance(prompt, str):
            return data
        if not isinstance(prompt, list) or not prompt:
            raise ValueError(f"prompt must be {PROMPT_SHAPES}; got {'an empty list' if prompt == [] else shown(prompt)}")
        kinds = {_prompt_item_kind(p) for p in prompt}
        if len(kinds) != 1 or None in kinds:
            raise ValueError(f"prompt must be {PROMPT_SHAPES}, not a mix or other values (booleans are not token "
                             "ids)")
        return data

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, one entry each: a batch of strings or of token lists, or one prompt."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


def _prompt_item_kind(item: Any) -> str | None:
    if isinstance(item, bool):
        return None
    if isinstance(item, int):
        return "id"
    if isinstance(item, str):
        return "text"
    if isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
        return "ids"
    return None


class ChatMessage(BaseModel):
    """Any role: the chat template decides what it renders (a role it drops is refused, see prompts.py)."""

    model_config = ConfigDict(extra="allow")
    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None  # its schema is enforced: always under required or named, under auto if strict


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Request):
    unsupported: ClassVar[dict[str, tuple[tuple, str]]] = CHAT_UNSUPPORTED
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=-1)  # -1: the whole vocabulary (--max-logprobs)
    echo: StrictBool = False  # vLLM's: the last message's content in front of the reply, when it is the reply's role
    return_prompt_text: StrictBool | None = None  # vLLM's: the prompt the chat template rendered
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    media_io_kwargs: Any = None
    include_reasoning: Any = None

    def unknown_fields(self) -> list[str]:
        inner = {f"messages[].{k}" for m in self.messages for k in (m.model_extra or ())}
        return sorted({*super().unknown_fields(), *inner})

    def tool_request(self) -> ToolRequest | None:
        tools = None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        return tool_request(tools, choice, self.parallel_tool_calls)

    def constraint(self) -> StructuredOutputsParams | dict | None:
        tools = self.tool_request()
        enforced = tools.constraint() if tools is not None else None
        return enforced if enforced is not None else super().constraint()

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def refusal(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true; send both"
        tools = self.tool_request()
        if tools is not None and tools.constraint() is not None:  # required, named, or auto with strict tools
            given = [name for name in ("response_format", "structured_outputs", *GUIDED) if self._asks(name)]
            if given:
                why = "strict tools under 'auto' enforce" if tools.choice == "auto" else \
                    f"tool_choice {tools.choice!r} constrains the output to tool calls, and"
                return given[0], f"{why} {given[0]} constrains it too; send one of them"
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            return "max_completion_tokens", ("max_tokens and max_completion_tokens disagree; send one of them "
                                             "(max_tokens is the older name of max_completion_tokens)")
        return super().refusal()


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or messages rendered with the chat template as /v1/chat/completions does."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: StrictBool | None = None  # prompt: true; messages: false (the template writes them)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    return_token_strs: StrictBool = False
    media_io_kwargs: Any = None
    mm_processor_kwargs: Any = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt or messages")
        chat_only = [name for name in ("continue_final_message", "chat_template", "chat_template_kwargs", "tools")
                     if self.prompt is not None and getattr(self, name) not in (None, False)]
        if chat_only:
            raise ValueError(f"{chat_only[0]} shapes how messages are rendered; send it with messages, not prompt")
        for name in ("media_io_kwargs", "mm_processor_kwargs"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is not supported: {TEXT_ONLY}")
        return self

    def as_chat(self) -> ChatCompletionRequest:
        """The chat request whose prompt this is (chat_prompt renders both alike)."""
        return ChatCompletionRequest.model_construct(  # the fields not named keep their defaults
            messages=self.messages, add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message, chat_template=self.chat_template,
            chat_template_kwargs=self.chat_template_kwargs, tools=self.tools, add_special_tokens=self.add_special_tokens)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: TokenIds


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: every 4xx and 5xx answers with one."""

    error: ErrorInfo


MESSAGE_CHARS = 1000  # an error message's length, past which it is cut (the messages themselves are a few lines)
_INTERNALS = ("\n<backtrace>", "Traceback (most recent call last)", "\nstack backtrace:")


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """The body; its message is cut before any traceback or backtrace a library wrote into it, and to
    MESSAGE_CHARS, so no error body carries internals or repeats a whole input."""
    for start in _INTERNALS:
        message = message.split(start, 1)[0]
    if len(message) > MESSAGE_CHARS:
        message = f"{message[:MESSAGE_CHARS]}... (cut: the message ran to {len(message)} characters)"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
