"""An edge's drain waits for context prefetches in flight (POST /v1/contexts), not only for completions: a
SIGTERM while a core pushes a shared prefix must not cut that request off."""

import asyncio

import pytest

from edgecore.edge.http import EdgeHTTP

pytestmark = pytest.mark.timeout(60)


class PrefetchingEdge:
    """An EdgeService stand-in whose prefetch waits until the test lets it finish."""
    ready, active, vocab_size, max_model_len, fingerprint = True, 0, 2048, 1024, "f" * 64
    adapters: dict[str, str] = {}
    tokenizer = None

    def __init__(self):
        self.started, self.release = asyncio.Event(), asyncio.Event()

    def count_error(self, status):
        pass

    async def prefetch(self, ids):
        self.started.set()
        await self.release.wait()
        return {"tokens": len(ids), "cached_tokens": 0}


async def test_a_drain_waits_for_a_prefetch_in_flight(aiohttp_client):
    edge = PrefetchingEdge()
    http = EdgeHTTP(edge, "pydoc-llama")
    client = await aiohttp_client(http.build_app())
    call = asyncio.ensure_future(client.post("/v1/contexts", json={"token_ids": [1, 2, 3]}))
    await asyncio.wait_for(edge.started.wait(), 10)
    http.start_drain()
    drained = asyncio.ensure_future(http.drained())
    await asyncio.sleep(0.2)
    assert not drained.done()                 # the prefetch is still being served
    refused = await client.post("/v1/contexts", json={"token_ids": [4]})
    assert refused.status == 503 and (await refused.json())["error"]["code"] == "server_shutting_down"
    edge.release.set()
    response = await asyncio.wait_for(call, 10)
    assert response.status == 200 and (await response.json())["tokens"] == 3
    await asyncio.wait_for(drained, 5)
