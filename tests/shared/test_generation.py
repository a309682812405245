"""Generation on the bundled model: equal to transformers and to itself under batching,
prefix caching, chunking and preemption; sampling, stops, logprobs, abort, KV entry points."""

import pytest
import torch

from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.errors import RequestError
from edgecore.shared.kv.transfer import KVSlice
from tests.conftest import make_engine

GREEDY64 = SamplingParams(max_tokens=64, temperature=0)


def heldout_prompts(tokenizer, heldout, count, lengths):
    words = heldout.split()
    out = []
    for i in range(count):
        n = lengths[i % len(lengths)]
        ids = tokenizer.encode(" ".join(words[i * 37: i * 37 + 400]))[:n]
        out.append(ids)
    return out


def test_golden_continuations(engine, golden):
    cases = golden["cases"]
    res = engine.generate([c["prompt_ids"] for c in cases], GREEDY64)
    for case, r in zip(cases, res):
        assert r["token_ids"] == case["greedy_ids"]
        assert r["text"] == case["greedy_text"]


def test_greedy_equals_transformers_generate(engine, hf_model, tokenizer):
    prompts = ["The for statement is used to", "A list comprehension", "import os\n",
               "Exceptions are raised when", "The with statement", "def main():"]
    for text in prompts:
        ids = tokenizer.encode(text)
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                                    eos_token_id=None, pad_token_id=2)[0, len(ids):].tolist()
        ours = engine.generate([ids], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0]
        assert ours["token_ids"] == ref, text


def test_batched_equals_one_at_a_time(tokenizer, heldout):
    prompts = heldout_prompts(tokenizer, heldout, 16, [5, 40, 130, 17, 260, 64, 9, 90])
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    batched = make_engine(budget=256).generate(prompts, params)
    single_engine = make_engine()
    single = [single_engine.generate([p], params)[0] for p in prompts]
    assert [r["token_ids"] for r in batched] == [r["token_ids"] for r in single]


def test_prefix_cache_hit_equals_miss(tokenizer, heldout):
    prompt = heldout_prompts(tokenizer, heldout, 1, [200])[0]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    miss = make_engine(prefix_caching=False).generate([prompt], params)[0]
    eng = make_engine()
    first = eng.generate([prompt], params)[0]
    hits_before = eng.block_manager.hits
    second = eng.generate([prompt], params)[0]
    assert eng.block_manager.hits - hits_before >= 192   # 12 full blocks reused
    assert first["token_ids"] == second["token_ids"] == miss["token_ids"]
    # A prompt sharing only the prefix continues correctly from the cached blocks.
    other = prompt[:150] + tokenizer.encode(" and then")
    ref = make_engine(prefix_caching=False).generate([other], params)[0]
    assert eng.generate([other], params)[0]["token_ids"] == ref["token_ids"]


def test_preempted_request_equals_undisturbed(tokenizer, heldout):
    prompts = heldout_prompts(tokenizer, heldout, 6, [60, 70, 80])
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    ref = make_engine().generate(prompts, params)
    tight = make_engine(block_size=8, num_blocks=40)   # 320 slots for 6 × ~120 tokens
    out = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert [r["token_ids"] for r in out] == [r["token_ids"] for r in ref]
    assert tight.block_manager.num_used == 0


def test_chunked_prefill_equals_whole(tokenizer, heldout):
    prompt = heldout_prompts(tokenizer, heldout, 1, [500])[0]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    whole = make_engine().generate([prompt], params)[0]
    chunked = make_engine(budget=64).generate([prompt], params)[0]
    assert whole["token_ids"] == chunked["token_ids"]


def test_seeded_sampling_is_reproducible_and_batch_independent(engine, tokenizer):
    ids = tokenizer.encode("The module")
    p = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    alone = engine.generate([ids], p)[0]["token_ids"]
    others = [SamplingParams(max_tokens=20, temperature=1.0) for _ in range(3)]
    mixed = engine.generate([ids, ids, ids, ids], [p] + others)[0]["token_ids"]
    assert alone == mixed
    different = engine.generate([ids], SamplingParams(max_tokens=20, temperature=0.9, seed=99))[0]
    greedy = engine.generate([ids], SamplingParams(max_tokens=20, temperature=0))[0]
    assert different["token_ids"] != alone or greedy["token_ids"] != alone


