"""Compiling structured-output constraints into llguidance matchers, once per distinct constraint.

Why llguidance (`nanoserve bench grammar` puts xgrammar beside it when both are installed): its wheel has no
dependencies (xgrammar's pulls in transformers and triton), it builds its tokenizer straight from the
`tokenizers` JSON this engine already holds (the GGUF one included), it refuses a JSON-schema keyword it cannot
enforce instead of ignoring it, and it takes Lark as well as GBNF. Its mask costs microseconds per row on the
default model's 49k vocabulary, against tens of milliseconds per decode step.

A compiled constraint is kept as a prototype matcher; each sequence gets a deep copy of it (cheap), so a schema
that a hundred requests share is compiled once. `Grammars.compile` is thread-safe: the server calls it off the
event loop before a request reaches the engine, and the engine thread then finds it cached.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from nanoserve.structured.params import StructuredOutputsError, StructuredOutputsParams
from nanoserve.structured.schema import closed

log = logging.getLogger("nanoserve.structured")
CACHE_SIZE = 256  # distinct constraints kept compiled
# Whitespace between JSON tokens, unless the request says otherwise: a line break with up to 32 spaces or tabs
# of indent, or up to 32 of them inline. Enough for pretty-printed JSON; what it rules out are runs of blank
# lines, in which a weak model (or random weights) can spend its whole budget without closing the object.
JSON_WHITESPACE = r"(\r?\n[\x20\x09]{0,32})|([\x20\x09]{1,32})"


@dataclass
class GrammarStats:
    compiles: int = 0  # distinct constraints compiled
    cache_hits: int = 0  # requests that found their constraint compiled
    compile_seconds: float = 0.0
    masked_rows: int = 0  # rows whose logits a grammar masked
    mask_seconds: float = 0.0  # filling and applying those masks

    def as_dict(self) -> dict:
        """The stats snapshot's `structured` section (present once a constraint was compiled)."""
        return {"compiles": self.compiles, "cache_hits": self.cache_hits,
                "compile_ms": round(1000 * self.compile_seconds, 3), "masked_rows": self.masked_rows,
                "mask_ms_per_row": round(1000 * self.mask_seconds / self.masked_rows, 4) if self.masked_rows else 0.0}


class _MatcherState:
    """What a sequence's matcher and its drafted copies share: mask seconds, and the grammar's failure."""

    __slots__ = ("seconds", "failure")

    def __init__(self):
        self.seconds, self.failure = 0.0, None


class Matcher:
    """One sequence's position in its grammar: which tokens may come next, advanced token by token.

    A grammar can compile and still fail while generating (llguidance's per-step limits: a rule with more
    alternatives than a parser row may hold). That failure belongs to this sequence alone: it is recorded here
    (`failure`), never raised into the step, so the engine ends this request and the step's other rows go on."""

    __slots__ = ("inner", "_state")

    def __init__(self, inner, state: _MatcherState | None = None):
        self.inner = inner
        self._state = state if state is not None else _MatcherState()

    @property
    def mask_seconds(self) -> float:
        """Time spent masking logits by this grammar (this sequence's share of each step's mask)."""
        return self._state.seconds

    def spent(self, seconds: float) -> None:
        self._state.seconds += seconds

    @property
    def failure(self) -> str | None:
        """Why this sequence's grammar failed while generating (None while it holds)."""
        return self._state.failure

    def check(self) -> bool:
        """Whether the grammar still holds; records its failure when it does not (after a mask is filled: an
        erring grammar's mask allows end-of-sequence alone, which must not pass for a finished answer)."""
        if self._state.failure is None and self.inner.is_error():
            self._state.failure = _failure_text(self.inner.get_error())
        return self._state.failure is None

    def consume(self, token: int) -> bool:
        """Advance by `token`; False (with `failure` set) when the grammar failed instead of taking it."""
        if not self.check():
            return False
        if self.inner.consume_token(token):
            return True
        self._state.failure = _failure_text(self.inner.get_error()) or f"it refused token {token}"
        return False

    @property
    def finished(self) -> bool:
        """The grammar is complete and nothing may follow (only end-of-sequence)."""
        return self.inner.is_stopped()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar would take from here (its state unchanged)."""
        return self.inner.validate_tokens(list(tokens)) if tokens and self.failure is None else 0

    def after(self, tokens) -> Matcher:
        """A copy of this matcher advanced along `tokens`: a drafted position's state. Should the grammar fail
        on one, the copy stops there and the failure is this sequence's (the state is shared)."""
        copy = Matcher(self.inner.deep_copy(), self._state)
        for token in tokens:
            if not copy.consume(token):
                break
        return copy


