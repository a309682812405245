"""One edge request's counters and latency metrics.

Life cycle: made when a request arrives at the `EdgeNode` (it counts as
active from then on), told which core prefilled it (if any), fed every output
(`observe`: TTFT, prefill time and the placement model's timing with the
first, ITL after; end-to-end, decode time, time per output token, token
counts and the finish reason with the last), and closed once (`done`),
whether the request finished, failed or was cancelled. With traces on and a
traced request, its spans (`trace`, edge/request_trace.py) follow the same
calls.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from edgecore.edge.core_client import CoreClient
from edgecore.edge.request_trace import RequestTrace
from edgecore.shared.engine.output import RequestOutput

if TYPE_CHECKING:
    from edgecore.edge.node import EdgeNode


class Progress:
    """One request's counters and latency metrics, fed each output (by `generate` or `submit`'s sink)."""

    def __init__(self, edge: EdgeNode, prompt_len: int, request_id: str = "", traceparent: str | None = None):
        self.edge, self.prompt_len = edge, prompt_len
        self.arrived = self.placed_at = time.perf_counter()
        self.trace = RequestTrace.begin(traceparent, request_id, prompt_len, self.arrived)
        self.core: CoreClient | None = None
        self.predicted: tuple[float, float] | None = None    # the latest core attempt: predicted TTFT, its start
        self.measured = True        # its first token times a prefill (False: it waited for KV room, or cores failed)
        self.queued = 0             # prompt tokens queued ahead of it where it was prefilled, at its placement
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.open = True
        edge.active += 1
        edge.metrics.prompt_tokens.inc(prompt_len)

    def observe(self, out: RequestOutput) -> None:
        metrics, now = self.edge.metrics, time.perf_counter()
        if self.first_at is None:
            self.first_at = now
            metrics.ttft.observe(now - self.arrived)
            metrics.prefill_time.observe(now - self.placed_at)
            if self.predicted is not None and self.core is not None and self.predicted[0] > 0:
                metrics.prediction_ratio.observe((now - self.predicted[1]) / self.predicted[0])
            metrics.cached_tokens.inc(out.num_cached_tokens)
            if self.trace is not None:
                self.trace.first_token(now, out.num_cached_tokens)
            # the tokens its time covers: its own uncached ones and the queue it waited behind (the prediction's
            # terms, edge/placement.py), so the rates measured are the ones the predictions assume
            prefilled = self.prompt_len - out.num_cached_tokens + self.queued
            if self.measured and self.core is None:
                self.edge.prefill_model.observe_local(prefilled, now - self.arrived)
            elif self.measured:
                assert self.core is not None
                self.edge.prefill_model.observe_remote(self.core.address, prefilled, now - self.arrived,
                                                       self.core.rtt)
        elif out.new_token_ids:
            assert self.last_at is not None          # set with first_at
            metrics.itl.observe(now - self.last_at)
        self.last_at = now
        if out.finished:
            assert out.finish_reason is not None     # a finished output has its reason
            metrics.requests.labels(out.finish_reason).inc()
            metrics.e2e.observe(now - self.arrived)
            metrics.decode_time.observe(now - self.first_at)
            metrics.request_prompt_tokens.observe(self.prompt_len)
            metrics.request_generation_tokens.observe(out.num_output_tokens)
            if out.num_output_tokens > 1:
                metrics.tpot.observe((now - self.first_at) / (out.num_output_tokens - 1))
            if self.trace is not None:
                self.trace.finished(out.num_output_tokens, out.finish_reason, now)

    def done(self) -> None:
        if self.open:
            self.open = False
            self.edge.active -= 1
            if self.trace is not None:
                self.trace.close()
