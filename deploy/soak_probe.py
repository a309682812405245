"""What a soak samples of one node: resident memory, open file descriptors and threads over its process group
(the node and its helpers, e.g. an edge's engine process), and its KV blocks in use from its /metrics.

Life cycle: stateless; `sample(pgid, metrics_url)` reads /proc and the node's metrics once and returns a
`NodeSample` (fields None when the node is down or does not answer).
"""

from __future__ import annotations

import os
import re
import urllib.request
from dataclasses import dataclass

_USAGE = re.compile(rb"^edgecore:kv_cache_usage_perc(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)
_BLOCKS = re.compile(rb'^edgecore:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', re.M)


@dataclass(frozen=True)
class NodeSample:
    rss_mb: float | None
    fds: int | None
    threads: int | None
    kv_blocks: int | None          # KV blocks in use
    kv_pool: int | None            # KV blocks in the pool


def _group(pgid: int) -> list[int]:
    """The live processes of a process group."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"Z" and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def _process(pid: int) -> tuple[float, int, int] | None:
    """(RSS in MB, open fds, threads) of one process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    rss_kb = int(status.get("VmRSS", "0 kB").split()[0])
    return rss_kb / 1024, fds, int(status["Threads"])


def kv_blocks(metrics_url: str, timeout: float = 5.0) -> tuple[int, int] | None:
    """(blocks in use, blocks in the pool) from a node's Prometheus text, or None."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout) as r:
            text = r.read()
    except OSError:
        return None
    usage, pool = _USAGE.search(text), _BLOCKS.search(text)
    if usage is None or pool is None:
        return None
    return round(float(usage.group(1)) * int(pool.group(1))), int(pool.group(1))


def sample(pgid: int, metrics_url: str) -> NodeSample:
    procs = [p for p in map(_process, _group(pgid)) if p is not None]
    kv = kv_blocks(metrics_url)
    if not procs:
        return NodeSample(None, None, None, None, None)
    return NodeSample(sum(p[0] for p in procs), sum(p[1] for p in procs), sum(p[2] for p in procs),
                      kv[0] if kv else None, kv[1] if kv else None)
