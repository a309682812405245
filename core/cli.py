"""`edgecore core`: run a core (prefill) node."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from edgecore.core.settings import CoreSettings
from edgecore.shared.node import tracing
from edgecore.shared.node.settings import add_arguments, from_args, namespace

if TYPE_CHECKING:
    import ssl

    from edgecore.core.http import ControlPort


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("core", help="run a core node: prefill for edges, stream compressed KV",
                       description="Serve prefill to edges over the edgecore protocol, with an HTTP control "
                                   "port (/health, /ready, /metrics, /stats).")
    add_arguments(p, CoreSettings)
    p.set_defaults(func=run_core)
    register_worker(sub)


def run_core(args: argparse.Namespace) -> int:
    import logging

    from edgecore.core.http import protection
    from edgecore.core.server import CoreConfig, CoreServer
    from edgecore.core.transfer import HandoverLimits
    from edgecore.shared.node.cli import kv_cache_config
    from edgecore.shared.models.config import EngineConfig, ModelConfig
    from edgecore.shared.models.loader import resolve_dtype
    from edgecore.shared.node.env import default_model, reserve_threads_for_engine, resolve_device
    from edgecore.shared.node.link_auth import link_auth
    from edgecore.shared.node.node_settings import check_drain_timeout
    from edgecore.shared.node.secrets import parse_hostport
    from edgecore.shared.node.service import run_service, setup_logging

    settings = from_args(CoreSettings, args)
    setup_logging(f"[{settings.name}] ")
    host, port = parse_hostport(settings.listen)
    http_host, http_port = parse_hostport(settings.http)
    api_keys, control = _control_port(settings, http_host)
    _check_connection_limits(settings)
    check_drain_timeout(settings.drain_timeout)
    tracing.start(settings.otlp_endpoint, "core", settings.name)
    engine_threads = reserve_threads_for_engine()
    model_dir, device = settings.model or default_model(), resolve_device(settings.device)
    pp_split = [int(x) for x in settings.pp_split.split(",")] if settings.pp_split else None
    if settings.tp * settings.pp != 1:
        _check_parallel(model_dir, pp_split, settings)         # one line before anything else is said or started
    cache, kv_line = kv_cache_config(namespace(settings), ModelConfig.from_dir(model_dir),
                                     resolve_dtype(settings.dtype, device).itemsize, tp=settings.tp)
    secret, identity, trust = link_auth(settings.secret_file, settings.credential, settings.authority,
                                        settings.revocations, needed=True)
    config = CoreConfig(model_dir=model_dir, secret=secret or b"", identity=identity, trust=trust, host=host,
                        port=port, http_host=http_host, http_port=http_port, dtype=settings.dtype,
                        device=device, lease_seconds=settings.lease, cache=cache,
                        engine=EngineConfig(max_num_batched_tokens=settings.max_batched_tokens, quantize=settings.quantize),
                        name=settings.name, ssl=_link_tls(settings), data_dir=settings.data_dir,
                        api_keys=api_keys, control=control,
                        max_file_bytes=int(settings.max_file_mb * 1024 * 1024), tp=settings.tp, pp=settings.pp,
                        pp_split=pp_split,
                        pp_micro_batches=settings.pp_micro_batches,
                        # worker ranks' stream ports do not present credentials yet: rank 0 sends all KV
                        gather_kv=settings.gather_kv or identity is not None, external_workers=settings.external_workers,
                        stream_layers=not settings.kv_after_prefill, engine_threads=engine_threads,
                        rendezvous=settings.rendezvous,
                        handover=HandoverLimits(settings.handover_max_tokens, settings.handover_max_seconds,
                                                settings.handover_refuse_waiting),
                        max_inflight=settings.max_inflight_per_connection,
                        max_admitted=settings.max_running_per_connection,
                        outbox_bytes=int(settings.outbox_mb * 1024 * 1024), **_loras(settings, model_dir))
    core = CoreServer(config)

    async def start() -> None:
        await core.start()
        logging.getLogger("edgecore.kv").info(kv_line)
        print(f"edgecore core '{settings.name}' ready: protocol {host}:{core.port}, "
              f"http {'https' if control.tls else 'http'}://{http_host}:{core.http_port} "
              f"({protection(http_host, api_keys)})", flush=True)

    return run_service(start, core.stop, core.drain, settings.drain_timeout)


def _link_tls(settings: CoreSettings) -> ssl.SSLContext | None:
    """The protocol listener's TLS context (`--link-tls-cert`/`--link-tls-key`, client certificates checked
    against `--link-tls-ca` when given), or None for the sealed link alone."""
    from edgecore.protocol.transport import tls_context

    if not settings.link_tls_cert:
        return None
    return tls_context(True, settings.link_tls_cert, settings.link_tls_key, settings.link_tls_ca,
                       settings.link_tls_ca is not None)


def _loras(settings: CoreSettings, model_dir: str) -> dict:
    """CoreConfig's `loras` and `max_lora_rank`: the `--lora` flags, each adapter checked against the model
    (one-line ConfigError) before anything loads."""
    from edgecore.shared.models.config import ModelConfig
    from edgecore.shared.errors import ConfigError
    from edgecore.shared.models.lora_files import check_lora_flags
    if settings.lora and settings.tp * settings.pp != 1:
        raise ConfigError("--lora needs a core on one process (no --tp/--pp)")
    loras = check_lora_flags(settings.lora, ModelConfig.from_dir(model_dir), settings.max_lora_rank) \
        if settings.lora else []
    return {"loras": loras, "max_lora_rank": settings.max_lora_rank}


def _check_connection_limits(settings: CoreSettings) -> None:
    from edgecore.shared.errors import ConfigError
    running = settings.max_running_per_connection
    if settings.max_inflight_per_connection < 1 or (running is not None and running < 1) or settings.outbox_mb <= 0:
        raise ConfigError("--max-inflight-per-connection and --max-running-per-connection must be at least 1, "
                          "--outbox-mb above 0")


def _control_port(settings: CoreSettings, http_host: str) -> tuple[list[bytes], ControlPort]:
    """The control port's API keys and settings; refuses (one line, before anything loads) a port beyond
    loopback without a key."""
    from edgecore.core.http import ControlPort, check_control_port
    from edgecore.shared.node.http_server import limits_from_args
    from edgecore.shared.node.secrets import read_api_keys
    from edgecore.shared.node.tls import server_tls
    api_keys = read_api_keys(settings.api_key_file)
    check_control_port(http_host, api_keys)
    return api_keys, ControlPort(limits_from_args(namespace(settings)), _push_edges(settings.push_edge),
                                 read_api_keys(settings.push_api_key_file)[0] if settings.push_api_key_file else None,
                                 server_tls(settings.tls_cert, settings.tls_key))


def _check_parallel(model_dir: str, pp_split: list[int] | None, settings: CoreSettings) -> None:
    from edgecore.shared.models.config import ModelConfig
    from edgecore.shared.errors import ConfigError
    from edgecore.shared.models.parallel import check_parallel
    from edgecore.shared.node.secrets import parse_hostport
    if parse_hostport(settings.rendezvous)[1] == 0 and settings.external_workers:
        raise ConfigError("--external-workers needs --rendezvous HOST:PORT with a port the workers are told")
    if settings.quantize or model_dir.endswith(".gguf"):
        raise ConfigError("quantized weights (--quantize, a .gguf model) run on one process: not with --tp/--pp")
    try:
        check_parallel(ModelConfig.from_dir(model_dir), settings.tp, settings.pp, pp_split)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _push_edges(values: tuple[str, ...]) -> dict[str, str]:
    from edgecore.shared.errors import ConfigError
    edges = {}
    for value in values:
        name, sep, url = value.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ConfigError(f"--push-edge must be NAME=http://HOST:PORT, got '{value}'")
        edges[name] = url
    return edges


def register_worker(sub: argparse._SubParsersAction) -> None:
    """`edgecore core-worker` (internal): core/ranks.py, imported only when a rank runs (it loads torch)."""
    p = sub.add_parser("core-worker", help="(internal) one rank of a parallel core",
                       description="A tensor/pipeline-parallel rank: started by `edgecore core --tp/--pp`, or "
                                   "started elsewhere for a driver run with --external-workers.")
    for flag in ("--rank", "--tp", "--pp"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--kv-blocks", type=int, default=0, help="KV blocks (a worker the driver starts is told)")
    p.add_argument("--pool-from-driver", action="store_true", help="receive the KV pool's size from the driver "
                   "(one run with --external-workers sends it): a worker started elsewhere")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--micro-batches", type=int, default=0)
    p.add_argument("--parent", type=int, default=0, help="the driver's PID: exit when it is gone (0: a worker "
                   "started elsewhere, which exits when its collectives fail)")
    p.add_argument("--join-timeout", type=float, default=120.0, help="seconds to reach the driver's rendezvous")
    p.add_argument("--master", required=True, help="HOST:PORT of the driver's rendezvous")
    p.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--split", default=None)
    p.add_argument("--stream-host", default=None, help="serve this rank's KV streams on this host "
                   "(the cluster secret, hex, is read from stdin)")
    p.add_argument("--codecs", default="")
    p.set_defaults(func=run_worker)


def run_worker(args: argparse.Namespace) -> int:
    from edgecore.core.ranks import run_worker as run
    from edgecore.shared.node.env import default_model
    args.model = args.model or default_model()
    return run(args)
