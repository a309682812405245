"""In-process core with a real socket: KV leaves before the last layer is computed; leases and Ack."""

import asyncio

import pytest

from edgecore.core.server import CoreConfig, CoreServer
from edgecore.edge.core_client import CoreClient
from edgecore.protocol import messages as m
from edgecore.protocol.codecs.equant import FLAG_LOG_STEPS, FLAG_SHARED_CENTRE, HEADER
from edgecore.protocol.kv import decode_chunk
from edgecore.protocol.state import KVData
from edgecore.shared.models.config import EngineConfig, ModelConfig
from edgecore.shared.models.fingerprint import model_fingerprint
from edgecore.shared.kv.wire import codec_rope

pytestmark = pytest.mark.timeout(60)


async def test_first_chunks_leave_before_last_layer_is_computed(model_dir, tokenizer, heldout, tmp_path):
    core = CoreServer(CoreConfig(str(model_dir), b"s", port=0, http_port=None, data_dir=str(tmp_path),
                                 engine=EngineConfig(max_num_batched_tokens=64)))
    await core.start()
    client = CoreClient("127.0.0.1", core.port, secret=b"s", fingerprint=model_fingerprint(model_dir),
                        codecs=["lossless"])
    try:
        await client.connect()
        prompt = tokenizer.encode(heldout)[:900]
        events = await client.prefill(m.PrefillRequest("long", prompt, codecs=["lossless"]))
        chunks, done = [], None
        while done is None:
            ev = await asyncio.wait_for(events.get(), 30)
            if isinstance(ev, KVData):
                chunks.append(ev.chunk)
                decode_chunk(ev)
            else:
                done = ev
        assert isinstance(done, m.PrefillDone)
        assert done.timings["first_chunk_sent_ms"] < done.timings["last_layer_done_ms"]
        # Every layer × token arrived exactly once, in chunks of at most the step budget.
        covered = {}
        for c in chunks:
            covered[c.layer_start] = covered.get(c.layer_start, 0) + (c.token_end - c.token_start)
        assert covered == {layer: 900 for layer in range(4)}
        assert max(c.token_end - c.token_start for c in chunks) <= 64
        assert core.stats()["leases"] == 1 and core.stats()["blocks_used"] > 0
        await client.send(m.Ack("long"))
        for _ in range(100):
            if core.stats()["blocks_used"] == 0:
                break
            await asyncio.sleep(0.02)
        assert core.stats()["blocks_used"] == 0 and core.stats()["leases"] == 0
        # A repeated prefix is not recomputed at the core.
        events = await client.prefill(m.PrefillRequest("again", prompt[:800] + prompt[:50], codecs=["lossless"]))
        while not isinstance(ev := await asyncio.wait_for(events.get(), 30), m.PrefillDone):
            pass
        assert ev.cached_tokens >= 784
        await client.send(m.Ack("again"))
    finally:
        await client.close()
        await core.stop()


@pytest.mark.parametrize("old_edge", [False, True])
async def test_edge_layers_keep_layer0_at_the_core(model_dir, tokenizer, heldout, tmp_path, old_edge, monkeypatch):
    """edge_layers=1: no layer-0 chunk. Compact q*e parameters go only to an edge that advertises them (an
    older edge's Auth has no "kv-compact-params": it gets float16 parameters it can decode)."""
    if old_edge:
        monkeypatch.setattr(m, "CAPABILITIES", ())
    core = CoreServer(CoreConfig(str(model_dir), b"s", port=0, http_port=None, data_dir=str(tmp_path)))
    await core.start()
    client = CoreClient("127.0.0.1", core.port, secret=b"s", fingerprint=model_fingerprint(model_dir),
                        codecs=["lossless", "q4e"])
    try:
        await client.connect()
        assert (m.COMPACT_KV_PARAMS in client.peer.conn.capabilities) is not old_edge
        rope = codec_rope(ModelConfig.from_dir(model_dir))
        prompt = tokenizer.encode(heldout)[:100]
        events = await client.prefill(m.PrefillRequest("e", prompt, codecs=["q4e"], edge_layers=1))
        layers, flags = [], set()
        while not isinstance(ev := await asyncio.wait_for(events.get(), 30), m.PrefillDone):
            assert isinstance(ev, KVData)
            layers += range(ev.chunk.layer_start, ev.chunk.layer_end)
            flags.add(HEADER.unpack_from(bytes(ev.payload))[2])
            decode_chunk(ev, rope)
        assert sorted(layers) == [1, 2, 3]
        assert all(f & (FLAG_LOG_STEPS | FLAG_SHARED_CENTRE) == (0 if old_edge else FLAG_LOG_STEPS | FLAG_SHARED_CENTRE)
                   for f in flags), flags
        await client.send(m.Ack("e"))
    finally:
        await client.close()
        await core.stop()


async def test_lease_expiry_and_disconnect_free_kv(model_dir, tmp_path):
    core = CoreServer(CoreConfig(str(model_dir), b"s", port=0, http_port=None, data_dir=str(tmp_path), lease_seconds=0.2))
    await core.start()
    client = CoreClient("127.0.0.1", core.port, secret=b"s", fingerprint=model_fingerprint(model_dir),
                        codecs=["lossless"])
    try:
        await client.connect()
        events = await client.prefill(m.PrefillRequest("a", list(range(3, 200))))
        while not isinstance(await asyncio.wait_for(events.get(), 30), m.PrefillDone):
            pass
        assert core.stats()["blocks_used"] > 0
        await asyncio.sleep(0.5)          # no Ack: the lease expires
        assert core.stats()["blocks_used"] == 0
        await client.prefill(m.PrefillRequest("b", list(range(3, 600))))
        await client.close()              # edge vanishes mid-request
        for _ in range(100):
            if core.stats()["blocks_used"] == 0 and core.stats()["connections"] == 0:
                break
            await asyncio.sleep(0.02)
        assert core.stats()["blocks_used"] == 0 and core.stats()["remote_requests"] == 0
    finally:
        await core.stop()


async def test_bad_prefill_requests_get_request_errors(model_dir, tmp_path):
    core = CoreServer(CoreConfig(str(model_dir), b"s", port=0, http_port=None, data_dir=str(tmp_path)))
    await core.start()
    client = CoreClient("127.0.0.1", core.port, secret=b"s", fingerprint=model_fingerprint(model_dir),
                        codecs=["lossless"])
    try:
        await client.connect()
        for req, needle in ((m.PrefillRequest("x", [5] * 2000), "context length"),
                            (m.PrefillRequest("y", [5, 6], codecs=["zip"]), "codecs"),
                            (m.PrefillRequest("z", [99999]), "token ids"),
                            (m.PrefillRequest("w", [5, 6], edge_layers=2), "edge_layers"),
                            (m.PrefillRequest("v", [5, 6], edge_layers=-1), "edge_layers")):
            events = await client.prefill(req)
            err = await asyncio.wait_for(events.get(), 10)
            assert isinstance(err, m.Error) and needle in err.message and err.request_id == req.request_id
        assert client.healthy          # request errors keep the connection
    finally:
        await client.close()
        await core.stop()
