"""The sans-IO connection: bytes in → events out, events in → bytes out (h11 style).

Life cycle of a connection (client = edge, server = core); both sides walk the same states, and
sends and receives are checked against the one table below (`TRANSITIONS`):

    START --Hello(c)--> HELLO --Welcome(s)--> WELCOME --Auth(c)--> AUTH --AuthOk(s)--> READY
    READY: the client sends PrefillRequest/Ack/Cancel, the server KVChunk/PrefillDone;
           both send Ping/Pong/Reject and Error naming a request.
           Version 3 only (`handover`): the client also Handover, the server Token/DecodeStop, and a
           PrefillRequest may ask for `core_decode`; on a version-2 connection these are protocol errors,
           so a version-2 peer keeps the old mode (the KV first, then the edge decodes).
           Version 4 only (`drain`): the server also Draining (it is stopping gracefully); an older peer is
           never sent it. Capability "prefix-digest" (the client's Auth lists it): the server also CacheDigest.
           Capability "block-pull" (the server's AuthOk lists it: an edge serving its peers): the client
           also BlockPull, the server BlockPullDone.
    any state --Error without request (either side)--> CLOSED;  before READY any Error closes.
    any exception inside the machine (sending or receiving) --> ERROR: further use raises,
           except `error_frame`, which tells the peer why and moves to CLOSED.

Hello and Welcome carry ephemeral X25519 key shares and are tagged under a key from the cluster secret
(mac.py); every later frame is sealed (cipher.py: AES-256-GCM under keys from the secret and the two
shares, TLS 1.3's psk_dhe_ke schedule), its message type and contents encrypted, its fixed header the
associated data. Tags and nonces use an implicit per-direction sequence number, so a frame that is
altered, replayed, dropped or reordered fails its tag (with `sealed=False`, the authenticated-only frames
of earlier releases: GMAC, nothing encrypted). Before READY that fails the connection, and
only handshake-sized frames are accepted (framing.HANDSHAKE_LIMITS). In READY one bad frame whose
fixed header was intact becomes a `BadFrame` event (the transport answers `Reject(seq)`); the sender
maps the rejected seq back to what it sent (`FrameRejected`) and fails only that request. Two bad
frames in a row (a drop or reorder shifts every later seq) fail the connection.

Use: `receive_data(data)` (or `get_buffer`/`buffer_updated`) then call `next_event()` until it
returns NEED_DATA; `send(event)` returns the buffers to write (the KV payload as a memoryview,
never copied). Protocol errors raise `LocalProtocolError` (sending) or `RemoteProtocolError`
(receiving); the caller then sends `error_frame(exc)` and closes.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar, TypeVarTuple

import msgspec

from edgecore.protocol import messages as m
from edgecore.protocol.errors import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError
from edgecore.protocol.events import NEED_DATA, BadFrame, FrameRejected, KVData, _NeedData
from edgecore.protocol.cipher import Ephemeral, InPlaceOpen, KeySchedule, LinkKeys, Rekey, TrafficKeys
from edgecore.protocol.credentials import CLIENT_LABEL, SERVER_LABEL, Credential, NodeIdentity, Trust
from edgecore.protocol.framing import (FIXED_SIZE, HANDSHAKE_LIMITS, KEY_PHASE, LEGACY_VERSION, SEALED, FrameParser,
                                      Limits, RawFrame, pack_fixed)
from edgecore.protocol.framing import VERSION as FRAME_VERSION
from edgecore.protocol.mac import HandshakeMac, IncrementalVerify, Keys, SessionMac, transcript_hash
from edgecore.protocol.transitions import TRANSITIONS, C, Role, S, State, next_state

__all__ = ["Connection", "Role", "State", "NEED_DATA", "KVData", "BadFrame", "FrameRejected", "TRANSITIONS",
           "next_state"]


NO_SECRET = b"edgecore: no cluster secret, node credentials only"   # the PSK input when there is no secret
SENT_WINDOW = 4096          # sent frames remembered (seq → message) for Reject recovery
_lenient = msgspec.msgpack.Decoder()
_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")
Event = m.Message | KVData | BadFrame | FrameRejected      # what `next_event` returns besides NEED_DATA


class Connection:
    def __init__(self, role: Role, secret: bytes, model_fingerprint: str, codecs: list[str],
                 limits: Limits | None = None, name: str = "", layout: dict[str, int] | None = None,
                 capabilities: list[str] | None = None, session: str = "", streams: list[int] | None = None,
                 sealed: bool = True, rekey: Rekey = Rekey(), clock: Callable[[], float] = time.monotonic,
                 identity: NodeIdentity | None = None, trust: Trust | None = None,
                 versions: tuple[int, ...] | None = None, server_role: str = "core"):
        """`sealed`: encrypt every frame after the handshake (cipher.py) and refuse a peer that cannot; False
        keeps the authenticated-only frames of earlier releases (benchmarks compare against it). `rekey`: when
        this side updates its sending key; `clock` times it. `identity` / `trust`: this node's credential and
        what it checks the peer's against (credentials.py); with them the cluster secret is optional.
        `versions`: the protocol versions this side offers or accepts (default `SUPPORTED_VERSIONS`; tests and
        benches speak an earlier release's set). `server_role`: the credential role the server must present ("edge"
        for an edge's connection to a peer edge that serves it KV)."""
        if not secret and identity is None:
            raise ValueError("a cluster secret or a node credential is required")
        if identity is not None and trust is None:
            raise ValueError("a node with a credential needs the authorities it trusts to check its peers")
        self.role, self.peer_role = role, (S if role is C else C)
        self.server_role = server_role
        self.fingerprint = model_fingerprint
        self.codecs = list(codecs)
        self.name = name
        self.layout = layout or {}
        self.capabilities = list(m.CAPABILITIES) if capabilities is None else list(capabilities)
        self.session = session             # client: sent in Auth; server: the peer's, from its Auth
        self.streams = list(streams or [])  # server: sent in AuthOk; client: the peer's, from its AuthOk
        self.state = State.START
        self.versions = tuple(versions or m.SUPPORTED_VERSIONS)
        if not set(self.versions) <= set(m.SUPPORTED_VERSIONS):
            raise ValueError(f"versions {list(self.versions)} must be among {list(m.SUPPORTED_VERSIONS)}")
        self.version: int | None = None
        self.peer_codecs: list[str] = []
        self.peer_layout: dict[str, int] = {}
        self.peer_name = ""
        self.peer_capabilities: list[str] = []      # what the peer's Auth / AuthOk says it implements
        self.parser = FrameParser(HANDSHAKE_LIMITS)
        self._limits = limits or Limits()
        self._keys = Keys(secret or NO_SECRET)
        self._identity, self._trust = identity, trust
        self._th = b""                                      # the handshake's transcript hash, once known
        self.peer_credential: Credential | None = None      # the peer's, once verified
        self._send_mac: HandshakeMac | SessionMac = self._keys.handshake
        self._recv_mac: HandshakeMac | SessionMac = self._keys.handshake
        self._send_seq = self._recv_seq = 0
        self._hello_header = b""
        self._sent: OrderedDict[int, m.Message] = OrderedDict()
        self._bad_in_a_row = 0
        self._legacy_peer = False
        self._incoming: IncrementalVerify | InPlaceOpen | None = None   # the large frame now arriving
        self._ephemeral = Ephemeral() if sealed else None   # this connection's X25519 key pair, until keys are made
        self._shared = b""                                  # the X25519 secret with the peer's key share
        self._link: LinkKeys | None = None                  # a sealed session's keys, once agreed
        self._incoming_keys: TrafficKeys | None = None      # the key the large frame now arriving opens with
        self._rekey, self._clock = rekey, clock

    # ---- handshake messages ----------------------------------------------------
    def hello(self) -> m.Hello:
        return m.Hello(list(self.versions), os.urandom(32), self.key_share)

    def welcome(self) -> m.Welcome:
        return m.Welcome(self.version or max(self.versions), os.urandom(32), self.key_share)

    @property
    def key_share(self) -> bytes:
        """This side's ephemeral X25519 public key for Hello / Welcome ("" when not sealed)."""
        return self._ephemeral.share if self._ephemeral is not None else b""

    @property
    def sealed(self) -> bool:
        """Frames after the handshake are encrypted (true once keys are agreed on a sealed connection)."""
        return self._link is not None

    @property
    def key_updates(self) -> int:
        """This side's sending key updates so far."""
        return self._link.updates if self._link is not None else 0

    def auth(self) -> m.Auth:
        return m.Auth(self.fingerprint, self.codecs, self.capabilities, self.name, self.session,
                      *self._prove(CLIENT_LABEL))

    def auth_ok(self) -> m.AuthOk:
        return m.AuthOk(self.fingerprint, self.peer_codecs, self.capabilities, self.name, self.layout, self.streams,
                        *self._prove(SERVER_LABEL))

    def _prove(self, label: bytes) -> tuple[bytes, bytes]:
        """(this node's signed credential, its signature over label ‖ the transcript hash), or empty."""
        if self._identity is None:
            return b"", b""
        return self._identity.signed, self._identity.prove(label, self._th)

    # ---- state -------------------------------------------------------------------
    @property
    def _pull_side(self) -> list[str]:
        """The server's capabilities (block pulls go to a server that lists block-pull)."""
        return self.capabilities if self.role is S else self.peer_capabilities

    @property
    def handover(self) -> bool:
        """True once both sides agreed a version with decode handover (Token, Handover, DecodeStop)."""
        return (self.version or 0) >= m.HANDOVER_VERSION

    @property
    def drain(self) -> bool:
        """True once both sides agreed a version with Draining (a core's announced graceful stop)."""
        return (self.version or 0) >= m.DRAIN_VERSION

    def _version_note(self, msg: m.Message) -> str:
        if self.state is State.READY and isinstance(msg, m.DRAIN_MESSAGES) and not self.drain:
            return f" (a version-{self.version} connection has no Draining)"
        if self.state is State.READY and not self.handover:
            return f" (a version-{self.version} connection has no decode handover)"
        return ""

    @property
    def usable(self) -> bool:
        return self.state not in (State.CLOSED, State.ERROR)

    def close(self) -> None:
        """The stream is gone: release the input buffer; further sends raise."""
        if self.state is not State.ERROR:
            self.state = State.CLOSED
        self.parser.close()

    def _enter(self, state: State) -> None:
        self.state = state
        if state is State.READY:
            self.parser.set_limits(self._limits)
        elif state is State.CLOSED:
            self.parser.close()

    # ---- sending -------------------------------------------------------------------
    def send(self, event: m.Message | KVData) -> list[bytes | memoryview]:
        """Serialize `event` (a message or KVData) for the wire; advance the state."""
        try:
            return self._send(event)
        except BaseException:
            self.state = State.ERROR
            raise

    def _send(self, event: m.Message | KVData) -> list[bytes | memoryview]:
        msg = event.chunk if isinstance(event, KVData) else event
        nxt = next_state(self.role, self.state, msg, self.version)
        if isinstance(msg, m.CacheDigest) and m.PREFIX_DIGEST not in self.peer_capabilities:
            raise LocalProtocolError("a peer that does not list prefix-digest is never sent a CacheDigest")
        if isinstance(msg, (m.BlockPull, m.BlockPullDone)) and m.BLOCK_PULL not in self._pull_side:
            raise LocalProtocolError("block pulls go only to a server that lists block-pull")
        if nxt is None:
            raise LocalProtocolError(f"{self.role.value} cannot send {type(msg).__name__} in state {self.state.value}"
                                     f"{self._version_note(msg)}")
        if isinstance(msg, m.KVChunk) and not isinstance(event, KVData):
            raise LocalProtocolError("a KVChunk must be sent as KVData with its payload")
        header = m.encoder.encode(msg)
        payload = event.payload if isinstance(event, KVData) else b""
        if not isinstance(payload, memoryview):
            payload = memoryview(payload)
        if payload.format != "B" or payload.ndim != 1:
            payload = payload.cast("B")            # lengths and MAC over bytes, whatever the view's items
        seq = self._send_seq
        parts = self._frame(m.tag_of(msg), header, payload)
        if self.state is State.READY:
            self._sent[seq] = msg
            if len(self._sent) > SENT_WINDOW:
                self._sent.popitem(last=False)
        if isinstance(msg, m.Hello):
            self._hello_header = header
        elif isinstance(msg, m.Welcome):
            self._start_session(header)
        self._enter(nxt)
        return parts

    def _frame(self, ftype: int, header: bytes, payload: memoryview) -> list[bytes | memoryview]:
        seq, self._send_seq = self._send_seq, self._send_seq + 1
        if self._link is not None:
            keys = self._link.sending(len(header) + payload.nbytes)
            fixed = pack_fixed(SEALED, len(header), payload.nbytes, flags=KEY_PHASE if keys.phase else 0)
            return keys.cipher.seal(seq, fixed, header, payload)
        head = pack_fixed(ftype, len(header), payload.nbytes) + header
        if payload.nbytes:
            return [head, payload, self._send_mac.tag(seq, [head, payload])]
        return [head + self._send_mac.tag(seq, [head])]

    def send_bytes(self, event: m.Message | KVData) -> bytes:
        return b"".join(self.send(event))

    def error_frame(self, exc: ProtocolError | str, code: ErrorCode | None = None) -> bytes:
        """The Error frame that tells the peer why this side is closing; closes the connection."""
        number = int(code if code is not None else getattr(exc, "code", ErrorCode.PROTOCOL))
        header = m.encoder.encode(m.Error(number, str(exc)[:1000]))
        if self._legacy_peer:        # an old peer can read only a version-1 frame
            data = pack_fixed(m.tag_of(m.Error(0, "")), len(header), 0, LEGACY_VERSION) + header
        else:
            data = b"".join(self._frame(m.tag_of(m.Error(0, "")), header, memoryview(b"")))
        self.state = State.CLOSED
        self.parser.close()
        return data

    # ---- receiving -------------------------------------------------------------------
    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        if self.usable:
            self._guard(self.parser.feed, data)

    def get_buffer(self) -> memoryview:
        """Where an I/O layer may receive the next bytes (asyncio BufferedProtocol)."""
        return self._guard(self.parser.get_buffer)

    def buffer_updated(self, nbytes: int) -> None:
        self._guard(self.parser.buffer_updated, nbytes)
        if self.parser.large_frame_pending:
            if self._incoming is None:     # a large frame is decrypted in place (or MACed) as its bytes arrive
                if self._link is not None:
                    self._incoming_keys = self._link.opening(self.parser.pending_flags)
                    self._incoming = self._incoming_keys.cipher.opener(self._recv_seq)
                elif isinstance(self._recv_mac, SessionMac):
                    self._incoming = self._recv_mac.verifier(self._recv_seq)
            if self._incoming is not None:
                self._incoming.pos = self.parser.feed_signed(self._incoming.update, self._incoming.pos)

    @property
    def full(self) -> bool:
        """True while the I/O layer should stop reading until `next_event` takes a frame."""
        return self.usable and self._guard(lambda: self.parser.full)

    @property
    def buffered(self) -> int:
        return self.parser.buffered

    def next_event(self) -> Event | _NeedData:
        if self.state is State.CLOSED:
            return NEED_DATA
        if self.state is State.ERROR:
            raise RemoteProtocolError("connection is in state ERROR after an earlier failure")
        return self._guard(self._next_event)

    def _guard(self, fn: Callable[[*_Ts], _T], *args: *_Ts) -> _T:
        try:
            return fn(*args)
        except BaseException:
            self.state = State.ERROR
            raise

    def _next_event(self) -> Event | _NeedData:
        frame = self.parser.next_frame()
        if frame is None:
            return NEED_DATA
        if frame.version == LEGACY_VERSION:
            self._legacy(frame)
        seq, self._recv_seq = self._recv_seq, self._recv_seq + 1
        sealed = self._link is not None
        cls = m.MESSAGE_TYPES.get(frame.frame_type)
        inc, self._incoming = self._incoming, None
        keys, self._incoming_keys = self._incoming_keys, None
        header, payload = frame.header, frame.payload
        if inc is not None:
            inc.update(frame.signed[inc.pos:])
            verified = inc.verify(frame.tag)
        elif self._link is not None:
            keys = self._link.opening(frame.flags)
            plain = keys.cipher.open(seq, frame.signed[:FIXED_SIZE], frame.signed[FIXED_SIZE:], frame.tag)
            verified = plain is not None
            if plain is not None:
                header, payload = memoryview(plain)[:len(header)], memoryview(plain)[len(header):]
        else:
            verified = self._recv_mac.verify(seq, frame.signed, frame.tag)
        if not verified:
            return self._bad_frame(seq, frame, None if sealed else cls)
        if keys is not None and self._link is not None:          # the peer updated its key: keep the new one
            self._link.verified(keys)
        self._bad_in_a_row = 0
        if sealed and frame.frame_type != SEALED:
            raise RemoteProtocolError(f"frame type {frame.frame_type} on a sealed connection")
        if cls is None and not sealed:
            raise RemoteProtocolError(f"unknown frame type {frame.frame_type}")
        try:
            msg = m.decoder.decode(header)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            raise RemoteProtocolError(f"malformed {cls.__name__ if cls else 'sealed'} header: {exc}") from None
        if not sealed and type(msg) is not cls:
            raise RemoteProtocolError(f"frame type {frame.frame_type} carries a {type(msg).__name__} header")
        cls = type(msg)
        if payload.nbytes and not isinstance(msg, m.KVChunk):
            raise RemoteProtocolError(f"{cls.__name__} frames carry no payload")
        nxt = next_state(self.peer_role, self.state, msg, self.version)
        if isinstance(msg, m.CacheDigest) and m.PREFIX_DIGEST not in self.capabilities:
            raise RemoteProtocolError("CacheDigest to a side that does not list prefix-digest")
        if isinstance(msg, (m.BlockPull, m.BlockPullDone)) and m.BLOCK_PULL not in self._pull_side:
            raise RemoteProtocolError(f"{cls.__name__} on a connection whose server does not list block-pull")
        if nxt is None:
            raise RemoteProtocolError(f"unexpected {type(msg).__name__} from peer in state {self.state.value}"
                                      f"{self._version_note(msg)}")
        self._check_handshake(msg, frame)
        self._enter(nxt)
        if isinstance(msg, m.KVChunk):
            if msg.k_bytes > payload.nbytes or msg.k_bytes < 0:
                raise RemoteProtocolError("KVChunk k_bytes exceeds its payload")
            return KVData(msg, payload)
        if isinstance(msg, m.Reject):
            sent = self._sent.get(msg.seq)
            if sent is None:
                raise RemoteProtocolError(f"peer rejected frame {msg.seq}, which this side does not remember "
                                          f"sending: cannot recover", ErrorCode.CHECKSUM)
            return FrameRejected(msg.seq, sent, msg.message)
        return msg

    def _bad_frame(self, seq: int, frame: RawFrame, cls: type | None) -> BadFrame | m.Error:
        name = cls.__name__ if cls else ("sealed" if frame.frame_type == SEALED else f"type-{frame.frame_type}")
        if self.state is not State.READY:
            if cls is m.Error:      # the peer is closing anyway; say what it said, marked as unverified
                self._enter(State.CLOSED)
                return _unverified_error(frame.header)
            raise RemoteProtocolError(f"authentication failed: {name} frame failed its MAC during the handshake "
                                      f"(wrong cluster secret on one side, or a corrupted frame)",
                                      ErrorCode.AUTH_FAILED)
        self._bad_in_a_row += 1
        if self._bad_in_a_row > 1:
            raise RemoteProtocolError("two frames in a row failed their MAC: frames were lost, reordered or "
                                      "replayed, or the link corrupts data", ErrorCode.CHECKSUM)
        return BadFrame(seq, frame.frame_type, f"frame {seq} ({name}) failed its MAC")

    def _legacy(self, frame: RawFrame) -> None:
        self._legacy_peer = True
        said = ""
        if frame.frame_type == m.tag_of(m.Error(0, "")):
            try:
                said = f" (the peer says: {str(_lenient.decode(frame.header)[2])[:300]})"
            except (msgspec.DecodeError, IndexError, TypeError, KeyError):
                pass
        raise RemoteProtocolError(f"edgecore protocol version mismatch: this side speaks version "
                                  f"{FRAME_VERSION}, the peer version {LEGACY_VERSION}; run the same "
                                  f"edgecore release on edges and cores{said}", ErrorCode.VERSION_MISMATCH)

    # ---- handshake checks (the table already allowed the message) -----------------------------
    def _check_handshake(self, msg: m.Message, frame: RawFrame) -> None:
        if isinstance(msg, m.Hello):
            common = sorted(set(msg.versions) & set(self.versions))
            if not common:
                raise RemoteProtocolError(f"no common protocol version: peer offers {msg.versions}, this side "
                                          f"supports {list(self.versions)}", ErrorCode.VERSION_MISMATCH)
            _check_nonce(msg.nonce)
            self._exchange(msg.key_share)
            self._hello_header, self.version = bytes(frame.header), common[-1]
        elif isinstance(msg, m.Welcome):
            if msg.version not in self.versions:
                raise RemoteProtocolError(f"server chose unsupported version {msg.version}",
                                          ErrorCode.VERSION_MISMATCH)
            _check_nonce(msg.nonce)
            self._exchange(msg.key_share)
            self.version = msg.version
            self._start_session(bytes(frame.header))
        elif isinstance(msg, (m.Auth, m.AuthOk)):
            if self._trust is not None:       # who the peer is, before anything it says is used
                label, role = (CLIENT_LABEL, "edge") if isinstance(msg, m.Auth) else (SERVER_LABEL, self.server_role)
                self.peer_credential = self._trust.verify(msg.credential, msg.proof, label, self._th, role)
            if msg.model_fingerprint != self.fingerprint:     # the peer is authenticated: names may be shown
                raise RemoteProtocolError(
                    f"model mismatch: peer serves model {msg.model_fingerprint[:16]}, this side "
                    f"{self.fingerprint[:16]}", ErrorCode.MODEL_MISMATCH)
            self.peer_codecs = [c for c in msg.codecs if c in self.codecs]
            self.peer_name = msg.name
            self.peer_capabilities = list(msg.capabilities)
            if isinstance(msg, m.Auth):
                self.session = msg.session
            else:
                self.peer_layout, self.streams = dict(msg.layout), list(msg.streams)

    def _exchange(self, share: bytes) -> None:
        """The X25519 exchange with the peer's key share, as soon as it arrives (a bad one fails here)."""
        if self._ephemeral is None:
            return
        if not share:
            raise RemoteProtocolError("the peer cannot encrypt the link (its handshake has no key share: an "
                                      "edgecore release before sealed frames); run the same release on edges and "
                                      "cores", ErrorCode.VERSION_MISMATCH)
        self._shared = self._ephemeral.exchange(bytes(share))

    def _start_session(self, welcome_header: bytes) -> None:
        th = self._th = transcript_hash(self._hello_header, welcome_header)
        if self._ephemeral is not None:     # sealed: TLS 1.3's psk_dhe_ke schedule (cipher.py)
            schedule = KeySchedule(self._keys.psk, self._shared, th)
            self._ephemeral, self._shared = None, b""    # used once: a later leak cannot recover this session
            c2s, s2c = TrafficKeys(schedule.client_secret), TrafficKeys(schedule.server_secret)
            self._link = LinkKeys(*((c2s, s2c) if self.role is C else (s2c, c2s)), self._rekey, self._clock)
            return
        c2s_mac, s2c_mac = self._keys.session(th)
        self._send_mac, self._recv_mac = (c2s_mac, s2c_mac) if self.role is C else (s2c_mac, c2s_mac)


def _check_nonce(nonce: bytes) -> None:
    if len(nonce) < 16:
        raise RemoteProtocolError("handshake nonce is too short", ErrorCode.AUTH_FAILED)


def _unverified_error(header: memoryview) -> m.Error:
    try:
        fields = _lenient.decode(header)
        code, message = int(fields[1]), str(fields[2])
    except (msgspec.DecodeError, IndexError, TypeError, ValueError):
        code, message = ErrorCode.PROTOCOL, "undecodable error"
    return m.Error(code, f"{message} (unverified: sent before keys were agreed)")
