"""The sans-IO connection: bytes in → events out, events in → bytes out (h11 style).

Life cycle of a connection (client = edge, server = core):

    client                                    server
    START --Hello-->                          START
          <--Welcome--                        HELLO_RECEIVED → WELCOME_SENT
    WELCOMED --Auth-->                        (MAC checked, constant time)
          <--AuthOk--                         READY
    READY  (MAC of the server checked)        READY
    READY: client sends PrefillRequest/Ack/Cancel, server sends KVChunk/PrefillDone;
           both send Ping/Pong/Error.
    Any side → CLOSED after sending or receiving a connection-level Error.

Use: `receive_data(data)` then call `next_event()` until it returns NEED_DATA;
`send(event)` returns the buffers to write (header bytes and, for KV data, the
payload as a memoryview, never copied). Messages illegal in the current
state raise `LocalProtocolError` (sending) or `RemoteProtocolError`
(receiving); the caller then sends `error_frame(exc)` and closes.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import zlib
from dataclasses import dataclass

import msgspec

from edgecore.protocol import messages as m
from edgecore.protocol.errors import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError
from edgecore.protocol.framing import FrameParser, Limits, pack_fixed


class Role(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


class State(enum.Enum):
    START = "START"
    HELLO_SENT = "HELLO_SENT"
    HELLO_RECEIVED = "HELLO_RECEIVED"
    WELCOME_SENT = "WELCOME_SENT"
    WELCOMED = "WELCOMED"
    AUTH_SENT = "AUTH_SENT"
    AUTH_RECEIVED = "AUTH_RECEIVED"
    READY = "READY"
    CLOSED = "CLOSED"


class _NeedData:
    def __repr__(self):
        return "NEED_DATA"


NEED_DATA = _NeedData()


@dataclass
class KVData:
    """A KVChunk header with its payload (encoded K then V); `received_crc` is the CRC-32 the frame
    parser computed while the payload arrived (None for data built locally)."""
    chunk: m.KVChunk
    payload: memoryview | bytes
    received_crc: int | None = None


READY_FROM_CLIENT = (m.PrefillRequest, m.Ack, m.Cancel, m.Ping, m.Pong, m.Error)
READY_FROM_SERVER = (m.KVChunk, m.PrefillDone, m.Ping, m.Pong, m.Error)

# (role that sends, state) → (allowed message types, next state or None to stay)
_SEND = {
    (Role.CLIENT, State.START): ((m.Hello,), State.HELLO_SENT),
    (Role.CLIENT, State.WELCOMED): ((m.Auth,), State.AUTH_SENT),
    (Role.SERVER, State.HELLO_RECEIVED): ((m.Welcome,), State.WELCOME_SENT),
    (Role.SERVER, State.AUTH_RECEIVED): ((m.AuthOk,), State.READY),
}


def _transcript(hello: m.Hello, welcome: m.Welcome) -> bytes:
    return b"".join([hello.nonce, welcome.nonce, hello.model_fingerprint.encode(),
                     welcome.version.to_bytes(2, "little")])


def compute_mac(secret: bytes, label: bytes, transcript: bytes) -> bytes:
    return hmac.new(secret, label + transcript, hashlib.sha256).digest()


class Connection:
    def __init__(self, role: Role, secret: bytes, model_fingerprint: str, codecs: list[str],
                 limits: Limits | None = None, name: str = "", layout: dict | None = None,
                 capabilities: list[str] | None = None, session: str = "", streams: list[int] | None = None):
        if not secret:
            raise ValueError("a cluster secret is required")
        self.role = role
        self.secret = secret
        self.fingerprint = model_fingerprint
        self.codecs = list(codecs)
        self.name = name
        self.layout = layout or {}
        self.capabilities = capabilities or []
        self.session = session             # client: sent in Hello; server: the peer's, from its Hello
        self.streams = list(streams or [])  # server: sent in Welcome; client: the peer's, from its Welcome
        self.state = State.START
        self.parser = FrameParser(limits)
        self.version: int | None = None
        self.peer_codecs: list[str] = []
        self.peer_layout: dict = {}
        self.peer_name = ""
        self._hello: m.Hello | None = None
        self._welcome: m.Welcome | None = None

    # ---- sending ----------------------------------------------------------
    def hello(self) -> m.Hello:
        return m.Hello(list(m.SUPPORTED_VERSIONS), self.codecs, self.fingerprint, os.urandom(32),
                       self.capabilities, self.name, self.session)

    def auth(self) -> m.Auth:
        return m.Auth(compute_mac(self.secret, b"edgecore-auth-client", _transcript(self._hello, self._welcome)))

    def send(self, event) -> list[bytes | memoryview]:
        """Serialize `event` (a message or KVData) for the wire; advance the state."""
        msg = event.chunk if isinstance(event, KVData) else event
        self._check_send(msg)
        payload = b""
        if isinstance(event, KVData):
            payload = event.payload
        elif isinstance(msg, m.KVChunk):
            raise LocalProtocolError("a KVChunk must be sent as KVData with its payload")
        header = m.encoder.encode(msg)
        parts: list[bytes | memoryview] = [pack_fixed(self.version or m.PROTOCOL_VERSION, m.tag_of(msg),
                                                      len(header), len(payload)) + header]
        if payload:
            parts.append(payload if isinstance(payload, memoryview) else memoryview(payload))
        return parts

    def send_bytes(self, event) -> bytes:
        return b"".join(self.send(event))

    def error_frame(self, exc: ProtocolError | str, code: ErrorCode | None = None) -> bytes:
        """The Error frame that tells the peer why this side is closing; closes the connection."""
        message = str(exc)
        code = code or getattr(exc, "code", ErrorCode.PROTOCOL)
        header = m.encoder.encode(m.Error(int(code), message[:1000]))
        self.state = State.CLOSED
        return pack_fixed(self.version or m.PROTOCOL_VERSION, m.tag_of(m.Error(0, "")), len(header), 0) + header

    def _check_send(self, msg) -> None:
        st = self.state
        if st is State.CLOSED:
            raise LocalProtocolError(f"cannot send {type(msg).__name__}: connection is in state {st.value}")
        if isinstance(msg, m.Error):
            if not msg.request_id:
                self.state = State.CLOSED
            return
        allowed = _SEND.get((self.role, st))
        if allowed is not None:
            types, nxt = allowed
            if isinstance(msg, types):
                if isinstance(msg, m.Hello):
                    self._hello = msg
                elif isinstance(msg, m.Welcome):
                    self._welcome = msg
                    self.version = msg.version
                self.state = nxt
                return
        if st is State.READY:
            ok = READY_FROM_CLIENT if self.role is Role.CLIENT else READY_FROM_SERVER
            if isinstance(msg, ok):
                return
        raise LocalProtocolError(f"{self.role.value} cannot send {type(msg).__name__} in state {st.value}")

    # ---- receiving --------------------------------------------------------
    def receive_data(self, data: bytes) -> None:
        if self.state is State.CLOSED:
            return
        self.parser.feed(data)

    def next_event(self):
        if self.state is State.CLOSED:
            return NEED_DATA
        frame = self.parser.next_frame()
        if frame is None:
            return NEED_DATA
        if frame.version not in m.SUPPORTED_VERSIONS:
            raise RemoteProtocolError(f"peer speaks protocol version {frame.version}; this side supports "
                                      f"{list(m.SUPPORTED_VERSIONS)}", ErrorCode.VERSION_MISMATCH)
        cls = m.MESSAGE_TYPES.get(frame.frame_type)
        if cls is None:
            raise RemoteProtocolError(f"unknown frame type {frame.frame_type}")
        try:
            msg = m.decoder.decode(frame.header)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            raise RemoteProtocolError(f"malformed {cls.__name__} header: {exc}") from None
        if type(msg) is not cls:
            raise RemoteProtocolError(f"frame type {frame.frame_type} carries a {type(msg).__name__} header")
        if frame.payload.nbytes and not isinstance(msg, m.KVChunk):
            raise RemoteProtocolError(f"{cls.__name__} frames carry no payload")
        self._on_receive(msg)
        if isinstance(msg, m.KVChunk):
            if msg.k_bytes > frame.payload.nbytes or msg.k_bytes < 0:
                raise RemoteProtocolError("KVChunk k_bytes exceeds its payload")
            return KVData(msg, frame.payload, frame.payload_crc)
        return msg

    def _on_receive(self, msg) -> None:
        st, role = self.state, self.role
        if isinstance(msg, m.Error):
            if not msg.request_id:
                self.state = State.CLOSED
            return
        if role is Role.SERVER and st is State.START and isinstance(msg, m.Hello):
            common = sorted(set(msg.versions) & set(m.SUPPORTED_VERSIONS))
            if not common:
                raise RemoteProtocolError(f"no common protocol version: peer offers {msg.versions}, this side "
                                          f"supports {list(m.SUPPORTED_VERSIONS)}", ErrorCode.VERSION_MISMATCH)
            if msg.model_fingerprint != self.fingerprint:
                raise RemoteProtocolError(
                    f"model mismatch: peer serves model {msg.model_fingerprint[:16]}, this side "
                    f"{self.fingerprint[:16]}", ErrorCode.MODEL_MISMATCH)
            if len(msg.nonce) < 16:
                raise RemoteProtocolError("Hello nonce is too short", ErrorCode.AUTH_FAILED)
            self._hello, self.version = msg, common[-1]
            self.peer_codecs = [c for c in msg.codecs if c in self.codecs]
            self.peer_name, self.session = msg.name, msg.session
            self.state = State.HELLO_RECEIVED
        elif role is Role.CLIENT and st is State.HELLO_SENT and isinstance(msg, m.Welcome):
            if msg.version not in m.SUPPORTED_VERSIONS:
                raise RemoteProtocolError(f"server chose unsupported version {msg.version}",
                                          ErrorCode.VERSION_MISMATCH)
            if msg.model_fingerprint != self.fingerprint:
                raise RemoteProtocolError(
                    f"model mismatch: core serves model {msg.model_fingerprint[:16]}, this side "
                    f"{self.fingerprint[:16]}", ErrorCode.MODEL_MISMATCH)
            self._welcome, self.version = msg, msg.version
            self.peer_codecs = [c for c in msg.codecs if c in self.codecs]
            self.peer_layout, self.peer_name, self.streams = dict(msg.layout), msg.name, list(msg.streams)
            self.state = State.WELCOMED
        elif role is Role.SERVER and st is State.WELCOME_SENT and isinstance(msg, m.Auth):
            expect = compute_mac(self.secret, b"edgecore-auth-client", _transcript(self._hello, self._welcome))
            if not hmac.compare_digest(expect, msg.mac):
                raise RemoteProtocolError("authentication failed: wrong cluster secret", ErrorCode.AUTH_FAILED)
            self.state = State.AUTH_RECEIVED
        elif role is Role.CLIENT and st is State.AUTH_SENT and isinstance(msg, m.AuthOk):
            expect = compute_mac(self.secret, b"edgecore-auth-server", _transcript(self._hello, self._welcome))
            if not hmac.compare_digest(expect, msg.mac):
                raise RemoteProtocolError("authentication failed: the core does not know the cluster secret",
                                          ErrorCode.AUTH_FAILED)
            self.state = State.READY
        elif st is State.READY and isinstance(msg, READY_FROM_SERVER if role is Role.CLIENT else READY_FROM_CLIENT):
            return
        else:
            raise RemoteProtocolError(f"unexpected {type(msg).__name__} from peer in state {st.value}")

    # ---- server helpers ---------------------------------------------------
    def welcome(self) -> m.Welcome:
        return m.Welcome(self.version, self.peer_codecs, self.fingerprint, os.urandom(32),
                         self.capabilities, self.name, self.layout, self.streams)

    def auth_ok(self) -> m.AuthOk:
        return m.AuthOk(compute_mac(self.secret, b"edgecore-auth-server", _transcript(self._hello, self._welcome)))


def checksum(payload) -> int:
    return zlib.crc32(payload) & 0xFFFFFFFF


def verify_checksum(chunk: m.KVChunk, payload, computed: int | None = None) -> None:
    if (checksum(payload) if computed is None else computed) != chunk.checksum:
        raise RemoteProtocolError(f"KV chunk of request {chunk.request_id} (layers {chunk.layer_start}-"
                                  f"{chunk.layer_end}) failed its checksum", ErrorCode.CHECKSUM)
