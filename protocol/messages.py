"""Protocol messages: msgspec Structs, one tagged union, one decoder.

Each message type has a small integer tag, which is also the frame type byte
of the frame that carries it (see docs/wire-format.md). Structs are encoded
as msgpack arrays (`array_like=True`) with trailing defaults omitted; tensor
bytes never go inside msgpack — a KVChunk's K and V planes travel as the
frame's raw payload. Integrity is the frame's business (framing.py, mac.py):
no message carries its own checksum.
"""

from __future__ import annotations

import typing


import msgspec

PROTOCOL_VERSION = 4
SUPPORTED_VERSIONS = (2, 3, 4)
HANDOVER_VERSION = 3                   # first version with core decoding (Token, Handover, DecodeStop)
DRAIN_VERSION = 4                      # first version with Draining (a core announces its graceful stop)
# Auth / AuthOk capabilities this implementation has beyond its version: "kv-compact-params": it decodes the
# entropy-coded levels' compact parameters (docs/wire-format.md, q4e/q3e/q2e flag bits 2 and 3); a core
# sends them only to a peer that says so. "lora": a core reads PrefillRequest's `adapter` fields (a core without it
# drops them, as unknown trailing fields, and would prefill with the base model): an edge sends a request with an
# adapter only to a core that says so. "prefix-digest" (not in CAPABILITIES: a client asks for it, `connect`'s
# `capabilities`): an edge reads CacheDigest (what the core's prefix cache holds and its queue); a core sends it only to
# an edge that says so. "block-pull" (not in CAPABILITIES: an edge that serves its peers lists it in its AuthOk,
# `serve`'s `capabilities`): the server answers BlockPull with the KV of the prefix-cache blocks it holds; a client
# sends BlockPull only to a server that lists it.
COMPACT_KV_PARAMS = "kv-compact-params"
LORA_ADAPTERS = "lora"
PREFIX_DIGEST = "prefix-digest"
BLOCK_PULL = "block-pull"
CAPABILITIES = (COMPACT_KV_PARAMS, LORA_ADAPTERS)
DIGEST_MAX_HASHES = 4096               # block hashes in one CacheDigest (32 KiB: its msgpack header stays small)


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, tag_field="t", frozen=True):
    pass


# The handshake reveals nothing before both sides have proved the secret: Hello and Welcome carry
# only versions, nonces and ephemeral key shares; what describes a node (model fingerprint, name, layout,
# stream ports) travels in Auth and AuthOk, the first sealed frames (encrypted under keys from the secret and
# the two key shares, cipher.py).
class Hello(_Msg, tag=1, frozen=True):
    versions: list[int]
    nonce: bytes                       # client's 32 random bytes (key derivation)
    key_share: bytes = b""             # client's ephemeral X25519 public key (32 bytes); "" = cannot seal


class Welcome(_Msg, tag=2, frozen=True):
    version: int                       # chosen
    nonce: bytes                       # server's 32 random bytes (key derivation)
    key_share: bytes = b""             # server's ephemeral X25519 public key


class Auth(_Msg, tag=3, frozen=True):
    model_fingerprint: str
    codecs: list[str]
    capabilities: list[str] = []
    name: str = ""
    session: str = ""                  # client's random id, shared with its stream connections (see AuthOk)
    credential: bytes = b""            # the edge's signed credential (credentials.py), when the fleet uses them
    proof: bytes = b""                 # its signature over "edgecore/1 client" ‖ the transcript hash


class AuthOk(_Msg, tag=4, frozen=True):
    model_fingerprint: str
    codecs: list[str]                  # codecs both sides support
    capabilities: list[str] = []
    name: str = ""
    layout: dict[str, int] = {}        # core layout: tp, pp, num_layers, num_kv_heads
    streams: list[int] = []            # ports where a parallel core's other ranks stream their own KV
    credential: bytes = b""            # the core's signed credential (credentials.py)
    proof: bytes = b""                 # its signature over "edgecore/1 server" ‖ the transcript hash


