"""The offline API as vLLM scripts use it: prompt forms, n, logprob shapes, token controls, tqdm, the tokenizer."""

from __future__ import annotations

import pytest

from nanoserve import LLM, EngineConfig, SamplingParams
from nanoserve.engine import Engine
from nanoserve.errors import RequestError

GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=str(tiny_checkpoint("llama")), max_model_len=256, kv_cache_gib=0.02)


def run(llm, prompts, **kw):
    return llm.generate(prompts, SamplingParams(**{**GREEDY, **kw}), use_tqdm=False)


def texts(outs):
    return [o.outputs[0].text for o in outs]


# ---- prompt forms ---------------------------------------------------------------------------------------

def test_tokens_prompt_dict_is_the_token_ids_not_the_key(llm):
    ids = llm.get_tokenizer().encode("Once upon a time")
    [out] = run(llm, {"prompt_token_ids": ids})
    assert out.prompt_token_ids == tuple(ids)
    assert texts([out]) == texts(run(llm, [ids]))


def test_text_prompt_dict_with_empty_multimodal_is_one_request(llm):
    outs = run(llm, {"prompt": "hi", "multi_modal_data": None})
    assert len(outs) == 1 and outs[0].prompt == "hi"
    assert texts(outs) == texts(run(llm, "hi"))


def test_a_list_mixing_every_form_keeps_prompt_order(llm):
    ids = llm.get_tokenizer().encode("the cat")
    mixed = run(llm, ["hello", ids, {"prompt": "a dog"}, {"prompt_token_ids": ids}])
    assert [o.prompt_token_ids for o in mixed] == [tuple(llm.get_tokenizer().encode(p)) for p in
                                                   ("hello", "the cat", "a dog", "the cat")]
    assert texts(mixed) == texts(run(llm, ["hello", "the cat", "a dog", "the cat"]))
    assert texts(run(llm, [{"prompt": "hi"}])) == texts(run(llm, ["hi"]))


@pytest.mark.parametrize("prompt,needle", [
    ({"prompt": "hi", "multi_modal_data": {"image": object()}}, "text only"),
    ({"prompt": "hi", "suffix": "x"}, "unknown keys"),
    ({"prompt_token_ids": "1 2 3"}, "list of ints"),
    ({"prompt_token_ids": [1, True]}, "list of ints"),
    ([{"text": "hi"}], "unknown keys"),
    (3.5, "prompts must be"),
])
def test_malformed_prompt_forms_are_refused(llm, prompt, needle):
    with pytest.raises(RequestError, match=needle):
        run(llm, prompt)
    assert not llm.engine.has_unfinished()


def test_one_sampling_params_or_one_per_prompt(llm):
    outs = llm.generate(["a", "b"], [SamplingParams(**GREEDY), SamplingParams(**{**GREEDY, "max_tokens": 3})],
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 3]
    with pytest.raises(RequestError, match="2 prompts but 3 sampling params"):
        llm.generate(["a", "b"], [SamplingParams()] * 3, use_tqdm=False)


# ---- n completions --------------------------------------------------------------------------------------

