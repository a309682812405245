"""A parallel core's processes: one per rank, started together, stopped together.

Life cycle: the driver (`edgecore core --tp N --pp M`) checks that the model
splits that way (one line if not, before any process starts), binds the
rendezvous socket on the configured host (`--rendezvous`, 127.0.0.1 and a free
port by default), starts ranks 1..N×M−1 as `edgecore core-worker` processes, joins the
torch.distributed world as rank 0, loads its own shard (stage 0's layers, its
TP slice of each) and gets an `LLMEngine` whose runner drives the others.
Each worker loads its shard and KV pool and follows the driver's step plans.
With a `DirectConfig`, every worker whose KV is its own (not a replica of a
lower TP rank's heads) also starts a `DirectServer` and reports its port to
the driver (the cluster secret reaches it on stdin, never on the command
line), so each stage streams its KV to edges itself.
`RankWatch` polls the workers: when one dies the core is marked unhealthy
(the callback closes its edge connections so edges fail over) and the rest are
stopped; a worker whose driver vanished exits on its own (its collectives fail
or its parent changes).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from edgecore.shared.models.config import CacheConfig, EngineConfig, ModelConfig
from edgecore.shared.engine.engine import LLMEngine
from edgecore.shared.engine.parallel_runner import ParallelModelRunner, StageRunner, kv_head_start, worker_loop
from edgecore.shared.errors import ConfigError
from edgecore.shared.kv.pool import KVPool
from edgecore.shared.models.loader import load_model, resolve_dtype
from edgecore.shared.models.parallel import check_parallel, init_distributed, rendezvous_socket
from edgecore.shared.node.secrets import parse_hostport
from edgecore.shared.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from edgecore.core.direct_server import DirectServer
    from edgecore.shared.models.llama import Attention, LlamaForCausalLM
    from edgecore.shared.models.mla import MLAttention
    from edgecore.shared.models.parallel import Layout

log = logging.getLogger("edgecore.ranks")


@dataclass
class DirectConfig:
    """How worker ranks serve their KV streams: bind host, cluster secret, codecs."""
    host: str
    secret: bytes
    codecs: list[str]


def owns_kv(tp_rank: int, tp: int, total_kv_heads: int) -> bool:
    """Whether this TP rank's KV heads are not a replica of a lower rank's (replicas are sent once)."""
    return tp_rank == 0 or kv_head_start(tp_rank, tp, total_kv_heads) != kv_head_start(tp_rank - 1, tp,
                                                                                       total_kv_heads)


def start_parallel_engine(model_dir: str, tp: int, pp: int, dtype: str, device: str, cache: CacheConfig,
                          engine_cfg: EngineConfig, split: list[int] | None = None, micro_batches: int = 0,
                          streams: DirectConfig | None = None, rendezvous: str = "127.0.0.1:0",
                          external: bool = False) -> tuple[LLMEngine, list[subprocess.Popen[bytes]], list[int]]:
    """Start the worker ranks and build the driver's engine. Returns (engine, worker processes, the ports of the
    workers' KV stream servers). `rendezvous`: HOST:PORT the driver's TCP store listens on (port 0: any).
    `external`: the workers are started elsewhere (none here, no streams) and are sent the KV pool's size."""
    config = ModelConfig.from_dir(model_dir)
    try:
        check_parallel(config, tp, pp, split)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    host, port = parse_hostport(rendezvous)
    try:
        listen = rendezvous_socket(host, port)
    except OSError as exc:
        raise ConfigError(f"--rendezvous: {exc}") from None
    master = f"[{host}]:{listen.getsockname()[1]}" if ":" in host else f"{host}:{listen.getsockname()[1]}"
    backend = "nccl" if device.startswith("cuda") else "gloo"
    workers = []
    for rank in range(1, tp * pp) if not external else ():
        cmd = [sys.executable, "-m", "edgecore", "core-worker", "--rank", str(rank), "--tp", str(tp), "--pp",
               str(pp), "--master", master, "--model", model_dir, "--dtype", dtype, "--device", device,
               "--kv-blocks", str(cache.num_blocks), "--block-size", str(cache.block_size),
               "--parent", str(os.getpid()), "--micro-batches", str(micro_batches)]
        if split:
            cmd += ["--split", ",".join(map(str, split))]
        if streams is not None:
            cmd += ["--stream-host", streams.host, "--codecs", ",".join(streams.codecs)]
        proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                stdin=subprocess.PIPE if streams is not None else None)
        if streams is not None:
            assert proc.stdin is not None       # stdin=PIPE above
            proc.stdin.write(streams.secret.hex().encode() + b"\n")
            proc.stdin.close()
        workers.append(proc)
    if external:
        log.info("waiting for %d worker rank(s) at %s", tp * pp - 1, master)
    lay = init_distributed(0, tp, pp, config.num_hidden_layers, master, backend, split,
                           micro_batches=micro_batches, listen=listen, timeout_s=600.0 if external else 120.0)
    if external:     # the pool's shape, which the driver alone derived from its settings
        dist.broadcast(torch.tensor([cache.num_blocks, cache.block_size], dtype=torch.long), src=0)
    torch_dtype = resolve_dtype(dtype, device)
    model = load_model(model_dir, torch_dtype, device, layers=lay.stage_layers(), config=config)
    tokenizer = Tokenizer.from_dir(model_dir) if (Path(model_dir) / "tokenizer.json").is_file() else None
    engine = LLMEngine(model, config, tokenizer, cache, engine_cfg)
    engine.runner = ParallelModelRunner(model, engine.pool, config.sliding_window, lay, config.num_key_value_heads)
    ports = []
    if streams is not None:         # every worker reports its stream port (0: it holds replicated heads only)
        for rank in range(1, tp * pp):
            reply = torch.zeros(1, dtype=torch.long)
            dist.recv(reply, src=rank)
            ports += [int(reply.item())] if reply.item() else []
    return engine, workers, ports