class SamplingSpec(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    logprobs: int | None = None
    presence_penalty: float = 0.0      # penalties over prompt/output tokens, vLLM semantics
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}  # token id -> added to its logit
    min_p: float = 0.0


class PrefillRequest(_Msg, tag=5, frozen=True):
    request_id: str
    token_ids: list[int]
    sampling: SamplingSpec = SamplingSpec()
    codecs: list[str] = msgspec.field(default_factory=lambda: ["lossless"])  # allowed, by preference
    deadline_ms: int = 0               # time budget from receipt; 0 = none
    skip_tokens: int = 0               # leading tokens whose KV the edge already holds
    direct: bool = False               # the client holds a connection to every stream port (same session):
                                       # each rank sends its own layers and heads there
    core_decode: int = 0               # version 3: tokens the core may decode after the first and stream
                                       # as Token frames until the edge's Handover; 0 = none (version 2 mode)
    edge_layers: int = 0               # leading layers whose KV the edge computes itself (0 or 1: layer 0's
                                       # K/V depend on each token alone); the core sends none of theirs
    group: str = ""                    # the edge's fairness group of the request (the choices of one HTTP
                                       # request); "" = the request alone. The core shares its steps by it
    cache_salt: str = ""               # the request's prefix-cache scope: the core reuses cached KV only between
                                       # requests with the same salt; "" = unsalted (an older edge sends none)
    tenant: str = ""                   # the edge's tenant of the request (shared/node/tenants.py): the core shares its
                                       # steps between tenants, then groups; "" = none (older peers ignore it)
    adapter: str = ""                  # the LoRA adapter to prefill with (shared/models/lora.py), loaded at the core
    adapter_fingerprint: str = ""      # under the same name (`--lora`); its content hash must match the edge's, or
                                       # the core answers an Error; "" = the base model (older edges send none)
    traceparent: str = ""              # W3C trace context of the edge's span for this prefill: the core's spans
                                       # join the request's trace (shared/node/tracing.py); "" = untraced


class KVChunk(_Msg, tag=6, frozen=True):
    request_id: str
    layer_start: int
    layer_end: int                     # exclusive
    token_start: int
    token_end: int                     # exclusive
    head_start: int                    # KV heads carried (tensor-parallel cores send slices)
    head_end: int
    head_dim: int
    dtype: str                         # "bfloat16" | "float16" | "float32"
    codec: str
    k_bytes: int                       # encoded K length; V follows in the payload
    raw_len: int                       # bytes of K+V before encoding (the frame's MAC covers the payload)
    total_tokens: int = 0              # prompt length (lossy codecs keep the last tokens exact)


class PrefillDone(_Msg, tag=7, frozen=True):
    request_id: str
    first_token: int
    logprob: float = 0.0
    top_logprobs: list[tuple[int, float]] = []
    num_tokens: int = 0
    cached_tokens: int = 0
    timings: dict[str, float] = {}


class Ack(_Msg, tag=8, frozen=True):
    request_id: str


class Cancel(_Msg, tag=9, frozen=True):
    request_id: str


class Error(_Msg, tag=10, frozen=True):
    code: int
    message: str
    request_id: str = ""               # empty: the connection is failing


class Reject(_Msg, tag=13, frozen=True):
    seq: int                           # the receiver's sequence number of a frame that failed its MAC
    message: str = ""


# Version 3: decode handover. Positions count output tokens: 0 is PrefillDone's first token, Token frames
# carry 1, 2, ... in order. The core stops at Handover, Cancel, its bound or the request's end, and says so
# with DecodeStop (`position`: the first position it will not send); see docs/wire-format.md.
class Token(_Msg, tag=14, frozen=True):
    request_id: str
    position: int
    token_id: int
    logprob: float = 0.0
    top_logprobs: list[tuple[int, float]] = []


