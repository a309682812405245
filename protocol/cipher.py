"""Sealed frames: every frame after the handshake encrypted and authenticated (AES-256-GCM), with session
keys from an ephemeral X25519 exchange mixed with the cluster secret, so nothing of a request is readable on
the wire and a recorded session stays unreadable after the secret leaks (forward secrecy).

Construction, followed exactly rather than invented: TLS 1.3's key schedule in its `psk_dhe_ke` mode (RFC 8446
§7.1: HKDF-Extract / HKDF-Expand-Label / Derive-Secret over SHA-256, the labels as there), with the cluster
secret's derived PSK as the pre-shared key and the X25519 (RFC 7748) shared secret of the two ephemeral keys
in Hello and Welcome as the (EC)DHE input; per-record nonces as TLS 1.3 forms them (§5.3: the traffic IV XOR
the 64-bit sequence number). The transcript hash is SHA-256 over the Hello and Welcome message headers
(mac.py `transcript_hash`), which carry both nonces and both key shares. See docs/wire-format.md §2a.

Life cycle: each side makes an `Ephemeral` key pair with its Connection; once Hello and Welcome are known,
`KeySchedule(psk, shared, transcript)` yields the two directions' traffic secrets, each held as `TrafficKeys`
(a `FrameCipher` and a key phase). A sender updates its key after `Rekey`'s frames, bytes or seconds
(TLS 1.3's key update, signalled by the frame's key-phase flag instead of a message: nothing in flight is
dropped or resent); a receiver that sees the other phase opens the frame with the next key and keeps it
only if the tag verifies (a flipped flag is a corrupted frame, never a lost key). A
frame is sealed with `seal(seq, fixed, header, payload)`: the fixed header (lengths, CRC) stays in clear as
associated data; the message header and payload are encrypted; the 16-byte tag ends the frame as the MAC
did. `open(seq, fixed, body, tag)` decrypts a frame that arrived whole (a copy: small frames);
`opener(seq)` decrypts a large frame in place, piece by piece, as its bytes arrive, and checks the tag at the
end. Keys live only in this object; a connection's close drops them.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import AEADDecryptionContext, Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from edgecore.protocol.errors import ErrorCode, RemoteProtocolError
from edgecore.protocol.framing import FIXED_SIZE, KEY_PHASE

HASH_LEN = 32
KEY_LEN = 32            # AES-256
IV_LEN = 12
SHARE_LEN = 32          # an X25519 public key


def hkdf_extract(salt: bytes, ikm: bytes) -> bytes:
    return hmac.digest(salt or bytes(HASH_LEN), ikm, "sha256")


def hkdf_expand_label(secret: bytes, label: str, context: bytes, length: int) -> bytes:
    """RFC 8446 §7.1: HKDF-Expand(secret, HkdfLabel, length), HkdfLabel = u16 length ‖ "tls13 "+label ‖ context."""
    full = b"tls13 " + label.encode()
    info = struct.pack(">H", length) + bytes([len(full)]) + full + bytes([len(context)]) + context
    out, block, i = b"", b"", 1
    while len(out) < length:
        block = hmac.digest(secret, block + info + bytes([i]), "sha256")
        out += block
        i += 1
    return out[:length]


def derive_secret(secret: bytes, label: str, transcript_hash: bytes) -> bytes:
    return hkdf_expand_label(secret, label, transcript_hash, HASH_LEN)


class KeySchedule:
    """The TLS 1.3 schedule from the PSK and the X25519 shared secret up to the two traffic secrets."""

    def __init__(self, psk: bytes, shared: bytes, transcript_hash: bytes):
        early = hkdf_extract(b"", psk)
        derived = derive_secret(early, "derived", hashlib.sha256(b"").digest())
        handshake = hkdf_extract(derived, shared)
        self.client_secret = derive_secret(handshake, "c ap traffic", transcript_hash)
        self.server_secret = derive_secret(handshake, "s ap traffic", transcript_hash)

    @staticmethod
    def traffic_keys(secret: bytes) -> tuple[bytes, bytes]:
        """(key, iv) of one direction's traffic secret."""
        return hkdf_expand_label(secret, "key", b"", KEY_LEN), hkdf_expand_label(secret, "iv", b"", IV_LEN)


class Ephemeral:
    """One connection's X25519 key pair: made with the connection, used once, then dropped."""

    def __init__(self, private: X25519PrivateKey | None = None):
        self._private = private or X25519PrivateKey.generate()
        self.share = self._private.public_key().public_bytes_raw()

    def exchange(self, peer_share: bytes) -> bytes:
        if len(peer_share) != SHARE_LEN:
            raise RemoteProtocolError(f"the peer's key share is {len(peer_share)} bytes, not {SHARE_LEN}",
                                      ErrorCode.AUTH_FAILED)
        try:
            return self._private.exchange(X25519PublicKey.from_public_bytes(peer_share))
        except ValueError:          # a low-order point: the shared secret would be all zeros
            raise RemoteProtocolError("the peer's key share is not a usable X25519 key",
                                      ErrorCode.AUTH_FAILED) from None


@dataclass(frozen=True)
class Rekey:
    """When a sending direction updates its key (whichever comes first): frames, bytes sealed, seconds."""
    frames: int = 1 << 24           # TLS 1.3's AES-GCM guidance is about 2^24.5 records per key
    bytes: int = 1 << 36            # 64 GiB
    seconds: float = 3600.0


