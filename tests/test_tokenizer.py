"""Tokenizer, chat templates, streaming detokenization and stop strings, checked against transformers."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from nanoserve.errors import CheckpointError, RequestError
from nanoserve.streaming import IncrementalDetokenizer, StopStringMatcher
from nanoserve.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TRICKY = [
    "Hello, world!",
    "",
    " leading space",
    "trailing space ",
    "multiple   spaces\tand\ttabs",
    "line one\nline two\n\n\nthree blank\r\nwindows",
    "emoji 😀 family 👨‍👩‍👧‍👦 flag 🇫🇷 skin 👍🏽",
    "CJK 你好，世界。日本語のテキスト 한국어",
    "combining e\u0301 a\u0308 and zalgo z\u0336\u0317a\u0337\u0325",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "not special <|im_start  |> <im_end> <|imend|>",
    "Ünïcödé ßtraße café naïve",
    "numbers 1234567890 3.14159 1e-9",
    "mixed: résumé 😀中文 end",
    "\u200bzero\u200dwidth\ufeff",
    "   ",
    "\n",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Be nice."},
        {"role": "user", "content": "Hello 😀"},
        {"role": "assistant", "content": "Hi! 你好"},
        {"role": "user", "content": "Tell me a joke.\nA short one."},
    ],
    [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "second"},
        {"role": "user", "content": "  third with spaces  "},
    ],
]

# Exercises trim_blocks/lstrip_blocks, loop controls, tojson (indent, non-ASCII, HTML characters),
# raise_exception, {% generation %}, namespace, extra kwargs and the special-token variables.
CUSTOM_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(turns=0) %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'system' and not loop.first %}
        {% continue %}
    {% endif %}
    {% if max_turns is defined and ns.turns >= max_turns %}
        {% break %}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
<|{{ message['role'] }}|>
    {% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] | trim }}{% endgeneration %}{{ eos_token }}
    {% else %}
{{ message['content'] | trim }}
    {% endif %}
    {% if message.tool_calls is defined %}
{{ message.tool_calls | tojson(indent=2) }}
    {% endif %}
{% endfor %}
{% if tools %}
Tools: {{ tools | tojson }}
{% endif %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""

TOOLS = [{"name": "lookup", "description": "Cherche <b>café</b> & 😀", "parameters": {"q": {"type": "string"}}}]


def _hf_chat(hf_tok, messages, **kwargs):
    return hf_tok.apply_chat_template(messages, tokenize=False, **kwargs)


def _hf_chat_ids(hf_tok, messages, **kwargs):
    return list(hf_tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


# -- fixtures -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_smol(hf_tokenizer_dir):
    return transformers.AutoTokenizer.from_pretrained(str(hf_tokenizer_dir))


@pytest.fixture(scope="module")
def smol(hf_tokenizer_dir):
    return Tokenizer.from_dir(hf_tokenizer_dir)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A small SentencePiece-style tokenizer (Metaspace, byte fallback, leading-space stripping), as transformers'
    LlamaTokenizer builds it, trained here so the test needs no download."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    corpus = [
        "Hello world, this is a small corpus for a tiny tokenizer.",
        "The quick brown fox jumps over the lazy dog.",
        "def main():\n    return 42\n",
        "Привет мир",
        "日本語のテキスト",
    ] * 10
    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    raw.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=700, special_tokens=specials, show_progress=False))
    model = json.loads(raw.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    out = tmp_path_factory.mktemp("llama-tokenizer")
    transformers.LlamaTokenizer(vocab=model["vocab"], merges=merges).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def hf_llama(llama_dir):
    return transformers.AutoTokenizer.from_pretrained(str(llama_dir))


@pytest.fixture(scope="module")
def llama(llama_dir):
    return Tokenizer.from_dir(llama_dir)


def _variant(tmp_path, src, *, config_update=None, drop=(), files=None):
    """Copy a tokenizer directory, editing tokenizer_config.json and adding or removing files."""
    dst = tmp_path / "variant"
    shutil.copytree(src, dst)
    for name in drop:
        (dst / name).unlink()
    if config_update is not None:
        cfg_path = dst / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.update(config_update)
        cfg_path.write_text(json.dumps(cfg))
    for name, content in (files or {}).items():
        (dst / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return dst


# -- encode / decode ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TRICKY)
def test_encode_decode_match_transformers(smol, hf_smol, llama, hf_llama, text):
    for ours, ref in ((smol, hf_smol), (llama, hf_llama)):
        assert ours.encode(text) == ref(text)["input_ids"]
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == ref(text, add_special_tokens=False)["input_ids"]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_special_tokens_are_single_ids(smol, hf_smol):
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == smol.bos_token_id == hf_smol.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == smol.eos_token_id == hf_smol.eos_token_id
    assert smol.decode(ids) == "user\nhi"


def test_random_ids_decode_like_transformers(smol, hf_smol):
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(smol.vocab_size) for _ in range(rng.randrange(1, 20))]
        for skip in (True, False):
            assert smol.decode(ids, skip_special_tokens=skip) == hf_smol.decode(ids, skip_special_tokens=skip)


def test_properties(smol, hf_smol):
    assert smol.vocab_size == len(hf_smol)
    assert smol.bos_token_id == hf_smol.bos_token_id
    assert smol.eos_token_id == hf_smol.eos_token_id
    assert smol.eos_token_ids == frozenset({hf_smol.eos_token_id})
    assert smol.chat_template == hf_smol.chat_template


def test_bos_eos_flags_match_transformers(tmp_path, hf_tokenizer_dir, llama_dir):
    # With tokenizer.json present, its post-processor decides; transformers ignores these flags, and so do we.
    for i, src in enumerate((hf_tokenizer_dir, llama_dir)):
        d = _variant(tmp_path / str(i), src, config_update={"add_bos_token": True, "add_eos_token": True})
        ours, ref = Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(str(d))
        for text in ("Hello world", "<s>hi", "<|im_start|>already there", ""):
            assert ours.encode(text) == ref(text)["input_ids"], (src, text)
            assert ours.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]


def test_bos_added_by_post_processor_is_not_doubled(tmp_path, hf_tokenizer_dir):
    tok_json = json.loads((hf_tokenizer_dir / "tokenizer.json").read_text())
    tok_json["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }
    d = _variant(tmp_path, hf_tokenizer_dir, files={"tokenizer.json": tok_json})
    ref = transformers.AutoTokenizer.from_pretrained(str(d))
    from_dir = Tokenizer.from_dir(d)
    explicit = Tokenizer(from_dir.hf, chat_template=None, bos_token="<|im_start|>", eos_token="<|im_end|>",
                         add_bos_token=True)
    for ours in (from_dir, explicit):
        assert ours.encode("hi") == ref("hi")["input_ids"] == [1, *ref("hi", add_special_tokens=False)["input_ids"]]


def test_explicit_add_bos_token_prepends_once(smol):
    tok = Tokenizer(smol.hf, chat_template=None, bos_token="<|im_start|>", eos_token="<|im_end|>", add_bos_token=True)
    assert tok.encode("hi") == [1, *smol.encode("hi")]
    assert tok.encode("hi", add_special_tokens=False) == smol.encode("hi")


# -- checkpoint metadata ----------------------------------------------------------------------------------------


def test_from_dir_reads_config_template_dict_tokens_and_generation_eos(tmp_path, hf_tokenizer_dir):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    d = _variant(
        tmp_path, hf_tokenizer_dir, drop=["chat_template.jinja"],
        config_update={
            "chat_template": template,
            "bos_token": {"__type": "AddedToken", "content": "<|im_start|>", "lstrip": False, "normalized": False,
                          "rstrip": False, "single_word": False, "special": True},
            "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        },
        files={"generation_config.json": {"eos_token_id": [2, 0]}},
    )
    ours, ref = Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(str(d))
    assert ours.chat_template == ref.chat_template == template
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert ours.eos_token_ids == frozenset({0, 2})
    msgs = CONVERSATIONS[2]
    assert ours.apply_chat_template(msgs) == _hf_chat(ref, msgs, add_generation_prompt=True)


def test_chat_template_file_precedence(tmp_path, hf_tokenizer_dir):
    d = _variant(tmp_path / "json", hf_tokenizer_dir, drop=["chat_template.jinja"],
                 config_update={"chat_template": "from config"}, files={"chat_template.json": {"chat_template": "J"}})
    assert Tokenizer.from_dir(d).chat_template == "J"
    d = _variant(tmp_path / "jinja", hf_tokenizer_dir, config_update={"chat_template": "from config"})
    ours, ref = Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(str(d))
    assert ours.chat_template == ref.chat_template == (hf_tokenizer_dir / "chat_template.jinja").read_text()


def test_generation_config_single_eos_id(tmp_path, hf_tokenizer_dir):
    d = _variant(tmp_path, hf_tokenizer_dir, files={"generation_config.json": {"eos_token_id": 0}})
    assert Tokenizer.from_dir(d).eos_token_ids == frozenset({0, 2})


# -- chat templates ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(smol, hf_smol, conversation, add_generation_prompt):
    text = smol.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert text == _hf_chat(hf_smol, conversation, add_generation_prompt=add_generation_prompt)
    ids = smol.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == _hf_chat_ids(hf_smol, conversation, add_generation_prompt=add_generation_prompt)


def test_chat_template_defaults_to_generation_prompt(smol):
    assert smol.apply_chat_template(CONVERSATIONS[0]).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("kwargs", [{}, {"tools": TOOLS}, {"max_turns": 2}])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_custom_template_matches_transformers(smol, hf_smol, kwargs, add_generation_prompt):
    ours = Tokenizer(smol.hf, chat_template=CUSTOM_TEMPLATE, bos_token=smol.bos_token, eos_token=smol.eos_token)
    conversation = [
        *CONVERSATIONS[2],
        {"role": "system", "content": "late system message, skipped by `continue`"},
        {"role": "assistant", "content": "  calling  ", "tool_calls": [{"name": "lookup", "arguments": {"q": "ü"}}]},
    ]
    expected = _hf_chat(hf_smol, conversation, chat_template=CUSTOM_TEMPLATE,
                        add_generation_prompt=add_generation_prompt, **kwargs)
    assert ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, **kwargs) == expected
    if kwargs.get("tools"):
        assert "<b>café</b> & 😀" in expected  # tojson keeps non-ASCII and HTML characters as they are
    ids = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs)
    assert ids == _hf_chat_ids(hf_smol, conversation, chat_template=CUSTOM_TEMPLATE,
                               add_generation_prompt=add_generation_prompt, **kwargs)


def test_custom_template_raise_exception(smol, hf_smol):
    ours = Tokenizer(smol.hf, chat_template=CUSTOM_TEMPLATE, bos_token=smol.bos_token, eos_token=smol.eos_token)
    conversation = [{"role": "tool", "content": "42"}]
    with pytest.raises(Exception, match="Unknown role: tool"):
        _hf_chat(hf_smol, conversation, chat_template=CUSTOM_TEMPLATE)
    with pytest.raises(RequestError, match="Unknown role: tool"):
        ours.apply_chat_template(conversation)


def test_strftime_now_and_unset_tokens(smol, hf_smol):
    template = "{{ strftime_now('%Y-%m') }}|{{ bos_token is defined }}|{{ tools is none }}"
    ours = Tokenizer(smol.hf, chat_template=template, bos_token=None, eos_token=None)
    rendered = ours.apply_chat_template(CONVERSATIONS[0])
    assert rendered.endswith("|False|True")
    assert rendered.split("|")[0] == _hf_chat(hf_smol, CONVERSATIONS[0], chat_template=template).split("|")[0]


def test_named_templates_pick_default_or_tool_use(smol):
    tok = Tokenizer(smol.hf, chat_template={"default": "D", "tool_use": "T{{ tools | length }}"}, bos_token=None,
                    eos_token=None)
    assert tok.chat_template == "D"
    assert tok.apply_chat_template(CONVERSATIONS[0]) == "D"
    assert tok.apply_chat_template(CONVERSATIONS[0], tools=TOOLS) == f"T{len(TOOLS)}"


def test_a_template_variable_the_template_never_reads_is_refused(smol):
    with pytest.raises(RequestError, match="does not use enable_thinkng"):
        smol.apply_chat_template(CONVERSATIONS[0], enable_thinkng=True)
    with pytest.raises(RequestError, match="does not use tools"):
        smol.apply_chat_template(CONVERSATIONS[0], chat_template="{{ messages[0].content }}", tools=TOOLS)


# -- clear errors ----------------------------------------------------------------------------------------------


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(CheckpointError) as err:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(err.value)
    assert "save_pretrained" in str(err.value)


def test_no_chat_template(llama):
    assert llama.chat_template is None
    with pytest.raises(RequestError, match="no chat template.*plain text prompt"):
        llama.apply_chat_template(CONVERSATIONS[0])


@pytest.mark.parametrize(
    ("messages", "pattern"),
    [
        ("hello", "must be a list"),
        ({"role": "user", "content": "hi"}, "must be a list"),
        ([], "empty"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"content": "hi"}], r"messages\[0\]\['role'\] must be a string, but it is missing"),
        ([{"role": "user", "content": "ok"}, {"role": "user", "content": 5}],
         r"messages\[1\]\['content'\] must be a string, but it is a int"),
        ([{"role": None, "content": "x"}], r"messages\[0\]\['role'\] must be a string"),
    ],
)
def test_malformed_messages(smol, messages, pattern):
    with pytest.raises(RequestError, match=pattern):
        smol.apply_chat_template(messages)


# -- incremental detokenizer ----------------------------------------------------------------------------------

STREAM_TEXTS = [*TRICKY, "😀😀😀 🎉🎊 🦄🐉 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𠜎𠜱", "混合 mixed テキスト with ünïcödé and 🧑‍💻 code()",
                " ".join(["word"] * 50) + " 结束"]


class _CountingHF:
    """Wraps a tokenizers.Tokenizer and counts the ids decoded, to check the work per token stays constant."""

    def __init__(self, hf):
        self._hf, self.decoded = hf, 0

    def __getattr__(self, name):
        return getattr(self._hf, name)

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)


def _stream(tok, ids, chunks=None, skip_special_tokens=True):
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    deltas, i = [], 0
    while i < len(ids):
        n = 1 if chunks is None else chunks.randrange(1, 5)
        deltas.append(det.feed(ids[i : i + n] if n > 1 else ids[i]))
        i += n
    return deltas, det.flush()


def test_stream_texts_have_chars_split_across_tokens(smol, llama):
    # Guard the next test's premise: some characters really are split across tokens in both tokenizers.
    for tok in (smol, llama):
        ids = tok.encode(STREAM_TEXTS[-3], add_special_tokens=False)
        assert any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_detokenizer_streams_whole_characters(smol, llama, text):
    for tok in (smol, llama):
        ids = tok.encode(text)
        deltas, tail = _stream(tok, ids)
        assert not any("\ufffd" in d for d in deltas), deltas
        assert "".join(deltas) + tail == tok.decode(ids)
        deltas, tail = _stream(tok, ids, chunks=random.Random(len(text)))
        assert "".join(deltas) + tail == tok.decode(ids)


def test_detokenizer_keeps_special_tokens_when_asked(smol):
    ids = smol.apply_chat_template(CONVERSATIONS[2], tokenize=True)
    for skip in (True, False):
        deltas, tail = _stream(smol, ids, skip_special_tokens=skip)
        assert "".join(deltas) + tail == smol.decode(ids, skip_special_tokens=skip)
    assert "<|im_start|>" in "".join(_stream(smol, ids, skip_special_tokens=False)[0])


@pytest.mark.parametrize("which", ["smol", "llama"])
def test_detokenizer_random_ids(request, which):
    tok = request.getfixturevalue(which)
    rng = random.Random(1234)
    vocab = list(range(tok.vocab_size))
    # Bias towards tokens that are fragments of characters, to create incomplete and invalid UTF-8.
    fragments = [i for i in vocab if "\ufffd" in tok.decode([i])]
    specials = sorted(tok.special_token_ids)
    assert fragments and specials
    for trial in range(300):
        pool = fragments if trial % 2 else vocab
        ids = [rng.choice(pool if rng.random() < 0.7 else specials if rng.random() < 0.2 else vocab)
               for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            for chunks in (None, rng):
                deltas, tail = _stream(tok, ids, chunks=chunks, skip_special_tokens=skip)
                assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize("which", ["smol", "llama"])
@pytest.mark.parametrize(
    "make_ids",
    [
        lambda tok: tok.encode(" ".join(f"word{i} 😀 中文" for i in range(300))),
        lambda tok: tok.encode("\ufffd" * 300),  # the model writing U+FFFD itself
        lambda tok: [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])][:1] * 300,  # invalid UTF-8
    ],
    ids=["long-text", "replacement-chars", "invalid-bytes"],
)
def test_detokenizer_work_per_token_is_constant(request, which, make_ids):
    tok = request.getfixturevalue(which)
    ids = make_ids(tok)
    counting = _CountingHF(tok.hf)
    spy = Tokenizer(counting, chat_template=None, bos_token=None, eos_token=None)
    deltas, tail = _stream(spy, ids)
    assert "".join(deltas) + tail == tok.decode(ids)
    assert counting.decoded <= 16 * len(ids), counting.decoded / len(ids)


def test_detokenizer_leading_space_of_sentencepiece_words(llama):
    text = "Hello  world  again, a b c d e"
    ids = llama.encode(text, add_special_tokens=False)
    pieces = [llama.hf.id_to_token(i) for i in ids]
    assert pieces[0].startswith("▁") and any(p.startswith("▁") for p in pieces[1:])
    deltas, tail = _stream(llama, ids)
    # One delta per piece: like decode(), only the very first piece loses its leading space.
    assert deltas == [pieces[0][1:].replace("▁", " ")] + [p.replace("▁", " ") for p in pieces[1:]]
    assert "".join(deltas) + tail == text


# -- stop strings -----------------------------------------------------------------------------------------------


def _feed_all(matcher, deltas):
    out = [matcher.feed(d) for d in deltas]
    return out, matcher.flush()


def test_stop_spanning_deltas_is_cut():
    m = StopStringMatcher(["STOP"])
    assert m.feed("Hello S") == ("Hello ", None)
    assert m.feed("TO") == ("", None)
    assert m.feed("P and more") == ("", "STOP")
    assert m.matched == "STOP"
    assert m.feed("ignored") == ("", "STOP")
    assert m.flush() == ""


def test_held_text_is_released_when_not_a_stop():
    m = StopStringMatcher(["STOP", "\n\nUser:"])
    assert m.feed("abc ST") == ("abc ", None)
    assert m.feed("OX\n") == ("STOX", None)
    assert m.feed("\nUs") == ("", None)
    assert m.feed("e") == ("", None)
    assert m.feed("d") == ("\n\nUsed", None)
    assert m.feed("end\n") == ("end", None)
    assert m.flush() == "\n"
    assert m.matched is None


def test_text_before_stop_is_emitted_exactly():
    out, tail = _feed_all(StopStringMatcher(["</answer>"]), ["The answer is 42.</ans", "wer> trailing"])
    assert "".join(text for text, _ in out) + tail == "The answer is 42."
    assert out[-1][1] == "</answer>"


def test_earliest_stop_wins():
    assert StopStringMatcher(["world", "o w"]).feed("hello world") == ("hell", "o w")
    assert StopStringMatcher(["lo", "hello"]).feed("hello") == ("", "hello")  # same end: the longer one
    m = StopStringMatcher(["abcd", "bc"])  # "bc" completes before "abcd" could, however the text is split
    assert m.feed("abcd") == ("a", "bc")


def test_no_stops_passes_text_through():
    m = StopStringMatcher()
    assert m.feed("anything") == ("anything", None)
    assert m.flush() == ""


def test_empty_stop_string_is_refused():
    with pytest.raises(RequestError, match="non-empty"):
        StopStringMatcher(["ok", ""])


def _reference_stop(text, stops):
    """Brute force: scan the text; the first position where some stop string ends decides."""
    for end in range(1, len(text) + 1):
        found = [s for s in stops if text[:end].endswith(s)]
        if found:
            stop = max(found, key=len)
            return text[: end - len(stop)], stop
    return text, None


def test_stop_matcher_random_splits_match_brute_force():
    rng = random.Random(7)
    for _ in range(500):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(1, 4))]
        text = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 20)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randrange(0, 6))))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        out, tail = _feed_all(StopStringMatcher(stops), deltas)
        matched = next((m for _, m in out if m), None)
        assert ("".join(t for t, _ in out) + tail, matched) == _reference_stop(text, stops), (stops, deltas)
