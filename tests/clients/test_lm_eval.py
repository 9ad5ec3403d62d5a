"""lm-eval's local-completions and local-chat-completions against the live server.

Every loglikelihood lm-eval reports for the multiple-choice task must equal the sum of the engine's own offline
prompt logprobs over the continuation, and those must equal transformers' log_softmax on the same weights; every
generation it reports must equal the engine's offline greedy text under the same stop strings. lm-eval runs with
--batch_size 4, so it sends several prompts (token-id lists) in one /v1/completions request.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from .support import (
    HERE,
    MAX_MODEL_LEN,
    MODEL,
    Exchange,
    LiveServer,
    client_tool,
    engine_prompt_logprobs,
    greedy_text,
    hf_argmax,
    hf_prompt_logprobs,
    run_client,
)

TASKS = HERE / "lm_eval_tasks"
# The server and the offline engine run the same float32 kernels, but in differently shaped batches; transformers
# runs its own kernels. Per-token tolerances, summed over a continuation where lm-eval reports a sum.
SAME_ENGINE = 1e-5
VS_TRANSFORMERS = 1e-4


@dataclass
class LmEvalRun:
    samples: dict[str, list[dict]]  # task -> lm-eval's logged samples, in doc order
    results: dict
    exchanges: list[Exchange]  # what the server saw during the run

    def posts(self, path: str) -> list[Exchange]:
        return [e for e in self.exchanges if e.method == "POST" and e.path == path]


def run_lm_eval(client_env: Path, live: LiveServer, home: Path, model: str, tasks: str, model_args: dict,
                *extra: str) -> LmEvalRun:
    lm_eval = client_tool(client_env, "lm_eval")
    shutil.copytree(TASKS, home / "tasks")  # the task YAMLs name their data files relative to the working dir
    args = ",".join(f"{k}={v}" for k, v in {"model": MODEL, "max_retries": 1, "max_length": MAX_MODEL_LEN,
                                              **model_args}.items())
    mark = live.recorder.mark()
    run_client([lm_eval, "--model", model, "--model_args", args, "--tasks", tasks, "--include_path",
                home / "tasks", "--log_samples", "--output_path", home / "out", *extra],
               home, timeout=300, cwd=home / "tasks", live=live, mark=mark)
    samples = {}
    for f in sorted((home / "out").rglob("samples_*.jsonl")):
        task = f.name[len("samples_"):].rsplit("_", 1)[0]
        samples[task] = sorted((json.loads(line) for line in f.read_text().splitlines()), key=lambda s: s["doc_id"])
    results = json.loads(next((home / "out").rglob("results_*.json")).read_text())
    return LmEvalRun(samples, results, live.recorder.since(mark))


def arguments(sample: dict) -> list[tuple]:
    """lm-eval's logged request arguments: {"gen_args_0": {"arg_0": ..., "arg_1": ...}, ...} -> tuples."""
    return [tuple(a[f"arg_{j}"] for j in range(len(a))) for _, a in sorted(sample["arguments"].items(),
                                                                          key=lambda kv: int(kv[0].split("_")[-1]))]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a loglikelihood request into context and continuation tokens (trailing spaces of
    the context move to the continuation; the whole string is encoded once and split at the context's length).
    The test checks the result is a prompt lm-eval actually sent, so a drift here fails rather than passes."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    ctx = tokenizer(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx):]


def sent_prompts(exchanges: list[Exchange]) -> list[list]:
    """Each prompt of each request, a request's `prompt` being one prompt or a list of them."""
    out = []
    for e in exchanges:
        prompt = e.request["prompt"]
        out.extend(prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str) else [prompt])
    return out


@pytest.fixture(scope="module")
def completions_run(client_env, live, tiny_dir, tmp_path_factory) -> LmEvalRun:
    """Both tasks through local-completions with the checkpoint's own tokenizer, four prompts per request."""
    return run_lm_eval(client_env, live, tmp_path_factory.mktemp("lm-eval"), "local-completions",
                       "nanoserve_mc,nanoserve_gen",
                       {"base_url": f"{live.url}/v1/completions", "tokenizer": tiny_dir,
                        "tokenizer_backend": "huggingface", "tokenized_requests": True},
                       "--batch_size", "4")


def test_lm_eval_batches_prompts_into_one_request(completions_run, live):
    posts = completions_run.posts("/v1/completions")
    assert posts and all(e.status == 200 for e in posts), live.recorder.failures()
    batched = [e for e in posts if len(sent_prompts([e])) > 1]
    assert batched, "lm-eval sent no request with several prompts; --batch_size 4 should make it"
    for e in batched:
        assert all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in e.request["prompt"])
        choices = e.response_json()["choices"]
        assert [c["index"] for c in choices] == list(range(len(e.request["prompt"]))), e.describe()