def test_n_with_a_seed_gives_distinct_reproducible_completions(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    [out] = llm.generate("Once upon a time", params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    got = [c.text for c in out.outputs]
    assert len(set(got)) == 3
    [again] = llm.generate("Once upon a time", params, use_tqdm=False)
    assert [c.text for c in again.outputs] == got
    # completion i is the solo request with seed + i (vLLM's rule), whoever else shares the batch
    for i in range(3):
        solo = SamplingParams(temperature=1.0, seed=7 + i, max_tokens=12, ignore_eos=True)
        assert llm.generate("Once upon a time", solo, use_tqdm=False)[0].outputs[0].text == got[i]
    assert out.usage["completion_tokens"] == 36 and out.usage["prompt_tokens"] == len(out.prompt_token_ids)
    llm.engine.audit()


def test_n_abort_ends_every_completion_and_frees_their_blocks(llm):
    engine = llm.engine
    rid = engine.add_request("a b c", SamplingParams(n=4, max_tokens=50, ignore_eos=True))
    engine.step()
    assert len(engine.sequences(rid)) == 4 and engine.kv.num_used > 0
    engine.abort(rid)
    outs = engine.step()
    assert sorted(o.outputs[0].index for o in outs) == [0, 1, 2, 3]
    assert [o.finished for o in outs] == [False, False, False, True]
    assert all(o.outputs[0].finish_reason == "abort" for o in outs)
    assert engine.kv.num_used == 0 and not engine.has_unfinished()
    engine.audit()


# ---- ends of text ---------------------------------------------------------------------------------------

def test_finishing_on_a_stop_token_id_flushes_held_back_text(llm):
    """A stop string prefix held back when a stop token id ends the text is still owed to the client."""
    plain = run(llm, "The capital of France is", max_tokens=12)[0].outputs[0]
    tok = llm.get_tokenizer()
    ids = list(plain.token_ids)
    k = next(k for k in range(4, 12) if ids[k] not in ids[:k] and tok.decode(ids[2:k]).strip())
    held = tok.decode(ids[:k])[len(tok.decode(ids[:2])):]  # text of tokens 2..k-1, which a stop string starts with
    out = run(llm, "The capital of France is", max_tokens=12, stop=[held + "\x00never"],
              stop_token_ids=[ids[k]])[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == ids[k]
    assert out.text == tok.decode(ids[:k]) and out.token_ids == tuple(ids[: k + 1])


def _first_match_ending_after(text: str, stop: str, after: int) -> int | None:
    """Where the first occurrence of `stop` that ends past `after` characters begins."""
    return next((i for i in range(len(text)) if text.startswith(stop, i) and i + len(stop) > after), None)


def test_stop_strings_wait_for_min_tokens(llm):
    plain = run(llm, "The capital of France is", max_tokens=24)[0].outputs[0]
    tok = llm.get_tokenizer()
    unarmed = len(tok.decode(plain.token_ids[:5]))  # min_tokens=6: the 6th token's text is the first checked
    # a stop string in the very first token's text that occurs again in text the 6th token or a later one ends
    stops = [c for c in dict.fromkeys(tok.decode(plain.token_ids[:1]).strip())
             if _first_match_ending_after(plain.text, c, unarmed) is not None]
    if not stops:
        pytest.fail(f"no character of the first token recurs after the 5th in {plain.text!r}; choose another prompt")
    stop = stops[0]
    early = run(llm, "The capital of France is", max_tokens=24, stop=[stop])[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) == 1
    late = run(llm, "The capital of France is", max_tokens=24, stop=[stop], min_tokens=6)[0].outputs[0]
    assert late.finish_reason == "stop" and late.stop_reason == stop and len(late.token_ids) >= 6
    assert late.text == plain.text[: _first_match_ending_after(plain.text, stop, unarmed)]


def test_reused_request_id_under_row_compaction_reads_its_own_blocks(tiny_checkpoint):
    """A finished request's id, reused while its old table row is still placed, must not inherit that row."""
    path = str(tiny_checkpoint("llama"))
    reference = Engine(EngineConfig(model=path, max_model_len=256, kv_cache_gib=0.02))
    engine = Engine(EngineConfig(model=path, max_model_len=256, kv_cache_gib=0.02, row_compaction=True))
    params = SamplingParams(**{**GREEDY, "max_tokens": 40})

    def solo(prompt):
        rid = reference.add_request(prompt, params)
        while reference.has_unfinished():
            for out in reference.step():
                if out.finished and out.request_id == rid:
                    final = out
        return final.outputs[0].text

    engine.add_request("a b c d e f g h i j", SamplingParams(**{**GREEDY, "max_tokens": 4}), request_id="x")
    engine.add_request("keep decoding", params, request_id="y")
    finals = {}
    while "x" not in finals:
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    engine.add_request("an entirely different prompt", params, request_id="x")
    finals.clear()
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["x"].outputs[0].text == solo("an entirely different prompt")
    assert finals["y"].outputs[0].text == solo("keep decoding")


# ---- token controls -------------------------------------------------------------------------------------

def test_logit_bias_allowed_token_ids_and_bad_words_change_the_pick(llm):
    plain = run(llm, "Once upon a time")[0].outputs[0].token_ids
    forced = run(llm, "Once upon a time", logit_bias={"42": 100})[0].outputs[0].token_ids
    assert set(forced) == {42}
    allowed = run(llm, "Once upon a time", allowed_token_ids=[7, 9, 11])[0].outputs[0].token_ids
    assert set(allowed) <= {7, 9, 11}
    tok = llm.get_tokenizer()
    word = tok.decode([plain[0]])
    banned = run(llm, "Once upon a time", bad_words=[word.strip()])[0].outputs[0].token_ids
    assert plain[0] not in banned
    # a two-token bad word: its second token is banned only right after its first
    def spelled_as(a, b):
        word = tok.decode([a, b]).strip()
        forms = {tuple(tok.encode(f, add_special_tokens=False)) for f in (word, " " + word)}
        return word if (a, b) in forms else None

    pairs = [(j, spelled_as(plain[j], plain[j + 1])) for j in range(len(plain) - 1)]
    j, word = next((j, w) for j, w in pairs if w)
    j = next(i for i in range(len(plain) - 1) if plain[i:i + 2] == plain[j:j + 2])  # its first occurrence
    two = run(llm, "Once upon a time", bad_words=[word])[0].outputs[0].token_ids
    assert two[: j + 1] == plain[: j + 1] and two[j + 1] != plain[j + 1]


def test_token_controls_refuse_ids_outside_the_vocabulary(llm):
    for kw in ({"logit_bias": {10**7: 1.0}}, {"allowed_token_ids": [10**7]}):
        with pytest.raises(RequestError, match="outside this model's vocabulary"):
            run(llm, "hi", **kw)
    with pytest.raises(RequestError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={1: 101})
    with pytest.raises(RequestError, match="no token could be sampled"):
        SamplingParams(allowed_token_ids=[])


def test_detokenize_false_gives_ids_without_text(llm):
    with_text = run(llm, "Once upon a time")[0].outputs[0]
    ids_only = run(llm, "Once upon a time", detokenize=False)[0].outputs[0]
    assert ids_only.token_ids == with_text.token_ids and ids_only.text == "" and with_text.text
    with pytest.raises(RequestError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["x"])


def test_prompt_logprobs_do_not_depend_on_chunking(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    prompt = "one two three four five six seven eight nine ten eleven twelve"
    params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    whole = LLM(model=path, max_model_len=256, kv_cache_gib=0.02, batch_invariant=True).generate(
        prompt, params, use_tqdm=False)[0]
    chunked = LLM(model=path, max_model_len=256, kv_cache_gib=0.02, max_num_batched_tokens=5, batch_invariant=True,
                  max_num_seqs=4).generate(prompt, params, use_tqdm=False)[0]
    assert len(whole.prompt_logprobs) == len(whole.prompt_token_ids) > 10
    assert whole.prompt_logprobs[0] is None and chunked.prompt_logprobs[0] is None
    for a, b in zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in a)


# ---- the progress bar, the tokenizer, chat --------------------------------------------------------------

def test_use_tqdm_shows_a_bar_and_false_hides_it(llm, capfd):
    llm.generate(["a", "b"], SamplingParams(**GREEDY))
    assert "Processed prompts" in capfd.readouterr().err
    llm.generate(["a", "b"], SamplingParams(**GREEDY), use_tqdm=False)
    assert "Processed prompts" not in capfd.readouterr().err


def test_get_tokenizer_answers_like_transformers(llm, tiny_checkpoint):
    from transformers import AutoTokenizer

    ours, theirs = llm.get_tokenizer(), AutoTokenizer.from_pretrained(str(tiny_checkpoint("llama")))
    text = "Hello, world! Ça va?"
    assert ours.encode(text) == theirs.encode(text)
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert ours([text, "hi"])["input_ids"] == theirs([text, "hi"])["input_ids"]
    assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))
    assert len(ours) == len(theirs) and ours.eos_token_id == theirs.eos_token_id
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_chat_takes_a_list_of_conversations_and_refuses_unknown_keywords(llm):
    one = [{"role": "user", "content": "Hi"}]
    two = [{"role": "user", "content": "What is 2+2?"}]
    params = SamplingParams(**GREEDY)
    both = llm.chat([one, two], params, use_tqdm=False)
    assert texts(both) == texts(llm.chat(one, params, use_tqdm=False) + llm.chat(two, params, use_tqdm=False))
    with pytest.raises(TypeError):
        llm.chat(one, params, enable_thinkng=True)  # a typo is not a template variable
    assert not llm.engine.has_unfinished()


def test_chat_continue_final_message_leaves_the_turn_open(llm):
    tok = llm.get_tokenizer()
    conv = [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "My favourite is"}]
    text = tok.apply_chat_template(conv, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("My favourite is")
    with pytest.raises(RequestError, match="add_generation_prompt=False"):
        tok.apply_chat_template(conv, continue_final_message=True)
