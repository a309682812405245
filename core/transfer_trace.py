"""The spans one remote request leaves at the core (traces on, shared/node/tracing.py; off: no object at all).

Life cycle: `TransferTrace.begin` makes one when this core traces and the PrefillRequest carries a `traceparent`
(the edge's span of this prefill attempt): "core.request" opens at receipt (prompt and skipped tokens, codec,
tokens the edge lets the core decode). The sender reports each KV frame (`sent`: bytes on the wire and raw,
the first and last frame's times). `prefilled` adds "core.prefill" (receipt to the first token; the tokens
found in this core's prefix cache). With decode handover, `decode_stopped` adds "core.decode" (first token to
DecodeStop: tokens decoded for the edge, why it stopped). `close` adds "core.kv_send" (first frame to last:
bytes, frames) and ends the request span with its outcome, once: released after the edge's Ack, cancelled by
the edge's Cancel, or in error: rejected, timeout, kv_lost, disconnected, lease_expired (no Ack in time).
"""

from __future__ import annotations

import time

from edgecore.protocol import messages as m
from edgecore.protocol.state import Connection
from edgecore.shared.node.tracing import Tracer, parse_traceparent, tracer


class TransferTrace:
    def __init__(self, tr: Tracer, traceparent: str, received_at: float, **attributes: object):
        self.tracer = tr
        self.root = tr.start("core.request", traceparent, received_at, kind="server", **attributes)
        self.received_at = received_at
        self.first_at: float | None = None
        self.first_sent_at: float | None = None
        self.last_sent_at: float | None = None
        self.sent_bytes = self.raw_bytes = self.frames = 0

    @classmethod
    def begin(cls, msg: m.PrefillRequest, received_at: float, codec: str, conn: Connection) -> TransferTrace | None:
        """The request's spans, when this core traces and the edge (on `conn`) sent a well-formed traceparent."""
        tr = tracer()
        if tr is None or parse_traceparent(msg.traceparent) is None:
            return None
        return cls(tr, msg.traceparent, received_at, request_id=msg.request_id, prompt_tokens=len(msg.token_ids),
                   skip_tokens=msg.skip_tokens, codec=codec, core_decode=msg.core_decode,
                   edge=conn.peer_name or None)

    def sent(self, encoded: int, raw: int) -> None:
        now = time.perf_counter()
        if self.first_sent_at is None:
            self.first_sent_at = now
        self.last_sent_at = now
        self.sent_bytes += encoded
        self.raw_bytes += raw
        self.frames += 1

    def prefilled(self, prompt_tokens: int, cached_tokens: int, at: float) -> None:
        """The first token was sampled `at` (the span ends there, not when the rest of the KV was queued)."""
        if self.root.ended:
            return
        self.first_at = at
        self.tracer.start("core.prefill", self.root, self.received_at, prompt_tokens=prompt_tokens,
                          cached_tokens=cached_tokens).end(at)

    def decode_stopped(self, tokens: int, reason: str) -> None:
        if self.first_at is not None:
            self.tracer.start("core.decode", self.root, self.first_at, decoded_tokens=tokens,
                              stop_reason=reason).end()

    def close(self, outcome: str) -> None:
        if self.root.ended:
            return
        if self.first_sent_at is not None:
            self.tracer.start("core.kv_send", self.root, self.first_sent_at, kv_bytes=self.sent_bytes,
                              kv_raw_bytes=self.raw_bytes, frames=self.frames).end(self.last_sent_at)
        if outcome not in ("released", "cancelled"):     # cancelled: the edge's Cancel (a request that ended)
            self.root.fail(outcome)                       # timeout, kv_lost, disconnected, lease_expired, rejected
        self.root.end(outcome=outcome, kv_bytes=self.sent_bytes)
