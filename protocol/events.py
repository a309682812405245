"""Events the sans-IO connection yields besides messages, and the per-request recovery rule.

Life cycle of a bad frame in READY: the receiver's `next_event` returns `BadFrame` (its MAC failed,
its fixed header was intact) and the transport sends `bad.reject()`; the sender's `next_event` turns
that `Reject` into `FrameRejected` carrying the message it had sent under that sequence number, and
`FrameRejected.recovery()` says what to do, so that only the request that frame belonged to fails:

    rejected frame                     sender does
    PrefillRequest(r)                  delivers Error(CHECKSUM, r) to itself: the edge retries r
    KVChunk(r) / PrefillDone(r)        sends Error(CHECKSUM, r): the edge fails r, retries, Cancels
    Ack / Cancel / Error(r) / Reject   sends the same message again (each is idempotent)
    Ping / Pong                        nothing (a lost heartbeat is harmless)
"""

from __future__ import annotations

from dataclasses import dataclass

from edgecore.protocol import messages as m
from edgecore.protocol.errors import ErrorCode


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = _NeedData()


@dataclass
class KVData:
    """A KVChunk header with its payload (encoded K then V). Received KVData has passed the frame MAC,
    which covers the payload."""
    chunk: m.KVChunk
    payload: memoryview | bytes


@dataclass(frozen=True)
class BadFrame:
    """A received frame failed its MAC; its boundaries were sound, so the connection can go on."""
    seq: int
    frame_type: int
    reason: str

    def reject(self) -> m.Reject:
        return m.Reject(self.seq, self.reason)


@dataclass(frozen=True)
class Recovery:
    send: tuple[m.Message, ...] = ()   # messages to send to the peer
    deliver: m.Error | None = None     # an error to hand to this side's application


@dataclass(frozen=True)
class FrameRejected:
    """The peer rejected our frame `seq`; `message` is what that frame carried (without payload)."""
    seq: int
    message: m.Message
    reason: str

    def recovery(self) -> Recovery:
        msg = self.message
        rid = getattr(msg, "request_id", "")
        text = f"a frame of request {rid} was corrupted in transit ({self.reason or 'MAC failed'})"
        if isinstance(msg, m.PrefillRequest):
            return Recovery(deliver=m.Error(int(ErrorCode.CHECKSUM), text, rid))
        if isinstance(msg, (m.KVChunk, m.PrefillDone, m.Token, m.DecodeStop)):
            return Recovery(send=(m.Error(int(ErrorCode.CHECKSUM), text, rid),))
        if isinstance(msg, (m.Ack, m.Cancel, m.Error, m.Reject, m.Handover)):
            return Recovery(send=(msg,))
        return Recovery()
