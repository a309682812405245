"""What the edge records of its remote prefills: the transfer metrics and the decode handover tallies.

Life cycle: one observer over the edge's `EdgeMetrics` (Prometheus) and its handover tallies (`counts`, the
`handover` section of /stats, a plain dict the edge owns); a remote prefill reports into it as things happen
and keeps no state of its own here. Each transfer that is not given up is counted once (`transfer`: by codec,
the encoded and raw bytes, the ratio, the seconds); each decode handover ends with one outcome (`handover`:
edge/metrics.py `HANDOVER_OUTCOMES`), and each token a core decoded and the client got counts once
(`core_token`). A handover whose core failed counts as a failover, and as a local prefill when the edge computes
the rest (`core_failed`). A traced request's transfer and handover become spans too (edge/request_trace.py).
"""

from __future__ import annotations

from edgecore.edge.metrics import EdgeMetrics
from edgecore.edge.request_trace import RequestTrace


class TransferMetrics:
    def __init__(self, metrics: EdgeMetrics, counts: dict | None = None, trace: RequestTrace | None = None):
        self.metrics = metrics
        self.counts = counts if counts is not None else {}
        self.trace = trace

    def transfer(self, codec: str, encoded: int, raw: int, seconds: float, layers_at: list[float | None] | None = None
                 ) -> None:
        """One transfer received (or left to the edge after the handover): `encoded` bytes on the wire, `raw`
        after unpacking, `seconds` from the PrefillRequest; `layers_at`, when each layer's KV was complete."""
        if self.trace is not None:
            self.trace.transfer(codec, encoded, raw, seconds, layers_at or [])
        metrics = self.metrics
        metrics.remote_prefills.labels(codec).inc()
        metrics.kv_bytes.labels(codec).inc(encoded)
        metrics.kv_raw_bytes.labels(codec).inc(raw)
        if encoded:
            metrics.compression.labels(codec).set(raw / encoded)
        metrics.transfer.labels(codec).observe(seconds)

    def core_token(self) -> None:
        """A token after the first that the core decoded went to the client."""
        self.metrics.handover_tokens.inc()

    def handover(self, core_tokens: int, key: str, outcome: str) -> None:
        """Count a handover's end: `key` in the /stats tallies ("handovers" counts every Handover sent, a
        refused one too, which also counts as "refused"), `outcome` in the metrics (HANDOVER_OUTCOMES)."""
        c = self.counts
        for k in (key, "refused") if outcome == "refused" else (key,):
            c[k] = c.get(k, 0) + 1
        c["core_tokens"] = c.get("core_tokens", 0) + core_tokens
        c["last_core_tokens"] = core_tokens
        self.metrics.handover_requests.labels(outcome).inc()
        if self.trace is not None:
            self.trace.handover(core_tokens, outcome)
        if outcome == "taken_over":
            self.metrics.handover_core_tokens.observe(core_tokens)

    def core_failed(self, computed_here: bool) -> None:
        """A decoding core failed after the first token: a failover; `computed_here`, the edge computes the rest
        itself (the request had not ended)."""
        self.metrics.failovers.inc()
        if self.trace is not None:
            self.trace.handover(-1, "core_failed")
        if computed_here:
            self.metrics.local_prefills.labels("core_failed").inc()
