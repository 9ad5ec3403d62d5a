"""Chat through langchain-openai's ChatOpenAI pointed at a base_url: invoke, stream and batch.

Run by the clients' environment: `python langchain_chat.py BASE_URL MODEL OUT.json`; writes each answer's text.
"""

import json
import sys

from langchain_openai import ChatOpenAI

base, model, out = sys.argv[1:4]
QUESTIONS = ["Name three colours.", "What is two plus two?", "Say hello.", "Count to five."]

chat = ChatOpenAI(model=model, base_url=base, api_key="unused", temperature=0, max_tokens=12, max_retries=0,
                  timeout=60)
seeded = ChatOpenAI(model=model, base_url=base, api_key="unused", temperature=0.9, seed=7, max_tokens=12,
                    max_retries=0, timeout=60)
results = {
    "invoke": chat.invoke([("user", QUESTIONS[0])]).content,
    "stream": "".join(chunk.content for chunk in chat.stream([("user", QUESTIONS[0])])),
    "seeded_invoke": seeded.invoke([("user", QUESTIONS[0])]).content,
    "seeded_stream": "".join(chunk.content for chunk in seeded.stream([("user", QUESTIONS[0])])),
    "batch": [m.content for m in chat.batch([[("user", q)] for q in QUESTIONS], config={"max_concurrency": 4})],
    "questions": QUESTIONS,
}
with open(out, "w") as f:
    json.dump(results, f)
