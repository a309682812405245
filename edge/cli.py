"""`edgecore edge`: run an edge (decode) node with the OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, cast

from edgecore.shared.cli import add_compile_arg, add_kv_cache_args, add_model_args, kv_cache_memory
from edgecore.shared.http_server import add_limit_args

if TYPE_CHECKING:
    import asyncio

    from aiohttp import web

    from edgecore.edge.engine import EdgeEngine
    from edgecore.edge.engine_client import EngineClient
    from edgecore.edge.service import EdgeService
    from edgecore.shared.http_server import ServerLimits


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("edge", help="run an edge node: OpenAI-compatible API, decode near users",
                       description="Serve /v1/completions and /v1/chat/completions; prefill on cores given by "
                                   "--core (or locally), decode here.")
    add_model_args(p)
    add_compile_arg(p)
    p.add_argument("--core", action="append", default=[], metavar="HOST:PORT",
                   help="a core's protocol address (repeatable); none: prefill locally")
    p.add_argument("--core-dns", action="append", default=[], metavar="NAME:PORT",
                   help="a DNS name whose addresses are cores (e.g. a headless Service), re-resolved periodically")
    p.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT", help="HTTP address")
    p.add_argument("--api-key-file", default=None, help="API keys, one per line (or EDGECORE_API_KEYS)")
    p.add_argument("--secret-file", default=None, help="cluster secret file (or EDGECORE_SECRET)")
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: directory name)")
    p.add_argument("--name", default="edge")
    p.add_argument("--codec", action="append", default=None, metavar="NAME",
                   help="allowed KV codec(s), in preference order (default lossless); lossy codecs "
                        "(fp8, int8, int4, q4e, q3e, q2e) only when listed")
    p.add_argument("--adaptive", action="store_true", help="pick the codec per request from link bandwidth")
    p.add_argument("--ttft-target-ms", type=float, default=None)
    p.add_argument("--kv-quality-budget", type=float, default=None, metavar="PPL",
                   help="with --adaptive: the largest relative perplexity increase a codec may cost, read from the "
                        "rate-distortion curve (default 0.01, i.e. 1%%; 0 allows only codecs measured lossless)")
    p.add_argument("--kv-curve", default=None, metavar="FILE",
                   help="with --adaptive: this model's rate-distortion curve, a bench/kv_rd.py result "
                        "(default: the bundled model's, shipped in edge/codec_policy.py)")
    p.add_argument("--first-layer-macs", type=float, default=1e9, metavar="N",
                   help="lossy codecs: compute layer 0's KV here (it depends on the prompt's tokens alone) instead "
                        "of receiving it, when that costs at most N multiply-adds (default 1e9; 0: always receive)")
    p.add_argument("--local-prefill-below", default="32", metavar="N|auto",
                   help="prompts (or uncached suffixes) shorter than N tokens prefill at the edge; 'auto' uses "
                        "the crossover measured from this edge's own and the cores' prefill times")
    p.add_argument("--max-concurrent", type=int, default=256,
                   help="sequences (prompts × n, all requests together) in flight before 503 (default 256)")
    p.add_argument("--max-seqs-per-request", type=int, default=64,
                   help="sequences (prompts × n) one request may ask for; more get a 400 (default 64)")
    add_limit_args(p)
    p.add_argument("--transfer-timeout", type=float, default=30.0,
                   help="seconds without KV progress before giving up on a core (then retry or prefill locally)")
    p.add_argument("--handover-max-tokens", type=int, default=64,
                   help="decode handover: tokens after the first a core may decode and stream while the KV "
                        "travels, before this edge takes over (0: wait for the KV, the old mode)")
    p.add_argument("--max-body-mb", type=float, default=8.0, help="request body limit")
    add_kv_cache_args(p)
    p.add_argument("--model-from", default=None, metavar="CORE_URL",
                   help="fetch the packed model from a core's control port (e.g. http://core:7101), "
                        "resuming and verifying, then serve it")
    p.add_argument("--model-from-key-file", default=None,
                   help="API key file for --model-from's core (first key; default: the first of --api-key-file)")
    p.add_argument("--model-cache", default=None, help="where fetched models are kept (default "
                   "~/.cache/edgecore/models)")
    p.add_argument("--tls-ca", default=None, help="CA for the cores' certificates (enables TLS to cores)")
    p.add_argument("--tls-cert", default=None, help="client certificate for mutual TLS")
    p.add_argument("--tls-key", default=None)
    p.add_argument("--engine-in-process", action="store_true",
                   help="run the engine inside the HTTP process instead of a process of its own (simpler to "
                        "debug; slower under load, as HTTP and the engine then share one GIL)")
    p.add_argument("--engine-fd", type=int, default=None, help=argparse.SUPPRESS)   # set for the engine process
    p.set_defaults(func=run_edge)


def run_edge(args: argparse.Namespace) -> int:
    """The HTTP frontend, which starts the engine process (`--engine-fd`) unless `--engine-in-process`."""
    from edgecore.edge.http import EdgeHTTP, start_http
    from edgecore.protocol.codecs import CODECS
    from edgecore.shared.env import default_model
    from edgecore.shared.errors import ConfigError
    from edgecore.shared.secrets import parse_hostport, read_api_keys
    from edgecore.shared.service import run_service, setup_logging

    setup_logging(f"[{args.name}{'/engine' if args.engine_fd is not None else ''}] ")
    codecs = args.codec or ["lossless"]
    for c in codecs:
        if c not in CODECS:
            raise ConfigError(f"unknown codec '{c}' (known: {', '.join(CODECS)})")
    local_below = _local_prefill_below(args.local_prefill_below)
    codec_policy(args)
    model_dir = args.model or default_model()
    limits = _check_limits(args)
    if args.engine_fd is not None:
        return _run_engine_process(args, model_dir, codecs, local_below)
    if args.model_from:
        model_dir = _fetch_model(args)
    host, port = parse_hostport(args.listen)
    edge: EdgeEngine | EngineClient
    if args.engine_in_process:
        edge = _edge_engine(args, model_dir, codecs, local_below)
    else:
        edge = _engine_client(args, model_dir)
    served = _served_name(args, model_dir)
    # An in-process EdgeEngine's tokenizer is None for a model without tokenizer files (EdgeService says
    # Tokenizer): such a model serves token-id prompts only, as it did before.
    http = EdgeHTTP(cast("EdgeService", edge), served, read_api_keys(args.api_key_file),
                    int(args.max_body_mb * 1024 * 1024), args.max_concurrent, args.max_seqs_per_request, limits)
    state: dict[str, web.AppRunner] = {}

    async def start() -> asyncio.Future[int]:
        import asyncio
        # The engine (its thread here, or the engine process) is gone: stop, exit status 1, for a supervisor.
        finished: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def on_death() -> None:
            if not finished.done():
                finished.set_result(1)
        edge.on_death = on_death
        await edge.start()
        state["runner"], bound = await start_http(http, host, port)
        print(f"edgecore edge '{args.name}' ready: http://{host}:{bound}/v1 (model {http.served_model}, "
              f"cores: {', '.join(args.core) or 'none, local prefill'}; "
              f"{'/v1/, /stats, /tokenize and /detokenize need an API key' if http.api_keys else 'no API key'})",
              flush=True)
        return finished

    async def stop() -> None:
        if "runner" in state:
            await state["runner"].cleanup()
        await edge.stop()

    return run_service(start, stop)


def _engine_client(args: argparse.Namespace, model_dir: str) -> EngineClient:
    """The frontend's handle on an engine process yet to start; a bad model or flag fails here, in one line."""
    from edgecore.edge.engine_client import EngineClient
    from edgecore.shared.config import ModelConfig
    from edgecore.shared.secrets import read_secret
    ModelConfig.from_dir(model_dir)
    read_secret(args.secret_file, required=bool(args.core or args.core_dns))
    return EngineClient(args.argv, model_dir)


