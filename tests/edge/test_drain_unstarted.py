"""At an edge's drain, a request still waiting for its first output is aborted and refused with 503
`server_shutting_down` (nothing of it was sent: another replica serves it whole); one that has its first
output goes on; after the drain began every request is refused at once."""

from __future__ import annotations

import asyncio

import pytest

from edgecore.edge.drain import Drain
from edgecore.shared.openai.request import ApiError

pytestmark = pytest.mark.timeout(10)


async def test_waiting_request_is_aborted_and_refused_at_the_drain():
    drain, aborted = Drain(), asyncio.Event()

    async def outputs():
        try:
            await asyncio.sleep(3600)          # queued: no first token yet
            yield 1
        finally:
            aborted.set()                      # the engine request is cancelled

    gen = outputs()
    waiting = asyncio.ensure_future(drain.first_output(gen))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    drain.start()
    with pytest.raises(ApiError) as err:
        await waiting
    assert err.value.status == 503 and err.value.code == "server_shutting_down"
    assert err.value.headers == {"retry-after": "1"}
    assert aborted.is_set()


async def test_started_request_keeps_its_output_and_new_ones_are_refused():
    drain = Drain()

    async def outputs():
        yield "first"
        yield "second"

    gen = outputs()
    assert await drain.first_output(gen) == "first"
    drain.start()
    assert await anext(gen) == "second"             # in flight: the drain waits for it
    with pytest.raises(ApiError) as err:
        await drain.first_output(outputs())
    assert err.value.status == 503


async def test_an_engine_refusal_before_the_first_output_passes_through():
    drain = Drain()

    async def outputs():
        raise ApiError(400, "bad grammar", "response_format", "invalid_value")
        yield                                         # an async generator

    with pytest.raises(ApiError) as err:
        await drain.first_output(outputs())
    assert err.value.status == 400
