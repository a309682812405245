"""`edgecore core`: run a core (prefill) node."""

from __future__ import annotations

import argparse

from edgecore.shared.cli import add_kv_cache_args, add_model_args
from edgecore.shared.http_server import add_limit_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("core", help="run a core node: prefill for edges, stream compressed KV",
                       description="Serve prefill to edges over the edgecore protocol, with an HTTP control "
                                   "port (/health, /ready, /metrics, /stats).")
    add_model_args(p)
    p.add_argument("--listen", default="127.0.0.1:7100", metavar="HOST:PORT", help="protocol address")
    p.add_argument("--http", default="127.0.0.1:7101", metavar="HOST:PORT", help="control port address")
    p.add_argument("--secret-file", default=None, help="cluster secret file (or EDGECORE_SECRET)")
    p.add_argument("--name", default="core", help="node name shown to peers and in logs")
    p.add_argument("--lease", type=float, default=30.0, help="seconds a finished prefill's KV waits for the "
                   "edge's Ack (default 30)")
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="prefill token budget per step")
    add_kv_cache_args(p)
    p.add_argument("--tls-cert", default=None)
    p.add_argument("--tls-key", default=None)
    p.add_argument("--tls-ca", default=None, help="CA to verify edge certificates (enables mutual TLS)")
    p.add_argument("--data-dir", default=None, help="batch API storage (default: ./edgecore-data/NAME)")
    p.add_argument("--api-key-file", default=None, help="API keys for the control port's /v1/ routes (batch "
                   "API, contexts, model downloads) and /stats; required when --http is not a loopback address")
    p.add_argument("--push-edge", action="append", default=[], metavar="NAME=URL",
                   help="an edge contexts may be pushed to (POST /v1/contexts/ID/push {\"edges\": [NAME]}), by its "
                        "API base URL (repeatable); pushes go nowhere else")
    p.add_argument("--push-api-key-file", default=None,
                   help="the API key the core presents to --push-edge edges (first line of the file)")
    add_limit_args(p)
    p.add_argument("--max-file-mb", type=float, default=200.0, help="upload limit of /v1/files")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (one process each)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (one process per stage and TP rank)")
    p.add_argument("--pp-split", default=None, metavar="N,N,...", help="layers per pipeline stage")
    p.add_argument("--pp-micro-batches", type=int, default=0,
                   help="micro-batches per step so pipeline stages overlap (default: one per stage)")
    p.add_argument("--kv-after-prefill", action="store_true",
                   help="send a request's KV only once its prefill has finished (the baseline that layer-wise "
                        "streaming is measured against)")
    p.add_argument("--rendezvous", default="127.0.0.1:0", metavar="HOST:PORT",
                   help="parallel core: where the ranks' rendezvous (TCP store) listens; gloo's own sockets use the "
                        "same host's interface (default 127.0.0.1, any free port)")
    p.add_argument("--gather-kv", action="store_true",
                   help="parallel core: rank 0 gathers every rank's KV after the prefill and sends it, instead "
                        "of each rank streaming its own on its own port (when edges can reach only --listen)")
    p.add_argument("--handover-max-tokens", type=int, default=64,
                   help="decode handover: tokens after the first this core decodes and streams for an edge while "
                        "its KV travels (the edge then takes over); 0 turns core decoding off")
    p.add_argument("--handover-max-seconds", type=float, default=10.0,
                   help="decode handover: seconds after the first token this core decodes for an edge at most")
    p.add_argument("--handover-refuse-waiting", type=int, default=8,
                   help="decode handover: refuse to decode for edges while this many requests wait here "
                        "(prefill pressure); the edge then waits for the KV")
    p.set_defaults(func=run_core)
    register_worker(sub)


