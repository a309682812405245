"""Prometheus metrics of an edge node: vLLM-style names under the `edgecore:` prefix, a `model_name` label on
every one (docs/metrics.md lists them).

Life cycle: `EdgeNode` builds one `EdgeMetrics` (its own registry); `Progress` (edge/progress.py) feeds the
per-request histograms as outputs arrive, placement and transfers count themselves (a decode
handover its outcome, `HANDOVER_OUTCOMES`, and the core's tokens), and a scrape refreshes the
gauges from the engine's stats snapshot (`EdgeNode.get_metrics`); the engine's own cumulative counts
(preemptions, prefix cache, tokens per step, cache configuration) are read from that snapshot by
`EngineCollector` during the scrape. `TenantMetrics` is the HTTP frontend's own (requests, tokens and 429s per
tenant, counted where requests are admitted; a `tenant` label whose values are the tenants file's names only),
appended to the engine's exposition on each scrape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest

from edgecore.shared.node.metrics import EngineCollector, ModelMetrics

if TYPE_CHECKING:
    from edgecore.shared.engine.handle import EngineStats

LATENCY = (.005, .01, .02, .04, .06, .08, .1, .25, .5, .75, 1, 2.5, 5, 7.5, 10, 20, 40)
TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
HANDOVER_OUTCOMES = ("taken_over", "finished_on_core", "refused", "core_failed")
PULL_OUTCOMES = ("pulled", "partial", "failed", "slower")     # edge/peer_pull.py
RATIO = (.125, .25, .5, .67, .8, .9, 1.1, 1.25, 1.5, 2, 4, 8)
TPOT = (.001, .0025, .005, .01, .02, .04, .06, .08, .1, .15, .2, .3, .4, .5, .75, 1, 2.5)


class EdgeMetrics:
    def __init__(self, model_name: str = "model", stats: Callable[[], EngineStats] | None = None, block_size: int = 0):
        r = self.registry = CollectorRegistry()
        m = ModelMetrics(r, model_name)
        self.ttft = m.histogram("edgecore:time_to_first_token_seconds", "Time to first token", buckets=LATENCY)
        self.itl = m.histogram("edgecore:inter_token_latency_seconds", "Time between output tokens",
                               buckets=(.001, .005, .01, .02, .04, .06, .08, .1, .25, .5, 1))
        self.tpot = m.histogram("edgecore:time_per_output_token_seconds", "Per finished request: decode time / "
                                "(output tokens - 1)", buckets=TPOT)
        self.e2e = m.histogram("edgecore:e2e_request_latency_seconds", "End-to-end request latency", buckets=LATENCY)
        self.queue_time = m.histogram("edgecore:request_queue_time_seconds", "Time before the first scheduling "
                                      "decision (placement)", buckets=LATENCY)
        self.prefill_time = m.histogram("edgecore:request_prefill_time_seconds", "Placement decided → first token "
                                        "(local or remote prefill, KV transfer included)", buckets=LATENCY)
        self.decode_time = m.histogram("edgecore:request_decode_time_seconds", "First token → last token",
                                       buckets=LATENCY)
        self.request_prompt_tokens = m.histogram("edgecore:request_prompt_tokens", "Prompt tokens per request",
                                                 buckets=TOKENS)
        self.request_generation_tokens = m.histogram("edgecore:request_generation_tokens", "Output tokens per "
                                                     "finished request", buckets=TOKENS)
        self.prompt_tokens = m.counter("edgecore:prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = m.counter("edgecore:generation_tokens", "Tokens generated")
        self.cached_tokens = m.counter("edgecore:prefix_cache_hit_tokens", "Prompt tokens not recomputed, per "
                                       "request: from the edge's prefix cache or disk KV tier, or for a remote "
                                       "prefill the core's (usage.prompt_tokens_details.cached_tokens)")
        self.requests = m.counter("edgecore:request_success", "Finished requests", "finished_reason")
        self.running = m.gauge("edgecore:num_requests_running", "Requests in the decode batch")
        self.waiting = m.gauge("edgecore:num_requests_waiting", "Requests waiting for the engine")
        self.predicted_ttft = m.gauge("edgecore:predicted_ttft_seconds", "Predicted time to first token of a "
                                      "new request of the recent mean prompt length (0 until a prefill is measured)")
        self.kv_usage = m.gauge("edgecore:kv_cache_usage_perc", "Fraction of KV blocks in use")
        self.kv_bytes = m.counter("edgecore:kv_bytes_received", "Encoded KV bytes received", "codec")
        self.kv_raw_bytes = m.counter("edgecore:kv_raw_bytes_received", "KV bytes after decoding", "codec")
        self.compression = m.gauge("edgecore:kv_compression_ratio", "Raw / encoded bytes of the last transfer",
                                   "codec")
        self.transfer = m.histogram("edgecore:kv_transfer_seconds", "PrefillRequest sent → PrefillDone", "codec",
                                    buckets=LATENCY)
        self.failovers = m.counter("edgecore:core_failovers", "Remote prefills retried elsewhere after a core "
                                   "failed")
        self.contexts_unpinned = m.counter("edgecore:contexts_unpinned", "Prefetched contexts unpinned to keep "
                                           "pinned blocks within their share of the KV pool")
        self.prefill_predicted = m.histogram("edgecore:core_prefill_predicted_seconds", "Predicted time to first "
                                             "token at the core chosen for a prefill (edge/core_choice.py)",
                                             buckets=LATENCY)
        self.prediction_ratio = m.histogram("edgecore:core_prefill_prediction_ratio", "Measured ÷ predicted time "
                                            "to first token of a prefill at a core", buckets=RATIO)
        self.core_cached_tokens = m.counter("edgecore:core_prefix_hit_tokens", "Prompt tokens the chosen core "
                                            "held in its prefix cache, by its digest, for prefills sent to it")
        self.local_prefills = m.counter("edgecore:local_prefills", "Prefills done at the edge", "reason")
        self.remote_prefills = m.counter("edgecore:remote_prefills", "Prefills done at a core", "codec")
        self.errors = m.counter("edgecore:request_errors", "Requests answered with an error", "status")
        self.handover_requests = m.counter("edgecore:handover_requests", "Remote requests that asked their core to "
                                           "decode until the KV is here, by outcome", "outcome")
        for outcome in HANDOVER_OUTCOMES:     # every outcome exposed from the start, at 0
            self.handover_requests.labels(outcome)
        self.handover_core_tokens = m.histogram("edgecore:handover_core_tokens", "Output tokens a core streamed "
                                                "(its first included) before the edge took over", buckets=TOKENS)
        self.handover_tokens = m.counter("edgecore:handover_tokens_received", "Tokens after the first received "
                                         "from cores decoding for this edge and sent to clients")
        self._peers(m)
        r.register(EngineCollector(model_name, stats, block_size))

    def _peers(self, m: ModelMetrics) -> None:
        """KV pulled from peer edges (edge/peer_pull.py) and served to them (edge/peer_server.py)."""
        self.peer_pulls = m.counter("edgecore:peer_pulls", "Prompts whose cached prefix a peer edge held beyond this "
                                    "edge's, by outcome: pulled, partial (fewer blocks than announced), failed "
                                    "(nothing usable: computed instead), slower (predicted slower than computing)",
                                    "outcome")
        for outcome in PULL_OUTCOMES:
            self.peer_pulls.labels(outcome)
        self.peer_pull_tokens = m.counter("edgecore:peer_pull_tokens", "Prompt tokens whose KV was pulled from peer "
                                          "edges into this edge's prefix cache")
        self.peer_pull_bytes = m.counter("edgecore:peer_pull_bytes", "Encoded KV bytes received from peer edges")
        self.peer_served_blocks = m.counter("edgecore:peer_served_blocks", "Cached KV blocks this edge sent to peer "
                                            "edges that pulled them")


class TenantMetrics:
    """Per-tenant counts of the HTTP frontend (edge/http.py); exposed even without tenants (no samples then)."""

    def __init__(self, model_name: str = "model"):
        r = self.registry = CollectorRegistry()
        m = ModelMetrics(r, model_name)
        self.requests = m.counter("edgecore:tenant_requests", "Requests admitted, by tenant", "tenant")
        self.prompt_tokens = m.counter("edgecore:tenant_prompt_tokens", "Prompt tokens of admitted requests, by "
                                       "tenant", "tenant")
        self.generation_tokens = m.counter("edgecore:tenant_generation_tokens", "Tokens generated, by tenant",
                                           "tenant")
        self.rate_limited = m.counter("edgecore:tenant_rate_limited", "Requests refused with a 429 by a tenant's "
                                      "limit, by tenant and limit", "tenant", "limit")
        self.in_flight = m.gauge("edgecore:tenant_sequences_in_flight", "Sequences (prompts × n) of a tenant's "
                                 "requests being served", "tenant")

    def keep(self, names: list[str]) -> None:
        """Drop the series of tenants no longer in the tenants file (the label stays bounded by it)."""
        wanted = set(names)
        for bound in (self.requests, self.prompt_tokens, self.generation_tokens, self.in_flight, self.rate_limited):
            for labels in list(bound.metric._metrics):       # (tenant[, limit], model_name)
                if labels[0] not in wanted:
                    bound.metric.remove(*labels)

    def text(self) -> str:
        return generate_latest(self.registry).decode()
