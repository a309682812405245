"""The KV-head partition rule of tensor parallelism, written once.

Life cycle: pure functions, asked when a model is built (which KV heads a rank
computes and caches), when a parallel core gathers or streams KV (which heads a
rank's pieces cover), and when it decides which ranks hold distinct KV. With at
least as many KV heads as ranks, each rank holds `heads // tp` consecutive heads;
with fewer, `tp // heads` consecutive ranks hold a replica of one head.
"""

from __future__ import annotations


def kv_heads_per_rank(tp: int, total_kv_heads: int) -> int:
    """How many KV heads one rank holds."""
    return max(1, total_kv_heads // tp)


def kv_head_start(tp_rank: int, tp: int, total_kv_heads: int) -> int:
    """The first (global) KV head that tensor-parallel rank `tp_rank` of `tp` holds."""
    if total_kv_heads >= tp:
        return tp_rank * kv_heads_per_rank(tp, total_kv_heads)
    return tp_rank * total_kv_heads // tp

