"""Decode handover inside the engine (no processes): tokens decoded elsewhere pushed into a reserved request,
then `take_over` with the prompt's KV (or none) — the continuation equals a single-node run, greedy and
seeded (randomness from (seed, position))."""

import pytest

from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.engine.sequence import Status
from edgecore.shared.errors import RequestError
from tests.conftest import make_engine


def run(engine):
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def prefill_kv(prompt, params):
    """A core's part: the prompt's KV (prefill-only) as slices."""
    core = make_engine()
    core.add_request("r", prompt, params, prefill_only=True)
    run(core)
    return core.read_kv_slices("r", 0, len(prompt))


@pytest.fixture(scope="module")
def edge_engine():
    return make_engine()


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                                    SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=77,
                                                   ignore_eos=True)],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [1, 7, 19])
@pytest.mark.parametrize("with_kv", [True, False], ids=["kv", "recompute"])
def test_take_over_after_k_tokens_equals_single_node(edge_engine, tokenizer, heldout, params, k, with_kv):
    prompt = tokenizer.encode(heldout)[300:420]
    ref = make_engine().generate([prompt], params)[0]["token_ids"]
    rid = f"h-{k}-{with_kv}-{params.seed}"
    eng = edge_engine
    _, cached = eng.reserve(rid, prompt, params)
    if with_kv:
        for piece in prefill_kv(prompt, params):
            eng.write_kv(rid, piece)
    for token in ref[:k]:                       # what the core decoded before the handover
        assert eng.push_token(rid, token) is False
    eng.take_over(rid, len(prompt) if with_kv else cached)
    outs = [o for o in run(eng) if o.request_id == rid]
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == ref                         # each position exactly once, in order
    assert outs[-1].finished and outs[-1].num_output_tokens == 20
    assert eng.stats().blocks_used == 0


def test_a_request_finished_by_a_pushed_token_never_moves(tokenizer):
    eng = make_engine()
    eng.reserve("r", tokenizer.encode("def f():"), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert [eng.push_token("r", t) for t in (5, 6, 7)] == [False, False, True]
    outs = run(eng)
    assert [o.new_token_ids for o in outs] == [[5], [6], [7]] and outs[-1].finish_reason == "length"
    assert eng.get("r") is None and eng.stats().blocks_used == 0
    with pytest.raises(RequestError):
        eng.take_over("r", 0)


def test_take_over_checks_its_arguments(tokenizer):
    eng = make_engine()
    prompt = tokenizer.encode("import os")
    eng.reserve("r", prompt, SamplingParams(max_tokens=4, temperature=0))
    with pytest.raises(RequestError, match="after 0 tokens"):
        eng.take_over("r", len(prompt))          # nothing pushed yet
    eng.push_token("r", 9)
    with pytest.raises(RequestError, match="KV until"):
        eng.take_over("r", len(prompt) + 1)
    eng.take_over("r", 0)
    assert eng.get("r").status is Status.RUNNING
    with pytest.raises(RequestError, match="not waiting"):
        eng.push_token("r", 3)


@pytest.mark.parametrize("bad", [{"token": 2048}, {"token": -1}, {"token": 5, "top": [(5, -0.1), (10**9, -2.0)]}],
                         ids=["past-vocab", "negative", "top-logprob-id"])
def test_a_token_id_outside_the_vocabulary_from_a_core_is_refused_and_changes_nothing(tokenizer, bad):
    eng = make_engine()
    assert eng.config.vocab_size == 2048
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = tokenizer.encode("def f(x):")
    ref = make_engine().generate([prompt], params)[0]["token_ids"]
    eng.reserve("r", prompt, params)
    for entry in (eng.push_token, eng.activate):
        with pytest.raises(RequestError, match="outside the vocabulary") as exc:
            entry("r", bad["token"], None, bad.get("top"))
        assert exc.value.param == "token"
        assert eng.requests["r"].seq.status is Status.AWAITING_KV and eng.requests["r"].seq.num_output_tokens == 0
    for piece in prefill_kv(prompt, params):     # the request still completes normally afterwards
        eng.write_kv("r", piece)
    eng.activate("r", ref[0])
    assert [t for o in run(eng) for t in o.new_token_ids] == ref


def test_a_pushed_token_reaches_the_stream_with_the_reply_not_a_turn_later(tokenizer):
    """EngineThread.push_token hands the token's output to the request's stream itself: a client sees a core's
    token without waiting for the engine thread to come round again (here any step waits on a gate)."""
    import asyncio
    import threading

    from edgecore.shared.engine.engine_thread import EngineThread
    from edgecore.shared.engine.handle import EngineRequest, FirstToken, OutputSink

    async def main():
        eng = make_engine()
        gate = threading.Event()
        step = eng.step

        def held_step(*a, **kw):              # a step waits for the gate: nothing it emits arrives before
            gate.wait(10)
            return step(*a, **kw)
        eng.step = held_step
        aengine = EngineThread(eng)
        aengine.start()
        try:
            queue = asyncio.Queue()
            await aengine.reserve(EngineRequest("r", tokenizer.encode("def f():"),
                                                SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)),
                                  OutputSink.queue(queue))
            assert await aengine.push_token("r", FirstToken(5, None, [])) is False
            out = queue.get_nowait()           # already there: no engine step had to emit it
            assert out.new_token_ids == [5] and not out.finished
            assert await aengine.push_token("r", FirstToken(6, None, [])) is True
            last = queue.get_nowait()
            assert last.new_token_ids == [6] and last.finished and last.finish_reason == "length"
        finally:
            gate.set()
            aengine.stop()
    asyncio.run(main())
