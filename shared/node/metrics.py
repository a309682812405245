"""Prometheus plumbing shared by the edge and core metrics: a `model_name` label on every metric, and the
engine's own counters read from its published stats at scrape time.

Life cycle: a node builds its metrics object once (`edge/metrics.py`,
`core/metrics.py`) with a `ModelMetrics` for its registry and served model
name; `counter` / `gauge` / `histogram` return metrics already bound to that
`model_name` (with further labels, `.labels(...)` takes only those). The
node installs `EngineCollector` with a function that returns the engine's
latest `EngineStats` snapshot; on every scrape it turns the engine's
cumulative counts (preemptions, prefix-cache queries and hits, tokens per
step) and cache configuration into metric families, so nothing is copied or
kept in step with the engine. `Buckets` is the engine-side, tensor-free
histogram those counts come from.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase

if TYPE_CHECKING:
    from edgecore.shared.engine.handle import EngineStats

_M = TypeVar("_M", bound=MetricWrapperBase)

# vLLM's buckets for tokens per engine step.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Buckets:
    """A cumulative histogram kept by the engine thread (plain ints): `counts[i]` observations ≤ `bounds[i]`
    (non-cumulative per bucket; the last entry counts those above every bound)."""

    def __init__(self, bounds: tuple[int, ...] = ITERATION_TOKEN_BUCKETS):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0

    def observe(self, value: int) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value


class _Bound(Generic[_M]):
    """A labelled metric whose `model_name` is fixed: `.labels(*rest)` names only the other labels."""

    def __init__(self, metric: _M, model: str):
        self.metric, self.model = metric, model

    def labels(self, *values: str) -> _M:
        return self.metric.labels(*values, self.model)


class ModelMetrics:
    """Metric constructors for one registry, each metric labelled with the served model's name."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.registry, self.model = registry, model_name

    def _make(self, cls: type[_M], name: str, doc: str, labels: tuple[str, ...], **kw: Any) -> _M | _Bound[_M]:
        # (the exposition sorts label names: `{codec="x",model_name=...}`, `{model_name=...,status="400"}`)
        metric = cls(name, doc, [*labels, "model_name"], registry=self.registry, **kw)
        return _Bound(metric, self.model) if labels else metric.labels(self.model)

    @overload
    def counter(self, name: str, doc: str) -> Counter: ...
    @overload
    def counter(self, name: str, doc: str, label: str, /, *labels: str) -> _Bound[Counter]: ...

    def counter(self, name: str, doc: str, *labels: str) -> Counter | _Bound[Counter]:
        return self._make(Counter, name, doc, labels)

    @overload
    def gauge(self, name: str, doc: str) -> Gauge: ...
    @overload
    def gauge(self, name: str, doc: str, label: str, /, *labels: str) -> _Bound[Gauge]: ...

    def gauge(self, name: str, doc: str, *labels: str) -> Gauge | _Bound[Gauge]:
        return self._make(Gauge, name, doc, labels)

    @overload
    def histogram(self, name: str, doc: str, *, buckets: Sequence[float | str]) -> Histogram: ...
    @overload
    def histogram(self, name: str, doc: str, label: str, /, *labels: str,
                  buckets: Sequence[float | str]) -> _Bound[Histogram]: ...

    def histogram(self, name: str, doc: str, *labels: str,
                  buckets: Sequence[float | str]) -> Histogram | _Bound[Histogram]:
        return self._make(Histogram, name, doc, labels, buckets=buckets)


