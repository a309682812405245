"""Prometheus metrics of an edge node, vLLM-style names under the `edgecore:` prefix."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY = (.005, .01, .02, .04, .06, .08, .1, .25, .5, .75, 1, 2.5, 5, 7.5, 10, 20, 40)


class EdgeMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("edgecore:time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=LATENCY)
        self.itl = Histogram("edgecore:inter_token_latency_seconds", "Time between output tokens", registry=r,
                             buckets=(.001, .005, .01, .02, .04, .06, .08, .1, .25, .5, 1))
        self.e2e = Histogram("edgecore:e2e_request_latency_seconds", "End-to-end request latency", registry=r,
                             buckets=LATENCY)
        self.queue_time = Histogram("edgecore:request_queue_time_seconds", "Time before the first scheduling "
                                    "decision (placement)", registry=r, buckets=LATENCY)
        self.prompt_tokens = Counter("edgecore:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("edgecore:generation_tokens", "Tokens generated", registry=r)
        self.cached_tokens = Counter("edgecore:prefix_cache_hit_tokens", "Prompt tokens from the edge prefix cache",
                                     registry=r)
        self.requests = Counter("edgecore:request_success", "Finished requests", ["finished_reason"], registry=r)
        self.running = Gauge("edgecore:num_requests_running", "Requests in the decode batch", registry=r)
        self.waiting = Gauge("edgecore:num_requests_waiting", "Requests waiting for the engine", registry=r)
        self.kv_usage = Gauge("edgecore:kv_cache_usage_perc", "Fraction of KV blocks in use", registry=r)
        self.kv_bytes = Counter("edgecore:kv_bytes_received", "Encoded KV bytes received", ["codec"], registry=r)
        self.kv_raw_bytes = Counter("edgecore:kv_raw_bytes_received", "KV bytes after decoding", ["codec"],
                                    registry=r)
        self.compression = Gauge("edgecore:kv_compression_ratio", "Raw / encoded bytes of the last transfer",
                                 ["codec"], registry=r)
        self.transfer = Histogram("edgecore:kv_transfer_seconds", "PrefillRequest sent → PrefillDone", ["codec"],
                                  registry=r, buckets=LATENCY)
        self.failovers = Counter("edgecore:core_failovers", "Remote prefills retried elsewhere after a core failed",
                                 registry=r)
        self.local_prefills = Counter("edgecore:local_prefills", "Prefills done at the edge", ["reason"], registry=r)
        self.remote_prefills = Counter("edgecore:remote_prefills", "Prefills done at a core", ["codec"], registry=r)
        self.errors = Counter("edgecore:request_errors", "Requests answered with an error", ["status"], registry=r)
