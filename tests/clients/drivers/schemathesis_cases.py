"""schemathesis validating the answers to known-good requests against the server's own /openapi.json.

Its generated requests rarely get past the server's semantic checks, so the success bodies (JSON and SSE) would
go unchecked; these cases make sure each route's 200 answer is held to the published schema.
Run by the clients' environment: `python schemathesis_cases.py BASE_URL MODEL OUT.json`.
"""

import json
import sys

import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

base, model, out = sys.argv[1:4]
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]
CHAT = [{"role": "user", "content": "Hi"}]
CASES = [
    ("completion", "POST", "/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 4}),
    ("completion streamed", "POST", "/v1/completions",
     {"model": model, "prompt": "Hello", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}),
    ("completion echo logprobs", "POST", "/v1/completions",
     {"model": model, "prompt": ["Hello", "Bye"], "max_tokens": 0, "echo": True, "logprobs": 1}),
    ("chat", "POST", "/v1/chat/completions", {"model": model, "messages": CHAT, "max_tokens": 4}),
    ("chat streamed", "POST", "/v1/chat/completions",
     {"model": model, "messages": CHAT, "max_tokens": 4, "stream": True, "logprobs": True, "top_logprobs": 2}),
    ("messages", "POST", "/v1/messages", {"model": model, "messages": CHAT, "max_tokens": 4}),
    ("messages streamed", "POST", "/v1/messages", {"model": model, "messages": CHAT, "max_tokens": 4, "stream": True}),
    ("messages count_tokens", "POST", "/v1/messages/count_tokens", {"model": model, "messages": CHAT}),
    ("responses", "POST", "/v1/responses", {"model": model, "input": "Hi", "max_output_tokens": 4}),
    ("responses streamed", "POST", "/v1/responses", {"model": model, "input": "Hi", "max_output_tokens": 4,
                                                     "stream": True}),
    ("models", "GET", "/v1/models", None),
    ("tokenize", "POST", "/tokenize", {"model": model, "prompt": "Hello world"}),
    ("detokenize", "POST", "/detokenize", {"model": model, "tokens": [100, 200, 300]}),
    ("health", "GET", "/health", None),
    ("metrics", "GET", "/metrics", None),
]

schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
results = []
for name, method, path, body in CASES:
    try:
        operation = schema[path][method]
        case = operation.Case(body=body) if body is not None else operation.Case()
        response = case.call_and_validate(checks=CHECKS)
        results.append({"case": name, "status": response.status_code, "failure": None})
    except (Exception, FailureGroup) as e:  # the schema violations found, a route not in the schema, ...
        results.append({"case": name, "status": None, "failure": f"{type(e).__name__}: {e}"[:3000]})
with open(out, "w") as f:
    json.dump(results, f)
