"""Request bodies a careless or hostile client sends: each must be refused with a 4xx and an OpenAI error body,
hold nothing, and leave the server serving. Used by the soak; the fuzz tests generate many more."""

from __future__ import annotations

LIMIT_BYTES = 4 * 2**20  # the server's default body limit


def _json(text: str) -> tuple[bytes, dict]:
    return text.encode(), {"content-type": "application/json"}


def hostile_bodies(max_model_len: int) -> list[tuple[str, str, bytes | None, dict, int]]:
    """(name, route, body bytes or None for a chunked oversized one, headers, status expected)."""
    completions, chat = "/v1/completions", "/v1/chat/completions"
    return [
        ("not JSON", completions, *_json("{prompt: hi"), 400),
        ("NaN temperature", completions, *_json('{"prompt": "hi", "temperature": NaN}'), 400),
        ("negative max_tokens", completions, *_json('{"prompt": "hi", "max_tokens": -5}'), 400),
        ("prompt of the wrong type", completions, *_json('{"prompt": {"a": 1}}'), 400),
        ("token id outside the vocabulary", completions, *_json('{"prompt": [99999999], "max_tokens": 1}'), 400),
        ("prompt longer than max_model_len", completions,
         *_json(f'{{"prompt": [1], "max_tokens": {max_model_len + 10}}}'), 400),
        ("unknown model", completions, *_json('{"model": "gpt-9", "prompt": "hi"}'), 404),
        ("no messages", chat, *_json('{"messages": []}'), 400),
        ("a role that is no string", chat, *_json('{"messages": [{"role": 5, "content": "hi"}]}'), 400),
        ("tools, which are refused", chat,
         *_json('{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}'), 400),
        ("deeply nested JSON", completions, *_json('{"prompt": ' + "[" * 2000 + "]" * 2000 + "}"), 400),
        ("bytes that are not UTF-8", completions, b'{"prompt": "\xff\xfe"}', {"content-type": "application/json"},
         400),
        ("a body over the limit, declared", completions, b"x" * (LIMIT_BYTES + 1),
         {"content-type": "application/json"}, 413),
        ("a body over the limit, chunked", completions, None, {"content-type": "application/json"}, 413),
    ]


async def chunked_oversize():
    """An oversized body with no Content-Length (an async client sends it chunked): the server must count it
    as it arrives."""
    yield b'{"prompt": "'
    piece = b"word " * 13107  # 64 KiB
    for _ in range(LIMIT_BYTES // len(piece) + 2):
        yield piece
    yield b'"}'
