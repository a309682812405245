"""asyncio transport over loopback: handshake, KV streaming, failures with clear errors and timeouts."""

import asyncio
import shutil
import subprocess

import numpy as np
import pytest

from edgecore.protocol import messages as m
from edgecore.protocol.errors import ErrorCode
from edgecore.protocol.framing import pack_fixed
from edgecore.protocol.kv import decode_chunk
from edgecore.protocol.transport import PeerError, Timeouts, connect, serve, tls_context
from tests.protocol.pairs import CODECS, FP, SECRET, sample_kv

pytestmark = pytest.mark.timeout(30)
FAST = Timeouts(handshake=2.0, idle=2.0, heartbeat=0)


async def echo_core(peer):
    """Answers each PrefillRequest with one KV chunk and PrefillDone."""
    while True:
        msg = await peer.recv()
        if isinstance(msg, m.PrefillRequest):
            await peer.send(sample_kv()[2])
            await peer.send(m.PrefillDone(msg.request_id, 7, -0.1))


async def start(handler=echo_core, **kw):
    server = await serve(handler, secret=kw.pop("secret", SECRET), fingerprint=kw.pop("fingerprint", FP),
                         codecs=CODECS, timeouts=kw.pop("timeouts", FAST), layout={"tp": 1}, **kw)
    return server, server.sockets[0].getsockname()[1]


async def test_handshake_and_kv_stream():
    server, port = await start()
    async with server:
        assert server.sockets[0].getsockname()[0] == "127.0.0.1"
        peer = await connect("127.0.0.1", port, secret=SECRET, fingerprint=FP, codecs=CODECS, timeouts=FAST)
        assert peer.conn.peer_layout == {"tp": 1}
        await peer.send(m.PrefillRequest("r1", [1, 2, 3]))
        kv = await peer.recv()
        k, v = decode_chunk(kv)
        assert np.array_equal(k, sample_kv()[0])
        done = await peer.recv()
        assert isinstance(done, m.PrefillDone) and done.first_token == 7
        await peer.ping()
        await peer.send(m.PrefillRequest("r2", [1]))
        await peer.recv()          # the Pong is consumed inside recv, RTT measured
        assert peer.rtt is not None and peer.rtt < 1
        await peer.close()


@pytest.mark.parametrize("kw, needle, code", [
    ({"secret": b"wrong"}, "wrong cluster secret", ErrorCode.AUTH_FAILED),
    ({"fingerprint": "0" * 64}, "model mismatch", ErrorCode.MODEL_MISMATCH),
])
async def test_refusals_are_clear(kw, needle, code, caplog):
    server, port = await start()
    async with server:
        with pytest.raises(PeerError, match=needle) as exc:
            await connect("127.0.0.1", port, secret=kw.get("secret", SECRET),
                          fingerprint=kw.get("fingerprint", FP), codecs=CODECS, timeouts=FAST)
        assert exc.value.code == code
        await asyncio.sleep(0.05)
    assert needle in caplog.text      # the core logs why it refused


async def test_stalled_server_times_out_on_client():
    async def silent(reader, writer):
        await asyncio.sleep(10)
    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        loop = asyncio.get_running_loop()
        t = loop.time()
        with pytest.raises(PeerError, match="timed out") as exc:
            await connect("127.0.0.1", port, secret=SECRET, fingerprint=FP, codecs=CODECS,
                          timeouts=Timeouts(handshake=0.5, idle=0.5, heartbeat=0))
        assert exc.value.code == ErrorCode.TIMEOUT and loop.time() - t < 2


async def test_stalled_client_is_dropped_by_server_with_error_frame():
    server, port = await start(timeouts=Timeouts(handshake=0.5, idle=0.5, heartbeat=0))
    async with server:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        data = await asyncio.wait_for(reader.read(), 3)        # server sends Error, then EOF
        assert data[:4] == b"EDGC" and b"timed out" in data
        writer.close()


async def test_stall_mid_stream_times_out_on_recv():
    async def stalls(peer):
        await peer.recv()
        await asyncio.sleep(10)
    server, port = await start(stalls)
    async with server:
        peer = await connect("127.0.0.1", port, secret=SECRET, fingerprint=FP, codecs=CODECS,
                             timeouts=Timeouts(handshake=2, idle=0.5, heartbeat=0))
        await peer.send(m.PrefillRequest("r", [1]))
        with pytest.raises(PeerError, match="timed out"):
            await peer.recv()
        assert peer.closed


@pytest.mark.parametrize("frame, needle", [
    (pack_fixed(1, 100, 1 << 30), b"exceeds the limit"),
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"bad frame magic"),
])
async def test_garbage_gets_error_frame_and_close(frame, needle):
    server, port = await start()
    async with server:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(frame)
        data = await asyncio.wait_for(reader.read(), 3)
        assert data.startswith(b"EDGC") and needle in data
        writer.close()


