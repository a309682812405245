"""The edge's frontend ↔ engine process link: frames, streams, aborts, calls, errors, a dead engine.

The engine side runs in this process (an `NodeProcessServer` on one end of a socketpair); the real
two-process edge is exercised by the end-to-end tests.
"""

import asyncio
import random
import socket

import pytest

from edgecore.edge.node import EdgeConfig, EdgeNode
from edgecore.edge.node_client import NodeProcessClient
from edgecore.edge.node_process import NodeProcessServer
from edgecore.edge.ipc import (MAX_FRAME, Abort, CountError, FrameBuffer, Generate, GetStats, IpcError, Outputs, Prefetch,
                               PrefetchReply, RequestFailed, StatsReply, encode)
from edgecore.shared.engine.output import RequestOutput, TokenLogprob
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.errors import EngineDead, RequestError
from tests.conftest import make_engine

pytestmark = pytest.mark.timeout(60)


def test_frames_survive_any_split_and_bad_frames_are_refused():
    msgs = [Generate("r1", [1, 2, 3], SamplingParams(max_tokens=4, stop=["x"], logprobs=2)), Abort("r1"),
            Prefetch(7, [4, 5]), PrefetchReply(7, 2, 0, "local"), GetStats(8), StatsReply(8, {"running": 0}),
            RequestFailed(9, "boom"), CountError("400"),
            Outputs([RequestOutput("r1", [9], "é", True, "length", [TokenLogprob(9, -0.5, [(9, -0.5), (3, -1.5)])],
                                   3, 0, 1)])]
    data = b"".join(encode(m) for m in msgs)
    rng = random.Random(0)
    for _ in range(20):
        buf, got, pos = FrameBuffer(), [], 0
        while pos < len(data):
            step = rng.randint(1, 9)
            got += buf.feed(data[pos:pos + step])
            pos += step
        assert got == msgs
    with pytest.raises(IpcError, match="exceeds"):
        FrameBuffer().feed((MAX_FRAME + 1).to_bytes(4, "little"))
    with pytest.raises(IpcError, match="malformed"):
        FrameBuffer().feed((3).to_bytes(4, "little") + b"\xc1\xc1\xc1")
    with pytest.raises(IpcError, match="malformed"):     # invalid sampling parameters never reach the engine
        import msgspec
        bad = msgspec.msgpack.encode({"type": "generate", "request_id": "r", "prompt_ids": [1],
                                      "params": {"max_tokens": -1}})
        FrameBuffer().feed(len(bad).to_bytes(4, "little") + bad)


@pytest.fixture
async def link(model_dir):
    edge = EdgeNode(EdgeConfig(model_dir=str(model_dir)), engine=make_engine())
    await edge.start()
    a, b = socket.socketpair()
    server = asyncio.create_task(NodeProcessServer(edge, a).run())
    client = NodeProcessClient(["edge"], str(model_dir))
    deaths = []
    client.on_death = lambda: deaths.append(client.dead)
    await client.connect(b)
    yield edge, client, server, deaths
    await client.stop()
    await asyncio.wait_for(asyncio.gather(server, return_exceptions=True), 10)
    await edge.stop()


async def collect(client, rid, prompt, params):
    return [out async for out in client.generate(rid, prompt, params)]


async def test_streams_match_the_engine_and_calls_answer(link, golden):
    edge, client, _, _ = link
    assert client.ready and client.max_model_len == edge.max_model_len and client.vocab_size == 2048
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=1)
    cases = golden["cases"][:4]
    remote = await asyncio.gather(*(collect(client, f"r{i}", c["prompt_ids"], params) for i, c in enumerate(cases)))
    local = await asyncio.gather(*(collect(edge, f"l{i}", c["prompt_ids"], params) for i, c in enumerate(cases)))
    for a, b in zip(remote, local):
        assert [t for o in a for t in o.new_token_ids] == [t for o in b for t in o.new_token_ids]
        assert "".join(o.new_text for o in a) == "".join(o.new_text for o in b)
        assert a[-1].finished and a[-1].logprobs[0].top
    assert client.active == 0
    stats = await client.get_stats()
    assert stats["running"] == 0 and stats["blocks_used"] == 0
    assert (await client.get_readiness()) == {"ready": True, "cores_healthy": 0}
    client.count_error("400")
    metrics = await client.get_metrics()
    assert 'edgecore:request_errors_total{model_name="pydoc-llama",status="400"} 1.0' in metrics
    ctx = await client.prefetch(golden["cases"][0]["prompt_ids"] * 3)
    assert ctx["source"] == "local" and ctx["cached_tokens"] > 0