def test_lm_eval_loglikelihoods_equal_engine_and_transformers(completions_run, offline, hf_model, hf_tokenizer):
    samples = completions_run.samples["nanoserve_mc"]
    echoed = [e for e in completions_run.posts("/v1/completions") if e.request.get("echo")]
    sent = {tuple(p) for p in sent_prompts(echoed)}
    assert len(samples) == 6
    correct = []
    for s in samples:
        totals = []
        for (context, continuation), resp in zip(arguments(s), s["resps"], strict=True):
            reported, greedy = float(resp[0][0]), resp[0][1] == "True"
            ctx, cont = encode_pair(hf_tokenizer, context, continuation)
            ids = ctx + cont
            assert tuple(ids) in sent, f"lm-eval never sent {context + continuation!r} as {ids}"
            ours = engine_prompt_logprobs(offline, ids)
            theirs = hf_prompt_logprobs(hf_model, ids)
            assert ours[1:] == pytest.approx(theirs[1:], abs=VS_TRANSFORMERS), (context, continuation)
            assert reported == pytest.approx(sum(ours[len(ctx):]), abs=SAME_ENGINE * len(cont)), \
                (context, continuation, reported)
            # lm-eval's is_greedy: every continuation token is the top-1 in the server's top_logprobs
            argmax = hf_argmax(hf_model, ids)
            assert greedy == all(argmax[i - 1] == ids[i] for i in range(len(ctx), len(ids))), (context, continuation)
            totals.append(sum(theirs[len(ctx):]))
        correct.append(max(range(len(totals)), key=totals.__getitem__) == s["doc"]["answer"])
    acc = completions_run.results["results"]["nanoserve_mc"]["acc,none"]
    assert acc == pytest.approx(sum(correct) / len(correct))


def test_lm_eval_generate_until_equals_offline_greedy(completions_run, offline, hf_tokenizer):
    gens = [e for e in completions_run.posts("/v1/completions") if not e.request.get("echo")]
    assert any(len(sent_prompts([e])) > 1 for e in gens), "no generate_until request carried several prompts"
    asked = {}
    for e in gens:
        for p in sent_prompts([e]):
            asked[tuple(p)] = (e.request.get("stop"), e.request["max_tokens"])
    samples = completions_run.samples["nanoserve_gen"]
    assert len(samples) == 5
    for s in samples:
        (context, gen_kwargs), = arguments(s)
        ids = tuple(hf_tokenizer(context, add_special_tokens=False).input_ids)
        assert ids in asked, f"lm-eval never sent {context!r} as {list(ids)}"
        stop, max_tokens = asked[ids]
        assert max_tokens == 12 and "\n\n" in stop and "." in stop
        assert s["resps"][0][0] == greedy_text(offline, list(ids), max_tokens, stop), context


@pytest.fixture(scope="module")
def chat_run(client_env, live, tmp_path_factory) -> LmEvalRun:
    """generate_until through local-chat-completions; lm-eval sends chat requests one conversation each (it
    drops --batch_size to 1 for chat), two at a time."""
    return run_lm_eval(client_env, live, tmp_path_factory.mktemp("lm-eval-chat"), "local-chat-completions",
                       "nanoserve_gen", {"base_url": f"{live.url}/v1/chat/completions", "num_concurrent": 2},
                       "--apply_chat_template", "--batch_size", "2")


def test_lm_eval_chat_generate_until_equals_offline_chat(chat_run, offline, live):
    posts = chat_run.posts("/v1/chat/completions")
    assert posts and all(e.status == 200 for e in posts), live.recorder.failures()
    asked = {e.request["messages"][-1]["content"]: e.request for e in posts}
    samples = chat_run.samples["nanoserve_gen"]
    assert len(samples) == 5
    for s in samples:
        (context, _), = arguments(s)  # lm-eval logs the conversation as [json string]
        messages = json.loads(context[0] if isinstance(context, list) else context)
        body = asked[messages[-1]["content"]]
        assert body["messages"] == messages and body["max_tokens"] == 12
        expected = greedy_text(offline, messages, body["max_tokens"], body["stop"], chat=True)
        assert s["resps"][0][0] == expected, messages


@pytest.fixture(scope="module")
def remote_tokenizer_run(client_env, live, tmp_path_factory) -> LmEvalRun:
    """The multiple-choice task with lm-eval's remote tokenizer: it reads /tokenizer_info and tokenizes every
    string through /tokenize instead of loading a tokenizer of its own."""
    return run_lm_eval(client_env, live, tmp_path_factory.mktemp("lm-eval-remote"), "local-completions",
                       "nanoserve_mc", {"base_url": f"{live.url}/v1/completions", "tokenizer_backend": "remote"},
                       "--batch_size", "4")


def test_lm_eval_remote_tokenizer_gives_the_same_loglikelihoods(remote_tokenizer_run, completions_run, live):
    tokenize = [e for e in remote_tokenizer_run.exchanges if e.path == "/tokenize"]
    assert tokenize and all(e.status == 200 for e in tokenize), live.recorder.failures()
    # /tokenize splits every string as the checkpoint's own tokenizer does: lm-eval sends the same prompts
    remote_prompts = sorted(sent_prompts(remote_tokenizer_run.posts("/v1/completions")))
    local_prompts = sorted(sent_prompts([e for e in completions_run.posts("/v1/completions") if e.request.get("echo")]))
    assert remote_prompts == local_prompts
    remote = [r for s in remote_tokenizer_run.samples["nanoserve_mc"] for r in s["resps"]]
    local = [r for s in completions_run.samples["nanoserve_mc"] for r in s["resps"]]
    assert len(remote) == len(local)
    for (a, a_greedy), (b, b_greedy) in zip((r[0] for r in remote), (r[0] for r in local), strict=True):
        assert float(a) == pytest.approx(float(b), abs=1e-4) and a_greedy == b_greedy
