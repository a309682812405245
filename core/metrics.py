"""Prometheus metrics of a core node (one registry per node, so tests can run several); a `model_name` label
on every one (docs/metrics.md lists them).

Life cycle: `CoreServer` builds one `CoreMetrics`; the prefill service counts requests, tokens and KV bytes
as it serves edges, the batch runner its queued, running and completed requests and tokens (and its
failures: writes a full disk refused, request tasks that raised), and a scrape
refreshes the gauges from the engine's stats snapshot (`core/http.py`); the engine's cumulative counts are
read from that snapshot by `EngineCollector` during the scrape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from edgecore.shared.node.metrics import EngineCollector, ModelMetrics

if TYPE_CHECKING:
    from edgecore.shared.engine.handle import EngineStats


class CoreMetrics:
    def __init__(self, model_name: str = "model", stats: Callable[[], EngineStats] | None = None, block_size: int = 0):
        r = self.registry = CollectorRegistry()
        m = ModelMetrics(r, model_name)
        self.prefill_requests = m.counter("edgecore:core_prefill_requests", "Prefill requests received", "outcome")
        self.prompt_tokens = m.counter("edgecore:core_prompt_tokens", "Prompt tokens prefilled")
        self.cached_tokens = m.counter("edgecore:core_prefix_cached_tokens", "Prompt tokens served from the core "
                                       "prefix cache")
        self.kv_bytes_sent = m.counter("edgecore:core_kv_bytes_sent", "Encoded KV bytes sent", "codec")
        self.kv_raw_bytes = m.counter("edgecore:core_kv_raw_bytes", "KV bytes before encoding", "codec")
        self.kv_chunks = m.counter("edgecore:core_kv_chunks_sent", "KV chunks sent")
        self.prefill_seconds = m.histogram("edgecore:core_prefill_seconds", "Time from request to PrefillDone",
                                           buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
        self.connections = m.gauge("edgecore:core_edge_connections", "Connected edges")
        self.leases = m.gauge("edgecore:core_kv_leases", "Requests whose KV waits for an edge Ack")
        self.prefill_backlog = m.gauge("edgecore:core_prefill_backlog_tokens", "Prompt tokens of edges' requests "
                                       "still prefilling here (beyond what the edge holds): the autoscaling signal")
        self.draining = m.gauge("edgecore:core_draining", "1 while the core drains after SIGTERM, else 0")
        self.kv_usage = m.gauge("edgecore:kv_cache_usage_perc", "Fraction of KV blocks in use")
        self.running = m.gauge("edgecore:num_requests_running", "Requests in the engine's batch (prefills and "
                               "batch-API decodes)")
        self.waiting = m.gauge("edgecore:num_requests_waiting", "Requests waiting for the engine")
        self.request_errors = m.counter("edgecore:request_errors", "Control-port HTTP requests answered with an "
                                        "error", "status")
        self.batch_queued = m.gauge("edgecore:core_batch_requests_queued", "Batch-API requests of the running "
                                    "batch not yet started")
        self.batch_running = m.gauge("edgecore:core_batch_requests_running", "Batch-API requests in the engine")
        self.batch_completed = m.counter("edgecore:core_batch_requests_completed", "Batch-API requests finished "
                                         "(a response line written)")
        self.batch_prompt_tokens = m.counter("edgecore:core_batch_prompt_tokens", "Prompt tokens of finished "
                                             "batch-API requests")
        self.batch_generation_tokens = m.counter("edgecore:core_batch_generation_tokens", "Tokens generated for "
                                                 "finished batch-API requests")
        self.batch_failures = m.counter("edgecore:core_batch_failures", "Batch-subsystem failures: store "
                                        "writes refused by a full disk (disk_full), request tasks that raised "
                                        "(task)", "cause")
        for cause in ("disk_full", "task"):
            self.batch_failures.labels(cause)
        self.handover_requests = m.counter("edgecore:core_handover_requests", "Remote requests the core decoded "
                                           "for their edge until it took over")
        self.core_decoded_tokens = m.counter("edgecore:core_handover_tokens", "Tokens decoded for edges before "
                                             "their handover (first tokens not counted)")
        self.handovers = m.counter("edgecore:core_handovers", "Handover messages that stopped a decoding request")
        self.handover_refusals = m.counter("edgecore:core_handover_refusals", "Requests for core decoding refused "
                                           "under prefill pressure")
        r.register(EngineCollector(model_name, stats, block_size))
