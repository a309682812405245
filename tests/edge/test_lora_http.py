"""LoRA adapters through the edge's OpenAI API (frontend ↔ engine process over a socketpair, as in
test_cache_salt_http.py): `model` names an adapter, output equals transformers + peft (greedy, float32),
requests for different adapters at once, /v1/models with `parent`, vLLM's load/unload routes behind the admin
key (401 without it, 400 naming a bad adapter with nothing loaded, 404 for unknown names, 404 routes without an
admin key), the tenants file's `models` restricting adapters, and `--lora` start-up errors in one line."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import subprocess
import sys

import aiohttp
import pytest

from edgecore.edge.node import EdgeConfig, EdgeNode
from edgecore.edge.node_client import NodeProcessClient
from edgecore.edge.node_process import NodeProcessServer
from edgecore.edge.http import EdgeHTTP, start_http
from edgecore.shared.node.admin_key import AdminKey
from edgecore.shared.node.tenants import TenantRegistry
from edgecore.shared.text.tokenizer import Tokenizer
from tests.conftest import make_engine
from tests.shared import lora_checkpoints

pytestmark = pytest.mark.timeout(180)

BASE = "base"
PROMPT = [5, 17, 33, 2, 71, 8, 40, 300, 1200, 7]
N = 6
ADMIN = "admin-secret"
USER = "sk-user"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory):
    return lora_checkpoints.build(tmp_path_factory.mktemp("lora-http"))


@pytest.fixture(scope="module")
def expected(root):
    """transformers + peft's greedy text per adapter (None: the base)."""
    tok = Tokenizer.from_dir(root / "base")
    return {name: tok.decode(lora_checkpoints.reference(root, name, PROMPT, N))
            for name in (None, "attn", "mlp", "all")}


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


async def _serve(root, tmp_path, admin: bool = True, tenants: bool = False):
    keys = tmp_path / "keys"
    keys.write_text(f"{USER}\n")
    engine = make_engine(root / "base", num_blocks=128)
    edge = EdgeNode(EdgeConfig(model_dir=str(root / "base"), loras=[("attn", str(root / "attn"))]), engine=engine)
    await edge.start()
    a, b = socket.socketpair()
    server = asyncio.create_task(NodeProcessServer(edge, a).run())
    client = NodeProcessClient(["edge"], str(root / "base"))
    await client.connect(b)
    registry = None
    if tenants:
        path = tmp_path / "tenants.toml"
        path.write_text(f'[[tenant]]\nname = "t"\napi_keys = ["{_digest("sk-t")}"]\nmodels = ["{BASE}", "attn"]\n')
        registry = TenantRegistry.load(str(path), [BASE, "attn"])
    http = EdgeHTTP(client, BASE, [USER.encode()], tenants=registry,
                    admin_key=AdminKey(ADMIN.encode()) if admin else None)
    runner, port = await start_http(http, "127.0.0.1", 0)

    async def close() -> None:
        await runner.cleanup()
        await client.stop()
        await asyncio.wait_for(asyncio.gather(server, return_exceptions=True), 10)
        await edge.stop()
    return port, close


@pytest.fixture
async def api(root, tmp_path):
    port, close = await _serve(root, tmp_path)
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", timeout=aiohttp.ClientTimeout(total=60)) as s:
        yield s
    await close()


def _auth(key: str = USER) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def complete(session, model: str, key: str = USER) -> tuple[int, dict]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    async with session.post("/v1/completions", json=body, headers=_auth(key)) as resp:
        return resp.status, await resp.json()


async def admin(session, route: str, body: dict, key: str = ADMIN) -> tuple[int, str]:
    async with session.post(f"/v1/{route}", json=body, headers=_auth(key)) as resp:
        return resp.status, await resp.text()


async def test_models_list_adapters_with_parent(api):
    async with api.get("/v1/models", headers=_auth()) as resp:
        cards = {c["id"]: c for c in (await resp.json())["data"]}
    assert cards[BASE]["parent"] is None and cards["attn"]["parent"] == BASE
    async with api.get("/v1/models/attn", headers=_auth()) as resp:
        assert resp.status == 200 and (await resp.json())["parent"] == BASE


async def test_adapter_output_equals_peft_and_mixes_in_one_batch(api, root, expected):
    status, body = await admin(api, "load_lora_adapter", {"lora_name": "mlp", "lora_path": str(root / "mlp")})
    assert status == 200, body
    status, body = await admin(api, "load_lora_adapter", {"lora_name": "all", "lora_path": str(root / "all")})
    assert status == 200, body
    models = [BASE, "attn", "mlp", "all"] * 2
    results = await asyncio.gather(*(complete(api, m) for m in models))      # in flight together
    for model, (status, body) in zip(models, results):
        assert status == 200, body
        assert body["choices"][0]["text"] == expected[None if model == BASE else model], model
        assert body["model"] == model              # as vLLM: the adapter's name
    assert len(set(expected.values())) > 1


