"""EngineThread: a request whose consumer leaves before its add ran is aborted, not left running; each kind of
output sink (queue, callback, at finish) gets every output once, in order, and the engine's failure."""

import asyncio

import pytest

from edgecore.shared.engine.engine_thread import EngineThread
from edgecore.shared.engine.handle import EngineRequest, OutputSink, read_outputs
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.errors import EngineDead
from tests.conftest import make_engine

pytestmark = pytest.mark.timeout(60)


async def test_cancelled_while_the_add_is_queued_the_request_is_aborted_after_it():
    engine = make_engine()
    aengine = EngineThread(engine)
    aengine.start()
    try:
        busy = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        hold, loop = asyncio.Event(), asyncio.get_running_loop()
        match_prefix = engine.block_manager.match_prefix

        def blocking_match(ids, salt=None):          # the engine thread waits inside this command
            asyncio.run_coroutine_threadsafe(hold.wait(), loop).result()
            return match_prefix(ids, salt)
        engine.block_manager.match_prefix = blocking_match
        blocked = asyncio.ensure_future(aengine.cached_prefix([1, 2, 3]))
        await asyncio.sleep(0.05)
        engine.block_manager.match_prefix = match_prefix

        async def consume():
            async for _ in aengine.generate(EngineRequest("left", list(range(3, 40)), busy)):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)          # the add is queued, not yet run
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        hold.set()
        await blocked
        await aengine.cached_prefix([1])   # one more turn of the engine thread: the abort has run
        stats = aengine.stats()
        assert stats.requests == 0 and stats.running == 0 and stats.waiting == 0
    finally:
        aengine.stop()


async def test_stats_are_a_snapshot_published_by_the_engine_thread():
    engine = make_engine()
    aengine = EngineThread(engine)
    aengine.start()
    try:
        assert aengine.stats().blocks_used == 0
        queue = asyncio.Queue()
        await aengine.submit(EngineRequest("s", list(range(3, 40)), SamplingParams(max_tokens=50, temperature=0,
                                                                                   ignore_eos=True)),
                             OutputSink.queue(queue))
        first = await queue.get()
        assert not first.finished
        seen = aengine.stats()
        assert seen.requests == 1 and seen.blocks_used > 0 and seen.running + seen.waiting == 1
        aengine.abort("s")
        for _ in range(200):
            if aengine.stats().requests == 0:
                break
            await asyncio.sleep(0.01)
        assert aengine.stats().requests == 0 and aengine.stats().blocks_used == 0
    finally:
        aengine.stop()


async def test_submit_if_uncached_below_admits_only_short_uncached_rests():
    engine = make_engine(block_size=16)
    aengine = EngineThread(engine)
    aengine.start()
    try:
        params = SamplingParams(max_tokens=2, temperature=0)
        prompt = list(range(3, 43))                       # 40 tokens, nothing cached yet
        queue = asyncio.Queue()
        cached, added = await aengine.submit_if_uncached_below(EngineRequest("a", prompt, params),
                                                               OutputSink.queue(queue), limit=32)
        assert (cached, added) == (0, False) and aengine.stats().requests == 0 and not aengine._sinks
        async for _ in aengine.generate(EngineRequest("b", prompt, params)):   # its full blocks stay cached
            pass
        cached, added = await aengine.submit_if_uncached_below(EngineRequest("c", prompt + [50], params),
                                                               OutputSink.queue(queue), limit=32)
        assert cached == 32 and added
        outs = [out async for out in read_outputs(queue, lambda: None)]
        assert outs[-1].finished and outs[-1].num_cached_tokens == 32
        assert not aengine._sinks                         # dropped after the last output
    finally:
        aengine.stop()


async def test_every_sink_kind_gets_the_same_outputs_in_order():
    aengine = EngineThread(make_engine())
    aengine.start()
    try:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        streamed = [out async for out in aengine.generate(EngineRequest("q", list(range(3, 30)), params))]
        called = []
        done = asyncio.Event()

        def emit(item):
            called.append(item)
            if getattr(item, "finished", True):
                done.set()
        await aengine.submit(EngineRequest("c", list(range(3, 30)), params), OutputSink(emit))
        await done.wait()
        steps, dispatch = [], aengine._dispatch

        def counted(outputs):                             # each wake-up of the event loop with outputs
            steps.append([o.request_id for o in outputs])
            dispatch(outputs)
        aengine._dispatch = counted
        collected = [out async for out in aengine.generate(EngineRequest("f", list(range(3, 30)), params),
                                                           at_finish=True)]
        tokens = [[t for o in outs for t in o.new_token_ids] for outs in (streamed, called, collected)]
        assert tokens[0] == tokens[1] == tokens[2] and len(tokens[0]) == 6
        assert [len(x) for x in (streamed, called, collected)] == [6, 6, 6]
        assert steps == [["f"] * 6]                       # held on the engine thread: one delivery at the end
        assert not aengine._sinks and not aengine._held
    finally:
        aengine.stop()


async def test_an_engine_failure_reaches_every_sink_and_waiting_command():
    engine = make_engine()
    aengine = EngineThread(engine)
    aengine.start()
    try:
        await aengine.started()
        called = []
        params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
        await aengine.submit(EngineRequest("c", list(range(3, 30)), params), OutputSink(called.append))

        def broken(*_, **__):
            raise RuntimeError("injected")
        engine.step = broken
        with pytest.raises(EngineDead, match="injected"):
            async for _ in aengine.generate(EngineRequest("q", list(range(3, 30)), params)):
                pass
        assert isinstance(called[-1], EngineDead) and not aengine._sinks
        with pytest.raises(EngineDead):
            await aengine.cached_prefix([1])
    finally:
        aengine.stop()


async def test_the_heap_is_trimmed_once_after_work_when_the_engine_idles(monkeypatch):
    from edgecore.shared.engine import engine_thread
    trims = []
    monkeypatch.setattr(engine_thread, "IDLE_TRIM_S", 0.2)
    monkeypatch.setattr(engine_thread, "return_free_memory", lambda: trims.append(1))
    aengine = EngineThread(make_engine())
    aengine.start()
    try:
        await asyncio.sleep(0.5)
        assert trims == []                      # nothing ran yet: nothing to give back
        async for _ in aengine.generate(EngineRequest("a", list(range(3, 40)), SamplingParams(max_tokens=4))):
            pass
        await asyncio.sleep(0.8)
        assert trims == [1]                     # once, not every timeout while idle
        async for _ in aengine.generate(EngineRequest("b", list(range(3, 40)), SamplingParams(max_tokens=4))):
            pass
        await asyncio.sleep(0.8)
        assert trims == [1, 1]
    finally:
        aengine.stop()
