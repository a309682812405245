"""`edgecore edge`: run an edge (decode) node with the OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, cast

from edgecore.edge.settings import EdgeSettings
from edgecore.shared.node.cli import kv_cache_memory
from edgecore.shared.node import tracing
from edgecore.shared.node.settings import add_arguments, from_args, namespace, to_argv

if TYPE_CHECKING:
    import asyncio

    from aiohttp import web

    from edgecore.edge.node import EdgeNode
    from edgecore.edge.node_client import NodeProcessClient
    from edgecore.edge.http import EdgeHTTP
    from edgecore.edge.service import EdgeService
    from edgecore.protocol.credentials import NodeIdentity, Trust
    from edgecore.shared.node.admin_key import AdminKey
    from edgecore.shared.node.http_server import ServerLimits
    from edgecore.shared.node.tenants import TenantRegistry


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("edge", help="run an edge node: OpenAI-compatible API, decode near users",
                       description="Serve /v1/completions and /v1/chat/completions; prefill on cores given by "
                                   "--core (or locally), decode here.")
    add_arguments(p, EdgeSettings)
    p.add_argument("--engine-fd", type=int, default=None, help=argparse.SUPPRESS)   # set for the engine process
    p.set_defaults(func=run_edge)


def run_edge(args: argparse.Namespace) -> int:
    """The HTTP frontend, which starts the engine process (`--engine-fd`) unless `--engine-in-process`."""
    from edgecore.edge.http import EdgeHTTP, start_http
    from edgecore.shared.node.env import default_model
    from edgecore.shared.node.node_settings import check_drain_timeout
    from edgecore.shared.node.secrets import parse_hostport, read_api_keys
    from edgecore.shared.node.service import run_service, setup_logging
    from edgecore.shared.node.tls import server_tls

    settings, engine_fd = from_args(EdgeSettings, args), args.engine_fd
    setup_logging(f"[{settings.name}{'/engine' if engine_fd is not None else ''}] ")
    check_drain_timeout(settings.drain_timeout)
    tracing.start(settings.otlp_endpoint, "edge", settings.name)    # in the HTTP and the engine process each
    codecs, local_below = _codecs(settings), _local_prefill_below(settings.local_prefill_below)
    codec_policy(settings)
    model_dir = settings.model or default_model()
    limits = _check_limits(settings)
    if engine_fd is not None:
        return _run_node_process(settings, engine_fd, model_dir, codecs, local_below)
    if settings.model_from:
        model_dir = _fetch_model(settings, settings.model_from)
    (host, port), tls = parse_hostport(settings.listen), server_tls(settings.tls_cert, settings.tls_key)
    served = _served_name(settings, model_dir)
    tenants = _tenants(settings, model_dir, served)      # (and the --lora adapters) a bad file: no start
    edge: EdgeNode | NodeProcessClient
    if settings.engine_in_process:
        edge = _edge_engine(settings, model_dir, codecs, local_below)
    else:
        edge = _node_client(settings, model_dir)
    http = EdgeHTTP(cast("EdgeService", edge), served, read_api_keys(settings.api_key_file),
                    int(settings.max_body_mb * 1024 * 1024), settings.max_concurrent,
                    settings.max_seqs_per_request, limits, tenants, _admin_key(settings))
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
        state["runner"], bound = await start_http(http, host, port, tls)
        print(_ready_line(settings, http, f"{'https' if tls else 'http'}://{host}:{bound}/v1"), flush=True)
        return finished

    async def drain(timeout: float) -> None:      # SIGTERM: /ready 503, new requests 503, streams finish
        http.start_drain()
        await http.drained()

    async def stop() -> None:
        # The engine first: streams still open (a drain cut short, or none) end now with an error instead of
        # holding the HTTP server's shutdown until they finish.
        await edge.stop()
        if "runner" in state:
            await state["runner"].cleanup()

    return run_service(start, stop, drain, settings.drain_timeout)


def _ready_line(settings: EdgeSettings, http: EdgeHTTP, url: str) -> str:
    """The line a started edge prints: where it listens, its model, its cores, how it is protected."""
    tenants = http.tenants
    keys = "/v1/, /stats, /tokenize and /detokenize need an API key" if http.api_keys or tenants else "no API key"
    return (f"edgecore edge '{settings.name}' ready: {url} (model {http.served_model}, "
            f"cores: {', '.join(settings.core) or 'none, local prefill'}; {keys}"
            f"{f'; {len(tenants.states)} tenant(s) from {settings.tenants}' if tenants else ''})")


def _tenants(settings: EdgeSettings, model_dir: str, served: str) -> TenantRegistry | None:
    """The `--lora` adapters, each checked against the model (one line, no start, if one does not fit), then the
    tenants file, whose tenants' models may name the base model and those adapters."""
    from edgecore.shared.models.config import ModelConfig
    from edgecore.shared.models.lora_files import check_lora_flags
    from edgecore.shared.node.tenants import TenantRegistry
    loras = check_lora_flags(settings.lora, ModelConfig.from_dir(model_dir), settings.max_lora_rank) \
        if settings.lora else []
    return TenantRegistry.load(settings.tenants, [served, *(n for n, _ in loras)]) if settings.tenants else None


