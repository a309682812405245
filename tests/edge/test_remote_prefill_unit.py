"""The edge's `RemotePrefill` on a scripted engine handle (tests/shared/fake_handle.py) and a fake core, without
sockets or a model: reserve (in the request's group, the cached prefix announced as skip_tokens) → the core's
chunks written into the reservation → activate with the core's first token → Ack, and the request's outputs
reach the sink chosen at reserve; a core error releases the reservation and Cancels; a prefetch is never
activated."""

import asyncio
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from edgecore.edge.metrics import EdgeMetrics
from edgecore.edge.remote_prefill import RemotePrefill, RemotePrefillFailed
from edgecore.protocol import messages as m
from edgecore.protocol.errors import ErrorCode
from edgecore.protocol.kv import encode_chunk
from edgecore.shared.engine.handle import FirstToken, OutputSink
from edgecore.shared.engine.sampling_params import SamplingParams
from tests.shared.fake_handle import FakeHandle, output

pytestmark = pytest.mark.timeout(30)

PROMPT = list(range(3, 43))           # 40 tokens
CACHED = 16                           # of them in the edge's prefix cache already
PARAMS = SamplingParams(max_tokens=8, temperature=0)


class FakeCore:
    """What a RemotePrefill uses of a `CoreClient`: the connection's facts, `prefill` (the request's events, as
    scripted), `send` and `finish`."""

    def __init__(self, events) -> None:
        self.peer = SimpleNamespace(conn=SimpleNamespace(handover=False, peer_codecs=["lossless", "raw"]))
        self.direct = False
        self.address = "core:1"
        self.events = events
        self.requests: list[m.PrefillRequest] = []
        self.sent: list[m.Message] = []
        self.finished: list[str] = []

    async def prefill(self, request: m.PrefillRequest) -> asyncio.Queue:
        self.requests.append(request)
        queue: asyncio.Queue = asyncio.Queue()
        for event in self.events(request):
            queue.put_nowait(event)
        return queue

    async def send(self, msg: m.Message) -> None:
        self.sent.append(msg)

    def finish(self, request_id: str, wire_bytes: int = 0, seconds: float = 0.0) -> None:
        self.finished.append(request_id)


def kv_of(handle: FakeHandle) -> np.ndarray:
    cfg = handle.config
    return np.random.default_rng(0).standard_normal(
        (cfg.num_hidden_layers, len(PROMPT) - CACHED, cfg.num_key_value_heads, cfg.head_dim), dtype=np.float32)


def core_sending(k: np.ndarray, first_token: int = 77):
    def events(request: m.PrefillRequest) -> list:
        bits = k.view(np.uint32)
        chunk = encode_chunk(request.request_id, bits, bits, layer_start=0, token_start=request.skip_tokens,
                             dtype="float32", codec="lossless", total_tokens=len(request.token_ids))
        return [chunk, m.PrefillDone(request.request_id, first_token, -0.5, [], len(request.token_ids),
                                     request.skip_tokens)]
    return events


def remote(handle: FakeHandle, core: FakeCore, pool: ThreadPoolExecutor) -> RemotePrefill:
    return RemotePrefill(handle, core, "r1", PROMPT, PARAMS, 5.0, pool, EdgeMetrics(), group="chat-3")


async def test_reserve_then_chunks_written_then_activate_with_the_cores_first_token():
    handle, pool = FakeHandle(cached=CACHED), ThreadPoolExecutor(1)
    k = kv_of(handle)
    core = FakeCore(core_sending(k))
    handle.outputs["r1"] = [output("r1", 5, finished=False), output("r1", 6, reason="stop")]
    queue: asyncio.Queue = asyncio.Queue()
    sink = OutputSink.queue(queue)
    try:
        await remote(handle, core, pool).run(lambda client, tokens: "lossless", sink)
    finally:
        pool.shutdown()

    (request, given), = handle.called("reserve")
    assert (request.request_id, request.prompt, request.params, request.group) == ("r1", PROMPT, PARAMS, "chat-3")
    assert given is sink and not request.prefill_only
    (sent,) = core.requests
    assert sent.skip_tokens == CACHED and sent.group == "chat-3" and sent.codecs == ["lossless"]
    written = handle.written
    assert [(p.layer, p.num_layers, p.token_start, p.token_end) for p in written] == \
        [(0, handle.config.num_hidden_layers, CACHED, len(PROMPT))]
    assert torch.equal(written[0].k, torch.from_numpy(k)) and torch.equal(written[0].v, torch.from_numpy(k))
    names = [name for name, _ in handle.calls]
    assert names == ["reserve", "write_kv", "activate"]       # every write queued before the activation
    assert handle.called("activate") == [("r1", FirstToken(77, None, []))]   # no logprobs asked: none kept
    assert core.sent == [m.Ack("r1")] and core.finished == ["r1"]
    outs = [await queue.get(), await queue.get()]                # decoding here: to the sink given at reserve
    assert [o.new_token_ids for o in outs] == [[5], [6]] and outs[-1].finished


async def test_a_core_error_releases_the_reservation_and_cancels():
    handle, pool = FakeHandle(cached=CACHED), ThreadPoolExecutor(1)
    core = FakeCore(lambda request: [m.Error(ErrorCode.OVERLOADED, "busy", request.request_id)])
    try:
        with pytest.raises(RemotePrefillFailed, match="busy"):
            await remote(handle, core, pool).run(lambda client, tokens: "lossless", OutputSink(lambda out: None))
    finally:
        pool.shutdown()
    assert handle.called("release") == [("r1",)] and handle.called("activate") == []
    assert "r1" not in handle.sinks                              # the sink is dropped with the reservation
    assert core.sent == [m.Cancel("r1")]


async def test_a_prefetch_is_reserved_without_a_sink_and_never_activated():
    handle, pool = FakeHandle(cached=CACHED), ThreadPoolExecutor(1)
    core = FakeCore(core_sending(kv_of(handle)))
    try:
        await remote(handle, core, pool).run(lambda client, tokens: "lossless", None)
    finally:
        pool.shutdown()
    (_, sink), = handle.called("reserve")
    assert sink is None and handle.called("activate") == [] and len(handle.written) == 1
    assert core.sent == [m.Ack("r1")]
