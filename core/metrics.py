"""Prometheus metrics of a core node (one registry per node, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class CoreMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.prefill_requests = Counter("edgecore:core_prefill_requests", "Prefill requests received", ["outcome"],
                                        registry=r)
        self.prompt_tokens = Counter("edgecore:core_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.cached_tokens = Counter("edgecore:core_prefix_cached_tokens", "Prompt tokens served from the core "
                                     "prefix cache", registry=r)
        self.kv_bytes_sent = Counter("edgecore:core_kv_bytes_sent", "Encoded KV bytes sent", ["codec"], registry=r)
        self.kv_raw_bytes = Counter("edgecore:core_kv_raw_bytes", "KV bytes before encoding", ["codec"], registry=r)
        self.kv_chunks = Counter("edgecore:core_kv_chunks_sent", "KV chunks sent", registry=r)
        self.prefill_seconds = Histogram("edgecore:core_prefill_seconds", "Time from request to PrefillDone",
                                         registry=r, buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
        self.connections = Gauge("edgecore:core_edge_connections", "Connected edges", registry=r)
        self.leases = Gauge("edgecore:core_kv_leases", "Requests whose KV waits for an edge Ack", registry=r)
        self.handover_requests = Counter("edgecore:core_handover_requests", "Remote requests the core decoded "
                                         "for their edge until it took over", registry=r)
        self.core_decoded_tokens = Counter("edgecore:core_handover_tokens", "Tokens decoded for edges before "
                                           "their handover (first tokens not counted)", registry=r)
        self.handovers = Counter("edgecore:core_handovers", "Handover messages that stopped a decoding request",
                                 registry=r)
        self.handover_refusals = Counter("edgecore:core_handover_refusals", "Requests for core decoding refused "
                                         "under prefill pressure", registry=r)
        self.kv_usage = Gauge("edgecore:kv_cache_usage_perc", "Fraction of KV blocks in use", registry=r)
        self.request_errors = Counter("edgecore:request_errors", "Control-port HTTP requests answered with an "
                                      "error", ["status"], registry=r)