def _admin_key(settings: EdgeSettings) -> AdminKey | None:
    """`--admin-key-file`: who may load and unload LoRA adapters (none: nobody, the routes are 404s)."""
    from edgecore.shared.node.admin_key import AdminKey
    return AdminKey.read(settings.admin_key_file) if settings.admin_key_file else None


def _codecs(settings: EdgeSettings) -> list[str]:
    from edgecore.protocol.codecs import CODECS
    from edgecore.shared.errors import ConfigError
    codecs = list(settings.codec or ["lossless"])
    for c in codecs:
        if c not in CODECS:
            raise ConfigError(f"unknown codec '{c}' (known: {', '.join(CODECS)})")
    return codecs


def _link_auth(settings: EdgeSettings, needed: bool) -> tuple[bytes | None, NodeIdentity | None, Trust | None]:
    from edgecore.shared.node.link_auth import link_auth
    return link_auth(settings.secret_file, settings.credential, settings.authority, settings.revocations, needed)


def _linked(settings: EdgeSettings) -> bool:
    """The edge talks to other nodes (cores, peer edges): a secret or a credential is needed."""
    return bool(settings.core or settings.core_dns or settings.peer or settings.peer_listen)


def _node_client(settings: EdgeSettings, model_dir: str) -> NodeProcessClient:
    """The frontend's handle on an engine process yet to start; a bad model or flag fails here, in one line."""
    from edgecore.edge.node_client import NodeProcessClient
    from edgecore.shared.models.config import ModelConfig
    ModelConfig.from_dir(model_dir)
    _link_auth(settings, _linked(settings))
    return NodeProcessClient(["edge", *to_argv(settings)], model_dir)        # the same settings, parsed again there


def _fetch_model(settings: EdgeSettings, model_from: str) -> str:
    """`--model-from`: download (resuming, verified) a core's packed model; its local directory."""
    from edgecore.edge.model_fetch import fetch_model
    from edgecore.shared.node.cli import Progress
    from edgecore.shared.node.secrets import read_api_keys
    cache = settings.model_cache or str(Path.home() / ".cache" / "edgecore" / "models")
    progress = Progress("fetch")
    keys = read_api_keys(settings.model_from_key_file or settings.api_key_file)
    model_dir = str(fetch_model(model_from, cache, progress, api_key=keys[0] if keys else None))
    progress.done(f"model ready in {model_dir}")
    return model_dir


def _served_name(settings: EdgeSettings, model_dir: str) -> str:
    """The model id in the API: --served-model-name, the packed original's name, or the directory's."""
    from edgecore.shared.node.env import default_model
    if settings.served_model_name:
        return settings.served_model_name
    if settings.model_from:
        import json
        return json.loads((Path(model_dir) / "edgecore-pack.json").read_text()).get("name", "model")
    return Path(settings.model or default_model()).name


def _check_limits(settings: EdgeSettings) -> ServerLimits:
    from edgecore.shared.errors import ConfigError
    from edgecore.shared.node.http_server import limits_from_args
    if settings.max_seqs_per_request < 1 or settings.max_concurrent < 1:
        raise ConfigError("--max-seqs-per-request and --max-concurrent must be at least 1")
    kv_cache_memory(namespace(settings))      # a bad size fails here, before the engine process starts
    if settings.max_seqs_per_request > settings.max_concurrent:
        raise ConfigError(f"--max-seqs-per-request ({settings.max_seqs_per_request}) must not exceed "
                          f"--max-concurrent ({settings.max_concurrent}), or such a request could never run")
    return limits_from_args(namespace(settings))


def _local_prefill_below(value: str) -> int | None:
    from edgecore.shared.errors import ConfigError
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"--local-prefill-below must be a number or 'auto', got '{value}'") from None


