"""The core's control port: context pushes go only to configured edges with the core's own key (no SSRF,
no forwarded credentials); beyond loopback it needs an API key or refuses to start; /stats needs the key."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from edgecore.core.batch_api import BatchAPI
from edgecore.core.contexts import Contexts, context_id
from edgecore.core.http import ControlPort, check_control_port, start_control_port
from edgecore.core.metrics import CoreMetrics
from edgecore.shared.errors import ConfigError
from edgecore.shared.node.http_server import ServerLimits

pytestmark = pytest.mark.timeout(60)
KEY = "sk-core"
TOKENS = [5, 6, 7, 8]


@pytest.fixture
async def target():
    """A stand-in edge (or an internal service an attacker would like the core to call): records every hit."""
    hits = []

    async def contexts(request):
        hits.append({"path": request.path, "auth": request.headers.get("Authorization"),
                     "body": await request.json()})
        return web.json_response({"object": "context", "tokens": 4, "cached_tokens": 0, "source": "local",
                                  "secret_internal_field": "do not leak"})

    async def anything(request):
        hits.append({"path": request.path, "auth": request.headers.get("Authorization")})
        return web.json_response({"internal": "metadata"})

    app = web.Application()
    app.router.add_post("/v1/contexts", contexts)
    app.router.add_route("*", "/{tail:.*}", anything)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", hits
    await runner.cleanup()


async def control_port(push_edges: dict, api_keys=(KEY.encode(),), push_key: bytes | None = b"sk-push"):
    core = SimpleNamespace(
        config=SimpleNamespace(api_keys=list(api_keys), control=ControlPort(ServerLimits(), push_edges, push_key)),
        metrics=CoreMetrics(), parallel=False, stats=lambda: {"pid": 1, "fingerprint": "f" * 64},
        engine=SimpleNamespace(block_manager=SimpleNamespace(block_size=16)), alive=True, server=None,
        handle=SimpleNamespace(block_size=16))
    contexts = Contexts(core.handle, store=None, control=core.config.control)
    contexts.pinned[context_id(TOKENS)] = {"blocks": [], "tokens": len(TOKENS), "token_ids": TOKENS,
                                           "created_at": 0}
    core.http_extensions = [BatchAPI(core.handle, None, None, contexts, 1 << 20).routes]
    runner, port = await start_control_port(core, "127.0.0.1", 0)
    return core, runner, f"http://127.0.0.1:{port}"


def errors(core) -> dict:
    return {s.labels["status"]: s.value for m in core.metrics.registry.collect() if m.name == "edgecore:request_errors"
            for s in m.samples if s.name.endswith("_total")}


async def test_push_to_an_arbitrary_url_is_refused_and_nothing_is_called(target):
    url, hits = target
    core, runner, base = await control_port({"west": "http://127.0.0.1:1"})
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
            for edges in ([url], [url + "/admin"], ["west", url], []):
                async with s.post(f"{base}/v1/contexts/{context_id(TOKENS)}/push", json={"edges": edges}) as r:
                    body = await r.json()
                    assert r.status == 400 and body["error"]["param"] == "edges", body
                    assert "known: west" in body["error"]["message"]
        assert hits == []
        assert errors(core) == {"400": 4.0}
    finally:
        await runner.cleanup()


async def test_push_to_a_configured_edge_uses_the_core_key_never_the_callers(target):
    url, hits = target
    core, runner, base = await control_port({"west": url})
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
            async with s.post(f"{base}/v1/contexts/{context_id(TOKENS)}/push",
                              json={"edges": ["west"], "api_key": "Bearer caller-credential"}) as r:
                body = await r.json()
        assert r.status == 200
        assert body["results"] == [{"edge": "west", "status": 200, "tokens": 4, "cached_tokens": 0, "source": "local"}]
        assert hits == [{"path": "/v1/contexts", "auth": "Bearer sk-push", "body": {"token_ids": TOKENS}}]
    finally:
        await runner.cleanup()


async def test_push_without_a_core_key_sends_no_authorization(target):
    url, hits = target
    core, runner, base = await control_port({"west": url}, push_key=None)
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
            async with s.post(f"{base}/v1/contexts/{context_id(TOKENS)}/push", json={}) as r:
                assert r.status == 200 and (await r.json())["results"][0]["status"] == 200   # all configured
        assert hits[0]["auth"] is None
    finally:
        await runner.cleanup()


async def test_stats_and_v1_need_the_key_health_does_not():
    core, runner, base = await control_port({})
    try:
        async with aiohttp.ClientSession() as s:
            for path in ("/stats", "/v1/contexts"):
                async with s.get(base + path) as r:
                    assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
                async with s.get(base + path, headers={"Authorization": f"bearer {KEY}"}) as r:
                    assert r.status == 200
            async with s.get(base + "/health") as r:
                assert r.status == 200
        assert errors(core) == {"401": 2.0}
    finally:
        await runner.cleanup()


def test_control_port_beyond_loopback_needs_a_key():
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        check_control_port(host, [])
    for host in ("0.0.0.0", "", "::", "10.1.2.3", "core.example"):
        with pytest.raises(ConfigError, match="--api-key-file"):
            check_control_port(host, [])
        check_control_port(host, [b"k"])


async def test_start_control_port_refuses_before_binding():
    core = SimpleNamespace(config=SimpleNamespace(api_keys=[], control=None), metrics=CoreMetrics())
    with pytest.raises(ConfigError):
        await start_control_port(core, "0.0.0.0", 0)


def test_cli_refuses_in_one_line(tmp_path):
    secret = tmp_path / "s"
    secret.write_text("x" * 32)
    r = subprocess.run([sys.executable, "-m", "edgecore", "core", "--http", "0.0.0.0:0", "--secret-file", str(secret)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert len(r.stderr.strip().splitlines()) == 1 and "--api-key-file" in r.stderr, r.stderr
