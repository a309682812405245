"""Per-node credentials: each node proves who it is with its own key, certified by the cluster authority, so a
leaked node is that node (revoke it), not the whole fleet.

Objects: an `Authority` (an Ed25519 key pair; its public key, or several during a rollover, is what nodes
trust) issues a `Credential` per node — name, role (core or edge), region, the node's Ed25519 public key,
validity (not before / not after, unix seconds), a random serial, the issuing authority's key id — signed by
the authority. A node holds its `NodeIdentity` (the signed credential and its private key, one text file a
Kubernetes Secret can hold). `Trust` is what a node checks peers against: the trusted authorities' public
keys, a revocation list (serials; a file re-read when it changes) and the allowed clock skew.

Life cycle in a handshake (state.py; a SIGMA-style exchange inside the sealed session of cipher.py): after
Hello and Welcome (whose transcript hash `th` covers both ephemeral key shares), Auth carries the edge's
credential and its signature over "edgecore/1 client" ‖ th, AuthOk the core's over "edgecore/1 server" ‖ th;
both travel encrypted. The receiver checks, in order: the authority is trusted, the authority's signature,
the role (an edge credential cannot act as a core, and the reverse), the validity window (with the skew),
the revocation list, then the signature over th with the credential's key — each refusal is an AUTH_FAILED
naming why (unknown authority, bad signature, wrong role, not yet valid / clock skew, expired, revoked).
`Trust.watch()` re-reads the revocation file every `interval` seconds and calls the hooks the transport
registered for live connections, which close those of a newly revoked serial.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from edgecore.protocol.errors import ErrorCode, RemoteProtocolError

ROLES = ("core", "edge")
CLIENT_LABEL, SERVER_LABEL = b"edgecore/1 client", b"edgecore/1 server"
SIG_LEN = 64


class Credential(msgspec.Struct, array_like=True, frozen=True):
    name: str
    role: str                   # "core" or "edge"
    region: str
    public_key: bytes           # the node's Ed25519 public key (32 bytes)
    not_before: int             # unix seconds
    not_after: int
    serial: str                 # random, names the credential in revocation lists
    authority: str              # key id of the issuing authority (`key_id`)


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Credential).decode


def key_id(public: bytes) -> str:
    return hashlib.sha256(public).hexdigest()[:16]


def _raw(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes_raw()


class Authority:
    """The cluster authority's key pair: issues credentials."""

    def __init__(self, private: Ed25519PrivateKey):
        self.private = private
        self.public = _raw(private.public_key())
        self.id = key_id(self.public)

    @classmethod
    def generate(cls) -> Authority:
        return cls(Ed25519PrivateKey.generate())

    def issue(self, name: str, role: str, region: str, node_key: Ed25519PrivateKey, days: float,
              now: float | None = None) -> bytes:
        """A signed credential (credential bytes ‖ 64-byte signature) for `node_key`'s public key."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        start = int(now if now is not None else time.time())
        cred = Credential(name, role, region, _raw(node_key.public_key()), start - 60, start + int(days * 86400),
                          secrets.token_hex(8), self.id)
        body = _encode(cred)
        return body + self.private.sign(body)


class NodeIdentity:
    """A node's signed credential and private key."""

    def __init__(self, signed: bytes, private: Ed25519PrivateKey):
        self.signed, self.private = signed, private
        self.credential = _decode(signed[:-SIG_LEN])

    def prove(self, label: bytes, transcript_hash: bytes) -> bytes:
        return self.private.sign(label + transcript_hash)

    def dumps(self) -> str:
        key = self.private.private_bytes_raw()
        return (f"# edgecore node credential: {self.credential.name} ({self.credential.role}), serial "
                f"{self.credential.serial}\ncredential {base64.b64encode(self.signed).decode()}\n"
                f"key {base64.b64encode(key).decode()}\n")

    @classmethod
    def load(cls, path: str | Path) -> NodeIdentity:
        fields = _fields(Path(path))
        try:
            return cls(base64.b64decode(fields["credential"]),
                       Ed25519PrivateKey.from_private_bytes(base64.b64decode(fields["key"])))
        except (KeyError, ValueError, msgspec.DecodeError) as exc:
            raise ValueError(f"{path} is not an edgecore node credential: {exc}") from None


