"""The core's `PrefillService` on a scripted engine handle (tests/shared/fake_handle.py), without sockets or a
model: a PrefillRequest in → one engine request admitted (prefill-only, in the edge connection's group) → the
request's KV and then PrefillDone queued for the session's sender; Ack frees it; an engine refusal is an Error
to the edge; with decode handover the request decodes here and its tokens go ahead of queued KV."""

from types import SimpleNamespace

import pytest
import torch

from edgecore.core.kv_sender import LayerSender
from edgecore.core.metrics import CoreMetrics
from edgecore.core.prefill_service import PrefillService, Session
from edgecore.core.transfer import KVSend, TransferState
from edgecore.protocol import messages as m
from edgecore.protocol.errors import ErrorCode
from edgecore.shared.engine.handle import EngineRequest
from edgecore.shared.errors import RequestError
from edgecore.shared.kv.transfer import KVSlice
from tests.shared.fake_handle import FakeHandle, output

pytestmark = pytest.mark.timeout(30)

PROMPT = list(range(3, 40))         # 37 tokens


class FakePeer:
    """What the service uses of a protocol connection: its negotiated facts and `send`."""

    def __init__(self, handover: bool = False) -> None:
        self.conn = SimpleNamespace(peer_codecs=["lossless", "raw"], handover=handover, session=b"")
        self.peername = ("edge", 1)
        self.sent: list[m.Message] = []

    async def send(self, msg: m.Message) -> None:
        self.sent.append(msg)


def service(handle: FakeHandle, parallel: bool = False, **limits) -> PrefillService:
    streamer: LayerSender = SimpleNamespace(register=lambda t: None, forget=lambda i: None, mode="stream",
                                              rope=None, step_scales=None)   # type: ignore[assignment]
    return PrefillService(handle, streamer, CoreMetrics(), encoder_pool=None, dtype_name="float32",
                          lease_seconds=30.0, parallel=parallel, **limits)


def queued(session: Session) -> list:
    items = []
    while not session.outbox.empty():
        items.append(session.outbox.get_nowait())
    return items


def admitted(handle: FakeHandle) -> EngineRequest:
    (request, _sink), = handle.called("submit")
    return request


async def test_a_prefill_request_runs_prefill_only_and_queues_its_kv_then_prefill_done():
    handle = FakeHandle()
    svc, session = service(handle, parallel=True), Session(FakePeer())      # parallel, no direct streams: gathered
    internal = f"s{session.id}/r1"
    cfg = handle.config
    k = torch.randn(cfg.num_hidden_layers, len(PROMPT), cfg.num_key_value_heads, cfg.head_dim)
    handle.kv[internal] = [KVSlice(0, 0, len(PROMPT), 0, k, k.clone())]
    handle.outputs[internal] = [output(internal, 42, prompt_tokens=len(PROMPT), cached=5)]
    await svc._prefill(session, m.PrefillRequest("r1", PROMPT, codecs=["lossless"], group="chat-7"))

    request = admitted(handle)
    assert request.request_id == internal and request.prompt == PROMPT and request.prefill_only
    assert request.group == f"s{session.id}/chat-7" and request.params.max_tokens == 1
    assert handle.called("read_kv") == [(internal, 0, len(PROMPT))]
    items = queued(session)
    sends, done = items[:-1], items[-1]
    assert sends and all(isinstance(s, KVSend) for s in sends)
    assert {layer for s in sends for layer in range(s.piece.layer, s.piece.layer + s.piece.num_layers)} == \
        set(range(cfg.num_hidden_layers))
    assert isinstance(done, m.PrefillDone) and done.request_id == "r1" and done.first_token == 42
    assert done.num_tokens == len(PROMPT) and done.cached_tokens == 5
    transfer = session.transfers["r1"]
    assert transfer.state is TransferState.LEASED and transfer.lease is not None

    svc._release(session, "r1")                                              # the edge's Ack
    assert transfer.state is TransferState.RELEASED and not session.transfers
    assert handle.called("abort") == [(internal,)] and handle.called("drop_direct_route") == [(internal,)]


async def test_an_engine_refusal_is_an_error_to_the_edge_and_nothing_is_kept():
    handle = FakeHandle()
    handle.refuse = RequestError("the prompt is too long")
    peer = FakePeer()
    svc, session = service(handle), Session(peer)
    await svc._prefill(session, m.PrefillRequest("r2", PROMPT, codecs=["lossless"]))
    assert admitted(handle).group == f"s{session.id}/r2"        # no group given: the request alone
    (error,) = peer.sent
    assert isinstance(error, m.Error) and error.code == ErrorCode.BAD_REQUEST and "too long" in error.message
    assert not session.transfers and queued(session) == []


async def test_a_bad_sampling_spec_is_refused_before_the_engine():
    handle = FakeHandle()
    session = Session(FakePeer())
    await service(handle)._prefill(session, m.PrefillRequest("r9", PROMPT, codecs=["lossless"],
                                                             sampling=m.SamplingSpec(temperature=-1.0)))
    (error,) = queued(session)
    assert handle.calls == [] and error.code == ErrorCode.BAD_REQUEST and not session.transfers


async def test_a_request_without_a_shared_codec_never_reaches_the_engine():
    handle, session = FakeHandle(), Session(FakePeer())
    await service(handle)._prefill(session, m.PrefillRequest("r3", PROMPT, codecs=["q3e"]))
    (error,) = queued(session)
    assert handle.calls == [] and isinstance(error, m.Error) and error.code == ErrorCode.CODEC


async def test_with_decode_handover_the_core_decodes_and_its_tokens_go_first():
    handle = FakeHandle()
    svc, session = service(handle), Session(FakePeer(handover=True))
    internal = f"s{session.id}/r4"
    handle.outputs[internal] = [output(internal, 10, finished=False), output(internal, 11, finished=False),
                                output(internal, 12, reason="length")]
    await svc._prefill(session, m.PrefillRequest("r4", PROMPT, codecs=["lossless"], core_decode=2, group="g"))

    request = admitted(handle)
    assert not request.prefill_only and request.params.max_tokens == 3 and request.params.ignore_eos
    assert request.group == f"s{session.id}/g"
    items = queued(session)
    assert isinstance(items[0], m.PrefillDone) and items[0].first_token == 10
    assert [(t.position, t.token_id) for t in items[1:3]] == [(1, 11), (2, 12)]
    assert isinstance(items[3], m.DecodeStop) and items[3].reason == "bound" and items[3].position == 3
    svc._release(session, "r4")
    assert handle.called("abort") == [(internal,)]
