"""Read vLLM's request models out of a vLLM wheel and write the field table the field walk checks against.

    pip download --no-deps --only-binary=:all: vllm==X.Y.Z -d /tmp/vllm
    python scripts/vllm-fields.py /tmp/vllm/vllm-X.Y.Z-*.whl        # rewrites tests/vllm_request_fields.json

The wheel is only read (its Python files parsed, nothing imported), so no GPU and none of vLLM's dependencies are
needed. tests/test_server_fields.py then requires every field named here to be declared by nanoserve's request
models, honoured or refused, so vLLM's next fields show as failing rows rather than as silence.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "vllm_request_fields.json"
MODELS = {  # table key -> (file in the wheel, class)
    "completion": ("vllm/entrypoints/openai/completion/protocol.py", "CompletionRequest"),
    "chat": ("vllm/entrypoints/openai/chat_completion/protocol.py", "ChatCompletionRequest"),
    "tokenize_prompt": ("vllm/entrypoints/serve/tokenize/protocol.py", "TokenizeCompletionRequest"),
    "tokenize_messages": ("vllm/entrypoints/serve/tokenize/protocol.py", "TokenizeChatRequest"),
    "detokenize": ("vllm/entrypoints/serve/tokenize/protocol.py", "DetokenizeRequest"),
    "responses": ("vllm/entrypoints/openai/responses/protocol.py", "ResponsesRequest"),
    "messages": ("vllm/entrypoints/anthropic/protocol.py", "AnthropicMessagesRequest"),
    "count_tokens": ("vllm/entrypoints/anthropic/protocol.py", "AnthropicCountTokensRequest"),
}


def fields(source: str, cls: str) -> list[str]:
    """The annotated public fields of `cls` (its own body: vLLM's request models derive from a fieldless base)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return [s.target.id for s in node.body if isinstance(s, ast.AnnAssign)
                    and isinstance(s.target, ast.Name) and not s.target.id.startswith("_")]
    raise SystemExit(f"{cls} not found: vLLM moved its request models; update MODELS in {__file__}")


def main(wheel: str) -> int:
    version = re.search(r"vllm-([^-]+)-", Path(wheel).name)
    if version is None:
        raise SystemExit(f"{wheel} is not named like a vLLM wheel (vllm-X.Y.Z-...whl)")
    with zipfile.ZipFile(wheel) as z:
        table = {key: fields(z.read(path).decode(), cls) for key, (path, cls) in MODELS.items()}
    OUT.write_text(json.dumps({"vllm": version.group(1), "read_from": {k: f"{p}:{c}" for k, (p, c) in
                                                                       MODELS.items()}, **table}, indent=1) + "\n")
    print(f"wrote {OUT}: vLLM {version.group(1)}, " + ", ".join(f"{k} {len(v)}" for k, v in table.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