class RankWatch(threading.Thread):
    def __init__(self, workers: list[subprocess.Popen], on_failure: Callable[[str], object]) -> None:
        super().__init__(name="edgecore-rank-watch", daemon=True)
        self.workers, self.on_failure = workers, on_failure
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.5):
            for rank, proc in enumerate(self.workers, start=1):
                if proc.poll() is not None:
                    self.on_failure(f"rank {rank} exited with code {proc.returncode}")
                    self.stop_all()
                    return

    def stop_all(self) -> None:
        self.stopped.set()
        for proc in self.workers:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.workers:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()


def run_worker(args: argparse.Namespace) -> int:
    def orphan_guard() -> None:
        while True:
            if os.getppid() != args.parent:
                os._exit(3)     # the driver is gone: leave at once
            time.sleep(0.5)
    if args.parent:         # started by the driver (0: started elsewhere; a failed collective ends it)
        threading.Thread(target=orphan_guard, daemon=True).start()
    if not args.pool_from_driver and args.kv_blocks < 1:
        raise ConfigError("core-worker needs --kv-blocks N, or --pool-from-driver for a driver run with "
                          "--external-workers")
    config = ModelConfig.from_dir(args.model)
    split = [int(x) for x in args.split.split(",")] if args.split else None
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    lay = init_distributed(args.rank, args.tp, args.pp, config.num_hidden_layers, args.master, backend, split,
                           timeout_s=args.join_timeout, micro_batches=args.micro_batches)
    if args.pool_from_driver:   # a driver with --external-workers sends its pool's shape
        shape = torch.zeros(2, dtype=torch.long)
        dist.broadcast(shape, src=0)
        args.kv_blocks, args.block_size = int(shape[0]), int(shape[1])
    dtype = resolve_dtype(args.dtype, args.device)
    model = load_model(args.model, dtype, args.device, layers=lay.stage_layers(), config=config)
    attn = cast("Attention | MLAttention", model.model.layers[0].self_attn)
    pool = KVPool(config, CacheConfig(args.block_size, args.kv_blocks), dtype, args.device,
                  num_kv_heads=attn.num_kv_heads, num_layers=len(model.model.layers))
    runner = StageRunner(model, pool, config.sliding_window, lay, config.num_key_value_heads)
    streams = None
    if args.stream_host is not None:
        streams = _start_direct_servers(args, lay, model, pool, config, dtype)
        dist.send(torch.tensor([streams.port if streams else 0], dtype=torch.long), dst=0)
    try:
        worker_loop(runner, streams)
    except RuntimeError as exc:     # the driver or a peer went away mid-collective
        log.warning("rank %d stopping: %s", args.rank, exc)
        return 1
    finally:
        if streams is not None:
            streams.close()
    return 0


def _start_direct_servers(args: argparse.Namespace, lay: Layout, model: LlamaForCausalLM, pool: KVPool, config: ModelConfig,
                   dtype: torch.dtype) -> DirectServer | None:
    """This rank's KV stream server, or None when its heads replicate a lower TP rank's."""
    from edgecore.core.direct_server import DirectServer
    from edgecore.shared.models.fingerprint import model_fingerprint
    from edgecore.shared.kv.wire import DTYPE_NAMES, codec_step_scales
    secret = bytes.fromhex(sys.stdin.readline().strip())
    if not owns_kv(lay.tp_rank, lay.tp, config.num_key_value_heads):
        return None
    server = DirectServer(pool, model, args.stream_host, secret, model_fingerprint(args.model, config),
                          [c for c in args.codecs.split(",") if c], DTYPE_NAMES[dtype],
                          kv_head_start(lay.tp_rank, lay.tp, config.num_key_value_heads), f"rank{args.rank}")
    server.streamer.step_scales = codec_step_scales(args.model)
    server.start()
    return server
