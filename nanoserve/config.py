"""EngineConfig: every engine flag, its default, and the checks that refuse a combination that cannot work."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass

import torch

from nanoserve.attention.dispatch import STREAMED_NOT_INVARIANT, check_read_block
from nanoserve.errors import ConfigError, shown
from nanoserve.kv.publisher import KVEventsConfig
from nanoserve.sampling_params import MAX_LOGPROBS
from nanoserve.step_budget import MOST_MS

QUANTIZATIONS = ("auto", "none", "int4", "int8")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TRUE, _FALSE = ("true", "on", "yes", "1"), ("false", "off", "no", "0")
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}


def _finite(value) -> bool:
    """A number that is not inf or NaN (an int always is: one past a float's range has no float to overflow)."""
    return isinstance(value, numbers.Integral) or math.isfinite(value)


def _flag(default, help: str, choices: tuple[str, ...] | None = None):
    """A config field that is also a CLI flag and a control on the console's flags screen."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class FlagSpec:
    """What a front end needs to offer one engine flag: its kind, default, help and allowed values."""

    name: str
    kind: type  # bool, int, float or str
    optional: bool  # None is allowed (meaning: decided at load time)
    default: object
    help: str
    choices: tuple[str, ...] | None

    def parse(self, text: str):
        """Turn a typed value into the flag's value ('' is None for optional flags); ValueError names the flag.

        Bools take true/false/on/off/yes/no/1/0 (bool('false') would be True).
        """
        text = text.strip()
        if text == "" and self.optional:
            return None
        if self.kind is bool:
            word = text.lower()
            if word not in _TRUE + _FALSE:
                raise ValueError(f"{self.name} must be true/false/on/off/yes/no/1/0, got {text!r}")
            return word in _TRUE
        try:
            value = self.kind(text)
        except ValueError:
            raise ValueError(f"{self.name} must be {'empty or ' if self.optional else ''}"
                             f"{'an integer' if self.kind is int else 'a number'}, got {shown(text)}") from None
        if self.kind is float and not math.isfinite(value):
            raise ValueError(f"{self.name} must be a finite number, got {shown(text)}")
        return value

    def check_kind(self, value) -> None:
        """ConfigError unless `value` is of the flag's kind: a bool is no number, a str no int, and an int stands
        for a float (None where the flag may be unset). Values come from Python callers and from JSON as well as
        from text, so the types are checked before any range compares them."""
        if value is None and self.optional:
            return
        if self.kind in (int, float):
            ok = isinstance(value, numbers.Integral if self.kind is int else numbers.Real) and not isinstance(value, bool)
        else:
            ok = isinstance(value, self.kind)
        if not ok:
            kind = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[self.kind]
            raise ConfigError(f"{self.name} takes {kind}{' or null' if self.optional else ''}, got {shown(value)}")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = _flag(None, "HF checkpoint dir or .gguf file; unset runs the embedded default model")
    dtype: str = _flag("auto", "weights and KV dtype; auto: float32 on CPU, the checkpoint's bf16/fp16 on CUDA",
                       choices=("auto", *DTYPES))
    device: str = _flag("auto", "auto: cuda when available, else cpu", choices=("auto", "cpu", "cuda"))
    quantization: str = _flag("auto", "linear weights: auto keeps a GGUF file's 4-bit blocks packed where this "
                                       "machine has the kernel (CPU), none runs dense weights, int4 / int8 also "
                                       "quantize a dense checkpoint at load", choices=QUANTIZATIONS)
    max_model_len: int | None = _flag(None, "longest prompt + output; unset: the model's context, capped by the KV pool")
    max_num_seqs: int = _flag(64, "rows a step may run at once")
    max_num_batched_tokens: int = _flag(2048, "token budget of one step (decodes first, then prefill chunks)")
    max_step_ms: float | None = _flag(None, "while streams decode, a step's prefill share is cut to fit this step "
                                            "time (ms), from costs measured online; unset: the larger of 150 ms "
                                            "and 4 decode steps; 0: off (the token budget alone)")
    block_size: int = _flag(16, "tokens per KV block (a power of two)")
    kv_cache_gib: float | None = _flag(None, "KV budget in GiB; unset: 1 GiB on CPU, gpu_memory_utilization on CUDA")
    gpu_memory_utilization: float = _flag(0.9, "share of the card the engine may fill (CUDA, KV budget unset)")
    seed: int = _flag(0, "seeds the generator that unseeded sampled requests draw from")
    max_logprobs: int = _flag(MAX_LOGPROBS, "the most logprobs alternatives a request may ask for (vLLM's flag); "
                                            "-1: no limit, so logprobs -1 returns the whole vocabulary")
    enable_prefix_caching: bool = _flag(True, "reuse the KV blocks of a prompt prefix another request already "
                                              "computed (full blocks, named by content; as vLLM, on by default)")
    batch_invariant: bool = _flag(True, "deterministic: a row's numbers depend only on its own tokens, never on "
                                         "the rows beside it, the chunk boundaries, the prefix cache or timing at "
                                         "load (README: Determinism); off: kernels chosen by a call's rows and by "
                                         "timing at load")
    fused_cpu_kernels: bool = _flag(True, "run the CPU decoder's norms, rotary + KV write and SiLU as C kernels "
                                           "built for this machine at first start (needs a C compiler; without "
                                           "one the eager torch ops run and stats say why)")
    read_ahead: bool = _flag(True, "while the CPU decoder runs the ops between two matmuls, an idle kernel thread "
                                   "asks memory for the next matmul's first weight bytes (fused kernels, 2+ "
                                   "threads; moves bytes into the cache, never changes a value)")
    decode_buckets: bool = _flag(False, "pad decode-only steps up to a closed set of shapes (rows x table width)")
    persistent_inputs: bool = _flag(False, "decode inputs and block table live in buffers written in place")
    row_compaction: bool = _flag(False, "decode rows keep their table row; a leaving row's place takes the last row")
    streamed_read: bool = _flag(False, "decode attention walks KV tiles in a Triton kernel instead of gathering a "
                                       "rectangle (slow under the CPU interpreter)")
    read_block: int = _flag(64, "the streamed read's tile width in tokens (a power of two >= 16)")
    capture_graphs: bool = _flag(False, "record a CUDA graph per decode bucket and replay it (CUDA only; needs "
                                        "decode_buckets and persistent_inputs)")
    cuda_graphs: bool = _flag(False, "the whole decode fast path: buckets, persistent inputs, compaction and "
                                     "capture (CUDA only)")
    tensor_parallel_size: int = _flag(1, "ranks every layer is split across (torch.distributed: gloo between CPU "
                                         "processes, NCCL between GPUs); the heads and kv heads must divide")
    distributed_init: str | None = _flag(None, "the group's rendezvous when ranks run on other machines: env:// "
                                               "(MASTER_ADDR, MASTER_PORT) or tcp://host:port, each started with "
                                               "`nanoserve worker`; unset: every rank runs here")
    tp_all_reduce: str = _flag("auto", "how tensor-parallel ranks exchange partial sums and logits: auto goes "
                                       "through shared memory between CPU ranks on one x86-64 machine, else "
                                       "through the group's backend; backend always uses gloo / NCCL",
                               choices=("auto", "backend"))
    speculative_config: str | None = _flag(None, "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", "
                                                 "\"num_speculative_tokens\": 4}' (prompt lookup) or "
                                                 "'{\"method\": \"suffix\"}' (suffix decoding); outputs unchanged")
    stall_factor: float = _flag(3.0, "a step slower than this many times the recent p99 step (and over 50 ms) is "
                                     "a stall, named with what it carried (Recent panel, /health's stalls)")
    stall_drop_fraction: float = _flag(0.5, "decode tok/s over a busy second under this share of its running "
                                            "median, while the rows per step held, is a throughput drop")
    otlp_traces_endpoint: str | None = _flag(None, "export one OpenTelemetry span per request (vLLM's flag): "
                                                   "http://host:4318/v1/traces is OTLP/HTTP, host:4317 OTLP/gRPC "
                                                   "(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL overrides); needs the otel "
                                                   "extra")
    kv_events_config: str | None = _flag(None, "publish KV cache events as vLLM does, its JSON: "
                                               "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                                               "\"endpoint\": \"tcp://*:5557\", \"topic\": \"kv-events\"}' "
                                               "(for KV-aware routers; needs the kv-events extra); tcp://*:PORT binds "
                                               "127.0.0.1 here, tcp://0.0.0.0:PORT every interface")
    data_parallel_rank: int = _flag(0, "this engine's rank among data-parallel replicas: its KV events carry it "
                                       "and --kv-events-config's port is offset by it (--data-parallel-size sets "
                                       "it for each replica)")
    distributed_timeout: float = _flag(60.0, "seconds a tensor-parallel collective may wait for the other ranks "
                                             "before the engine stops with an error (start-up: at least 120)")

    def __post_init__(self) -> None:
        for spec in self.flag_specs():
            if spec.kind in (int, float):
                spec.check_kind(getattr(self, spec.name))
        self._check_ranges()
        for spec in self.flag_specs():  # a float flag without a range of its own is still refused infinite or NaN
            value = getattr(self, spec.name)
            if spec.kind is float and value is not None and not _finite(value):
                raise ConfigError(f"{spec.name} must be a finite number, got {value}")
        self._check_combinations()

    def _check_ranges(self) -> None:
        """Each number in its range. A float's range says finite: inf passes `>= 0` and then breaks the step that
        divides by it, and the JSON (/health, GET /knobs) that publishes it."""
        checks = (
            (self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}"),
            (self.max_logprobs >= -1, f"max_logprobs must be >= 0, or -1 for no limit, got {self.max_logprobs}"),
            (self.max_num_batched_tokens >= 1,
             f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"),
            (self.max_num_batched_tokens >= self.max_num_seqs,
             f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
             f"({self.max_num_seqs}) so every running row can decode each step; raise it or lower max_num_seqs"),
            (self.max_step_ms is None or 0 <= self.max_step_ms <= MOST_MS,
             f"max_step_ms must be a number of milliseconds in [0, {MOST_MS}] (0 turns the step-time budget off; "
             f"unset: automatic), got {self.max_step_ms}"),
            (self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
             f"block_size must be a power of two, got {self.block_size}"),
            (self.max_model_len is None or self.max_model_len >= 2,
             f"max_model_len must be >= 2, got {self.max_model_len}"),
            (self.kv_cache_gib is None or 0 < self.kv_cache_gib and _finite(self.kv_cache_gib),
             f"kv_cache_gib must be > 0 and finite, got {self.kv_cache_gib}"),
            (0 < self.gpu_memory_utilization <= 1,
             f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"),
            (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             f"device must be auto, cpu or cuda[:N], got {self.device!r}"),
            (self.tensor_parallel_size >= 1, f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}"),
            (self.data_parallel_rank >= 0, f"data_parallel_rank must be >= 0, got {self.data_parallel_rank}"),
            (self.distributed_init is None or self.distributed_init.startswith(("env://", "tcp://", "file://")),
             f"distributed_init must be env://, tcp://host:port or file://path, got {self.distributed_init!r}"),
            (self.distributed_init is None or self.tensor_parallel_size > 1,
             "distributed_init names a rendezvous for tensor_parallel_size > 1; set both or neither"),
            (self.stall_factor > 1 and _finite(self.stall_factor),
             f"stall_factor must be > 1 (a step slower than the p99) and finite, got {self.stall_factor}"),
            (0 < self.stall_drop_fraction < 1,
             f"stall_drop_fraction must be in (0, 1), got {self.stall_drop_fraction}"),
            (0 < self.distributed_timeout and _finite(self.distributed_timeout),
             f"distributed_timeout must be > 0 and finite (seconds), got {self.distributed_timeout}"),
            (self.tp_all_reduce in ("auto", "backend"),
             f"tp_all_reduce must be auto or backend, got {self.tp_all_reduce!r}"),
        )
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    def _check_combinations(self) -> None:
        """Flags that each pass but cannot work together, and the values only a parser can check."""
        self.torch_device()  # refuses cuda on a machine without it
        check_read_block(self.read_block)
        switches = self.decode_switches()
        if switches["capture"] and not (switches["buckets"] and switches["persistent"]):
            raise ConfigError("capture_graphs replays fixed shapes from fixed addresses: turn on decode_buckets and "
                              "persistent_inputs too, or use cuda_graphs, which bundles them")
        if switches["capture"] and self.torch_device().type != "cuda":
            raise ConfigError("CUDA-graph capture (capture_graphs / cuda_graphs) needs a CUDA device; turn it off "
                              "here: decode_buckets, persistent_inputs and row_compaction work on the CPU")
        if switches["capture"] and self.tensor_parallel_size > 1:
            raise ConfigError("CUDA-graph capture under tensor parallelism is not built yet; use cuda_graphs with "
                              "tensor_parallel_size 1, or the other decode switches (buckets, persistent inputs, "
                              "compaction), which work per rank")
        if self.streamed_read and self.batch_invariant:
            raise ConfigError(STREAMED_NOT_INVARIANT)
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization {self.quantization!r} is not supported; choose one of "
                              f"{', '.join(QUANTIZATIONS)}")
        self._check_speculative()
        if self.dtype != "auto" and _ALIASES.get(self.dtype, self.dtype) not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not supported; choose auto, {', '.join(DTYPES)}")

    def _check_speculative(self) -> None:
        from nanoserve.speculative.config import SpeculativeConfig

        KVEventsConfig.parse(self.kv_events_config)  # its JSON checked before anything loads
        spec = SpeculativeConfig.parse(self.speculative_config)
        if spec is not None and not self.batch_invariant:
            raise ConfigError("speculative decoding keeps a draft only where it equals the token decoding one at a "
                              "time would pick, which needs a position's logits to be the same bits in any step: "
                              "turn batch_invariant back on, or speculative_config off")

    @classmethod
    def from_flags(cls, **flags) -> EngineConfig:
        """Build from keyword flags, refusing unknown names with the list of known ones. speculative_config may
        be a dict (as vLLM's LLM takes it); it is kept as JSON."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(flags) - known)
        if unknown:
            raise ConfigError(f"unknown engine flag(s) {unknown}; known flags: {sorted(known)}")
        if isinstance(flags.get("speculative_config"), dict):
            flags["speculative_config"] = json.dumps(flags["speculative_config"])
        return cls(**flags)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device {self.device!r} asked for but CUDA is not available; use --device cpu")
        return torch.device(self.device)

    def torch_dtype(self, checkpoint_dtype: str | None) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[_ALIASES.get(self.dtype, self.dtype)]
        if self.torch_device().type == "cpu":
            return torch.float32
        return {"float16": torch.float16}.get(str(checkpoint_dtype), torch.bfloat16)

    def decode_switches(self) -> dict[str, bool]:
        """The decode fast path's switches in force, with the cuda_graphs bundle applied."""
        bundle = self.cuda_graphs
        return {"buckets": self.decode_buckets or bundle, "persistent": self.persistent_inputs or bundle,
                "compaction": self.row_compaction or bundle, "capture": self.capture_graphs or bundle}

    @classmethod
    def flag_specs(cls) -> list[FlagSpec]:
        kinds = {"bool": bool, "int": int, "float": float, "str": str}
        specs = []
        for f in dataclasses.fields(cls):
            base, _, rest = str(f.type).partition(" | ")
            specs.append(FlagSpec(f.name, kinds[base], rest == "None", f.default, f.metadata["help"],
                                  f.metadata["choices"]))
        return specs

    def public(self) -> dict:
        """The flags in force, as published by stats()."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