def _fetch_model(args: argparse.Namespace) -> str:
    """`--model-from`: download (resuming, verified) a core's packed model; its local directory."""
    from edgecore.edge.model_fetch import fetch_model
    from edgecore.shared.cli import Progress
    from edgecore.shared.secrets import read_api_keys
    cache = args.model_cache or str(Path.home() / ".cache" / "edgecore" / "models")
    progress = Progress("fetch")
    keys = read_api_keys(args.model_from_key_file or args.api_key_file)
    model_dir = str(fetch_model(args.model_from, cache, progress, api_key=keys[0] if keys else None))
    progress.done(f"model ready in {model_dir}")
    return model_dir


def _served_name(args: argparse.Namespace, model_dir: str) -> str:
    """The model id in the API: --served-model-name, the packed original's name, or the directory's."""
    from edgecore.shared.env import default_model
    if args.served_model_name:
        return args.served_model_name
    if args.model_from:
        import json
        return json.loads((Path(model_dir) / "edgecore-pack.json").read_text()).get("name", "model")
    return Path(args.model or default_model()).name


def _check_limits(args: argparse.Namespace) -> ServerLimits:
    from edgecore.shared.errors import ConfigError
    from edgecore.shared.http_server import limits_from_args
    if args.max_seqs_per_request < 1 or args.max_concurrent < 1:
        raise ConfigError("--max-seqs-per-request and --max-concurrent must be at least 1")
    kv_cache_memory(args)                 # a bad size fails here, before the engine process starts
    if args.max_seqs_per_request > args.max_concurrent:
        raise ConfigError(f"--max-seqs-per-request ({args.max_seqs_per_request}) must not exceed --max-concurrent "
                          f"({args.max_concurrent}), or such a request could never run")
    return limits_from_args(args)