async def test_truncated_frame_then_close_is_reported():
    async def truncates(reader, writer):
        await reader.read(100)
        writer.write(pack_fixed(2, 50, 0) + b"\x00" * 10)   # a Welcome cut short
        await writer.drain()
        writer.close()
    server = await asyncio.start_server(truncates, "127.0.0.1", 0)
    async with server:
        with pytest.raises(PeerError, match="closed the connection"):
            await connect("127.0.0.1", server.sockets[0].getsockname()[1], secret=SECRET, fingerprint=FP,
                          codecs=CODECS, timeouts=FAST)


async def test_heartbeat_detects_silent_peer():
    async def mute(peer):
        await asyncio.sleep(10)
    server, port = await start(mute, timeouts=Timeouts(handshake=2, idle=60, heartbeat=0))
    async with server:
        peer = await connect("127.0.0.1", port, secret=SECRET, fingerprint=FP, codecs=CODECS,
                             timeouts=Timeouts(handshake=2, idle=0.3, heartbeat=0.1))
        # The server never reads, so pongs never come back; the heartbeat closes the link.
        for _ in range(40):
            if peer.closed:
                break
            await asyncio.sleep(0.05)
        # Pings are answered by the peer's recv loop only; this mute handler never calls it.
        assert peer.closed


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl command not available")
async def test_mutual_tls(tmp_path):
    def make(name, ca=None):
        key, crt = tmp_path / f"{name}.key", tmp_path / f"{name}.crt"
        subj = f"/CN={name}"
        if ca is None:
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out",
                            crt, "-days", "1", "-subj", subj, "-addext", "basicConstraints=critical,CA:TRUE"],
                           check=True, capture_output=True)
        else:
            csr = tmp_path / f"{name}.csr"
            ext = tmp_path / f"{name}.ext"
            ext.write_text("subjectAltName=IP:127.0.0.1\n")
            subprocess.run(["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
                            "-subj", subj], check=True, capture_output=True)
            subprocess.run(["openssl", "x509", "-req", "-in", csr, "-CA", ca[1], "-CAkey", ca[0],
                            "-CAcreateserial", "-out", crt, "-days", "1", "-extfile", ext],
                           check=True, capture_output=True)
        return str(key), str(crt)
    ca = make("ca")
    skey, scrt = make("core", ca)
    ckey, ccrt = make("edge", ca)
    server, port = await start(ssl=tls_context(True, scrt, skey, ca[1], require_client_cert=True))
    async with server:
        peer = await connect("127.0.0.1", port, secret=SECRET, fingerprint=FP, codecs=CODECS, timeouts=FAST,
                             ssl=tls_context(False, ccrt, ckey, ca[1]))
        await peer.send(m.PrefillRequest("r", [1]))
        assert isinstance(await peer.recv(), type(sample_kv()[2]))
        await peer.close()
        with pytest.raises(PeerError):   # no client certificate: refused
            await connect("127.0.0.1", port, secret=SECRET, fingerprint=FP, codecs=CODECS, timeouts=FAST,
                          ssl=tls_context(False, None, None, ca[1]))


async def test_peer_that_stops_reading_is_dropped_within_the_idle_timeout():
    """A peer that sends requests, stops reading, then pings: every send of the other side (its KV, the Pong it
    owes, its heartbeat's Ping) gives up after the idle timeout instead of awaiting drain() for ever, so the
    session ends and its buffers go with it."""
    ended = asyncio.Event()
    big = sample_kv(tokens=4000)[2]                 # about 0.5 MB a frame: the socket buffers fill in a few

    async def core(peer):
        try:
            while True:
                if isinstance(await peer.recv(), m.PrefillRequest):
                    await peer.send(big)
        finally:
            ended.set()
    idle = 1.0
    server, port = await start(core, timeouts=Timeouts(handshake=2, idle=idle, heartbeat=0.3))
    async with server:
        peer = await connect("127.0.0.1", port, secret=SECRET, fingerprint=FP, codecs=CODECS,
                             timeouts=Timeouts(handshake=2, idle=60, heartbeat=0))
        peer.transport.pause_reading()
        loop = asyncio.get_running_loop()
        for i in range(40):
            await peer.send(m.PrefillRequest(f"req-{i}", [1, 2, 3], m.SamplingSpec(), ["lossless"]))
        await peer.send(m.Ping(99))
        sent = loop.time()
        await asyncio.wait_for(ended.wait(), idle + 5)
        assert loop.time() - sent < idle + 2.5
        await peer.close()
