"""Request bodies -> the token ids the engine runs: completion prompts in each accepted shape, and chat messages
rendered with the model's template. Anything a template would silently drop is refused instead."""

from __future__ import annotations

import re
import secrets
from typing import Any

from nanoserve.errors import RequestError, shown
from nanoserve.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from nanoserve.template_budget import TemplateBudgetError
from nanoserve.tokenizer import Tokenizer
from nanoserve.tools.prompt import template_arguments, with_tool_prompt, written_calls
from nanoserve.tools.spec import ToolRequest

# message keys a template may or may not render
_TEMPLATE_ONLY_KEYS = ("name", "tool_calls", "tool_call_id")
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})  # OpenAI's; any other is the template's


class PromptError(RequestError):
    """A prompt or message the server refuses; `field` names where it is in the body."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def completion_prompts(body: CompletionRequest, tokenizer: Tokenizer, vocab_size: int,
                       max_model_len: int) -> list[tuple[str, list[int]]]:
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
                raise PromptError("prompt", f"prompt token id {bad[0]} is out of vocabulary (this model's ids are "
                                            f"[0, {vocab_size})); encode the prompt with this model's tokenizer")
        ids = truncated(ids, body, max_model_len)
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


# what rendering sets from the request's own fields: chat_template_kwargs may not set them a second time
RENDER_ARGUMENTS = frozenset({"messages", "add_generation_prompt", "continue_final_message", "tokenize",
                              "chat_template", "tools", "documents"})


def chat_prompt(body: ChatCompletionRequest, tokenizer: Tokenizer, tools: ToolRequest | None = None,
                max_model_len: int | None = None) -> list[int]:
    """The conversation rendered with the chat template (or the request's own) and encoded, with the request's
    tools where its tool_choice shows them to the model (see nanoserve.tools.prompt)."""
    return rendered_chat(body, tokenizer, tools, max_model_len)[1]


def rendered_chat(body: ChatCompletionRequest, tokenizer: Tokenizer, tools: ToolRequest | None = None,
                  max_model_len: int | None = None) -> tuple[str, list[int]]:
    """(the prompt text the template rendered, its token ids after any truncation); a prompt a router already
    rendered (kv_transfer_params.prompt_token_ids) is taken as it is."""
    forwarded = body.forwarded_prompt_ids()
    if forwarded is not None:
        return tokenizer.decode(forwarded, skip_special_tokens=False), list(forwarded)
    messages = [_template_message(m, i) for i, m in enumerate(body.messages)]
    _check_tool_results(messages)
    variables = dict(body.chat_template_kwargs or {})
    own = sorted(set(variables) & RENDER_ARGUMENTS)
    if own:
        raise PromptError("chat_template_kwargs", f"chat_template_kwargs sets {', '.join(own)}, which the request "
                                                  "sets itself; send it as its own field")
    if body.documents is not None:
        variables["documents"] = body.documents
    if tools is not None and tools.template_tools() is not None:
        if tokenizer.template_reads("tools", body.chat_template):
            variables["tools"] = tools.template_tools()
        else:
            messages = with_tool_prompt(messages, tools)

    def render(msgs: list[dict], continuing: bool = body.continue_final_message) -> str:
        return tokenizer.apply_chat_template(
            msgs, add_generation_prompt=body.add_generation_prompt and not continuing, tokenize=False,
            chat_template=body.chat_template, continue_final_message=continuing, **variables)

    text = render(messages)

    def renders_the_same_without(key: str) -> bool:
        try:
            return render([_without(m, key) for m in messages]) == text
        except TemplateBudgetError:
            raise
        except RequestError:  # the template needs the key, so it reads it
            return False

    if any("tool_calls" in m for m in messages) and renders_the_same_without("tool_calls"):
        messages = [written_calls(m) if "tool_calls" in m else m for m in messages]  # written into the text
        text = render(messages)
    if any("name" in m for m in messages) and renders_the_same_without("name"):
        raise PromptError("messages.name", "this model's chat template does not render a message's 'name', so it "
                                           "would be dropped; send the conversation without it")
    _check_roles_render(messages, render)
    ids = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
    return text, truncated(ids, body, max_model_len)


def _check_roles_render(messages: list[dict], render) -> None:
    """A message of a role outside OpenAI's is passed to the template as vLLM passes it; one the template drops is
    refused, since the model would never see it. One more render tells, however many such messages there are:
    each one's content is replaced by a marker of its own, and a marker missing from the result is a message
    dropped (a render per message made a long conversation cost the square of its length)."""
    custom = [i for i, m in enumerate(messages) if m["role"] not in ROLES]
    if not custom:
        return
    tag = f"{secrets.randbelow(10**12):012d}"  # digits: they come through the filters a template may apply
    marked = list(messages)
    for i in custom:
        marked[i] = {**messages[i], "content": f"[{tag}:{i}]"}
    try:
        text = render(marked, continuing=False)
    except TemplateBudgetError:
        raise
    except RequestError:  # the template cannot take the marker for the content: it reads the message
        return
    seen = {int(i) for i in re.findall(rf"\[{tag}:(\d+)\]", text)}  # one pass: a search per marker was n^2
    dropped = next((i for i in custom if i not in seen), None)
    if dropped is not None:
        raise PromptError(f"messages.{dropped}.role", f"messages[{dropped}] has role "
                                                      f"{shown(messages[dropped]['role'])}, which this model's chat "
                                                      "template does not render, so the model would never see it; "
                                                      f"use one of {', '.join(sorted(ROLES))}")


def _check_tool_results(messages: list[dict]) -> None:
    """Every tool result answers a call of an earlier assistant turn. Templates that do not render the id (the
    default model's, Qwen2.5's) show results in the order of the calls, so an id that matches no call, or a
    result with none, is refused rather than shown to the model as an answer to something it never asked."""
    called: set[str] = set()
    for i, m in enumerate(messages):
        for call in m.get("tool_calls") or ():
            if isinstance(call, dict) and isinstance(call.get("id"), str):
                called.add(call["id"])
        if m.get("tool_call_id") is not None and m["role"] != "tool":
            raise PromptError(f"messages.{i}.tool_call_id", f"messages[{i}] is a {m['role']} message; tool_call_id "
                                                            "belongs on a tool message (the result of a call)")
        if m["role"] == "tool":
            if m.get("tool_call_id") not in called:
                raise PromptError(f"messages.{i}.tool_call_id", f"messages[{i}] is a tool result for "
                                  f"{m.get('tool_call_id')!r}, which no earlier assistant tool call has; send the "
                                  "assistant turn with its tool_calls before their results")


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
    return template_arguments(out)


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


def truncated(ids: list[int], body, max_model_len: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep that many tokens, the last ones (truncation_side 'left', the default)
    or the first ('right'); -1 keeps as many as the model takes with one left for output. More than the model
    takes is refused, as vLLM refuses it."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return ids
    if max_model_len is not None and keep > max_model_len:
        raise PromptError("truncate_prompt_tokens", f"truncate_prompt_tokens {keep} is more than max_model_len "
                                                    f"{max_model_len}; ask for at most {max_model_len - 1}")
    if keep == -1:
        keep = max_model_len - 1 if max_model_len is not None else len(ids)
    if keep >= len(ids):
        return ids
    return ids[:keep] if body.truncation_side == "right" else ids[len(ids) - keep:]
