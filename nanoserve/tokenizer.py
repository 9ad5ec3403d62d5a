"""Text <-> token ids: encoding and chat templates.

`Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` and reproduces what `transformers` does with the same
checkpoint files (BOS handling, chat-template rendering), so prompts match what a model was trained on.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers

from nanoserve.errors import CheckpointError, RequestError
from nanoserve.template_budget import RenderAbandoned, TemplateBudgetError, render
from nanoserve.template_sandbox import BudgetedSandbox

__all__ = ["Tokenizer"]

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class Tokenizer:
    """A fast tokenizer plus the checkpoint metadata needed to build prompts and detect the end of a reply."""

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        *,
        chat_template: str | Mapping[str, str] | None,
        bos_token: str | None,
        eos_token: str | None,
        add_bos_token: bool = False,
        extra_eos_token_ids: Iterable[int] = (),
    ):
        self.hf = hf
        self.bos_token = bos_token
        self.eos_token = eos_token
        # A checkpoint may ship several named templates; "default" is the one used unless tools ask for "tool_use".
        if isinstance(chat_template, Mapping):
            self._chat_templates = dict(chat_template)
        else:
            self._chat_templates = {"default": chat_template} if chat_template else {}
        self.bos_token_id = self._token_id(bos_token)
        self.eos_token_id = self._token_id(eos_token)
        eos_ids = {int(i) for i in extra_eos_token_ids}
        if self.eos_token_id is not None:
            eos_ids.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        # Only prepend BOS ourselves when the post-processor does not already do it, so it is never doubled.
        self._prepend_bos = add_bos_token and self.bos_token_id is not None and not self._post_processor_adds_bos()
        self._token_texts: dict[int, str] = {}

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from a Hugging Face checkpoint directory, honouring the same files `transformers` reads."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(
                f"{tokenizer_file} not found: nanoserve needs a Hugging Face fast tokenizer file. Use a checkpoint "
                "that ships tokenizer.json, or create one with "
                f"`AutoTokenizer.from_pretrained(...).save_pretrained('{path}')`."
            )
        hf = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(path / "tokenizer_config.json")
        bos_token = _token_content(config.get("bos_token"))
        eos_token = _token_content(config.get("eos_token"))
        generation = _read_json(path / "generation_config.json")
        extra_eos = generation.get("eos_token_id")
        if extra_eos is None:
            extra_eos = []
        elif isinstance(extra_eos, int):
            extra_eos = [extra_eos]
        return cls(
            hf,
            chat_template=_load_chat_template(path, config),
            bos_token=bos_token,
            eos_token=eos_token,
            # tokenizer.json's post-processor alone decides BOS/EOS: transformers ignores tokenizer_config.json's
            # add_bos_token/add_eos_token when tokenizer.json exists, and following it keeps prompts identical.
            add_bos_token=False,
            extra_eos_token_ids=extra_eos,
        )

    # -- vocabulary -------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included (a model may pad its embedding further)."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self._chat_templates.get("default")

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that `decode(..., skip_special_tokens=True)` drops."""
        return frozenset(i for i, tok in self.hf.get_added_tokens_decoder().items() if tok.special)

    @cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of `<0xNN>` byte tokens when the decoder uses byte fallback (SentencePiece-style), else empty."""
        if not _has_decoder(json.loads(self.hf.decoder.__getstate__()) if self.hf.decoder else None, "ByteFallback"):
            return frozenset()
        return frozenset(i for tok, i in self.hf.get_vocab(with_added_tokens=False).items() if _BYTE_TOKEN.fullmatch(tok))

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self.hf.token_to_id(token)

    def _post_processor_adds_bos(self) -> bool:
        with_special = self.hf.encode("a", add_special_tokens=True).ids
        without = self.hf.encode("a", add_special_tokens=False).ids
        return with_special[:1] == [self.bos_token_id] and without[:1] != [self.bos_token_id]

    # -- encode / decode --------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens included (what logprobs name a token by); cached per id."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.hf.decode([token_id], skip_special_tokens=False)
        return text

    def token_piece(self, token_id: int) -> str:
        """The vocabulary's own string for a token (`'Ġis'` for " is" in a byte-level BPE): what transformers'
        convert_ids_to_tokens answers, and vLLM's /tokenize token_strs."""
        piece = self.hf.id_to_token(token_id)
        return piece if piece is not None else self.token_text(token_id)

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> dict:
        """`tokenizer(text)` as transformers answers it: {"input_ids": ids} (a list of lists for a batch)."""
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        return {"input_ids": [self.encode(t, add_special_tokens) for t in text]}

    def __len__(self) -> int:
        """Vocabulary size with added tokens, as len() of a transformers tokenizer."""
        return self.vocab_size

    # -- chat templates ---------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render a conversation the way `transformers` does; with `tokenize=True` return its ids.

        `chat_template` replaces the checkpoint's template for this call. `continue_final_message` leaves the
        last (assistant) message open, so the model continues it instead of starting a new turn.
        Extra keyword arguments (tools, documents, enable_thinking, ...) become template variables.
        """
        if continue_final_message and add_generation_prompt:
            raise RequestError("continue_final_message continues the last message, add_generation_prompt starts "
                               "a new one; set add_generation_prompt=False to continue")
        source = chat_template or self._template_source(kwargs.get("tools"))
        template = _compiled_or_refused(source)
        # a variable the template never reads is dropped: refused, unless it asks for nothing (None, false:
        # enable_thinking false on a model that never thinks is what happens anyway, as vLLM accepts it)
        unused = sorted(k for k, v in kwargs.items() if v is not None and v is not False and k not in _variables(source))
        if unused:
            raise RequestError(f"this chat template does not use {', '.join(unused)}, so it would be dropped; "
                               "leave it out, or pass a chat template that reads it")
        messages = _validate_messages(messages)
        variables: dict[str, Any] = {"tools": None, "documents": None}
        if self.bos_token is not None:
            variables["bos_token"] = self.bos_token
        if self.eos_token is not None:
            variables["eos_token"] = self.eos_token
        variables.update(kwargs)
        variables.update(messages=messages, add_generation_prompt=add_generation_prompt)
        text = _rendered(template, variables)
        if continue_final_message:
            text = _cut_after_final_message(text, messages[-1].get("content", ""))
        if tokenize:
            # The template writes BOS itself when the model wants one, so no special tokens are added here.
            return self.encode(text, add_special_tokens=False)
        return text

    def template_reads(self, variable: str, chat_template: str | None = None) -> bool:
        """Whether the chat template (the request's own, or the one used with tools) reads `variable`."""
        return variable in _variables(chat_template or self._template_source(tools=[]))

    def template_source(self, chat_template: str | None = None, tools: Any = None) -> str:
        """The template text a conversation would be rendered with."""
        return chat_template or self._template_source(tools)

    def _template_source(self, tools: Any) -> str:
        if not self._chat_templates:
            raise RequestError(
                "this tokenizer has no chat template, so chat messages cannot be turned into a prompt; "
                "send a plain text prompt (completions) instead, or use a checkpoint whose tokenizer_config.json "
                "or chat_template.jinja defines a chat template"
            )
        name = "tool_use" if tools is not None and "tool_use" in self._chat_templates else "default"
        if name not in self._chat_templates:
            raise RequestError(
                f"this tokenizer has several chat templates ({sorted(self._chat_templates)}) but none named "
                "'default'; use a checkpoint with a default chat template"
            )
        return self._chat_templates[name]


# -- checkpoint file helpers ----------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); fix or remove the file") from e
    return data if isinstance(data, dict) else {}


def _has_decoder(config: Any, kind: str) -> bool:
    """Whether a decoder config (possibly a Sequence of decoders) contains a decoder of type `kind`."""
    if not isinstance(config, dict):
        return False
    return config.get("type") == kind or any(_has_decoder(d, kind) for d in config.get("decoders") or ())


def _token_content(token: Any) -> str | None:
    """Special tokens are saved either as plain strings or as serialized AddedToken dicts."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _load_chat_template(path: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """Newer checkpoints keep the template in its own file, which takes precedence over tokenizer_config.json."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(path / "chat_template.json").get("chat_template") or config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        return {t["name"]: t["template"] for t in template if isinstance(t, dict) and "name" in t}
    return template if isinstance(template, str) else None


# -- chat template rendering ----------------------------------------------------------------------------------


class _GenerationBlock(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (used to mark assistant tokens for training) as a no-op."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


@functools.lru_cache(maxsize=32)
def _compiled(source: str) -> jinja2.Template:
    return _jinja_env().from_string(source)


def _compiled_or_refused(source: str) -> jinja2.Template:
    try:
        return _compiled(source)
    except jinja2.TemplateSyntaxError as e:
        raise RequestError(f"the chat template does not parse: {_short(e)}; fix the template") from None
    except RecursionError:
        raise RequestError("the chat template nests too deep to parse; fix the template") from None


def _rendered(template: jinja2.Template, variables: dict[str, Any]) -> str:
    """The template rendered within its budget (template_budget.py). Whatever it raises is the template's or
    the conversation's doing, so it is a request error naming what went wrong, not a server error."""
    try:
        return render(template, variables)
    except (RequestError, RenderAbandoned):
        raise
    except jinja2.TemplateError as e:
        raise RequestError(f"the chat template rejected this conversation: {_short(e)}") from None
    except RecursionError:
        raise TemplateBudgetError("the chat template recursed too deep rendering this conversation; fix the "
                                  "template") from None
    except Exception as e:  # noqa: BLE001 (a template's own failure: 1/0, a bad index, a wrong type)
        raise RequestError(f"the chat template failed on this conversation: {type(e).__name__}: {_short(e)}") \
            from None


def _short(e: Exception) -> str:
    """An error's text, cut short: it may carry the template's or the conversation's own words."""
    text = str(e)
    return text if len(text) <= 300 else text[:300] + "..."


@functools.lru_cache(maxsize=32)
def _variables(source: str) -> frozenset[str]:
    """The variables a template reads (so a variable it never reads can be refused, not dropped)."""
    from jinja2 import meta

    return frozenset(meta.find_undeclared_variables(_jinja_env().parse(source)))


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt the model was trained on.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _jinja_env() -> BudgetedSandbox:
    """The environment transformers renders chat templates in (templates from the Hub rely on its settings),
    with a budget for each render."""
    env = BudgetedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.add_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _cut_after_final_message(text: str, final: str) -> str:
    """The rendered conversation up to the end of the final message's content (transformers' rule)."""
    final = final.strip() if final.strip() and final.strip() in text else final
    at = text.rfind(final) if final else -1
    if at < 0:
        raise RequestError("continue_final_message: the chat template does not write the final message's content "
                           "verbatim, so it cannot be left open; send the conversation without it")
    return text[: at + len(final)]


def _validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the conversation shape up front so a bad request fails with a clear message, not a template error."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise RequestError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}"
        )
    if not messages:
        raise RequestError("messages is empty; send at least one {'role': ..., 'content': ...} message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise RequestError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        # An assistant turn that only calls tools may have no content (OpenAI's shape).
        calls_tools = message.get("role") == "assistant" and message.get("tool_calls")
        for key in ("role",) if calls_tools and message.get("content") is None else ("role", "content"):
            if not isinstance(message.get(key), str):
                got = "missing" if key not in message else f"a {type(message[key]).__name__}"
                raise RequestError(f"messages[{i}]['{key}'] must be a string, but it is {got}")
        # Keys set to None are dropped, as transformers does: templates test for presence, not for None.
        out.append({k: v for k, v in message.items() if v is not None})
    return out
