"""The parts of the edge's remote prefill, each alone on a scripted engine handle (tests/shared/fake_handle.py),
without sockets or a model: the plan (built from its inputs, frozen, its PrefillRequest and receiver), the chunk
writer (inline and worker unpacks, the `written` barrier, failures kept for it, a drop), the handover follower
(token positions, a request that stops, Handover and take-over, recovery) and the metrics observer."""

import asyncio
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from edgecore.edge.chunk_writer import ChunkWriter
from edgecore.edge.handover_follower import HandoverFollower
from edgecore.protocol.kv_receiver import KVReceiver, TransferFailed
from edgecore.edge.metrics import EdgeMetrics
from edgecore.edge.prefill_plan import PrefillPlan, RemotePrefillSettings
from edgecore.edge.transfer_metrics import TransferMetrics
from edgecore.protocol import messages as m
from edgecore.protocol.handover import HandoverError, Phase
from edgecore.protocol.kv import SMALL_CHUNK_BYTES, encode_chunk
from edgecore.shared.engine.handle import EngineRequest, FirstToken
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.errors import RequestError
from tests.shared.fake_handle import FakeHandle

pytestmark = pytest.mark.timeout(30)

PROMPT = list(range(3, 103))          # 100 tokens
CACHED = 16
PARAMS = SamplingParams(max_tokens=8, temperature=0)


def request(params: SamplingParams = PARAMS, group: str | None = "chat-3") -> EngineRequest:
    return EngineRequest("r1", PROMPT, params, group=group)


def plan(core_decode: int = 0, codec: str = "lossless", params: SamplingParams = PARAMS) -> PrefillPlan:
    return PrefillPlan.build(request(params), CACHED, codec, RemotePrefillSettings(5.0, core_decode),
                             layer0_macs_per_token=0, core_decodes=core_decode > 0, direct=False)


