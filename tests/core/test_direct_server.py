"""A worker rank's stream server, in process: routes in, that rank's KV out on the edge's stream connection."""

import asyncio

import pytest
import torch

from edgecore.core.ranks import owns_kv
from edgecore.core.direct_server import DirectServer
from edgecore.protocol import messages as m
from edgecore.protocol.kv import decode_chunk
from edgecore.protocol.state import KVData
from edgecore.protocol.transport import PeerError, connect
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.engine.step_plan import StepRoutes
from edgecore.shared.models.fingerprint import model_fingerprint
from edgecore.shared.kv.transfer import DirectRoute
from edgecore.shared.kv.wire import from_bits
from tests.conftest import MODEL_DIR, make_engine

SECRET = b"stream-secret"


@pytest.fixture
def served():
    engine = make_engine()
    fp = model_fingerprint(MODEL_DIR, engine.config)
    server = DirectServer(engine.pool, engine.model, "127.0.0.1", SECRET, fp, ["raw", "lossless"], "float32",
                          head_start=1, name="rank1")
    server.start()
    yield engine, server, fp
    server.close()


async def test_routed_request_streams_each_layer_with_this_ranks_offsets(served):
    engine, server, fp = served
    peer = await connect("127.0.0.1", server.port, secret=SECRET, fingerprint=fp, codecs=["raw", "lossless"],
                         session="edge-1")
    try:
        for _ in range(100):                   # the server registers the session after its handshake
            if "edge-1" in server.sessions:
                break
            await asyncio.sleep(0.01)
        prompt = list(range(5, 45))
        server.apply(StepRoutes(new={"s1/a": DirectRoute("a", "edge-1", "lossless", 8, len(prompt))}))
        engine.add_request("s1/a", prompt, SamplingParams(max_tokens=1), prefill_only=True)
        engine.step(on_layer=server.on_layer)
        layers = engine.config.num_hidden_layers
        chunks = [await asyncio.wait_for(peer.recv(), 10) for _ in range(layers)]
        assert all(isinstance(c, KVData) for c in chunks)
        assert sorted(c.chunk.layer_start for c in chunks) == list(range(layers))
        for ev in chunks:
            c = ev.chunk
            assert (c.request_id, c.head_start, c.token_start, c.token_end) == ("a", 1, 8, len(prompt))
            k, v = decode_chunk(ev)
            ref_k, ref_v = engine.read_kv("s1/a", c.layer_start, 8)
            assert torch.equal(from_bits(k, c.dtype)[0], ref_k) and torch.equal(from_bits(v, c.dtype)[0], ref_v)
        assert server.streamer.remote == {}    # forgotten once its last tokens left
        # A dropped route is cancelled before it sends anything.
        server.apply(StepRoutes(new={"s1/b": DirectRoute("b", "edge-1", "raw", 0, 4)}))
        server.apply(StepRoutes(drop=["s1/b"]))
        assert server.streamer.remote == {}
        # The stream connection carries KV only.
        await peer.send(m.PrefillRequest("x", [1, 2, 3]))
        err = await asyncio.wait_for(peer.recv(), 10)
        assert isinstance(err, m.Error) and err.request_id == "x" and "only carries KV" in err.message
    finally:
        await peer.close()


async def test_stream_connection_needs_a_session(served):
    _, server, fp = served
    peer = await connect("127.0.0.1", server.port, secret=SECRET, fingerprint=fp, codecs=["raw"])
    with pytest.raises(PeerError, match="session id"):
        await asyncio.wait_for(peer.recv(), 10)


def test_replicated_kv_heads_are_streamed_by_one_rank_each():
    assert [owns_kv(r, 4, 2) for r in range(4)] == [True, False, True, False]
    assert [owns_kv(r, 2, 4) for r in range(2)] == [True, True]
    assert [owns_kv(r, 4, 1) for r in range(4)] == [True, False, False, False]


async def test_edge_client_attaches_to_stream_ports_and_reattaches(served):
    """A CoreClient follows Welcome.streams with its session id, and reopens a dropped stream connection."""
    from edgecore.edge.core_client import CoreClient
    from edgecore.protocol.transport import serve
    _, server, fp = served

    async def main_port(peer):                # stands in for rank 0: only the handshake matters here
        while True:
            await peer.recv()
    main = await serve(main_port, secret=SECRET, fingerprint=fp, codecs=["raw"], streams=[server.port])
    client = CoreClient("127.0.0.1", main.sockets[0].getsockname()[1], secret=SECRET, fingerprint=fp,
                        codecs=["raw"])
    try:
        await client.connect()
        assert client.direct and len(client.direct_peers) == 1
        session = client.peer.conn.session
        for _ in range(100):
            if session in server.sessions:
                break
            await asyncio.sleep(0.01)
        assert session in server.sessions      # the rank knows the edge by its main connection's session
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(server.sessions[session].peer.close(),
                                                                   server.loop))
        for _ in range(100):
            if not client.direct:
                break
            await asyncio.sleep(0.01)
        assert not client.direct               # requests would now come gathered from rank 0
        await client.connect_direct()
        assert client.direct
    finally:
        await client.close()
        main.close()