def _fields(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, value = line.strip().partition(" ")
            out[name] = value.strip()
    return out


def load_authorities(path: str | Path) -> dict[str, bytes]:
    """Trusted authority public keys from a file of `authority BASE64` lines (several during a rollover)."""
    keys = {}
    for line in Path(path).read_text().splitlines():
        name, _, value = line.strip().partition(" ")
        if name == "authority":
            public = base64.b64decode(value)
            keys[key_id(public)] = public
    if not keys:
        raise ValueError(f"{path} holds no 'authority BASE64' line")
    return keys


class Trust:
    """What a node checks a peer's credential against."""

    def __init__(self, authorities: dict[str, bytes], revocations: str | Path | None = None,
                 skew: float = 300.0, clock: Callable[[], float] = time.time, interval: float = 2.0):
        self.authorities, self.skew, self.clock, self.interval = dict(authorities), skew, clock, interval
        self.revocations = Path(revocations) if revocations is not None else None
        self.revoked: set[str] = set()
        self._stamp: tuple[float, int] | None = None
        self._hooks: dict[int, tuple[str, Callable[[str], object]]] = {}
        self._watcher: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self.reload()

    # ---- the handshake ---------------------------------------------------------
    def verify(self, signed: bytes, proof: bytes, label: bytes, transcript_hash: bytes, role: str) -> Credential:
        """The peer's credential, once every check passed; else RemoteProtocolError(AUTH_FAILED, why)."""
        if not signed:
            raise _refuse(f"the peer presented no credential (this node requires a {role} credential)")
        if len(signed) <= SIG_LEN:
            raise _refuse("the peer's credential is malformed")
        body, signature = signed[:-SIG_LEN], signed[-SIG_LEN:]
        try:
            cred = _decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _refuse(f"the peer's credential is malformed: {exc}") from None
        who = f"credential {cred.serial} ({cred.name}, {cred.role})"
        authority = self.authorities.get(cred.authority)
        if authority is None:
            raise _refuse(f"{who} is issued by an unknown authority {cred.authority}")
        if not _valid(authority, signature, body):
            raise _refuse(f"{who} does not carry its authority's signature")
        if cred.role != role:
            article = "an" if role == "edge" else "a"
            raise _refuse(f"{who} is for the {cred.role} role, but its peer here must be {article} {role}")
        now = self.clock()
        if now + self.skew < cred.not_before:
            raise _refuse(f"{who} is not valid yet (from {_when(cred.not_before)}; clock skew between the nodes?)")
        if now - self.skew > cred.not_after:
            raise _refuse(f"{who} expired at {_when(cred.not_after)}")
        self.reload()
        if cred.serial in self.revoked:
            raise _refuse(f"{who} is revoked")
        if len(cred.public_key) != 32 or not _valid(cred.public_key, proof, label + transcript_hash):
            raise _refuse(f"{who}: the peer did not prove it holds the credential's key")
        return cred

    # ---- revocation -----------------------------------------------------------
    def reload(self) -> bool:
        """Re-read the revocation file if it changed; True when new serials were revoked."""
        if self.revocations is None:
            return False
        try:
            st = os.stat(self.revocations)
        except FileNotFoundError:
            return False
        if (st.st_mtime, st.st_size) == self._stamp:
            return False
        self._stamp = (st.st_mtime, st.st_size)
        revoked = {line.split()[0] for line in self.revocations.read_text().splitlines()
                   if line.strip() and not line.startswith("#")}
        added = revoked - self.revoked
        self.revoked = revoked
        for ident, (serial, hook) in list(self._hooks.items()):
            if serial in added:
                self._hooks.pop(ident, None)
                hook(serial)
        return bool(added)

    def track(self, serial: str, on_revoked: Callable[[str], object]) -> Callable[[], None]:
        """Call `on_revoked(serial)` if `serial` is revoked while its connection lives; returns the
        un-registration to call when the connection ends. Starts the file watcher on the running loop."""
        ident = next(self._ids)
        self._hooks[ident] = (serial, on_revoked)
        if self.revocations is not None and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.get_running_loop().create_task(self.watch())
        return lambda: self._hooks.pop(ident, None) and None

    async def watch(self) -> None:
        while self._hooks:
            await asyncio.sleep(self.interval)
            self.reload()


def _valid(public: bytes, signature: bytes, data: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


def _when(t: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _refuse(why: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"authentication failed: {why}", ErrorCode.AUTH_FAILED)


def load_node_credentials(credential: str | None, authority: str | None, revocations: str | None
                          ) -> tuple[NodeIdentity | None, Trust | None]:
    """A node's `--credential`, `--authority` and `--revocations` files: (its identity, what it trusts), or
    (None, None) when it uses none; ValueError naming the problem otherwise."""
    if credential is None and authority is None:
        if revocations is not None:
            raise ValueError("--revocations needs --credential and --authority")
        return None, None
    if credential is None or authority is None:
        raise ValueError("per-node credentials need both --credential (this node's) and --authority (whom to trust)")
    identity = NodeIdentity.load(credential)
    trust = Trust(load_authorities(authority), revocations)
    if identity.credential.authority not in trust.authorities:
        raise ValueError(f"{credential} is issued by authority {identity.credential.authority}, which {authority} "
                         f"does not list")
    return identity, trust
