"""Request bodies -> the token ids the engine runs: completion prompts in each accepted shape, and chat messages
rendered with the model's template. Anything a template would silently drop is refused instead."""

from __future__ import annotations

from typing import Any

from nanoserve.errors import RequestError
from nanoserve.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from nanoserve.tokenizer import Tokenizer

# message keys a template may or may not render; a conversation that uses one is checked to change the prompt
_TEMPLATE_ONLY_KEYS = ("name", "tool_calls", "tool_call_id")


class PromptError(RequestError):
    """A prompt or message the server refuses; `field` names where it is in the body."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def completion_prompts(body: CompletionRequest, tokenizer: Tokenizer, vocab_size: int) -> list[tuple[str, list[int]]]:
    """(prompt text, token ids) per prompt of the request, in order. The text is what echo returns: the prompt
    as sent, or the decoded ids when it was sent as ids or truncated ("" when echo is off: nothing reads it)."""
    special = True if body.add_special_tokens is None else body.add_special_tokens
    out = []
    for i, prompt in enumerate(body.prompts()):
        if isinstance(prompt, str):
            if not prompt:
                raise PromptError("prompt", "prompt is empty; send at least one token")
            ids = tokenizer.encode(prompt, add_special_tokens=special)
        else:
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise PromptError("prompt", f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size}); "
                                            "encode the prompt with this model's tokenizer")
        ids = _truncated(ids, body.truncate_prompt_tokens)
        if not ids:
            raise PromptError("prompt", f"prompt {i} encodes to no tokens; send at least one token")
        if not body.echo:
            text = ""
        elif isinstance(prompt, str) and body.truncate_prompt_tokens is None:
            text = prompt
        else:
            text = tokenizer.decode(ids, skip_special_tokens=False)
        out.append((text, ids))
    return out


def chat_prompt(body: ChatCompletionRequest, tokenizer: Tokenizer) -> list[int]:
    """The conversation rendered with the chat template (or the request's own) and encoded."""
    messages = [_template_message(m, i) for i, m in enumerate(body.messages)]
    variables = dict(body.chat_template_kwargs or {})
    if body.documents is not None:
        variables["documents"] = body.documents

    def render(msgs: list[dict]) -> str:
        return tokenizer.apply_chat_template(
            msgs, add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
            tokenize=False, chat_template=body.chat_template, continue_final_message=body.continue_final_message,
            **variables)

    text = render(messages)

    def renders_the_same_without(key: str) -> bool:
        try:
            return render([_without(m, key) for m in messages]) == text
        except RequestError:  # the template needs the key, so it reads it
            return False

    for key in _TEMPLATE_ONLY_KEYS:
        if any(key in m for m in messages) and renders_the_same_without(key):
            raise PromptError(f"messages.{key}", f"this model's chat template does not render a message's "
                                                 f"{key!r}, so it would be dropped; send the conversation without it")
    ids = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
    return _truncated(ids, body.truncate_prompt_tokens)


def _template_message(m: ChatMessage, i: int) -> dict[str, Any]:
    """One message as the template reads it: text content (parts joined), developer spoken as system."""
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        raise PromptError(f"messages.{i}.content", f"messages[{i}] ({m.role}) has no content; send its text as "
                                                   "'content'")
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                           "content": "" if m.content is None else _text(m.content, i)}
    for key in _TEMPLATE_ONLY_KEYS:
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    return out


def _text(content: str | list[dict], i: int) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind != "text" or not isinstance(part.get("text"), str):
            what = f"a {kind!r} part" if kind != "text" else "a text part without a 'text' string"
            raise PromptError(f"messages.{i}.content.{j}", f"messages[{i}].content[{j}] is {what}; this model "
                                                           "takes text only, so send text parts or a string")
        texts.append(part["text"])
    return "\n".join(texts)  # vLLM's join for several text parts


def _without(message: dict, key: str) -> dict:
    return {k: v for k, v in message.items() if k != key}


def _truncated(ids: list[int], keep: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last `keep` tokens."""
    return ids if keep is None else ids[-keep:]
