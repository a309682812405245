"""The core's HTTP control port: /health, /ready, /metrics, /stats, /v1/models (and the batch API routes).

Life cycle: `check_control_port(host, api_keys)` runs before anything loads
(the CLI) and again at bind time: a control port that listens beyond loopback
without an API key refuses to start. `start_control_port(core, host, port)`
builds the aiohttp app, binds it under the server limits of
`core.config.control` (connection cap, header and body timeouts) and returns
the runner; the core cleans it up on stop. With API keys, /v1/ (batch API,
contexts, model downloads) and /stats need one; /health, /ready and /metrics
never do. Every error answer is an OpenAI error object counted in
`edgecore:request_errors`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from edgecore.core.server import CoreServer, model_name
from edgecore.shared.errors import ConfigError
from edgecore.shared.node.http_server import ServerLimits, start_site
from edgecore.shared.openai.extra_routes import add_model_routes, model_card
from edgecore.shared.openai.http import error_middleware
from edgecore.shared.node.secrets import is_loopback
from edgecore.shared.node.tls import ServerTLS


@dataclass
class ControlPort:
    """Control-port settings beyond its address: server limits and the edges contexts may be pushed to."""
    limits: ServerLimits = field(default_factory=ServerLimits)
    push_edges: dict[str, str] = field(default_factory=dict)   # edge name → its API base URL
    push_api_key: bytes | None = None                          # what the core presents to those edges
    tls: ServerTLS | None = None                               # HTTPS (--tls-cert / --tls-key)


def check_control_port(host: str, api_keys: list[bytes]) -> None:
    if not api_keys and not is_loopback(host):
        raise ConfigError(f"the control port listens on {host or 'every interface'}, beyond loopback, without "
                          f"an API key: pass --api-key-file (or set EDGECORE_API_KEYS), or --http 127.0.0.1:PORT")


def protection(host: str, api_keys: list[bytes]) -> str:
    """One line for the start-up message: what the control port protects."""
    if api_keys:
        return "/v1/ and /stats need an API key"
    return f"no API key: open to local processes only ({host})"


def build_app(core: CoreServer) -> web.Application:
    node_metrics = getattr(core, "metrics", None)
    count = (lambda status: node_metrics.request_errors.labels(str(status)).inc()) if node_metrics else None
    app = web.Application(client_max_size=1 << 20, middlewares=[error_middleware(core.config.api_keys, 1 << 20,
                                                                                 count)])

    # alive unless failed: a supervisor (Kubernetes' liveness probe) restarts it
    async def health(_: web.Request) -> web.Response:
        failure = getattr(core, "failure", None)
        if failure is not None:
            return web.json_response({"status": "failed", "failure": failure}, status=503)
        return web.json_response({"status": "ok"})

    async def ready(_: web.Request) -> web.Response:
        draining = getattr(core, "draining", False)          # SIGTERM: load balancers take it out at once
        ok = core.alive and core.server is not None and not draining
        return web.json_response({"ready": ok, **({"draining": True} if draining else {})},
                                 status=200 if ok else 503)

    async def metrics(_: web.Request) -> web.Response:
        stats = core.handle.stats()
        core.metrics.kv_usage.set(stats.kv_cache_usage)
        core.metrics.running.set(stats.running)
        core.metrics.waiting.set(stats.waiting)
        return web.Response(body=generate_latest(core.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def stats(_: web.Request) -> web.Response:
        stats = core.stats()
        if core.parallel and core.alive:
            try:
                stats["ranks"] = await core.handle.rank_stats()
            except Exception as exc:   # a rank is gone: the core stops serving, and says so
                core.mark_failed(f"gathering rank stats failed: {exc}")
                stats.update(ranks=None, failure=core.failure, engine_alive=False)
        return web.json_response(stats)

    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", stats)
    add_model_routes(app, lambda: model_card(model_name(core.config.model_dir), core.handle.max_model_len,
                                             int(core.started_at)), adapters=lambda: core.prefill.adapters)
    for extend in getattr(core, "http_extensions", []):
        extend(app)
    return app


async def start_control_port(core: CoreServer, host: str, port: int) -> tuple[web.AppRunner, int]:
    check_control_port(host, core.config.api_keys)
    control = getattr(core.config, "control", None) or ControlPort()
    return await start_site(build_app(core), host, port, control.limits, tls=control.tls)
