"""The spans one edge request leaves in its engine process (traces on, shared/node/tracing.py; off: no object at all).

Life cycle: `RequestTrace.begin` makes one when this process traces and the request carries a `traceparent`
(the HTTP process's span of it): "edge.request" opens at arrival, "edge.queue" under it. `placed` ends the queue
span (where the prompt is prefilled, and why). A remote prefill opens one "edge.prefill.remote" span per core
tried (`attempt`; the PrefillRequest carries its traceparent, so the core's spans hang under it; a failed
attempt ends in error, `attempt_failed`); a local one opens "edge.prefill.local" (`local`). `first_token` ends
the open prefill span. Under the remote prefill, `transfer` adds "edge.kv_transfer" (codec, bytes on the wire
and unpacked, each layer's completion as an event) and `handover` adds "edge.handover" (tokens the core
decoded, the outcome). `finished` adds "edge.decode" (first token to last); `close` ends the request span once,
whether the request finished, failed or was cancelled.
"""

from __future__ import annotations

import time

from edgecore.shared.node.tracing import Span, Tracer, tracer


class RequestTrace:
    def __init__(self, tr: Tracer, traceparent: str, request_id: str, prompt_tokens: int, arrived: float):
        self.tracer = tr
        self.root = tr.start("edge.request", traceparent, arrived, request_id=request_id,
                             prompt_tokens=prompt_tokens)
        self.queue: Span | None = tr.start("edge.queue", self.root, arrived)
        self.prefill: Span | None = None
        self.first_at: float | None = None

    @classmethod
    def begin(cls, traceparent: str | None, request_id: str, prompt_tokens: int, arrived: float
              ) -> RequestTrace | None:
        tr = tracer()
        if tr is None or traceparent is None:
            return None
        return cls(tr, traceparent, request_id, prompt_tokens, arrived)

    def placed(self, where: str, reason: str, at: float) -> None:
        if self.queue is not None:
            self.queue.end(at, placement=where, placement_reason=reason or None)
            self.queue = None
        self.root.set(placement=where)

    def attempt(self, core: str) -> str:
        """A prefill at `core` begins: its span's traceparent, for the PrefillRequest."""
        self.prefill = self.tracer.start("edge.prefill.remote", self.root, core=core)
        return self.prefill.traceparent

    def predicted(self, core: str, seconds: float, cached_tokens: int) -> None:
        """Why `core` was chosen: its predicted time to first token and the prompt tokens it held."""
        if self.prefill is not None:
            self.prefill.set(predicted_ttft_s=round(seconds, 4), core_cached_tokens=cached_tokens)

    def attempt_failed(self, why: str) -> None:
        if self.prefill is not None:
            self.prefill.fail(why)
            self.prefill.end()
            self.prefill = None

    def local(self, reason: str) -> None:
        self.prefill = self.tracer.start("edge.prefill.local", self.root, reason=reason)

    def first_token(self, at: float, cached_tokens: int) -> None:
        self.first_at = at
        self.root.set(cached_tokens=cached_tokens)
        if self.prefill is not None:
            self.prefill.end(at, cached_tokens=cached_tokens)

    def transfer(self, codec: str, encoded: int, raw: int, seconds: float, layers_at: list[float | None]) -> None:
        """The KV transfer ended now, `seconds` after its PrefillRequest left; `layers_at`: when each layer's KV
        was complete here (None: it never needed to be sent)."""
        now = time.perf_counter()
        span = self.tracer.start("edge.kv_transfer", self.prefill or self.root, now - seconds, codec=codec,
                                 kv_bytes=encoded, kv_raw_bytes=raw)
        for layer, at in enumerate(layers_at):
            if at is not None:
                span.event("layer_complete", at, layer=layer)
        span.end(now)

    def handover(self, core_tokens: int, outcome: str) -> None:
        """The handover ended (`core_tokens` < 0: unknown; outcome "core_failed": in error, the edge computed
        the rest)."""
        start = self.first_at if self.first_at is not None else time.perf_counter()
        span = self.tracer.start("edge.handover", self.prefill or self.root, start, outcome=outcome,
                                 core_tokens=core_tokens if core_tokens >= 0 else None)
        if outcome == "core_failed":
            span.fail("the core failed after the first token")
        span.end()

    def finished(self, output_tokens: int, finish_reason: str, at: float) -> None:
        if self.first_at is not None:
            self.tracer.start("edge.decode", self.root, self.first_at, output_tokens=output_tokens).end(at)
        self.root.set(output_tokens=output_tokens, finish_reason=finish_reason)

    def close(self) -> None:
        if self.queue is not None:
            self.queue.end()
        if self.prefill is not None and not self.prefill.ended:
            self.prefill.end()
        self.root.end()
