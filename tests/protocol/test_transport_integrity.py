"""asyncio transport over loopback with a bit-flipping relay: a corrupted frame fails only its request,
the connection goes on; unauthenticated connections hold only small buffers, released on close; an
old (version 1) peer gets an error it can read."""

import asyncio

import msgspec
import pytest

from edgecore.deploy.fault_relay import Fault, FaultRelay
from edgecore.protocol import messages as m
from edgecore.protocol import transport
from edgecore.protocol.errors import ErrorCode
from edgecore.protocol.framing import HANDSHAKE_LIMITS, LEGACY_VERSION, SEALED, pack_fixed
from edgecore.protocol.state import KVData
from edgecore.protocol.transport import connect
from tests.protocol.pairs import CODECS, FP, SECRET
from tests.protocol.test_transport import FAST, start

pytestmark = pytest.mark.timeout(30)
HEADER_BIT = 3 * 8 + 1      # a bit inside the (encrypted) msgpack header of a frame
# Sealed frames hide their message type (the fixed header says SEALED): the relay picks them by their order.
# Down: AuthOk is the 1st sealed frame, then each request's KVChunk and PrefillDone; up: Auth, then requests.


def flip_header_of(direction: str, frame_type: int, nth: int):
    """A relay plan that flips HEADER_BIT of the nth frame of frame_type going direction, nothing else."""
    fault = Fault("flip_message", direction, frame_type, 0, HEADER_BIT)
    return lambda d, ftype, n, _: fault if (d, ftype, n) == (direction, frame_type, nth) else None


async def through_relay(plan, handler=None):
    server, port = await start(handler) if handler else await start()
    relay = FaultRelay(("127.0.0.1", port), plan=plan)
    relay_port = await relay.start(("127.0.0.1", 0))
    peer = await connect("127.0.0.1", relay_port, secret=SECRET, fingerprint=FP, codecs=CODECS, timeouts=FAST)
    return server, relay, peer


async def test_flipped_prefill_done_fails_only_that_request():
    server, relay, peer = await through_relay(flip_header_of("down", SEALED, 3))      # r1's PrefillDone
    async with server:
        await peer.send(m.PrefillRequest("r1", [1, 2, 3]))
        assert isinstance(await peer.recv(), KVData)
        err = await peer.recv()          # the corrupted PrefillDone never arrives; the core names r1
        assert isinstance(err, m.Error) and err.request_id == "r1" and err.code == ErrorCode.CHECKSUM
        await peer.send(m.PrefillRequest("r2", [1, 2, 3]))          # the same connection goes on
        assert isinstance(await peer.recv(), KVData)
        done = await peer.recv()
        assert isinstance(done, m.PrefillDone) and done.request_id == "r2" and done.first_token == 7
        assert [(d, t) for d, t, _ in relay.log] == [("down", SEALED)]
        await peer.close()
        await relay.stop()


async def test_flipped_prefill_request_is_reported_to_the_edge():
    server, relay, peer = await through_relay(flip_header_of("up", SEALED, 2))        # r1's PrefillRequest
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
    server, relay, peer = await through_relay(flip_header_of("up", SEALED, 2), records_acks)     # the Ack
    async with server:
        await peer.send(m.Ack("r1"))
        with pytest.raises(asyncio.TimeoutError):       # the edge's reader resends when the Reject arrives
            await asyncio.wait_for(peer.recv(), 0.5)
        assert acks == ["r1"] and relay.frames["up", SEALED] == 3      # Auth, the Ack, the Ack again
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


async def test_an_old_edge_is_told_in_a_frame_it_can_read():
    server, port = await start()
    async with server:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        header = msgspec.msgpack.encode([1, [1], ["raw"], FP, b"n" * 32])          # a version-1 Hello
        writer.write(pack_fixed(1, len(header), 0, LEGACY_VERSION) + header)
        data = await asyncio.wait_for(reader.read(), 3)
        assert data[:5] == b"EDGC\x01" and data[5] == 10                         # a version-1 Error frame
        tag, code, message = msgspec.msgpack.decode(data[16:])[:3]
        assert code == ErrorCode.VERSION_MISMATCH and "version 2, the peer version 1" in message
        writer.close()


class _Paused:
    """A transport that records what the stream asks of it (no socket)."""

    def __init__(self):
        self.paused, self.closed, self.written = False, False, []

    def pause_reading(self):
        self.paused = True

    def resume_reading(self):
        self.paused = False

    def write(self, data):
        self.written.append(bytes(data))

    def writelines(self, parts):
        self.written += [bytes(p) for p in parts]

    def close(self):
        self.closed = True

    def get_extra_info(self, _):
        return None


async def test_a_bad_header_behind_a_large_frame_is_an_error_frame_and_a_close():
    """Reads that end inside a bad frame's fixed header while a large frame fills the buffer: the header is
    first parsed when the large frame is taken (`_Stream.taken`). That must end as any bad frame does (a
    PeerError, an Error frame, the connection closed), not as an exception out of `recv` that leaves the
    connection open and its reader dead."""
    from tests.protocol.pairs import handshake, new_pair
    client, server = new_pair()
    handshake(client, server)
    chunk = m.KVChunk("r", 0, 1, 0, 10, 0, 1, 64, "float32", "raw", 100_000, 200_000)
    small, large = server.send_bytes(m.PrefillDone("other", 1)), server.send_bytes(KVData(chunk, bytes(200_000)))
    bad = bytearray(server.send_bytes(m.PrefillDone("r", 5)))
    bad[9] ^= 1                                            # a length bit: the fixed header's CRC fails
    data = small + large + bytes(bad)
    stream, tr = transport._Stream(client), _Paused()
    stream.transport = tr
    peer = transport.Peer(client, stream, transport.Timeouts(heartbeat=0))
    pos = 0

    def arrive(upto: int) -> None:
        nonlocal pos
        while pos < upto and not tr.paused:
            buf = stream.get_buffer(-1)
            n = min(len(buf), upto - pos)
            buf[:n] = data[pos:pos + n]
            buf.release()
            pos += n
            stream.buffer_updated(n)

    arrive(len(small) + len(large) + 10)             # the bad frame's first bytes only
    assert isinstance(await peer.recv(1), m.PrefillDone)
    arrive(len(data))
    assert isinstance(await peer.recv(1), KVData)
    with pytest.raises(transport.PeerError, match="CRC"):
        await peer.recv(1)
    assert tr.closed and tr.written        # the Error frame, then the close