async def test_a_consumer_that_leaves_aborts_the_request_and_frees_its_blocks(link):
    edge, client, _, _ = link
    stream = client.generate("gone", list(range(3, 60)), SamplingParams(max_tokens=500, temperature=0,
                                                                         ignore_eos=True))
    async for out in stream:
        if out.num_output_tokens >= 3:
            break
    await stream.aclose()
    for _ in range(200):
        stats = await client.get_stats()
        if stats["running"] == 0 and stats["blocks_used"] == 0:
            break
        await asyncio.sleep(0.02)
    assert stats["running"] == 0 and stats["blocks_used"] == 0
    assert edge.handle.stats().requests == 0          # "gone" is no longer in the engine


async def test_request_errors_keep_their_kind_and_the_link_keeps_serving(link):
    edge, client, _, _ = link
    too_long = list(range(3, 3 + edge.max_model_len + 10))        # the frontend would refuse it first
    with pytest.raises(RequestError, match="maximum context length"):
        await collect(client, "long", too_long, SamplingParams(max_tokens=4))
    out = await collect(client, "ok", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0))
    assert out[-1].finished and client.ready


async def test_a_dead_engine_fails_open_streams_and_new_calls(link):
    _, client, server, deaths = link
    stream = client.generate("open", list(range(3, 40)), SamplingParams(max_tokens=400, temperature=0,
                                                                         ignore_eos=True))
    first = await stream.__anext__()
    assert first.request_id == "open"
    server.cancel()                         # the engine side goes away (as if its process died)
    with pytest.raises(EngineDead):
        async for _ in stream:
            pass
    assert not client.ready and deaths
    with pytest.raises(EngineDead):
        await client.get_stats()
    with pytest.raises(EngineDead):
        await collect(client, "late", [5, 6], SamplingParams(max_tokens=2))
    assert (await client.get_readiness())["ready"] is False


async def test_prefetched_contexts_keep_within_their_share_of_the_pool(model_dir):
    """Every context a client prefetches is pinned until it falls out of `PINNED_SHARE` of the pool (least
    recently prefetched first): a stream of new contexts cannot fill the pool for good, and prefetching the
    same context again takes no second pin."""
    from edgecore.edge.node import PINNED_SHARE
    edge = EdgeNode(EdgeConfig(model_dir=str(model_dir)), engine=make_engine(num_blocks=64))
    await edge.start()
    try:
        limit = int(64 * PINNED_SHARE)                       # 16 blocks: each 100-token context pins 6
        rng = random.Random(0)
        contexts = [[rng.randrange(3, 2000) for _ in range(100)] for _ in range(8)]
        for ctx in contexts:
            await edge.prefetch(ctx)
            assert len(set().union(*edge.pinned)) <= limit
            assert edge.handle.stats().blocks_used <= limit
        assert len(edge.pinned) == 2                          # two 6-block contexts fit in 16, a third does not
        before = edge.handle.stats().blocks_used
        older, newer = edge.pinned
        await edge.prefetch(contexts[-1])                     # the newest again: one pin, nothing evicted
        assert edge.pinned == [older, newer] and edge.handle.stats().blocks_used == before
        await edge.prefetch(contexts[-2])                     # the older one again: now the most recent
        assert edge.pinned == [newer, older] and edge.handle.stats().blocks_used == before
        out = [o async for o in edge.generate("long", list(range(3, 700)), SamplingParams(max_tokens=2))]
        assert out[-1].finished                               # a long prompt still finds its blocks
    finally:
        await edge.stop()
