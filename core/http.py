"""The core's HTTP control port: /health, /ready, /metrics, /stats (and the batch API routes).

Life cycle: `start_control_port(core, host, port)` builds the aiohttp app,
binds it (127.0.0.1 by default) and returns the runner; the core cleans it
up on stop.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from edgecore.shared.openai.http import error_middleware


def build_app(core) -> web.Application:
    app = web.Application(client_max_size=1 << 20,
                          middlewares=[error_middleware(core.config.api_keys, 1 << 20)])

    async def health(_):
        return web.json_response({"status": "ok"})

    async def ready(_):
        ok = core.alive and core.server is not None
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    async def metrics(_):
        core.metrics.kv_usage.set(core.handle.stats().kv_cache_usage)
        return web.Response(body=generate_latest(core.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def stats(_):
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
    for extend in getattr(core, "http_extensions", []):
        extend(app)
    return app


async def start_control_port(core, host: str, port: int):
    runner = web.AppRunner(build_app(core), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]
    return runner, bound
