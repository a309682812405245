"""asyncio transport over loopback with a bit-flipping relay: a corrupted frame fails only its request,
the connection goes on; unauthenticated connections hold only small buffers, released on close."""

import asyncio

import pytest

from edgecore.protocol import messages as m
from edgecore.protocol import transport
from edgecore.protocol.errors import ErrorCode
from edgecore.protocol.framing import FIXED_SIZE, HANDSHAKE_LIMITS, pack_fixed
from edgecore.protocol.state import KVData
from edgecore.protocol.transport import connect
from tests.protocol.pairs import CODECS, FP, SECRET
from tests.protocol.relay import FrameRelay
from tests.protocol.test_transport import FAST, start

pytestmark = pytest.mark.timeout(30)
HEADER_BIT = (FIXED_SIZE + 3) * 8 + 1      # a bit inside the msgpack header of a frame


async def through_relay(corrupt, handler=None):
    server, port = await start(handler) if handler else await start()
    relay = FrameRelay(port, corrupt)
    relay_port = await relay.start()
    peer = await connect("127.0.0.1", relay_port, secret=SECRET, fingerprint=FP, codecs=CODECS, timeouts=FAST)
    return server, relay, peer


async def test_flipped_prefill_done_fails_only_that_request():
    server, relay, peer = await through_relay(
        lambda d, ftype, n, _: HEADER_BIT if (d, ftype, n) == ("s2c", 7, 1) else None)
    async with server:
        await peer.send(m.PrefillRequest("r1", [1, 2, 3]))
        assert isinstance(await peer.recv(), KVData)
        err = await peer.recv()          # the corrupted PrefillDone never arrives; the core names r1
        assert isinstance(err, m.Error) and err.request_id == "r1" and err.code == ErrorCode.CHECKSUM
        await peer.send(m.PrefillRequest("r2", [1, 2, 3]))          # the same connection goes on
        assert isinstance(await peer.recv(), KVData)
        done = await peer.recv()
        assert isinstance(done, m.PrefillDone) and done.request_id == "r2" and done.first_token == 7
        assert relay.flipped == [("s2c", 7, HEADER_BIT)]
        await peer.close()
        await relay.stop()


async def test_flipped_prefill_request_is_reported_to_the_edge():
    server, relay, peer = await through_relay(
        lambda d, ftype, n, _: HEADER_BIT if (d, ftype, n) == ("c2s", 5, 1) else None)
    async with server:
        await peer.send(m.PrefillRequest("r1", [1, 2, 3]))
        err = await peer.recv()
        assert isinstance(err, m.Error) and err.request_id == "r1" and err.code == ErrorCode.CHECKSUM
        await peer.send(m.PrefillRequest("r2", [4]))
        assert isinstance(await peer.recv(), KVData)
        await peer.close()
        await relay.stop()


async def test_flipped_ack_is_sent_again():
    acks = []

    async def records_acks(peer):
        while True:
            msg = await peer.recv()
            if isinstance(msg, m.Ack):
                acks.append(msg.request_id)
    server, relay, peer = await through_relay(
        lambda d, ftype, n, _: HEADER_BIT if (d, ftype, n) == ("c2s", 8, 1) else None, records_acks)
    async with server:
        await peer.send(m.Ack("r1"))
        with pytest.raises(asyncio.TimeoutError):       # the edge's reader resends when the Reject arrives
            await asyncio.wait_for(peer.recv(), 0.5)
        assert acks == ["r1"] and relay.frames["c2s", 8] == 2
        await peer.close()
        await relay.stop()


async def test_unauthenticated_connections_hold_only_small_buffers(monkeypatch):
    conns = []

    class Recorded(transport.Connection):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            conns.append(self)
    monkeypatch.setattr(transport, "Connection", Recorded)
    server, port = await start()
    async with server:
        writers = []
        for i in range(32):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            if i % 2:     # announces a 64 MiB frame: refused at once
                writer.write(pack_fixed(1, 100, 64 << 20))
            else:         # announces a frame of the largest allowed size, then stalls half-way
                writer.write(pack_fixed(1, HANDSHAKE_LIMITS.max_header, 0) + b"\x00" * 2000)
            writers.append((reader, writer))
        await asyncio.sleep(0.3)
        assert len(conns) == 32
        assert max(c.parser.capacity for c in conns) <= HANDSHAKE_LIMITS.max_buffer
        refused = [await asyncio.wait_for(r.read(), 3) for r, _ in writers[1::2]]
        assert all(b"exceeds the limit" in data for data in refused)
        for _, writer in writers:
            writer.close()
        await asyncio.sleep(0.3)
        assert all(c.parser.capacity == 0 for c in conns)      # released when each connection closed