def test_top_k_one_is_greedy_and_top_p_restricts(engine, tokenizer):
    ids = tokenizer.encode("The class")
    greedy = engine.generate([ids], SamplingParams(max_tokens=10, temperature=0))[0]
    topk1 = engine.generate([ids], SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=3))[0]
    tiny_p = engine.generate([ids], SamplingParams(max_tokens=10, temperature=1.0, top_p=1e-6, seed=3))[0]
    assert topk1["token_ids"] == greedy["token_ids"] == tiny_p["token_ids"]


def test_stop_strings_and_stop_tokens(engine, golden):
    case = golden["cases"][0]
    full = case["greedy_text"]
    stop = full[20:26]
    r = engine.generate([case["prompt_ids"]], SamplingParams(max_tokens=64, temperature=0, stop=[stop]))[0]
    assert r["finish_reason"] == "stop" and r["text"] == full[:full.index(stop)]
    r = engine.generate([case["prompt_ids"]], SamplingParams(max_tokens=64, temperature=0, stop=[stop],
                                                            include_stop_str_in_output=True))[0]
    assert r["text"] == full[:full.index(stop) + len(stop)]
    tok = case["greedy_ids"][5]
    r = engine.generate([case["prompt_ids"]], SamplingParams(max_tokens=64, temperature=0,
                                                            stop_token_ids=[tok]))[0]
    assert r["finish_reason"] == "stop" and r["token_ids"] == case["greedy_ids"][:6]


def test_detokenize_false_gives_the_same_ids_without_text(engine, golden):
    case = golden["cases"][0]
    r = engine.generate([case["prompt_ids"]], SamplingParams(max_tokens=32, temperature=0, detokenize=False))[0]
    assert r["token_ids"] == case["greedy_ids"][:32] and r["text"] == "" and r["finish_reason"] == "length"
    with pytest.raises(RequestError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_streamed_text_never_shows_stop_string(engine, golden):
    case = golden["cases"][0]
    stop = case["greedy_text"][30:40]
    engine.add_request("s", case["prompt_ids"], SamplingParams(max_tokens=64, temperature=0, stop=[stop]))
    pieces = []
    while engine.has_unfinished():
        pieces += [o.new_text for o in engine.step()]
    text = "".join(pieces)
    assert stop not in text and text == case["greedy_text"][:case["greedy_text"].index(stop)]


def test_logprobs_match_transformers(engine, hf_model, tokenizer):
    ids = tokenizer.encode("The for statement")
    r = engine.generate([ids], SamplingParams(max_tokens=5, temperature=0, logprobs=3))[0]
    full = ids + r["token_ids"]
    with torch.no_grad():
        ref = hf_model(torch.tensor([full])).logits[0].log_softmax(-1)
    for i, lp in enumerate(r["logprobs"]):
        row = ref[len(ids) - 1 + i]
        assert abs(lp.logprob - row[lp.token_id].item()) < 1e-4
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()


def test_abort_frees_blocks(engine, tokenizer):
    engine.add_request("a", tokenizer.encode("hello " * 40), SamplingParams(max_tokens=50))
    engine.step()
    assert engine.block_manager.num_used > 0
    assert engine.abort("a")
    assert engine.block_manager.num_used == 0 and not engine.has_unfinished()


def test_request_errors(engine):
    with pytest.raises(RequestError, match="context length"):
        engine.add_request("x", [5] * 1000, SamplingParams(max_tokens=100))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("y", [], SamplingParams())
    with pytest.raises(RequestError, match="token ids"):
        engine.add_request("z", [5, 99999], SamplingParams())
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(RequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_prefill_only_then_external_kv_decode_equals_single_node(tokenizer, heldout):
    """Entry points (a) and (b): KV computed by one engine, decoded by another."""
    prompt = heldout_prompts(tokenizer, heldout, 1, [150])[0]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    ref = make_engine().generate([prompt], params)[0]["token_ids"]
    core, edge = make_engine(), make_engine()
    core.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0), prefill_only=True)
    first = None
    while core.has_unfinished():
        for out in core.step():
            first = out.new_token_ids[0]
            assert out.finish_reason == "prefill"
    edge.reserve("r", prompt, params)
    for layer in range(core.config.num_hidden_layers):
        k, v = core.read_kv("r", layer)
        edge.write_kv("r", KVSlice(layer, 0, len(prompt), 0, k[None], v[None]))
    core.release("r")
    assert core.block_manager.num_used == 0
    edge.activate("r", first)
    tokens = []
    while edge.has_unfinished():
        for out in edge.step():
            tokens += out.new_token_ids
    assert tokens == ref
    assert edge.block_manager.num_used == 0
