"""Placing a LoRA request (edge/node.py, edge/core_client.py): a core that does not advertise the "lora"
capability (an older core, which drops PrefillRequest's unknown trailing adapter fields and would prefill with the
base model) never gets a request with an adapter: the router skips it, `CoreClient.prefill` refuses it, and with
no other core the edge prefills the request itself. Base-model requests still go to it. No sockets, no model."""

import time
from types import SimpleNamespace

import pytest

from edgecore.edge.core_choice import CoreChoice
from edgecore.edge.core_client import CoreClient, CoreRouter
from edgecore.edge.peer_pull import PeerPull
from edgecore.edge.node import EdgeConfig, EdgeNode
from edgecore.edge.metrics import EdgeMetrics
from edgecore.edge.placement import PrefillModel
from edgecore.protocol import messages as m
from edgecore.protocol.transport import PeerError
from edgecore.shared.engine.handle import EngineRequest, OutputSink
from edgecore.shared.engine.sampling_params import SamplingParams
from tests.shared.fake_handle import FakeHandle

pytestmark = pytest.mark.timeout(30)

OLD = [m.COMPACT_KV_PARAMS]                     # what a core before LoRA advertises
PARAMS = SamplingParams(max_tokens=4, temperature=0)


class FakePeer:
    def __init__(self, capabilities: list[str], rtt: float) -> None:
        self.closed, self.rtt, self.peer_load = False, rtt, 0
        self.conn = SimpleNamespace(peer_capabilities=capabilities)
        self.sent: list[m.Message] = []

    def unresponsive(self, after: float) -> bool:
        return False

    async def send(self, msg: m.Message) -> None:
        self.sent.append(msg)


def core(port: int, capabilities: list[str], rtt: float = 0.01) -> CoreClient:
    client = CoreClient("10.0.0.1", port, secret=b"s", fingerprint="f" * 64, codecs=["lossless"])
    client.peer = FakePeer(capabilities, rtt)    # connected, handshake done
    return client


def edge(*cores: CoreClient) -> tuple[EdgeNode, FakeHandle, list[str]]:
    """An EdgeNode around a scripted handle and these cores (`_remote` records the core instead of sending)."""
    engine = object.__new__(EdgeNode)
    handle = FakeHandle()
    engine.config = EdgeConfig(model_dir="unused", local_prefill_below=0)     # never local by prompt length
    engine.handle, engine.metrics = handle, EdgeMetrics()
    engine.router = CoreRouter(list(cores))
    engine.prefill_model, engine.prompt_tokens_mean = PrefillModel(32), None
    engine.adapters = {"sql": "0123456789abcdef"}
    engine.peer_pull = PeerPull([], handle, engine.prefill_model, engine.metrics, None, None, 1.0)   # no peers
    remote: list[str] = []

    async def fake_remote(client: CoreClient, request: EngineRequest, sink: OutputSink | None, trace=None) -> None:
        remote.append(client.address)
    engine._remote = fake_remote
    return engine, handle, remote


def request(rid: str, adapter: str | None) -> EngineRequest:
    return EngineRequest(rid, list(range(3, 103)), PARAMS, adapter=adapter)


def test_the_router_picks_only_cores_that_serve_adapters_for_an_adapter():
    old, new = core(1, OLD, rtt=0.001), core(2, list(m.CAPABILITIES), rtt=0.1)
    assert m.LORA_ADAPTERS in m.CAPABILITIES            # this implementation advertises it
    router = CoreRouter([old, new])

    def pick(exclude=frozenset(), needs=None):
        best = CoreChoice(router.healthy(needs), list(range(3, 103)), None, PrefillModel()).best(exclude)
        return best.client if best is not None else None
    assert pick() is old                                 # the base model: the nearest core
    assert pick(needs=m.LORA_ADAPTERS) is new
    assert pick({new.address}, needs=m.LORA_ADAPTERS) is None
    assert CoreRouter([old]).healthy(m.LORA_ADAPTERS) == [] and CoreRouter([old]).healthy() == [old]


async def test_an_older_core_is_never_sent_an_adapter():
    old = core(1, OLD)
    with pytest.raises(PeerError, match="LoRA"):
        await old.prefill(m.PrefillRequest("r", [1, 2, 3], adapter="sql", adapter_fingerprint="0123456789abcdef"))
    assert old.peer.sent == [] and old.inflight == {}
    await old.prefill(m.PrefillRequest("b", [1, 2, 3]))                        # the base model: sent
    assert [r.request_id for r in old.peer.sent] == ["b"]


async def test_an_adapter_request_with_only_an_older_core_is_prefilled_at_the_edge():
    engine, handle, remote = edge(core(1, OLD))
    progress = SimpleNamespace(arrived=time.perf_counter(), placed_at=None, trace=None)
    assert await engine._open(request("lora", "sql"), OutputSink(lambda item: None), progress) is None
    assert remote == [] and "lora" in handle.requests                           # admitted here, never sent
    assert engine.metrics.local_prefills.labels("no_lora_core")._value.get() == 1
    core_used = await engine._open(request("base", None), OutputSink(lambda item: None), progress)
    assert core_used is not None and remote == ["10.0.0.1:1"]                  # the base model still goes there


async def test_an_adapter_request_goes_to_the_core_that_serves_adapters():
    engine, handle, remote = edge(core(1, OLD, rtt=0.001), core(2, list(m.CAPABILITIES), rtt=0.1))
    progress = SimpleNamespace(arrived=time.perf_counter(), placed_at=None, trace=None)
    used = await engine._open(request("lora", "sql"), OutputSink(lambda item: None), progress)
    assert used is not None and used.address == "10.0.0.1:2" and remote == ["10.0.0.1:2"]
    assert "lora" not in handle.requests