class TrafficKeys:
    """One direction's traffic secret, its cipher and its key phase; `updated()` is the next key (RFC 8446
    §7.2: traffic_secret_N+1 = HKDF-Expand-Label(traffic_secret_N, "traffic upd", "", 32)), phase flipped."""

    def __init__(self, secret: bytes, phase: int = 0):
        self.secret, self.phase = secret, phase
        self.cipher = FrameCipher(*KeySchedule.traffic_keys(secret))

    def updated(self) -> TrafficKeys:
        return TrafficKeys(hkdf_expand_label(self.secret, "traffic upd", b"", HASH_LEN), self.phase ^ 1)


class LinkKeys:
    """A sealed connection's keys: what this side sends with (updated per `Rekey`, counted in `updates`) and
    what it receives with (the peer's current key and, once a frame shows the other phase, its next)."""

    def __init__(self, send: TrafficKeys, receive: TrafficKeys, rekey: Rekey, clock: Callable[[], float]):
        self.send, self.receive, self.rekey, self.clock = send, receive, rekey, clock
        self._next: TrafficKeys | None = None
        self._frames, self._bytes, self._since = 0, 0, clock()
        self.updates = 0

    def sending(self, nbytes: int) -> TrafficKeys:
        """The key for the next frame (of `nbytes` plaintext): updated first when `rekey` says it is due."""
        rekey = self.rekey
        if self._frames >= rekey.frames or self._bytes >= rekey.bytes or self.clock() - self._since >= rekey.seconds:
            self.send = self.send.updated()
            self._frames, self._bytes, self._since = 0, 0, self.clock()
            self.updates += 1
        self._frames += 1
        self._bytes += nbytes
        return self.send

    def opening(self, flags: int) -> TrafficKeys:
        """The key a frame with these flags opens with: the current one, or (the other key phase) the peer's
        next, which becomes current only through `verified`."""
        if bool(flags & KEY_PHASE) == bool(self.receive.phase):
            return self.receive
        if self._next is None:
            self._next = self.receive.updated()
        return self._next

    def verified(self, keys: TrafficKeys) -> None:
        """A frame opened and verified under `keys`: if it is the peer's next key, it is now its current."""
        if keys is not self.receive:
            self.receive, self._next = keys, None


class FrameCipher:
    """AES-256-GCM for one direction of one connection; the nonce is the IV XOR the frame's sequence number."""

    def __init__(self, key: bytes, iv: bytes):
        self._key, self._iv = key, int.from_bytes(iv, "big")
        self._aead = AESGCM(key)

    def nonce(self, seq: int) -> bytes:
        return (self._iv ^ seq).to_bytes(IV_LEN, "big")

    def seal(self, seq: int, fixed: bytes, header: bytes, payload: memoryview) -> list[bytes | memoryview]:
        """The frame's buffers: fixed header ‖ encrypted header, encrypted payload, tag. The payload is read,
        never written (it may be a view of the KV the sender still holds)."""
        if not payload.nbytes:
            return [fixed + self._aead.encrypt(self.nonce(seq), header, fixed)]
        enc = Cipher(algorithms.AES(self._key), modes.GCM(self.nonce(seq))).encryptor()
        enc.authenticate_additional_data(fixed)
        head = fixed + enc.update(header)
        body = enc.update(payload)
        enc.finalize()
        return [head, body, enc.tag]

    def open(self, seq: int, fixed: memoryview, body: memoryview, tag: memoryview) -> bytes | None:
        """The plaintext of a frame's header ‖ payload, or None when it fails its tag."""
        dec = Cipher(algorithms.AES(self._key), modes.GCM(self.nonce(seq))).decryptor()
        dec.authenticate_additional_data(fixed)
        plain = dec.update(body)
        try:
            dec.finalize_with_tag(bytes(tag))
        except InvalidTag:
            return None
        return plain

    def opener(self, seq: int) -> InPlaceOpen:
        return InPlaceOpen(Cipher(algorithms.AES(self._key), modes.GCM(self.nonce(seq))).decryptor())


class InPlaceOpen:
    """A large frame decrypted where it lies in the receive buffer, as its bytes arrive (`update` with the
    frame's bytes from `pos` on: the fixed header is associated data, the rest is decrypted in place), then
    checked against its tag (`verify`). Until `verify` passes the buffer holds unauthenticated plaintext,
    which nothing reads."""

    def __init__(self, dec: AEADDecryptionContext):
        self._dec = dec
        self.pos = 0            # bytes of the frame fed so far (kept by the caller)

    def update(self, data: memoryview) -> None:
        start = self.pos
        if start < FIXED_SIZE:
            aad = min(len(data), FIXED_SIZE - start)
            self._dec.authenticate_additional_data(bytes(data[:aad]))
            data = data[aad:]
        n = len(data)
        if n:
            # cryptography refuses overlapping input and output (since 51): decrypt into a scratch buffer, then
            # copy the plaintext back where the ciphertext lay (a memcpy, far cheaper than the AES itself).
            scratch = _scratch(n + 15)
            self._dec.update_into(data, scratch)
            data[:] = scratch[:n]

    def verify(self, tag: bytes | memoryview) -> bool:
        return tag_ok(self._dec, tag)


_SCRATCH = threading.local()


def _scratch(n: int) -> memoryview:
    """A reusable output buffer of at least n bytes, one per thread (each event loop decrypts on its own thread; a
    buffer is only borrowed for the span of one `update_into` call)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or len(buf) < n:
        buf = _SCRATCH.buf = memoryview(bytearray(max(n, 2 * len(buf) if buf is not None else n)))
    return buf[:n]


def tag_ok(dec: AEADDecryptionContext, tag: bytes | memoryview) -> bool:
    """Finish a GCM decryption (or GMAC verification) fed in pieces: does the frame's tag match?"""
    try:
        dec.finalize_with_tag(bytes(tag))
    except InvalidTag:
        return False
    return True
