"""The core's send side of one KV transfer: a request's state as one explicit enum.

Life cycle (the state is written by one thread — the core's event loop; on a
worker rank, its engine thread — and read by the others: a one-word enum swap
is atomic):

    PREFILLING --prefill_done()--> LEASED --release()--> RELEASED   (Ack, or the lease ran out)
        |                             |
        +--------cancel()-------------+--> CANCELLED   (Cancel, disconnect, deadline, error, drop)

    worker rank (no Ack there):  PREFILLING --all layers left--> SENT

PREFILLING: the request runs prefill-only in the engine; each computed layer's
new tokens are cut out of the pool as a `KVSlice` and queued (`KVSend`) for the
connection's sender while the next layer computes (or kept back in `held`, in
the baseline mode that sends everything after the last layer, and on a parallel
core whose edge lacks stream connections, where rank 0 gathers the KV after
the prefill). LEASED: PrefillDone is queued behind the request's last chunk;
the KV stays in the engine under a lease until the edge's Ack frees it.
Chunks of a CANCELLED transfer still queued are dropped by the sender.

Decode handover (protocol version 3, `decoding`): the request runs as an ordinary
request instead of prefill-only; the first token goes out ahead of queued KV
(PREFILLING → LEASED as above), then the core keeps decoding it in its batch,
each token a Token frame ahead of queued KV, until the edge's Handover, Cancel,
the `HandoverLimits` bound or the request's end; `decode` is that task,
`position` the next output position. The KV already left layer by layer, so
nothing waits for it; the lease starts when decoding stops.

Bounded copying (core/outbox.py, core/kv_sender.py): the layer hook copies a
layer only while the connection's outbox has room; when it has none, the hook
marks the transfer `paused` and never copies for it again. After the prefill,
the service queues what was left — each layer from `layer_until` (or all of
it, for a gathered transfer) — reading it back from the pool, where the KV
stays until the edge's Ack, in windows the outbox has room for (`queue_rest`).

Written by the engine thread only: `sent_until`, `last_layer_at`, `needed`,
`layer_until` and `paused` (until it is set; after that, and for a gathered
transfer, the event loop owns `layer_until`); by the sender only:
`first_chunk_sent_at`.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from edgecore.protocol.messages import Message
from edgecore.shared.errors import ConfigError
from edgecore.shared.kv.transfer import KVSlice

if TYPE_CHECKING:
    from edgecore.core.transfer_trace import TransferTrace
    from edgecore.core.outbox import Outbox


class TransferState(enum.Enum):
    PREFILLING = "prefilling"
    LEASED = "leased"              # prefilled, KV kept until the edge's Ack
    RELEASED = "released"          # acknowledged (or the lease expired): KV freed
    CANCELLED = "cancelled"
    SENT = "sent"                  # a worker rank's route: its last layers and tokens have left


_NEXT = {
    TransferState.PREFILLING: {TransferState.LEASED, TransferState.CANCELLED, TransferState.SENT},
    TransferState.LEASED: {TransferState.RELEASED, TransferState.CANCELLED},
}


@dataclass(eq=False)
class Transfer:
    internal_id: str                   # the engine's request id
    request_id: str                    # the edge's request id
    outbox: Outbox                     # the connection's outbox (KVSend and messages, in order; core/outbox.py)
    codec: str
    total_tokens: int                  # prompt length
    skip_tokens: int = 0               # tokens the edge holds already
    edge_layers: int = 0               # leading layers whose KV the edge computes itself: none of theirs is sent
    gather: bool = False               # parallel core, edge not attached to every rank: rank 0 gathers the KV
    group: str = ""                    # the engine's fairness group: the edge connection's, then the edge's own
    cache_salt: str | None = None      # the request's prefix-cache scope (PrefillRequest.cache_salt; None: unsalted)
    tenant: str | None = None          # the edge's tenant of the request (PrefillRequest.tenant): its fair share here
    adapter: str | None = None         # the LoRA adapter it is prefilled with (PrefillRequest.adapter; None: base)
    state: TransferState = TransferState.PREFILLING
    sent_until: int = 0                # tokens fully queued (all layers); engine thread only
    needed: list[int] | None = None    # per global layer, the first token the edge needs (`needed_from`); engine thread
    layer_until: list[int] | None = None   # per global layer, tokens queued so far (see the module's docstring)
    paused: bool = False               # the layer hook found the outbox full: the rest is read back after the prefill
    resumable: bool = True             # the layer hook may pause it (False: a parallel core's direct streams)
    received_at: float = field(default_factory=time.perf_counter)
    first_chunk_sent_at: float | None = None
    last_layer_at: float | None = None
    lease: asyncio.TimerHandle | None = None
    held: list[KVSend] = field(default_factory=list)   # chunks kept back until the prefill ends
    decode: asyncio.Task | None = None   # decode handover: the task streaming this request's tokens
    position: int = 0                  # decode handover: the next output position to send
    piece_bytes: int = 0               # decode handover: KV frames cut to about this size (0: whole slices)
    trace: TransferTrace | None = None  # its spans when traced (core/transfer_trace.py)

    def __post_init__(self) -> None:
        self.sent_until = self.skip_tokens

    @property
    def cancelled(self) -> bool:
        return self.state is TransferState.CANCELLED

    def move(self, to: TransferState) -> bool:
        """Take a transition of the diagram above; False (and no change) if it is not one from here."""
        if to not in _NEXT.get(self.state, ()):
            return False
        self.state = to
        return True

    def prefill_done(self) -> bool:
        return self.move(TransferState.LEASED)

    def cancel(self) -> bool:
        return self.move(TransferState.CANCELLED)

    def release(self) -> bool:
        return self.move(TransferState.RELEASED)

    def timings(self, now: float) -> dict[str, float]:
        """PrefillDone's timings (ms since the request arrived)."""
        out = {"total_ms": (now - self.received_at) * 1e3}
        if self.first_chunk_sent_at is not None:
            out["first_chunk_sent_ms"] = (self.first_chunk_sent_at - self.received_at) * 1e3
        if self.last_layer_at is not None:
            out["last_layer_done_ms"] = (self.last_layer_at - self.received_at) * 1e3
        return out


@dataclass(frozen=True)
class HandoverLimits:
    """How much a core decodes for an edge before the edge takes over (PrefillRequest.core_decode)."""
    max_tokens: int = 64               # tokens after the first; 0: never decode for edges (old mode)
    max_seconds: float = 10.0          # from the first token
    refuse_waiting: int = 8            # refuse when this many requests wait in the core's engine (prefill pressure)

    def __post_init__(self) -> None:
        if self.max_tokens < 0 or self.max_seconds <= 0 or self.refuse_waiting < 0:
            raise ConfigError("--handover-max-tokens and --handover-refuse-waiting must be >= 0 and "
                              "--handover-max-seconds > 0")


@dataclass(frozen=True, slots=True)
class KVSend:
    """One slice of one transfer's KV, queued for the connection's sender."""
    transfer: Transfer
    piece: KVSlice


Outgoing = KVSend | Message            # what a connection's sender queue holds