FAILURE_CHARS = 300  # of llguidance's message (which goes on to dump its parser state)


def _failure_text(error: str) -> str:
    """llguidance's reason, first line only and bounded: it names the limit the grammar ran into."""
    first = (error or "").strip().splitlines()[0] if (error or "").strip() else ""
    return first[:FAILURE_CHARS]


class CompiledGrammar:
    def __init__(self, prototype):
        self._prototype = prototype

    def matcher(self) -> Matcher:
        return Matcher(self._prototype.deep_copy())


class Grammars:
    """The engine's grammar compiler: the llguidance tokenizer (built on first use) and the compiled cache."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, stats: GrammarStats | None = None):
        """`stats`: the counters to add compiles to (the sampler's masker adds its mask time to the same)."""
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._eos = sorted(eos_token_ids)
        self._lltok = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = stats if stats is not None else GrammarStats()

    @property
    def lltokenizer(self):
        """llguidance's view of the vocabulary (about 0.2 s to build, so only when a constraint first needs it)."""
        with self._lock:
            if self._lltok is None:
                import llguidance

                self._lltok = llguidance.LLTokenizer(self._tokenizer.hf.to_str(), n_vocab=self.vocab_size,
                                                     eos_token=self._eos or None)
            return self._lltok

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The constraint compiled (cached by its canonical text); StructuredOutputsError names a bad one."""
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                return hit
        started = time.perf_counter()
        compiled = CompiledGrammar(self._prototype(spec))
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds += time.perf_counter() - started
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _prototype(self, spec: StructuredOutputsParams):
        import llguidance

        grammar = _grammar_text(spec)
        tokenizer = self.lltokenizer
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if failed:
            raise StructuredOutputsError(f"structured output {spec.kind} is not usable: {_reason(messages[0])}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise StructuredOutputsError(f"structured output {spec.kind} is not usable: {_reason(matcher.get_error())}")
        return matcher


def _grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for one constraint (its JSON-schema, regex, choice and Lark/GBNF front ends)."""
    import llguidance

    try:
        if spec.kind in ("json", "json_object"):
            schema = spec.json if spec.kind == "json" else {"type": "object"}
            if spec.disable_additional_properties:
                schema = closed(schema)
            options = {"whitespace_flexible": not spec.disable_any_whitespace}
            if not spec.disable_any_whitespace:
                options["whitespace_pattern"] = spec.whitespace_pattern or JSON_WHITESPACE
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if spec.kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(list(spec.choice)))
        return llguidance.grammar_from("grammar", spec.grammar)
    except (ValueError, RuntimeError, TypeError) as e:
        raise StructuredOutputsError(f"structured output {spec.kind} is not usable: {_reason(str(e))}") from None


REASON_CHARS = 300  # llguidance's reason, cut: it may quote the grammar or the schema it refused


def _reason(text: str) -> str:
    """llguidance's reason for refusing a constraint, fit for the caller: its first line, cut to REASON_CHARS. A
    panic inside the compiler (with a backtrace) is logged and named as what it is, not repeated."""
    if text.startswith("panic") or "<backtrace>" in text:
        log.warning("the grammar compiler failed: %s", text)
        return "the grammar compiler failed on it (it is too large or too complex); send a smaller constraint"
    line = text.strip().split("\n", 1)[0]
    return line if len(line) <= REASON_CHARS else line[:REASON_CHARS] + "..."
