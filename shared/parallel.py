"""Tensor-parallel process state, read by the parallel layers.

Life cycle: a single-process run never touches this (rank 0 of 1). A
tensor-parallel core calls `init_tensor_parallel` once per rank after
`torch.distributed` is initialised; the layers then shard their weights
and reduce their outputs across `group`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None


_TP = TensorParallel()


def tensor_parallel() -> TensorParallel:
    return _TP


def init_tensor_parallel(rank: int, size: int, group: Any = None) -> None:
    _TP.rank, _TP.size, _TP.group = rank, size, group


def all_reduce(x):
    if _TP.size > 1:
        import torch.distributed as dist
        dist.all_reduce(x, group=_TP.group)
    return x


def all_gather_last_dim(x):
    if _TP.size == 1:
        return x
    import torch
    import torch.distributed as dist
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous(), group=_TP.group)
    return torch.cat(parts, dim=-1)