def run_core(args: argparse.Namespace) -> int:
    import logging

    from edgecore.core.http import ControlPort, check_control_port, protection
    from edgecore.core.server import CoreConfig, CoreServer
    from edgecore.core.transfer import HandoverLimits
    from edgecore.shared.http_server import limits_from_args
    from edgecore.protocol.transport import tls_context
    from edgecore.shared.cli import kv_cache_config
    from edgecore.shared.config import EngineConfig, ModelConfig
    from edgecore.shared.models.loader import resolve_dtype
    from edgecore.shared.env import default_model, reserve_threads_for_engine, resolve_device
    from edgecore.shared.secrets import parse_hostport, read_api_keys, read_secret
    from edgecore.shared.service import run_service, setup_logging

    setup_logging(f"[{args.name}] ")
    host, port = parse_hostport(args.listen)
    http_host, http_port = parse_hostport(args.http)
    api_keys = read_api_keys(args.api_key_file)
    check_control_port(http_host, api_keys)              # before anything loads: one line, exit non-zero
    control = ControlPort(limits_from_args(args), _push_edges(args.push_edge),
                          read_api_keys(args.push_api_key_file)[0] if args.push_api_key_file else None)
    engine_threads = reserve_threads_for_engine()
    model_dir, device = args.model or default_model(), resolve_device(args.device)
    pp_split = [int(x) for x in args.pp_split.split(",")] if args.pp_split else None
    if args.tp * args.pp != 1:
        _check_parallel(model_dir, pp_split, args)         # one line before anything else is said or started
    cache, kv_line = kv_cache_config(args, ModelConfig.from_dir(model_dir), resolve_dtype(args.dtype, device).itemsize,
                            tp=args.tp)
    ssl = tls_context(True, args.tls_cert, args.tls_key, args.tls_ca, args.tls_ca is not None) \
        if args.tls_cert else None
    secret = read_secret(args.secret_file)
    assert secret is not None                            # required: read_secret raises when there is none
    config = CoreConfig(model_dir=model_dir, secret=secret, host=host,
                        port=port, http_host=http_host, http_port=http_port, dtype=args.dtype,
                        device=device, lease_seconds=args.lease, cache=cache,
                        engine=EngineConfig(max_num_batched_tokens=args.max_batched_tokens),
                        name=args.name, ssl=ssl, data_dir=args.data_dir,
                        api_keys=api_keys, control=control,
                        max_file_bytes=int(args.max_file_mb * 1024 * 1024), tp=args.tp, pp=args.pp,
                        pp_split=pp_split,
                        pp_micro_batches=args.pp_micro_batches, gather_kv=args.gather_kv,
                        stream_layers=not args.kv_after_prefill, engine_threads=engine_threads,
                        rendezvous=args.rendezvous,
                        handover=HandoverLimits(args.handover_max_tokens, args.handover_max_seconds,
                                                args.handover_refuse_waiting))
    core = CoreServer(config)

    async def start() -> None:
        await core.start()
        logging.getLogger("edgecore.kv").info(kv_line)
        print(f"edgecore core '{args.name}' ready: protocol {host}:{core.port}, "
              f"http http://{http_host}:{core.http_port} ({protection(http_host, api_keys)})", flush=True)

    return run_service(start, core.stop)


def _check_parallel(model_dir: str, pp_split: list[int] | None, args: argparse.Namespace) -> None:
    from edgecore.shared.config import ModelConfig
    from edgecore.shared.errors import ConfigError
    from edgecore.shared.parallel import check_parallel
    from edgecore.shared.secrets import parse_hostport
    parse_hostport(args.rendezvous)
    try:
        check_parallel(ModelConfig.from_dir(model_dir), args.tp, args.pp, pp_split)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _push_edges(values: list[str]) -> dict[str, str]:
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
                       description="A tensor/pipeline-parallel rank started by `edgecore core --tp/--pp`.")
    for flag, kind in (("--rank", int), ("--tp", int), ("--pp", int), ("--kv-blocks", int), ("--block-size", int),
                       ("--parent", int), ("--micro-batches", int)):
        p.add_argument(flag, type=kind, required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--split", default=None)
    p.add_argument("--stream-host", default=None, help="serve this rank's KV streams on this host "
                   "(the cluster secret, hex, is read from stdin)")
    p.add_argument("--codecs", default="")
    p.set_defaults(func=run_worker)


def run_worker(args: argparse.Namespace) -> int:
    from edgecore.core.ranks import run_worker as run
    return run(args)