async def test_load_and_unload_need_the_admin_key(api, root):
    body = {"lora_name": "mlp", "lora_path": str(root / "mlp")}
    assert (await admin(api, "load_lora_adapter", body, key=USER))[0] == 401      # an API key is not enough
    status, text = await admin(api, "load_lora_adapter", body, key="wrong")
    assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"
    assert (await admin(api, "unload_lora_adapter", {"lora_name": "attn"}, key=USER))[0] == 401
    assert (await complete(api, "mlp"))[0] == 404


async def test_bad_loads_are_400s_and_load_nothing(api, root, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 8, "bias": "all"}))
    cases = [({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, "adapter_config.json: cannot read"),
             ({"lora_name": "x", "lora_path": str(bad)}, "bias='all' is not supported"),
             ({"lora_name": "attn", "lora_path": str(root / "mlp")}, "has already been loaded"),
             ({"lora_name": BASE, "lora_path": str(root / "mlp")}, "base model's name"),
             ({"lora_name": "x"}, "'lora_path' must be a non-empty string")]
    for body, message in cases:
        status, text = await admin(api, "load_lora_adapter", body)
        error = json.loads(text)["error"]
        assert status == 400 and message in error["message"], (body, text)
    async with api.get("/v1/models", headers=_auth()) as resp:
        assert [c["id"] for c in (await resp.json())["data"]] == [BASE, "attn"]


async def test_streamed_chunks_name_the_adapter(api, expected):
    body = {"model": "attn", "prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True, "stream": True}
    async with api.post("/v1/completions", json=body, headers=_auth()) as resp:
        events = [json.loads(line[6:]) for line in (await resp.text()).splitlines() if line.startswith("data: {")]
    assert {e["model"] for e in events} == {"attn"}
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == expected["attn"]


async def test_unload_then_unknown(api, expected):
    assert (await complete(api, "attn"))[1]["choices"][0]["text"] == expected["attn"]
    status, text = await admin(api, "unload_lora_adapter", {"lora_name": "attn"})
    assert status == 200, text
    status, body = await complete(api, "attn")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert (await admin(api, "unload_lora_adapter", {"lora_name": "attn"}))[0] == 404
    assert (await complete(api, BASE))[1]["choices"][0]["text"] == expected[None]


async def test_without_an_admin_key_the_routes_are_404(root, tmp_path):
    port, close = await _serve(root, tmp_path, admin=False)
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as s:
            status, text = await admin(s, "load_lora_adapter", {"lora_name": "mlp", "lora_path": str(root / "mlp")})
            assert status == 404 and "error" in json.loads(text)
    finally:
        await close()


async def test_tenant_models_restrict_adapters(root, tmp_path, expected):
    port, close = await _serve(root, tmp_path, tenants=True)
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as s:
            assert (await admin(s, "load_lora_adapter", {"lora_name": "mlp", "lora_path": str(root / "mlp")}))[0] == 200
            status, body = await complete(s, "attn", key="sk-t")
            assert status == 200 and body["choices"][0]["text"] == expected["attn"]
            assert (await complete(s, "mlp", key="sk-t"))[0] == 404          # not among the tenant's models
            async with s.get("/v1/models", headers=_auth("sk-t")) as resp:
                assert [c["id"] for c in (await resp.json())["data"]] == [BASE, "attn"]
            async with s.get("/v1/models/attn", headers=_auth("sk-t")) as resp:
                assert resp.status == 200 and (await resp.json())["parent"] == BASE
            answers = []
            for name in ("mlp", "nothing"):          # hidden from the tenant: as a model that does not exist
                async with s.get(f"/v1/models/{name}", headers=_auth("sk-t")) as resp:
                    answers.append((resp.status, (await resp.json())["error"]["code"]))
            assert answers == [(404, "model_not_found")] * 2
    finally:
        await close()


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", [
    (["--lora", "nodir"], "expected NAME=DIR"),
    (["--lora", "a={root}/attn", "--lora", "a={root}/mlp"], "given twice"),
    (["--lora", "big={root}/all", "--max-lora-rank", "8"], "rank 16 exceeds the limit of 8"),
    (["--lora", "gone={root}/nothing"], "cannot read"),
])
def test_startup_errors_are_one_line(root, flags, message):
    argv = [a.replace("{root}", str(root)) for a in flags]
    proc = subprocess.run([sys.executable, "-m", "edgecore", "edge", "--model", str(root / "base"),
                           "--listen", "127.0.0.1:0", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


async def test_core_lists_its_adapters(aiohttp_client, model_dir):
    from types import SimpleNamespace

    from edgecore.core.http import build_app
    core = SimpleNamespace(config=SimpleNamespace(api_keys=[], model_dir=str(model_dir)),
                           handle=SimpleNamespace(max_model_len=1024), started_at=1.0e9, http_extensions=[],
                           prefill=SimpleNamespace(adapters={"sql": "0123456789abcdef"}))
    client = await aiohttp_client(build_app(core))
    body = await (await client.get("/v1/models")).json()
    assert [(m["id"], m["parent"]) for m in body["data"]] == [("pydoc-llama", None), ("sql", "pydoc-llama")]
    assert (await (await client.get("/v1/models/sql")).json())["parent"] == "pydoc-llama"
