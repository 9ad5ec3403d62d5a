"""A conversation is rendered with the chat template a fixed number of times, however long it is, and the checks
that a custom role reaches the model still hold (accepted where the template renders it, refused where it
drops it)."""

from __future__ import annotations

import pytest

from nanoserve.errors import RequestError
from nanoserve.server.prompts import rendered_chat
from nanoserve.server.protocol import ChatCompletionRequest
from nanoserve.tokenizer import Tokenizer

RENDERS_ALL_ROLES = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
DROPS_CRITICS = "{% for m in messages %}{% if m.role != 'critic' %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer(hf_tokenizer_dir):
    return Tokenizer.from_dir(hf_tokenizer_dir)


@pytest.fixture
def renders(tokenizer, monkeypatch):
    """Counts the template renders a request costs, on the real tokenizer."""
    count = {"n": 0}
    real = tokenizer.apply_chat_template

    def counting(*args, **kwargs):
        count["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", counting)
    return count


def conversation(n: int, template: str | None = None,
                 roles=("narrator", "user", "assistant", "critic")) -> ChatCompletionRequest:
    messages = [{"role": roles[i % len(roles)], "content": f"line {i}"} for i in range(n)]
    return ChatCompletionRequest.model_validate({"messages": messages, "chat_template": template})


def test_a_long_conversation_of_custom_roles_costs_a_fixed_number_of_renders(tokenizer, renders):
    text, ids = rendered_chat(conversation(800, RENDERS_ALL_ROLES), tokenizer)
    assert renders["n"] <= 2  # one render per custom-role message before: 401 here
    assert "<narrator>line 0\n" in text and "<critic>line 799\n" in text and ids


def test_a_custom_role_the_template_drops_is_refused_in_a_fixed_number_of_renders(tokenizer, renders):
    body = conversation(799, DROPS_CRITICS, roles=("narrator", "user", "assistant"))
    body.messages[-1].role = "critic"  # the one message the template drops comes last
    with pytest.raises(RequestError) as err:
        rendered_chat(body, tokenizer)
    assert renders["n"] <= 2
    assert "messages[798] has role 'critic'" in str(err.value) and "does not render" in str(err.value)


def test_a_custom_role_is_checked_by_its_content_reaching_the_prompt(tokenizer):
    """Content equal to another message's, or empty, is still told apart: each custom-role message is looked for
    on its own."""
    template = ("{% for m in messages %}{% if m.role != 'aside' or loop.index0 > 0 %}<{{ m.role }}>{{ m.content }}"
                "{% endif %}{% endfor %}")
    same = [{"role": "aside", "content": "hi"}, {"role": "user", "content": "hi"}, {"role": "aside", "content": ""}]
    with pytest.raises(RequestError, match=r"messages\[0\] has role 'aside'"):
        rendered_chat(ChatCompletionRequest.model_validate({"messages": same, "chat_template": template}), tokenizer)
    kept = same[1:]
    text, _ = rendered_chat(ChatCompletionRequest.model_validate({"messages": kept, "chat_template": template}),
                            tokenizer)
    assert text == "<user>hi<aside>"
