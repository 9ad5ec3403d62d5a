"""`nanoserve serve --port 0` as a user starts it: it says where it serves, answers one completion over HTTP, and
stops cleanly on Ctrl-C. Run by scripts/quickstart-check.sh with only the standard library beside nanoserve.

    python scripts/quickstart_serve.py      # exit 0 when all three hold; otherwise why, and the server's output
    python scripts/quickstart_serve.py --data-parallel-size 2     # any other arguments go to `nanoserve serve`
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request

SERVING = re.compile(r"serving (\S+) at (http://\S+)/v1")


def main(extra: list[str]) -> int:
    server = subprocess.Popen(["nanoserve", "serve", "--port", "0", *extra], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in server.stdout:  # the model loads first; the line comes once it serves
            seen.append(line)
            if found := SERVING.search(line):
                break
        else:
            return fail("the server exited without saying where it serves", seen)
        model, url = found.groups()
        body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 8,
                           "temperature": 0}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.load(response)
        text = answer["choices"][0]["text"]
        if answer["usage"]["completion_tokens"] < 1 or not text:
            return fail(f"an empty completion: {answer}", seen)
        print(f"{url}/v1/completions answered {text!r}")
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
    rest, _ = server.communicate(timeout=60)
    seen.append(rest)
    if server.returncode != 0 or "nanoserve: stopped" not in rest:
        return fail(f"Ctrl-C did not stop the server cleanly (exit {server.returncode})", seen)
    return 0


def fail(why: str, output: list[str]) -> int:
    print(f"{why}\n--- server output ---\n{''.join(output)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
