"""AsyncEngine: a request whose consumer leaves before its add ran is aborted, not left running."""

import asyncio

import pytest

from edgecore.shared.engine.async_engine import AsyncEngine
from edgecore.shared.engine.sampling_params import SamplingParams
from tests.conftest import make_engine

pytestmark = pytest.mark.timeout(60)


async def test_cancelled_while_the_add_is_queued_the_request_is_aborted_after_it():
    engine = make_engine()
    aengine = AsyncEngine(engine)
    aengine.start()
    try:
        busy = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        hold, loop = asyncio.Event(), asyncio.get_running_loop()
        match_prefix = engine.block_manager.match_prefix

        def blocking_match(ids):          # the engine thread waits inside this command
            asyncio.run_coroutine_threadsafe(hold.wait(), loop).result()
            return match_prefix(ids)
        engine.block_manager.match_prefix = blocking_match
        blocked = asyncio.ensure_future(aengine.cached_prefix([1, 2, 3]))
        await asyncio.sleep(0.05)
        engine.block_manager.match_prefix = match_prefix

        async def consume():
            async for _ in aengine.generate("left", list(range(3, 40)), busy):
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
    aengine = AsyncEngine(engine)
    aengine.start()
    try:
        assert aengine.stats().blocks_used == 0
        queue = await aengine.add("s", list(range(3, 40)), SamplingParams(max_tokens=50, temperature=0,
                                                                          ignore_eos=True))
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


async def test_add_if_uncached_below_adds_only_short_uncached_rests():
    engine = make_engine(block_size=16)
    aengine = AsyncEngine(engine)
    aengine.start()
    try:
        params = SamplingParams(max_tokens=2, temperature=0)
        prompt = list(range(3, 43))                       # 40 tokens, nothing cached yet
        cached, queue = await aengine.add_if_uncached_below("a", prompt, params, limit=32)
        assert (cached, queue) == (0, None) and aengine.stats().requests == 0
        async for _ in aengine.generate("b", prompt, params):   # its full blocks stay in the prefix cache
            pass
        cached, queue = await aengine.add_if_uncached_below("c", prompt + [50], params, limit=32)
        assert cached == 32 and queue is not None
        outs = [out async for out in aengine.stream("c", queue)]
        assert outs[-1].finished and outs[-1].num_cached_tokens == 32
    finally:
        aengine.stop()


async def test_the_heap_is_trimmed_once_after_work_when_the_engine_idles(monkeypatch):
    from edgecore.shared.engine import async_engine
    trims = []
    monkeypatch.setattr(async_engine, "IDLE_TRIM_S", 0.2)
    monkeypatch.setattr(async_engine, "return_free_memory", lambda: trims.append(1))
    aengine = AsyncEngine(make_engine())
    aengine.start()
    try:
        await asyncio.sleep(0.5)
        assert trims == []                      # nothing ran yet: nothing to give back
        async for _ in aengine.generate("a", list(range(3, 40)), SamplingParams(max_tokens=4)):
            pass
        await asyncio.sleep(0.8)
        assert trims == [1]                     # once, not every timeout while idle
        async for _ in aengine.generate("b", list(range(3, 40)), SamplingParams(max_tokens=4)):
            pass
        await asyncio.sleep(0.8)
        assert trims == [1, 1]
    finally:
        aengine.stop()
