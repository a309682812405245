"""A parallel core's processes: one per rank, started together, stopped together.

Life cycle: the driver (`edgecore core --tp N --pp M`) picks a rendezvous
port, starts ranks 1..N×M−1 as `edgecore core-worker` processes, joins the
torch.distributed world as rank 0, loads its own shard (stage 0's layers, its
TP slice of each) and gets an `LLMEngine` whose runner drives the others.
Each worker loads its shard and KV pool and follows the driver's step plans.
`RankWatch` polls the workers: when one dies the core is marked unhealthy
(the callback closes its edge connections so edges fail over) and the rest are
stopped; a worker whose driver vanished exits on its own (its collectives fail
or its parent changes).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from shared.config import CacheConfig, EngineConfig, ModelConfig
from shared.engine.engine import LLMEngine
from shared.engine.parallel_runner import ParallelModelRunner, StageRunner, worker_loop
from shared.kv.pool import KVPool
from shared.models.loader import load_model, resolve_dtype
from shared.parallel import init_distributed
from shared.tokenizer import Tokenizer

log = logging.getLogger("edgecore.ranks")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_parallel_engine(model_dir: str, tp: int, pp: int, dtype: str, device: str, cache: CacheConfig,
                          engine_cfg: EngineConfig, split: list[int] | None = None, micro_batches: int = 0):
    """Start the worker ranks and build the driver's engine. Returns (engine, worker processes)."""
    config = ModelConfig.from_dir(model_dir)
    master = f"127.0.0.1:{_free_port()}"
    backend = "nccl" if device.startswith("cuda") else "gloo"
    workers = []
    root = Path(__file__).resolve().parents[1]
    for rank in range(1, tp * pp):
        cmd = [sys.executable, "-m", "deploy.cli", "core-worker", "--rank", str(rank), "--tp", str(tp), "--pp",
               str(pp), "--master", master, "--model", model_dir, "--dtype", dtype, "--device", device,
               "--kv-blocks", str(cache.num_blocks), "--block-size", str(cache.block_size),
               "--parent", str(os.getpid()), "--micro-batches", str(micro_batches)]
        if split:
            cmd += ["--split", ",".join(map(str, split))]
        workers.append(subprocess.Popen(cmd, cwd=root, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
    lay = init_distributed(0, tp, pp, config.num_hidden_layers, master, backend, split,
                           micro_batches=micro_batches)
    torch_dtype = resolve_dtype(dtype, device)
    model = load_model(model_dir, torch_dtype, device, layers=lay.stage_layers(), config=config)
    tokenizer = Tokenizer.from_dir(model_dir) if (Path(model_dir) / "tokenizer.json").is_file() else None
    engine = LLMEngine(model, config, tokenizer, cache, engine_cfg)
    engine.runner = ParallelModelRunner(model, engine.pool, config.sliding_window, lay, config.num_key_value_heads)
    return engine, workers


class RankWatch(threading.Thread):
    def __init__(self, workers: list[subprocess.Popen], on_failure):
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


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("core-worker", help="(internal) one rank of a parallel core",
                       description="A tensor/pipeline-parallel rank started by `edgecore core --tp/--pp`.")
    for flag, kind in (("--rank", int), ("--tp", int), ("--pp", int), ("--kv-blocks", int), ("--block-size", int),
                       ("--parent", int), ("--micro-batches", int)):
        p.add_argument(flag, type=kind, required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--split", default=None)
    p.set_defaults(func=run_worker)


def run_worker(args: argparse.Namespace) -> int:
    def orphan_guard():
        while True:
            if os.getppid() != args.parent:
                os._exit(3)     # the driver is gone: leave at once
            time.sleep(0.5)
    threading.Thread(target=orphan_guard, daemon=True).start()
    config = ModelConfig.from_dir(args.model)
    split = [int(x) for x in args.split.split(",")] if args.split else None
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    lay = init_distributed(args.rank, args.tp, args.pp, config.num_hidden_layers, args.master, backend, split,
                           micro_batches=args.micro_batches)
    dtype = resolve_dtype(args.dtype, args.device)
    model = load_model(args.model, dtype, args.device, layers=lay.stage_layers(), config=config)
    attn = model.model.layers[0].self_attn
    pool = KVPool(config, CacheConfig(args.block_size, args.kv_blocks), dtype, args.device,
                  num_kv_heads=attn.num_kv_heads, num_layers=len(model.model.layers))
    runner = StageRunner(model, pool, config.sliding_window, lay, config.num_key_value_heads)
    try:
        worker_loop(runner)
    except RuntimeError as exc:     # the driver or a peer went away mid-collective
        log.warning("rank %d stopping: %s", args.rank, exc)
        return 1
    return 0
