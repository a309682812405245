"""The edge's `RemotePrefill` on a scripted engine handle (tests/shared/fake_handle.py) and a fake core, without
sockets or a model: reserve (in the request's group, the cached prefix announced as skip_tokens) → the core's
chunks written into the reservation → activate with the core's first token → Ack, and the request's outputs
reach the sink chosen at reserve; a core error releases the reservation and Cancels; a prefetch is never
activated; with decode handover the core's tokens are pushed and the edge takes over once the KV is written, a
request that ends on the core never moves, and a core that fails after the first token leaves the rest here."""

import asyncio
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from edgecore.edge.metrics import EdgeMetrics
from edgecore.edge.prefill_plan import RemotePrefillSettings
from edgecore.edge.remote_prefill import RemotePrefill, RemotePrefillFailed
from edgecore.edge.transfer_metrics import TransferMetrics
from edgecore.protocol import messages as m
from edgecore.protocol.errors import ErrorCode
from edgecore.protocol.kv import encode_chunk
from edgecore.shared.engine.handle import EngineRequest, FirstToken, OutputSink
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
    return RemotePrefill(handle, core, EngineRequest("r1", PROMPT, PARAMS, group="chat-3"),
                         settings=RemotePrefillSettings(5.0), pool=pool, metrics=TransferMetrics(EdgeMetrics()))


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
    # no logprobs asked: none kept; the core's cached prefix (PrefillDone.cached_tokens) is what the usage reports
    assert handle.called("activate") == [("r1", FirstToken(77, None, [], CACHED))]
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


K = np.zeros((4, len(PROMPT) - CACHED, 2, 32), dtype=np.float32)       # the bundled model's KV shape


def handing_over(request: m.PrefillRequest) -> list:
    """A core that decodes: PrefillDone, Token 1, the KV, then its DecodeStop answering the Handover."""
    kv, done = core_sending(K)(request)
    return [done, m.Token("r1", 1, 5), kv, m.DecodeStop("r1", 2, "handover")]


class HandoverHandle(FakeHandle):
    """push_token says the request finished at the `stop_at`-th push (0: never)."""
    stop_at = 0

    async def push_token(self, request_id: str, token: FirstToken) -> bool:
        await super().push_token(request_id, token)
        return len(self.called("push_token")) == self.stop_at


async def follow(handle: FakeHandle, events) -> tuple[FakeCore, dict]:
    core, counts, pool = FakeCore(events), {}, ThreadPoolExecutor(1)
    core.peer.conn.handover = True
    prefill = RemotePrefill(handle, core, EngineRequest("r1", PROMPT, PARAMS, group="chat-3"),
                            settings=RemotePrefillSettings(5.0, core_decode=64), pool=pool,
                            metrics=TransferMetrics(EdgeMetrics(), counts))
    try:
        await prefill.run(lambda client, tokens: "lossless", OutputSink(lambda out: None))
        assert prefill.follow is not None and prefill.plan is not None and prefill.plan.core_decode == 7
        assert [t.token for _, t in handle.called("push_token")] == [77]    # run() returns at the first token
        await asyncio.wait_for(prefill.follow, 5)
    finally:
        pool.shutdown()
    return core, counts


async def test_decode_handover_pushes_the_cores_tokens_then_takes_over():
    handle = HandoverHandle(cached=CACHED)
    core, counts = await follow(handle, handing_over)
    assert [t.token for _, t in handle.called("push_token")] == [77, 5]
    assert [t.cached_tokens for _, t in handle.called("push_token")] == [CACHED, None]   # the first carries it
    names = [name for name, _ in handle.calls]
    assert names == ["reserve", "push_token", "push_token", "write_kv", "take_over"]   # written before take-over
    assert handle.called("take_over") == [("r1", len(PROMPT))]
    assert core.sent == [m.Handover("r1", 2), m.Ack("r1")]
    assert counts == {"handovers": 1, "core_tokens": 2, "last_core_tokens": 2}


async def test_a_request_that_ends_on_the_core_never_moves():
    handle = HandoverHandle(cached=CACHED)
    handle.stop_at = 2                               # the core's Token 1 ends it
    core, counts = await follow(handle, handing_over)
    assert handle.called("take_over") == [] and core.sent == [m.Cancel("r1")]
    assert counts == {"finished_before": 1, "core_tokens": 2, "last_core_tokens": 2}


async def test_a_core_that_fails_after_the_first_token_leaves_the_rest_to_the_edge():
    handle = HandoverHandle(cached=CACHED)

    def events(request: m.PrefillRequest) -> list:
        return [core_sending(K)(request)[1], m.Error(ErrorCode.OVERLOADED, "gone", "r1")]
    core, counts = await follow(handle, events)
    assert handle.called("take_over") == [("r1", CACHED)] and core.sent == [m.Cancel("r1")]
    assert counts == {"recovered": 1, "core_tokens": 1, "last_core_tokens": 1}


async def test_a_token_from_a_core_not_asked_to_decode_fails_the_transfer():
    handle, pool = FakeHandle(cached=CACHED), ThreadPoolExecutor(1)
    core = FakeCore(lambda request: [m.Token("r1", 1, 5)])
    try:
        with pytest.raises(RemotePrefillFailed, match="a Token for a request that did not ask"):
            await remote(handle, core, pool).run(lambda client, tokens: "lossless", OutputSink(lambda out: None))
    finally:
        pool.shutdown()
    assert handle.called("release") == [("r1",)] and core.sent == [m.Cancel("r1")]
