"""The peers a user would pick instead, as benchmark arms: llama.cpp (llama-cpp-python, the `peers` extra) on
the same GGUF file and threads. transformers' arm lives beside nanoserve's in throughput.py.

llama-cpp-python's `Llama` runs one sequence at a time (continuous batching is llama-server's, a separate
binary), so its mixed-workload arm serves the requests one after another: what a user of that package gets.
"""

from __future__ import annotations

import time
from pathlib import Path

from nanoserve.optional import available, left_out


def llama_cpp_runs(path: Path, skip: bool = False) -> bool:
    """Whether llama.cpp's arm runs: on the engine's own file when it is a GGUF file, unless skipped; without
    llama-cpp-python the arm is left out with a line saying how to install it."""
    if skip or not path.is_file():
        return False
    if not available("llama_cpp"):
        print(left_out("llama.cpp", "llama_cpp"))
        return False
    return True


def llama_cpp_arm(path: Path, threads: int, n_ctx: int, skip: bool = False) -> LlamaCppArm | None:
    """llama.cpp on `path` when `llama_cpp_runs` says it can, else None."""
    return LlamaCppArm(path, threads, n_ctx) if llama_cpp_runs(path, skip) else None


class LlamaCppArm:
    """llama.cpp on `path` with `threads` threads (for decode and for prompt batches alike), greedy."""

    def __init__(self, path: Path, threads: int, n_ctx: int):
        import llama_cpp

        self.version = llama_cpp.__version__
        self.llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads,
                                   n_ctx=n_ctx, verbose=False)

    def _run(self, prompt: list[int], n: int) -> tuple[float, float]:
        """(seconds to the first token, seconds for the n - 1 after it), EOS ignored."""
        start = time.perf_counter()
        first = None
        made = 0
        for _ in self.llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            made += 1
            if first is None:
                first = time.perf_counter()
            if made == n:
                break
        return first - start, time.perf_counter() - first

    def first_token_and_answer(self, prompt: list[int], n: int) -> tuple[float, list[int]]:
        """(seconds to the first token, the n tokens), greedy. `generate` reuses the longest prefix this
        context already evaluated (llama-cpp-python's own prompt cache); `llm.reset()` first to compute all."""
        start = time.perf_counter()
        first, tokens = None, []
        for token in self.llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            tokens.append(token)
            if first is None:
                first = time.perf_counter() - start
            if len(tokens) == n:
                break
        return first, tokens

    def single(self, prompt: list[int], n: int) -> float:
        """Decode tokens/s of one stream after its first token (the same measure as the other arms)."""
        _, decode = self._run(prompt, n)
        return (n - 1) / decode

    def facts(self) -> dict:
        return {"version": self.version}

    def close(self) -> None:
        """Free the model and its context now, not when the collector gets to them (the next arm needs the memory)."""
        self.llm.close()

    def mixed(self, work: list[tuple[list[int], int]]) -> dict:
        t = time.perf_counter()
        for prompt, n in work:
            self._run(prompt, n)
        dt = time.perf_counter() - t
        tokens = sum(n for _, n in work)
        return {"seconds": dt, "output_tokens": tokens, "tok_s": tokens / dt, "peak_running": 1}