def _local_prefill_below(value: str) -> int | None:
    from edgecore.shared.errors import ConfigError
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"--local-prefill-below must be a number or 'auto', got '{value}'") from None


def _edge_engine(args: argparse.Namespace, model_dir: str, codecs: list[str], local_below: int | None
                 ) -> EdgeEngine:
    import logging

    from edgecore.edge.engine import EdgeConfig, EdgeEngine
    from edgecore.protocol.transport import tls_context
    from edgecore.shared.cli import kv_cache_config
    from edgecore.shared.config import EngineConfig, ModelConfig
    from edgecore.shared.env import reserve_threads_for_engine, resolve_device
    from edgecore.shared.models.loader import resolve_dtype
    from edgecore.shared.secrets import parse_hostport, read_secret

    engine_threads = reserve_threads_for_engine()
    device = resolve_device(args.device)
    cache, kv_line = kv_cache_config(args, ModelConfig.from_dir(model_dir), resolve_dtype(args.dtype, device).itemsize)
    logging.getLogger("edgecore.kv").info(kv_line)
    cores = [parse_hostport(c) for c in args.core]
    core_dns = [parse_hostport(c) for c in args.core_dns]
    ssl = tls_context(False, args.tls_cert, args.tls_key, args.tls_ca) if args.tls_ca else None
    config = EdgeConfig(model_dir=model_dir, cores=cores, core_dns=core_dns,
                        secret=read_secret(args.secret_file, required=bool(cores or core_dns)),
                        dtype=args.dtype, device=device, codecs=codecs,
                        adaptive=args.adaptive, ttft_target_ms=args.ttft_target_ms, **codec_policy(args),
                        local_prefill_below=local_below, cache=cache, engine=EngineConfig(compile_decode=args.compile),
                        transfer_timeout=args.transfer_timeout, handover_tokens=max(0, args.handover_max_tokens),
                        first_layer_macs=max(0.0, args.first_layer_macs),
                        name=args.name, ssl=ssl, engine_threads=engine_threads,
                        served_model_name=args.served_model_name or "")
    return EdgeEngine(config)


def _run_engine_process(args: argparse.Namespace, model_dir: str, codecs: list[str], local_below: int | None) -> int:
    """The engine process (edge/engine_process.py): serves the frontend on the socket `--engine-fd`."""
    import asyncio
    import socket

    from edgecore.edge.engine_process import EngineServer
    from edgecore.shared.service import run_service

    import sys

    from edgecore.edge.engine_process import SWITCH_INTERVAL_S
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    sock = socket.socket(fileno=args.engine_fd)
    edge = _edge_engine(args, model_dir, codecs, local_below)
    tasks: list[asyncio.Task[None]] = []

    async def start() -> asyncio.Future[int]:
        await edge.start()
        finished: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def on_death() -> None:                                 # the frontend sees it and exits too
            if not finished.done():
                finished.set_result(1)
        edge.on_death = on_death

        def served(task: asyncio.Task) -> None:     # the frontend went away
            if not finished.done():
                error = None if task.cancelled() else task.exception()
                finished.set_exception(error) if error else finished.set_result(0)
        tasks.append(asyncio.create_task(EngineServer(edge, sock).run()))      # held: a task is weakly referenced
        tasks[0].add_done_callback(served)
        return finished

    return run_service(start, edge.stop)


def codec_policy(args: argparse.Namespace) -> dict:
    """The adaptive codec choice's quality budget and curve from the flags (EdgeConfig fields)."""
    from edgecore.edge.codec_policy import DEFAULT_QUALITY_BUDGET, load_curve
    from edgecore.shared.errors import ConfigError
    budget = DEFAULT_QUALITY_BUDGET if args.kv_quality_budget is None else args.kv_quality_budget
    if not budget >= 0:           # NaN too
        raise ConfigError(f"--kv-quality-budget must be a perplexity increase ≥ 0 (0.01 = 1%), not {budget}")
    try:
        curve = load_curve(args.kv_curve) if args.kv_curve else None
    except ValueError as exc:
        raise ConfigError(f"--kv-curve: {exc}") from None
    return {"kv_quality_budget": budget, "kv_curve": curve}