class EngineCollector:
    """The engine's cumulative counts and cache configuration, from its stats snapshot, at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats] | None = None, block_size: int = 0):
        self.model, self.stats, self.block_size = model_name, stats, block_size

    def describe(self) -> list[Metric]:
        return []          # families are built per scrape; nothing to check at registration

    def collect(self) -> list[Metric]:
        from edgecore.shared.engine.handle import EngineStats     # no engine import for nodes that never scrape
        s = self.stats() if self.stats is not None else EngineStats()
        m = [self.model]
        preempt = CounterMetricFamily("edgecore:num_preemptions", "Requests preempted (KV dropped, recomputed "
                                      "later) by the engine", labels=["model_name"])
        preempt.add_metric(m, s.preemptions)
        queries = CounterMetricFamily("edgecore:prefix_cache_queries", "Prompt tokens looked up in the engine's "
                                      "prefix cache", labels=["model_name"])
        queries.add_metric(m, s.prefix_cache_query_tokens)
        hits = CounterMetricFamily("edgecore:prefix_cache_hits", "Prompt tokens found in the engine's prefix "
                                   "cache (hit rate: hits / queries)", labels=["model_name"])
        hits.add_metric(m, s.prefix_cache_hit_tokens)
        steps = HistogramMetricFamily("edgecore:iteration_tokens", "Tokens computed per engine step (prefill "
                                      "chunks and decode rows)", labels=["model_name"])
        counts = list(s.iteration_tokens) or [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        cumulative, running = [], 0
        for bound, count in zip([*(str(float(b)) for b in ITERATION_TOKEN_BUCKETS), "+Inf"], counts):
            running += count
            cumulative.append((bound, running))
        steps.add_metric(m, cumulative, s.iteration_tokens_sum)
        info = GaugeMetricFamily("edgecore:cache_config_info", "KV cache configuration (value 1; the labels)",
                                 labels=["block_size", "num_gpu_blocks", "enable_prefix_caching", "model_name"])
        info.add_metric([str(self.block_size), str(s.blocks_total), str(s.prefix_caching).lower(), self.model], 1)
        return [preempt, queries, hits, steps, info,
                *(stats_families(s, m, "spec_decode_num_", _SPEC_COUNTERS, ()) if s.speculative else ()),
                *(stats_families(s, m, "kv_tier_", _TIER_COUNTERS, _TIER_GAUGES) if s.tier_capacity_bytes else ())]


# Speculative decoding's series (shared/engine/speculative.py), as the tier's below.
_SPEC_COUNTERS = (
    ("drafts", "spec_drafts", "Speculative decoding: verification steps of sequences that drafted"),
    ("draft_tokens", "spec_draft_tokens", "Speculative decoding: tokens drafted"),
    ("accepted_tokens", "spec_accepted_tokens", "Speculative decoding: drafted tokens accepted (acceptance rate: "
                                                "rate of this / rate of draft_tokens)"),
)
# The disk KV tier's series (shared/kv/tier.py): (name, EngineStats field, help), counters then gauges.
_TIER_COUNTERS = (
    ("hit_blocks", "tier_hit_blocks", "KV blocks read back from the disk tier instead of recomputed"),
    ("miss_blocks", "tier_miss_blocks", "KV blocks after the pool's cached prefix looked up in the disk tier and "
                                        "not found (or found bad)"),
    ("read_bytes", "tier_read_bytes", "Bytes read from the disk tier"),
    ("read_seconds", "tier_read_seconds", "Seconds the disk tier's reader spent reading, checking and decoding "
                                          "(read speed: rate of read_bytes / rate of this)"),
    ("written_blocks", "tier_written_blocks", "KV blocks written to the disk tier"),
    ("written_bytes", "tier_written_bytes", "Bytes written to the disk tier"),
    ("dropped_blocks", "tier_dropped_blocks", "Evicted KV blocks not stored in the disk tier (its writer was "
                                              "behind, or the write failed)"),
    ("errors", "tier_errors", "Disk tier I/O errors (writes, reads, deletions)"),
    ("removed_files", "tier_removed_files", "Disk tier files removed as corrupted, truncated or foreign"),
)
_TIER_GAUGES = (
    ("used_bytes", "tier_used_bytes", "Bytes the disk tier's files take"),
    ("capacity_bytes", "tier_capacity_bytes", "The disk tier's size bound (--kv-tier-size)"),
    ("files", "tier_files", "Blocks (files) in the disk tier"),
    ("healthy", "tier_healthy", "1 while writes to the disk tier's directory succeed, 0 while they fail"),
)


def stats_families(s: EngineStats, labels: list[str], prefix: str, counters: tuple, gauges: tuple) -> list[Metric]:
    """Metric families `edgecore:PREFIX+name` from a stats snapshot's fields, per table (name, field, help)."""
    out: list[Metric] = []
    for kind, table in ((CounterMetricFamily, counters), (GaugeMetricFamily, gauges)):
        for name, field, doc in table:
            family = kind(f"edgecore:{prefix}{name}", doc, labels=["model_name"])
            family.add_metric(labels, float(getattr(s, field)))
            out.append(family)
    return out
