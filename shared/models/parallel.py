"""Tensor- and pipeline-parallel process state, read by the parallel layers and runners.

Life cycle: a single-process run never touches this (rank 0 of 1, one stage).
Before any rank starts, `check_parallel(config, tp, pp)` says in one line
why a layout cannot shard the model (heads, KV heads, MLP width, layers).
The driver binds the rendezvous socket first (`rendezvous_socket`, on the
configured host, port 0 = any free one) so workers learn its port before they
start. A parallel core calls `init_distributed` once in every rank: it joins
the torch.distributed world through a TCP store on that socket (gloo on CPU,
NCCL on CUDA; gloo's and NCCL's own sockets are put on the interface of the
rendezvous host, loopback by default, unless GLOO_SOCKET_IFNAME /
NCCL_SOCKET_IFNAME say otherwise), creates one tensor-parallel group per
pipeline stage, and records this rank's place; the layers then shard their
weights and reduce their outputs across the rank's TP group, and the runner
passes hidden states from stage to stage.

Global rank = stage × tp + tp_rank; rank 0 (stage 0, tp rank 0) drives.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from edgecore.shared.models.config import ModelConfig


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


def check_parallel(config: ModelConfig, tp: int, pp: int, split: list[int] | None = None) -> None:
    """Raise ValueError (one line, naming the flag) when `tp` × `pp` cannot shard the model `config`."""
    if tp < 1 or pp < 1:
        raise ValueError("--tp and --pp must be at least 1")
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % tp:
        raise ValueError(f"--tp {tp}: the model's {heads} attention heads do not split over {tp} ranks")
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise ValueError(f"--tp {tp}: the model's {kv} KV heads do not split over {tp} ranks (use a divisor or "
                         f"a multiple of {kv})")
    for name in ("intermediate_size", "moe_intermediate_size"):
        width = getattr(config, name, None)
        if width and width % tp:
            raise ValueError(f"--tp {tp}: the model's {name} {width} does not split over {tp} ranks")
    try:
        balanced_split(config.num_hidden_layers, pp, split)
    except ValueError as exc:
        raise ValueError(f"--pp {pp}: {exc}") from None


def rendezvous_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """The driver's listening socket for the TCP store, bound before any worker starts (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind the rendezvous address {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    return sock


def _interface_of(host: str) -> str | None:
    """The network interface holding IPv4 address `host` (Linux), for gloo's and NCCL's own sockets."""
    try:
        import fcntl
        import ipaddress
        import struct
        addr = ipaddress.ip_address(host)
        if addr.is_loopback:
            return "lo"
        for _, name in socket.if_nameindex():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:
                    raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
                except OSError:
                    continue
            if socket.inet_ntoa(raw[20:24]) == str(addr):
                return name
    except (ImportError, ValueError, OSError):
        pass
    return None


def init_distributed(rank: int, tp: int, pp: int, num_layers: int, master: str, backend: str = "gloo",
                     split: list[int] | None = None, timeout_s: float = 120.0, micro_batches: int = 0,
                     listen: socket.socket | None = None) -> Layout:
    """Join the world. `master` is HOST:PORT of the driver's TCP store; the driver (rank 0) passes `listen`,
    the socket `rendezvous_socket` bound, and the store serves on it (never on every interface)."""
    import datetime

    import torch.distributed as dist
    world = tp * pp
    host, _, port = master.rpartition(":")
    host = host.strip("[]")
    iface = _interface_of(host)
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if iface and not os.environ.get(var):
            os.environ[var] = iface      # read by torch's gloo / NCCL when they open their sockets
    timeout = datetime.timedelta(seconds=timeout_s)
    if listen is not None:
        store = dist.TCPStore(host, listen.getsockname()[1], world, True, timeout, master_listen_fd=listen.detach())
    else:
        store = dist.TCPStore(host, int(port), world, False, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    _LAYOUT.tp, _LAYOUT.pp, _LAYOUT.rank = tp, pp, rank
    _LAYOUT.split = balanced_split(num_layers, pp, split)
    _LAYOUT.micro_batches = micro_batches or pp
    groups = [dist.new_group([s * tp + i for i in range(tp)]) for s in range(pp)]   # same order everywhere
    init_tensor_parallel(_LAYOUT.tp_rank, tp, groups[_LAYOUT.stage])
    return _LAYOUT


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP.size > 1:
        import torch.distributed as dist
        dist.all_reduce(x, group=_TP.group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _TP.size == 1:
        return x
    import torch
    import torch.distributed as dist
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous(), group=_TP.group)
    return torch.cat(parts, dim=-1)