class Handover(_Msg, tag=15, frozen=True):
    request_id: str
    position: int                      # the edge holds tokens [0, position) and decodes from here on


class DecodeStop(_Msg, tag=16, frozen=True):
    request_id: str
    position: int                      # no Token at or after this position follows
    reason: str                        # "refused" | "bound" | "handover" | "finished" | "cancelled"


# Version 4: a core that is stopping gracefully (SIGTERM) tells each edge once, then takes no new PrefillRequest
# (each is refused with Error SHUTTING_DOWN) and finishes what it has in flight within `timeout_ms`; an edge
# sends it nothing new, and treats it as failed if the connection is still open after that time. An older
# (version 2 or 3) peer never receives it: it learns from the refusals and the closed connection.
class Draining(_Msg, tag=17, frozen=True):
    timeout_ms: int                    # the longest the core will take to finish its requests in flight
    message: str = ""


# Capability "prefix-digest": a core tells an edge which prompt prefixes its prefix cache holds, as the chained
# block hashes of shared/kv/block_manager.py (each 8 bytes little-endian, at most DIGEST_MAX_HASHES per frame), and
# how much prefill work it has queued. The first digest on a connection has `reset` (the set so far, maybe in several
# frames: only the first has `reset`); later ones carry the changes since the previous one. The edge predicts each
# core's time to first token from it (edge/core_cache.py).
class CacheDigest(_Msg, tag=18, frozen=True):
    block_size: int                    # tokens per hashed block
    stored: bytes = b""                # hashes cached since the previous digest
    evicted: bytes = b""               # hashes no longer cached
    reset: bool = False                # forget every hash announced before this frame
    queued_tokens: int = 0             # prompt tokens waiting or prefilling at the core, every edge's


# Capability "block-pull": an edge asks a peer edge for the KV of prompt-prefix blocks its pool holds (the hashes its
# CacheDigests announced), in prefix order. The server answers with one KVChunk per block it still holds (all layers
# and heads, `token_start` 0: each chunk is one block, in the order asked), stopping at the first it does not, then
# BlockPullDone with the count. Nothing is computed for a pull: it is a copy of cached KV.
class BlockPull(_Msg, tag=19, frozen=True):
    request_id: str
    block_size: int                    # tokens per block (the server's must match)
    hashes: bytes                      # chained block hashes, 8 bytes little-endian each, at most DIGEST_MAX_HASHES
    codec: str = "lossless"            # the wire codec of the KVChunks


class BlockPullDone(_Msg, tag=20, frozen=True):
    request_id: str
    blocks: int                        # KVChunks sent: the leading blocks asked for that the server held


class Ping(_Msg, tag=11, frozen=True):
    nonce: int
    pad: bytes = b""        # ignored: a core's probe train at a connection's start carries bytes (core/pacer.py)


class Pong(_Msg, tag=12, frozen=True):
    nonce: int
    load: int = 0                      # sender's queued + running requests
    # What the sender's kernel had received on this connection (bytes, since it opened) when it read the Ping, and
    # when (its own monotonic clock, µs); 0, 0: unknown. The Ping's sender paces its KV by them (core/pacer.py).
    received: int = 0
    at_us: int = 0


Message = (Hello | Welcome | Auth | AuthOk | PrefillRequest | KVChunk | PrefillDone | Ack | Cancel | Error
           | Ping | Pong | Reject | Token | Handover | DecodeStop | Draining | CacheDigest | BlockPull | BlockPullDone)
HANDOVER_MESSAGES = (Token, Handover, DecodeStop)     # only on a connection that agreed version 3
DRAIN_MESSAGES = (Draining,)                          # only on a connection that agreed version 4
MESSAGE_TYPES: dict[int, type] = {cls.__struct_config__.tag: cls for cls in typing.get_args(Message)}

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(Message)


def tag_of(msg: Message) -> int:
    return typing.cast(int, msg.__struct_config__.tag)     # every message class has an integer tag
