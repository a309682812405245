"""Tensor- and pipeline-parallel process state, read by the parallel layers and runners.

Life cycle: a single-process run never touches this (rank 0 of 1, one stage).
A parallel core calls `init_distributed` once in every rank: it joins the
torch.distributed world (gloo on CPU, NCCL on CUDA), creates one tensor-parallel
group per pipeline stage, and records this rank's place; the layers then shard
their weights and reduce their outputs across the rank's TP group, and the
runner passes hidden states from stage to stage.

Global rank = stage × tp + tp_rank; rank 0 (stage 0, tp rank 0) drives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None


@dataclass
class Layout:
    tp: int = 1
    pp: int = 1
    rank: int = 0
    split: tuple[int, ...] = ()        # layers per stage
    micro_batches: int = 0             # per step with several stages (0: one per stage)

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    def stage_layers(self, stage: int | None = None) -> range:
        stage = self.stage if stage is None else stage
        start = sum(self.split[:stage])
        return range(start, start + self.split[stage])

    def rank_of(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp + tp_rank


_TP = TensorParallel()
_LAYOUT = Layout()


def tensor_parallel() -> TensorParallel:
    return _TP


def layout() -> Layout:
    return _LAYOUT


def init_tensor_parallel(rank: int, size: int, group: Any = None) -> None:
    _TP.rank, _TP.size, _TP.group = rank, size, group


def balanced_split(num_layers: int, pp: int, split: list[int] | None = None) -> tuple[int, ...]:
    """Layers per stage: as given (must sum to num_layers), else as even as possible (earlier stages
    take one fewer, since stage 0 also embeds and the last stage computes logits... both cost little;
    the remainder goes to the middle-to-last stages)."""
    if split:
        if len(split) != pp or sum(split) != num_layers or min(split) < 1:
            raise ValueError(f"pipeline split {split} must give {pp} stages ≥ 1 layer summing to {num_layers}")
        return tuple(split)
    if pp > num_layers:
        raise ValueError(f"{pp} pipeline stages for {num_layers} layers")
    base, extra = divmod(num_layers, pp)
    return tuple(base + (1 if s >= pp - extra else 0) for s in range(pp))


def init_distributed(rank: int, tp: int, pp: int, num_layers: int, master: str, backend: str = "gloo",
                     split: list[int] | None = None, timeout_s: float = 120.0, micro_batches: int = 0) -> Layout:
    import datetime

    import torch.distributed as dist
    world = tp * pp
    dist.init_process_group(backend, init_method=f"tcp://{master}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    _LAYOUT.tp, _LAYOUT.pp, _LAYOUT.rank = tp, pp, rank
    _LAYOUT.split = balanced_split(num_layers, pp, split)
    _LAYOUT.micro_batches = micro_batches or pp
    groups = [dist.new_group([s * tp + i for i in range(tp)]) for s in range(pp)]   # same order everywhere
    init_tensor_parallel(_LAYOUT.tp_rank, tp, groups[_LAYOUT.stage])
    return _LAYOUT


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
