"""Per-step outputs: cumulative text and ids as vLLM gives them, built without copying the sequence each step."""

from nanoserve import LLM, SamplingParams
from nanoserve.outputs import TextSoFar, TokenIds


def test_token_ids_view_reads_and_compares_as_its_tuple_and_keeps_its_length():
    ids = [5, 6, 7]
    view = TokenIds(ids)
    ids.append(8)  # the request grows after the output was made
    assert len(view) == 3 and view == (5, 6, 7) and view == [5, 6, 7] and view != (5, 6, 7, 8)
    assert list(view) == [5, 6, 7] and view[-1] == 7 and view[1:] == (6, 7) and view[:10] == (5, 6, 7)
    assert (1,) + view == (1, 5, 6, 7) and view + (9,) == (5, 6, 7, 9)
    assert hash(view) == hash((5, 6, 7)) and repr(view) == "(5, 6, 7)"
    pieces = ["a", "b"]
    text = TextSoFar(pieces)
    pieces.append("c")
    assert str(text) == "ab"


def test_each_steps_output_is_a_snapshot_that_shares_the_requests_storage(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01)
    engine = llm.engine
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), "r")
    seen = []
    while engine.has_unfinished():
        seen.extend(engine.step())
    req_ids = list(seen[-1].outputs[0].token_ids)
    assert len(req_ids) == 12
    for step, out in enumerate(seen, start=1):
        c = out.outputs[0]
        # earlier outputs still say what they said then, though the request kept growing after them
        assert len(c.token_ids) == step and c.token_ids == tuple(req_ids[:step])
        assert c.text == "".join(o.delta_text for o in seen[:step])
        assert out.delta_token_ids == (req_ids[step - 1],)
    first = seen[0].outputs[0].token_ids
    assert isinstance(first, TokenIds) and first._ids is seen[-1].outputs[0].token_ids._ids  # one list, no copies
    final = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert final.token_ids == tuple(req_ids) and final.text == seen[-1].outputs[0].text