def sample(metrics: EdgeMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": "model", **labels}) or 0.0


# ---- the plan -----------------------------------------------------------------------------------------------
def test_the_plan_is_built_from_its_inputs_and_frozen():
    settings = RemotePrefillSettings(2.5, core_decode=64, layer0_budget_macs=1e9)
    p = PrefillPlan.build(request(), CACHED, "int8", settings, layer0_macs_per_token=1000, core_decodes=True, direct=True)
    assert (p.request_id, p.prompt_ids, p.codec, p.skip_tokens, p.group) == ("r1", PROMPT, "int8", CACHED, "chat-3")
    assert p.core_decode == PARAMS.max_tokens - 1          # bounded by the request's own tokens
    assert p.edge_layers == 1                              # lossy, within the budget: layer 0 computed here
    assert p.deadline_ms == 2500 and p.direct
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.codec = "lossless"  # type: ignore[misc]


@pytest.mark.parametrize("codec, macs, budget, core_decodes, layers, limit", [
    ("lossless", 1000, 1e9, True, 0, 7),       # a lossless transfer promises the core's own bits: layer 0 travels
    ("int8", 1000, 1e3, True, 0, 7),           # over the budget
    ("int8", 0, 1e9, True, 0, 7),              # the engine cannot compute layer 0 alone
    ("int8", 1000, 1e9, False, 1, 0),          # a prefetch, or a core without decode handover: no core decode
])
def test_edge_layers_and_core_decode_follow_the_rules(codec, macs, budget, core_decodes, layers, limit):
    settings = RemotePrefillSettings(5.0, core_decode=64, layer0_budget_macs=budget)
    p = PrefillPlan.build(request(), CACHED, codec, settings, layer0_macs_per_token=macs, core_decodes=core_decodes,
                          direct=False)
    assert (p.edge_layers, p.core_decode) == (layers, limit)


def test_the_prefill_request_and_the_receiver_come_from_the_plan():
    p = plan(core_decode=4, codec="int8")
    sent = p.request()
    assert (sent.request_id, sent.token_ids, sent.codecs, sent.skip_tokens, sent.core_decode, sent.group,
            sent.deadline_ms, sent.direct) == ("r1", PROMPT, ["int8"], CACHED, 4, "chat-3", 5000, False)
    assert sent.sampling == m.SamplingSpec(**PARAMS.spec_fields())
    alone = PrefillPlan.build(request(group=None), CACHED, "lossless", RemotePrefillSettings(5.0),
                              layer0_macs_per_token=0, core_decodes=False, direct=False)
    assert alone.group is None and alone.request().group == ""     # the request alone
    receiver = p.receiver(FakeHandle().config)
    assert (receiver.total_tokens, receiver.skip_tokens) == (len(PROMPT), CACHED)
    assert receiver.direct                     # a decoding core's chunks may follow PrefillDone
    assert not plan().receiver(FakeHandle().config).direct


def test_a_token_keeps_its_logprobs_only_when_asked():
    assert plan().token(7, -0.5, [(7, -0.5)]) == FirstToken(7, None, [(7, -0.5)])
    asked = plan(params=SamplingParams(max_tokens=8, logprobs=1))
    assert asked.token(7, -0.5, [(7, -0.5)]) == FirstToken(7, -0.5, [(7, -0.5)])


# ---- the chunk writer ---------------------------------------------------------------------------------------
def chunk(tokens: int, token_start: int = CACHED):
    cfg = FakeHandle().config
    k = np.random.default_rng(0).standard_normal((cfg.num_hidden_layers, tokens, cfg.num_key_value_heads,
                                                  cfg.head_dim), dtype=np.float32).view(np.uint32)
    return encode_chunk("r1", k, k, layer_start=0, token_start=token_start, dtype="float32", codec="lossless",
                        total_tokens=len(PROMPT))


async def test_a_small_chunk_is_written_at_once():
    handle, pool = FakeHandle(), ThreadPoolExecutor(1)
    writer = ChunkWriter(handle, "r1", pool, None)
    data = chunk(4)
    assert data.chunk.raw_len < SMALL_CHUNK_BYTES
    writer.write(data)
    assert [(p.token_start, p.token_end) for p in handle.written] == [(CACHED, CACHED + 4)] and not writer.in_flight
    pool.shutdown()


async def test_a_large_chunk_unpacks_in_a_worker_and_the_barrier_waits_for_its_write():
    handle, pool, gate = FakeHandle(), ThreadPoolExecutor(1), threading.Event()
    pool.submit(gate.wait)                     # the one worker is busy: the unpack waits behind it
    writer = ChunkWriter(handle, "r1", pool, None)
    data = chunk(len(PROMPT) - CACHED)
    assert data.chunk.raw_len >= SMALL_CHUNK_BYTES
    writer.write(data)
    assert handle.written == [] and len(writer.in_flight) == 1
    barrier = asyncio.ensure_future(writer.written())
    await asyncio.sleep(0.05)
    assert not barrier.done()                  # nothing may read the KV yet
    gate.set()
    await asyncio.wait_for(barrier, 10)
    assert [(p.token_start, p.token_end) for p in handle.written] == [(CACHED, len(PROMPT))]
    assert not writer.in_flight
    pool.shutdown()


async def test_a_failed_unpack_is_raised_by_the_barrier():
    handle, pool = FakeHandle(), ThreadPoolExecutor(1)
    writer = ChunkWriter(handle, "r1", pool, None)
    data = chunk(len(PROMPT) - CACHED)
    data.payload = bytes(data.payload)[:-100]  # a payload shorter than its header says
    writer.write(data)
    with pytest.raises(Exception):             # noqa: B017 (the codec's own error)
        await writer.written()
    assert handle.written == [] and writer.error is not None
    pool.shutdown()


async def test_a_failed_first_layer_write_fails_the_transfer_at_the_barrier():
    class Failing(FakeHandle):
        async def write_first_layer_kv(self, request_id: str) -> None:
            raise RuntimeError("no room")
    handle, pool = Failing(), ThreadPoolExecutor(1)
    writer = ChunkWriter(handle, "r1", pool, None)
    writer.first_layer()
    with pytest.raises(TransferFailed, match="layer 0's KV at the edge: no room"):
        await writer.written()
    pool.shutdown()


async def test_a_dropped_writer_writes_nothing_still_in_flight():
    handle, pool, gate = FakeHandle(), ThreadPoolExecutor(1), threading.Event()
    busy = pool.submit(gate.wait)
    writer = ChunkWriter(handle, "r1", pool, None)
    writer.write(chunk(len(PROMPT) - CACHED))
    writer.drop()
    assert writer.dropped and not writer.in_flight
    gate.set()
    busy.result(5)
    await writer.written()                     # nothing left to wait for
    await asyncio.sleep(0.05)
    assert handle.written == []
    pool.shutdown()


# ---- the handover follower ----------------------------------------------------------------------------------
class StoppingHandle(FakeHandle):
    """push_token says the request finished at the `stop_at`-th push; refuses a token id of -1."""

    def __init__(self, stop_at: int = 0) -> None:
        super().__init__(cached=CACHED)
        self.stop_at = stop_at

    async def push_token(self, request_id: str, token: FirstToken) -> bool:
        await super().push_token(request_id, token)
        if token.token < 0:
            raise RequestError("token -1 is out of the vocabulary")
        return len(self.called("push_token")) == self.stop_at


def follower(handle: FakeHandle, core_decode: int = 4) -> tuple[HandoverFollower, TransferMetrics, KVReceiver]:
    p = plan(core_decode)
    receiver, metrics = p.receiver(handle.config), TransferMetrics(EdgeMetrics(), {})
    return HandoverFollower(handle, p, receiver.fail, metrics), metrics, receiver


def done(first: int = 77) -> m.PrefillDone:
    return m.PrefillDone("r1", first, -0.1, [], len(PROMPT), CACHED)


class Sent:
    def __init__(self) -> None:
        self.sent: list[m.Message] = []

    async def send(self, msg: m.Message) -> None:
        self.sent.append(msg)


async def test_the_follower_pushes_each_token_in_position_order():
    handle = FakeHandle(cached=CACHED)
    f, metrics, _ = follower(handle)
    assert f.awaiting_first
    await f.on_first(done())
    await f.on_token(m.Token("r1", 1, 5))
    await f.on_token(m.Token("r1", 2, 6))
    assert [t.token for _, t in handle.called("push_token")] == [77, 5, 6]
    assert f.core_tokens == 3 and not f.awaiting_first and not f.finished
    assert sample(metrics.metrics, "edgecore:handover_tokens_received_total") == 2   # the first is not counted
    with pytest.raises(HandoverError, match="expected 3"):
        await f.on_token(m.Token("r1", 4, 8))      # a gap
    assert len(handle.called("push_token")) == 3


async def test_a_token_beyond_the_limit_breaks_the_rules():
    f, _, _ = follower(FakeHandle(cached=CACHED), core_decode=1)
    await f.on_first(done())
    await f.on_token(m.Token("r1", 1, 5))
    with pytest.raises(HandoverError, match="beyond"):
        await f.on_token(m.Token("r1", 2, 6))


async def test_a_request_that_stops_on_a_core_token_never_moves():
    handle = StoppingHandle(stop_at=2)
    f, _, _ = follower(handle)
    await f.on_first(done())
    await f.on_token(m.Token("r1", 1, 5))           # the engine's stop rules end the request here
    assert f.finished and f.core.phase is Phase.FINISHED
    await f.on_token(m.Token("r1", 2, 6))           # in flight when it ended: dropped
    assert len(handle.called("push_token")) == 2 and f.core.dropped == 1


async def test_a_refused_push_fails_the_transfer():
    handle = StoppingHandle()
    f, _, receiver = follower(handle)
    with pytest.raises(TransferFailed, match="vocabulary"):
        await f.on_first(done(first=-1))
    assert receiver.failure == "token -1 is out of the vocabulary"


async def test_handover_at_the_next_position_then_the_cores_stop():
    handle, client = FakeHandle(cached=CACHED), Sent()
    f, _, _ = follower(handle)
    await f.on_first(done())
    await f.on_token(m.Token("r1", 1, 5))
    await f.hand_over(client)
    assert client.sent == [m.Handover("r1", 2)]
    assert handle.called("take_over") == [("r1", len(PROMPT))]
    await f.on_token(m.Token("r1", 2, 6))           # decoded before the core read the Handover: dropped
    assert len(handle.called("push_token")) == 2
    events: asyncio.Queue = asyncio.Queue()
    for ev in (m.Token("r1", 3, 7), m.DecodeStop("r1", 2, "handover")):
        events.put_nowait(ev)
    await f.await_stop(events)
    assert f.core.stop_reason == "handover" and f.outcome == "taken_over"


async def test_a_core_that_refused_to_decode_is_counted_as_refused():
    handle, client = FakeHandle(cached=CACHED), Sent()
    f, _, _ = follower(handle)
    await f.on_first(done())
    f.on_stop(m.DecodeStop("r1", 1, "refused"))
    assert f.core.phase is Phase.STOPPED
    await f.hand_over(client)
    await f.await_stop(asyncio.Queue())             # the reason is in already: no wait
    assert client.sent == [m.Handover("r1", 1)] and f.outcome == "refused"


async def test_recovery_computes_the_rest_from_the_cached_prefix():
    handle = FakeHandle(cached=CACHED)
    f, metrics, _ = follower(handle)
    await f.on_first(done())
    assert await f.recover()
    assert handle.called("take_over") == [("r1", CACHED)] and f.finished
    assert metrics.counts == {"recovered": 1, "core_tokens": 1, "last_core_tokens": 1}
    assert sample(metrics.metrics, "edgecore:handover_requests_total", outcome="core_failed") == 1

    class Ended(FakeHandle):
        async def take_over(self, request_id: str, kv_until: int) -> None:
            raise RequestError("r1 ended")
    f, metrics, _ = follower(Ended(cached=CACHED))
    await f.on_first(done())
    assert not await f.recover() and metrics.counts == {}


# ---- the metrics observer -----------------------------------------------------------------------------------
def test_a_transfer_is_counted_by_codec():
    observer = TransferMetrics(EdgeMetrics())
    observer.transfer("int8", 100, 400, 0.25)
    metrics = observer.metrics
    assert sample(metrics, "edgecore:remote_prefills_total", codec="int8") == 1
    assert sample(metrics, "edgecore:kv_bytes_received_total", codec="int8") == 100
    assert sample(metrics, "edgecore:kv_raw_bytes_received_total", codec="int8") == 400
    assert sample(metrics, "edgecore:kv_compression_ratio", codec="int8") == 4.0
    assert sample(metrics, "edgecore:kv_transfer_seconds_count", codec="int8") == 1


def test_handover_tallies():
    counts: dict = {}
    observer = TransferMetrics(EdgeMetrics(), counts)
    observer.handover(3, "handovers", "taken_over")
    observer.handover(1, "handovers", "refused")
    observer.handover(2, "finished_before", "finished_on_core")
    assert counts == {"handovers": 2, "refused": 1, "finished_before": 1, "core_tokens": 6, "last_core_tokens": 2}
    metrics = observer.metrics
    assert sample(metrics, "edgecore:handover_requests_total", outcome="taken_over") == 1
    assert sample(metrics, "edgecore:handover_core_tokens_count") == 1     # taken over only
    observer.core_failed(computed_here=False)
    observer.core_failed(computed_here=True)
    assert sample(metrics, "edgecore:core_failovers_total") == 2
    assert sample(metrics, "edgecore:local_prefills_total", reason="core_failed") == 1
