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
        # The engine thread is inside this command while the add below is queued behind it.
        blocked = asyncio.ensure_future(aengine.call(lambda e: asyncio.run_coroutine_threadsafe(
            hold.wait(), loop).result()))
        await asyncio.sleep(0.05)

        async def consume():
            async for _ in aengine.generate("left", list(range(3, 40)), busy):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)          # the add is queued, not yet run
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        hold.set()
        await blocked
        assert await aengine.call(lambda e: "left" not in e.requests and not e.has_unfinished())
    finally:
        aengine.stop()
