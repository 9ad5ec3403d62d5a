"""A `tokenizers.Tokenizer` rebuilt from a GGUF file's `tokenizer.ggml.*` metadata."""

from __future__ import annotations

import warnings
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from nanoserve.errors import CheckpointError

__all__ = ["build_tokenizer", "special_token"]

_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> split regex, as transformers' GGUF tokenizer conversion maps them. Any other value
# gets the GPT-2 regex of the ByteLevel pre-tokenizer.
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}
# llama.cpp's LLAMA3 pre-tokenizer family: a word that is itself a token is taken whole, skipping the merges
# (the Llama 3 tokenizer.json's `ignore_merges`), and BOS is added unless the file says otherwise.
_LLAMA3_FAMILY = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"}
# Values known to want the GPT-2 regex itself (byte-level vocabularies without multi-digit merges split
# digits alike with or without llama.cpp's extra `\p{N}` rule, so starcoder/smollm belong here too).
_KNOWN_GPT2_REGEX = {"default", "gpt2", "smollm", "starcoder", "refact", "olmo", "mpt"}
_SUPPORTED_TOKENIZERS = "'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE)"


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte, the alphabet byte-level BPE vocabularies are written in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


def _merge_pairs(merges: list[str], path: Path) -> list[tuple[str, str]]:
    pairs = []
    for m in merges:
        cut = m.find(" ", 1)  # llama.cpp splits at the first space after the first character
        if cut < 0:
            raise CheckpointError(f"{path} has a malformed tokenizer merge {m!r}; the tokenizer metadata is corrupt")
        pairs.append((m[:cut], m[cut + 1:]))
    return pairs


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a token into two tokens, best score
    first (transformers' `generate_merges`, so both tokenize alike)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, score in dict(zip(tokens, scores, strict=True)).items():
        local = [(token[:k], token[k:], score) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        found.extend(local)
    found.sort(key=lambda x: (x[2], len(x[0]), len(x[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _bpe(vocab: dict[str, int], merges: list[tuple[str, str]], path: Path, **kwargs) -> models.BPE:
    try:
        return models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                          end_of_word_suffix="", **kwargs)
    except Exception as e:  # tokenizers raises a bare Exception for merges naming unknown tokens
        raise CheckpointError(f"{path} has inconsistent tokenizer metadata ({e}); the file is corrupt") from None


def _byte_level_tokenizer(meta: dict, tokens: list[str], types: list[int], path: Path) -> Tokenizer:
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # Tokens outside the byte alphabet (rare mislabels) are respelled byte by byte, as transformers does.
    vocab = {t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    merges = _merge_pairs(meta.get("tokenizer.ggml.merges") or [], path)
    tok = Tokenizer(_bpe(vocab, merges, path, fuse_unk=False, byte_fallback=False,
                         ignore_merges=pre in _LLAMA3_FAMILY))
    if pre in _PRE_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        if pre not in _KNOWN_GPT2_REGEX:
            warnings.warn(f"{path}: no pre-tokenizer rule for tokenizer.ggml.pre={pre!r}; using GPT-2's split "
                          "regex, so tokenization may differ from llama.cpp's", stacklevel=3)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # Control tokens outside the byte alphabet are llama.cpp mislabels; adding them would grow the vocab.
    control = [t for t, k in zip(tokens, types, strict=True) if k == _CONTROL and t and set(t) <= spelled]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    user = [t for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED and t in vocab]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tok


def _sentencepiece_tokenizer(meta: dict, tokens: list[str], types: list[int], path: Path) -> Tokenizer:
    """A SentencePiece BPE vocabulary (Llama 1/2, Mistral) as a byte-fallback BPE, like transformers builds."""
    if "tokenizer.ggml.merges" in meta:
        merges = _merge_pairs(meta["tokenizer.ggml.merges"], path)
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if not scores or len(scores) != len(tokens):
            raise CheckpointError(
                f"{path} has a SentencePiece vocabulary with neither merges nor one score per token; the "
                "tokenizer metadata is incomplete, re-convert the model with llama.cpp"
            )
        merges = _merges_from_scores(tokens, scores)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(_bpe(vocab, merges, path, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                 split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + [decoders.Strip(content=" ", left=1, right=0)] if prefix else steps)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types, strict=True) if k == _CONTROL and t])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED and t])
    return tok


def build_tokenizer(meta: dict, path: Path) -> tuple[Tokenizer, bool]:
    """The tokenizer and whether BOS is prepended (llama.cpp's default when the file does not say)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind not in ("gpt2", "llama") or not tokens:
        what = f"tokenizer model {kind!r}" if tokens else "no tokenizer vocabulary"
        raise CheckpointError(
            f"{path} has {what}; supported GGUF tokenizers: {_SUPPORTED_TOKENIZERS}. Use the Hugging Face "
            "checkpoint directory (with tokenizer.json) of this model instead"
        )
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(
            f"{path} has {len(tokens)} tokens but {len(types)} token types; the tokenizer metadata is corrupt, "
            "download or convert the file again"
        )
    if kind == "gpt2":
        tok = _byte_level_tokenizer(meta, tokens, types, path)
        default_bos = meta.get("tokenizer.ggml.pre") in _LLAMA3_FAMILY
    else:
        tok = _sentencepiece_tokenizer(meta, tokens, types, path)
        default_bos = True
    return tok, bool(meta.get("tokenizer.ggml.add_bos_token", default_bos))


def special_token(meta: dict, key: str) -> str | None:
    """The text of the token whose id the metadata `key` gives (e.g. the BOS token), if any."""
    tokens, idx = meta.get("tokenizer.ggml.tokens") or [], meta.get(key)
    return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None
