#!/usr/bin/env bash
# Run vLLM 0.33.0's own OpenAI-server tests (bodies unchanged) against `nanoserve serve`.
# Usage: ./run.sh [test-file ...]     (default: every file in files.txt)
# Env:   NANOSERVE_SRC=/work/main  test the working tree instead of a snapshot of /work/main's HEAD
#        PER_TEST_TIMEOUT=300
set -uo pipefail
H=/work/vllm-harness
VLLM_SRC=${VLLM_SRC:-/tmp/vllm-src/vllm-0.33.0}
VLLM_WHEEL=${VLLM_WHEEL:-/tmp/vllm/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl}
MAIN=${MAIN:-/work/main}
cd "$H"

# 1. test venv (cached): vllm wheel --no-deps + the pure-python deps its protocol/tokenizer imports need
if [ ! -x venv/bin/python ] || ! venv/bin/python -c "import vllm.entrypoints.openai.chat_completion.protocol, pytest_timeout" 2>/dev/null; then
  python3.11 -m venv venv
  venv/bin/pip install -q torch==2.13.0
  venv/bin/pip install -q --no-deps "$VLLM_WHEEL"
  venv/bin/pip install -q regex cachetools psutil numpy requests tqdm py-cpuinfo "transformers>=5.16.1,<5.21.0" \
    "huggingface_hub>=1.31.0" "tokenizers>=0.23.2" safetensors protobuf "fastapi>=0.133.0,<0.137.0" "starlette>=1.0.1" \
    aiohttp openai "pydantic>=2.12.0" orjson prometheus_client pillow prometheus-fastapi-instrumentator tiktoken \
    partial-json-parser jsonschema pyzmq msgspec pyyaml einops cloudpickle python-json-logger pybase64 cbor2 ijson \
    setproctitle anthropic blake3 sentencepiece pytest pytest-asyncio pytest-timeout httpx jinja2 uvloop \
    oss-harmony "mcp>=2.2.0,<3" lm-format-enforcer==0.11.3 xgrammar==0.2.8 "llguidance>=1.7,<1.8" outlines_core==0.2.14 \
    lark==1.2.2 "model-hosting-container-standards>=0.1.14,<1" "mistral_common>=1.11.6" schemathesis
fi

# 2. the server under test: a snapshot of nanoserve's committed tree (the working tree may be mid-edit)
if [ -z "${NANOSERVE_SRC:-}" ]; then
  rm -rf "$H/nanoserve-src" && mkdir -p "$H/nanoserve-src"
  REF=${NANOSERVE_REF:-HEAD}   # pin a commit with NANOSERVE_REF=<sha> (the project keeps committing meanwhile)
  git -C "$MAIN" archive "$REF" nanoserve console | tar -x -C "$H/nanoserve-src"
  export NANOSERVE_SRC="$H/nanoserve-src"
  echo "nanoserve under test: $MAIN @ $(git -C "$MAIN" rev-parse "$REF") (snapshot in $NANOSERVE_SRC)"
else
  echo "nanoserve under test: $NANOSERVE_SRC (as is)"
fi
export NANOSERVE_BIN=${NANOSERVE_BIN:-$MAIN/.venv/bin/nanoserve}

# 3. tokenizer of the default model, for tests that call get_tokenizer(MODEL_NAME) (no hub access)
if [ ! -f "$H/tokenizer/tokenizer.json" ]; then
  PYTHONPATH="$NANOSERVE_SRC" "$MAIN/.venv/bin/python" "$H/make_tokenizer.py" "$H/tokenizer"
fi
[ -f "$H/tokenizer/config.json" ] || cp "$H/shim/tokenizer_config_model.json" "$H/tokenizer/config.json"
export HARNESS_TOKENIZER_DIR="$H/tokenizer"

# 4. tests: vLLM's tests/entrypoints unchanged, plus the shims (tests/utils.py, tests/conftest.py)
rm -rf "$H/tests" && mkdir -p "$H/tests"
cp -r "$VLLM_SRC/tests/entrypoints" "$H/tests/"
touch "$H/tests/__init__.py"
cp "$H/shim/utils.py" "$H/tests/utils.py"
cp "$H/shim/conftest.py" "$H/tests/conftest.py"

# 5. run, one pytest process per file (a server per module, as vLLM does; one crash cannot stop the rest)
# a full run starts from empty results; a run of named files replaces only those files' results
[ $# -eq 0 ] && rm -rf "$H/results"
mkdir -p "$H/results/junit" "$H/results/logs" "$H/results/server-logs"
export HARNESS_SERVER_LOG_DIR="$H/results/server-logs" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ $# -gt 0 ]; then FILES=("$@"); else mapfile -t FILES < <(grep -v '^#' files.txt | grep .); fi
for f in "${FILES[@]}"; do
  name=$(echo "$f" | tr '/' '_' | sed 's/\.py$//')
  echo "=== $f"
  start=$(date +%s)
  timeout 3600 venv/bin/python -m pytest -p no:cacheprovider -rA -vv --timeout "${PER_TEST_TIMEOUT:-300}" \
    --junitxml "results/junit/$name.xml" -o junit_suite_name="$f" "tests/entrypoints/$f" \
    > "results/logs/$name.log" 2>&1
  echo "    rc=$? $(( $(date +%s) - start ))s  $(tail -1 results/logs/$name.log)"
done

# 6. merge junit + summary
venv/bin/python "$H/summarize.py" "$H/results"
