"""A connection's bounds at the core, without sockets: the outbox (urgent items first, the KV byte count, room),
the cap on requests in flight (one beyond is answered OVERLOADED and never reaches the engine), the cap on
requests in the engine at once, and the KV byte bound reaching the engine's layer hook (it stops copying while
the sender is blocked; everything arrives, exactly once, when the sender drains)."""

import asyncio

import pytest
import torch

from edgecore.core.kv_sender import LayerSender, queue_rest
from edgecore.core.outbox import Outbox
from edgecore.core.transfer import KVSend, Transfer
from edgecore.protocol import messages as m
from edgecore.protocol.errors import ErrorCode
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.kv.transfer import KVSlice
from tests.conftest import make_engine
from tests.core.test_prefill_service_unit import PROMPT, FakePeer, queued, service
from edgecore.core.prefill_service import Session
from tests.shared.fake_handle import FakeHandle, output

pytestmark = pytest.mark.timeout(60)


def kv(tokens: int, start: int = 0) -> KVSlice:
    k = torch.zeros(1, tokens, 2, 32)
    return KVSlice(1, start, start + tokens, 0, k, k.clone())


async def test_the_outbox_counts_kv_bytes_and_says_when_there_is_room():
    box = Outbox(bound=4 * 512)                 # room for 4 tokens of `kv` (512 B each, K and V)
    t = Transfer("i", "r", box, "raw", 100)
    assert box.reserve(8 * 512)                 # an empty outbox takes a slice of any size: a transfer moves
    assert not box.reserve(1)                   # over the bound: refused, nothing counted
    assert box.nbytes == 8 * 512
    box.put(KVSend(t, kv(8)), reserved=True)
    box.put(m.PrefillDone("r", 1))              # messages count nothing
    box.put(m.Token("r", 1, 2), urgent=True)
    assert box.nbytes == 8 * 512 and len(box) == 3
    room = asyncio.ensure_future(box.drained())
    await asyncio.sleep(0)
    assert not room.done()
    assert isinstance(box.get_nowait(), m.Token)        # urgent first
    assert isinstance(box.get_nowait(), KVSend) and box.nbytes == 0
    await asyncio.wait_for(room, 1)
    box.put(KVSend(t, kv(4)))
    t.cancel()
    box.drop(t)                                 # a cancelled transfer's queued KV goes at once
    assert box.nbytes == 0 and len(box) == 1
    box.close()
    assert not box.reserve(1) and box.empty()   # the sender is gone: the hook copies nothing more
    await asyncio.wait_for(box.drained(items=0), 1)


async def test_a_request_beyond_the_in_flight_cap_is_overloaded_and_never_admitted():
    handle = FakeHandle()
    svc, session = service(handle, max_inflight=2), Session(FakePeer())
    accepted = [svc._accept(session, m.PrefillRequest(f"r{i}", PROMPT, codecs=["lossless"])) for i in range(3)]
    assert accepted[0] is not None and accepted[1] is not None and accepted[2] is None
    (error,) = queued(session)
    assert isinstance(error, m.Error) and error.code == ErrorCode.OVERLOADED and error.request_id == "r2"
    assert "busy" in error.message and "2 requests" in error.message
    assert handle.calls == [] and set(session.transfers) == {"r0", "r1"} and svc.counts["overloaded"] == 1
    svc._release(session, "r0", cancelled=True)          # one leaves: room for another
    assert svc._accept(session, m.PrefillRequest("r3", PROMPT, codecs=["lossless"])) is not None


async def test_one_connection_has_at_most_max_admitted_requests_in_the_engine():
    handle = FakeHandle()
    svc, session = service(handle, max_inflight=8, max_admitted=2), Session(FakePeer(), admitted=2)
    for i in range(4):
        handle.outputs[f"s{session.id}/r{i}"] = [output(f"s{session.id}/r{i}", 5, finished=False)]  # never ends
    tasks = [asyncio.create_task(svc._prefill(session, m.PrefillRequest(f"r{i}", PROMPT, codecs=["lossless"])))
             for i in range(4)]
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(handle.called("submit")) == 2 and len(session.transfers) == 4      # two wait here, in flight
    tasks[0].cancel()
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(handle.called("submit")) == 3
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class EngineReader:
    """What `queue_rest` asks of a handle, over an in-process engine."""

    def __init__(self, engine):
        self.engine, self.config = engine, engine.config
        self.kv_bytes_per_token = sum(k[0].nbytes + v[0].nbytes for k, v in zip(engine.pool.k, engine.pool.v))

    async def read_kv(self, request_id, start, end):
        return self.engine.read_kv_slices(request_id, start, end)