def _edge_engine(settings: EdgeSettings, model_dir: str, codecs: list[str], local_below: int | None
                 ) -> EdgeNode:
    """The engine in this process (`--engine-in-process`). Its tokenizer is None for a model without tokenizer
    files (EdgeService says Tokenizer): such a model serves token-id prompts only."""
    import logging

    from edgecore.edge.node import EdgeConfig, EdgeNode
    from edgecore.protocol.transport import tls_context
    from edgecore.shared.node.cli import kv_cache_config
    from edgecore.shared.models.config import EngineConfig, ModelConfig, SpeculativeConfig
    from edgecore.shared.node.env import reserve_threads_for_engine, resolve_device
    from edgecore.shared.models.lora_files import lora_specs
    from edgecore.shared.models.loader import resolve_dtype
    from edgecore.shared.node.secrets import parse_hostport

    engine_threads = reserve_threads_for_engine()
    device = resolve_device(settings.device)
    cache, kv_line = kv_cache_config(namespace(settings), ModelConfig.from_dir(model_dir),
                                     resolve_dtype(settings.dtype, device).itemsize)
    logging.getLogger("edgecore.kv").info(kv_line)
    cores = [parse_hostport(c) for c in settings.core]
    core_dns = [parse_hostport(c) for c in settings.core_dns]
    ssl = (tls_context(False, settings.link_tls_cert, settings.link_tls_key, settings.link_tls_ca)
           if settings.link_tls_ca else None)
    secret, identity, trust = _link_auth(settings, _linked(settings))
    config = EdgeConfig(model_dir=model_dir, cores=cores, core_dns=core_dns, secret=secret, identity=identity,
                        trust=trust, peers=[parse_hostport(p) for p in settings.peer],
                        peer_listen=parse_hostport(settings.peer_listen) if settings.peer_listen else None,
                        dtype=settings.dtype, device=device, codecs=codecs,
                        adaptive=settings.adaptive, ttft_target_ms=settings.ttft_target_ms,
                        **codec_policy(settings), local_prefill_below=local_below, cache=cache,
                        core_routing=settings.core_routing,
                        engine=EngineConfig(compile_decode=settings.compile, quantize=settings.quantize,
                                            speculative=SpeculativeConfig.parse(settings.speculative_config,
                                                                                settings.draft_model)),
                        transfer_timeout=settings.transfer_timeout, handover_tokens=max(0, settings.handover_max_tokens),
                        layer0_budget_macs=max(0.0, settings.layer0_budget_macs),
                        name=settings.name, ssl=ssl, engine_threads=engine_threads,
                        served_model_name=settings.served_model_name or "",
                        loras=lora_specs(settings.lora), max_lora_rank=settings.max_lora_rank)
    return EdgeNode(config)


def _run_node_process(settings: EdgeSettings, engine_fd: int, model_dir: str, codecs: list[str],
                        local_below: int | None) -> int:
    """The engine process (edge/node_process.py): serves the frontend on the socket `--engine-fd`."""
    import asyncio
    import socket

    from edgecore.edge.node_process import NodeProcessServer
    from edgecore.shared.node.service import run_service

    import sys

    from edgecore.edge.node_process import SWITCH_INTERVAL_S
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    sock = socket.socket(fileno=engine_fd)
    edge = _edge_engine(settings, model_dir, codecs, local_below)
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
        tasks.append(asyncio.create_task(NodeProcessServer(edge, sock).run()))      # held: a task is weakly referenced
        tasks[0].add_done_callback(served)
        return finished

    # SIGTERM (to the whole process group, say) is the frontend's to act on: this process serves it until it
    # leaves, once its drain is over (or at once, with --drain-timeout 0).
    return run_service(start, edge.stop, ignore_sigterm=True)


def codec_policy(settings: EdgeSettings) -> dict:
    """The adaptive codec choice's quality budget and curve from the flags (EdgeConfig fields)."""
    from edgecore.edge.codec_policy import DEFAULT_QUALITY_BUDGET, load_curve
    from edgecore.shared.errors import ConfigError
    budget = DEFAULT_QUALITY_BUDGET if settings.kv_quality_budget is None else settings.kv_quality_budget
    if not budget >= 0:           # NaN too
        raise ConfigError(f"--kv-quality-budget must be a perplexity increase ≥ 0 (0.01 = 1%), not {budget}")
    try:
        curve = load_curve(settings.kv_curve) if settings.kv_curve else None
    except ValueError as exc:
        raise ConfigError(f"--kv-curve: {exc}") from None
    return {"kv_quality_budget": budget, "kv_curve": curve}