async def test_the_layer_hook_stops_copying_at_the_bound_and_the_rest_arrives_when_the_sender_drains():
    engine = make_engine()
    loop = asyncio.get_running_loop()
    streamer = LayerSender(engine.pool, engine.model, loop)
    prompt = torch.randint(2, 250, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    layers = engine.config.num_hidden_layers
    per_layer = engine.pool.k[0][0].nbytes + engine.pool.v[0][0].nbytes
    bound = 64 * 1024                       # less than one layer of the prompt (300 × 512 B)
    box = Outbox(bound)
    req = Transfer("c", "r", box, "raw", len(prompt), 4)
    streamer.register(req)
    reads = []
    read = engine.pool.read
    engine.pool.read = lambda layer, slots: reads.append(len(slots)) or read(layer, slots)
    engine.add_request("c", prompt, SamplingParams(max_tokens=1, temperature=0), prefill_only=True)
    while engine.has_unfinished():          # the engine thread's steps; the sender takes nothing meanwhile
        await asyncio.to_thread(engine.step, streamer.on_layer)
    await asyncio.sleep(0.05)               # the hook's slices reach the loop
    assert req.paused and reads == [len(prompt) - 4]     # one layer copied (into an empty outbox), then none
    assert box.nbytes == (len(prompt) - 4) * per_layer and len(box) == 1
    engine.pool.read = read

    got, most = [], [0]

    async def sender():
        while True:
            item = await box.get()
            most[0] = max(most[0], box.nbytes)
            got.append(item.piece)
            await asyncio.sleep(0)
    drain = asyncio.create_task(sender())
    await asyncio.wait_for(queue_rest(EngineReader(engine), req), 30)
    while len(box):
        await asyncio.sleep(0.01)
    drain.cancel()
    assert most[0] <= bound                 # read back in windows as room came
    for layer in range(layers):             # every layer's tokens [4, 300) exactly once, the pool's values
        mine = sorted((p for p in got if p.layer <= layer < p.layer + p.num_layers), key=lambda p: p.token_start)
        assert [p.token_start for p in mine][0] == 4 and mine[-1].token_end == len(prompt)
        assert all(a.token_end == b.token_start for a, b in zip(mine, mine[1:]))
        ref_k, ref_v = engine.read_kv("c", layer, 4)
        k = torch.cat([p.k[layer - p.layer] for p in mine])
        v = torch.cat([p.v[layer - p.layer] for p in mine])
        assert torch.equal(k, ref_k) and torch.equal(v, ref_v)
    assert req.sent_until == len(prompt)
    engine.release("c")


async def test_a_full_outbox_delays_prefill_done_until_the_kv_is_queued():
    """The service's side of the bound: a paused transfer's rest, then PrefillDone, in that order."""
    handle = FakeHandle()
    svc, session = service(handle, outbox_bytes=64 * 1024), Session(FakePeer(), outbox_bytes=64 * 1024)
    internal = f"s{session.id}/r1"
    cfg = handle.config
    k = torch.randn(cfg.num_hidden_layers, len(PROMPT), cfg.num_key_value_heads, cfg.head_dim)
    handle.kv[internal] = [KVSlice(0, 0, len(PROMPT), 0, k, k.clone())]
    handle.outputs[internal] = [output(internal, 42, prompt_tokens=len(PROMPT))]
    req = svc._accept(session, m.PrefillRequest("r1", PROMPT, codecs=["lossless"]))
    req.paused, req.needed = True, [0] * cfg.num_hidden_layers
    req.layer_until = [len(PROMPT)] + [10] * (cfg.num_hidden_layers - 1)   # layer 0 left whole, the rest from 10
    await svc._start(session, req, m.PrefillRequest("r1", PROMPT, codecs=["lossless"]))
    items = queued(session)
    assert isinstance(items[-1], m.PrefillDone)
    pieces = [i.piece for i in items[:-1]]
    assert [(p.layer, p.num_layers, p.token_start, p.token_end) for p in pieces] == \
        [(1, cfg.num_hidden_layers - 1, 10, len(PROMPT))]
    assert handle.called("read_kv") == [(internal, 10, len(PROMPT))]


def test_the_default_limits():
    svc = service(FakeHandle())
    assert svc.max_inflight == 64 and svc.max_admitted == 32 and svc.outbox_bytes == 64 * 1024 * 1024
