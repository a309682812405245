"""Tenants at the edge's HTTP API: keys found by digest (401 otherwise), per-tenant limits answered with 429 and
Retry-After before any work is admitted (requests and tokens per minute, sequences in flight), models, engine
terms (tenant, weight, priority band) carried to the engine, per-tenant metrics, the tenants file's errors and
its reload. An in-process EdgeHTTP over a scripted fake edge (no model run)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import subprocess
import sys
import time

import aiohttp
import pytest

from edgecore.edge.http import EdgeHTTP, start_http
from edgecore.shared.engine.output import RequestOutput
from edgecore.shared.errors import ConfigError
from edgecore.shared.node.tenants import BAND_SPAN, TenantRegistry, Tenants, TokenBucket
from edgecore.shared.text.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(60)
MODEL = "pydoc-llama"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


TENANTS = f"""
[[tenant]]
name = "acme"
api_keys = ["{digest('sk-acme')}", "{digest('sk-acme-2')}"]
requests_per_minute = 3
weight = 3

[[tenant]]
name = "tok"
api_keys = ["{digest('sk-tok')}"]
tokens_per_minute = 100

[[tenant]]
name = "one"
api_keys = ["{digest('sk-one')}"]
max_concurrent = 1
priority = 2

[[tenant]]
name = "other"
api_keys = ["{digest('sk-other')}"]
models = ["another-model"]
"""


class FakeEdge:
    """The surface EdgeHTTP uses: each choice yields `tokens` one-token outputs; `gate` holds generation."""

    def __init__(self, tokenizer: Tokenizer, tokens: int = 3):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.max_model_len = 512
        self.fingerprint = ""
        self.adapters: dict[str, str] = {}     # LoRA adapters served (none)
        self.ready = True
        self.active = 0
        self.tokens = tokens
        self.errors: list[str] = []
        self.calls: list[dict] = []
        self.gate: asyncio.Event | None = None

    def count_error(self, status: str) -> None:
        self.errors.append(status)

    async def generate(self, rid, prompt, params, group=None, cache_salt=None, **terms):
        self.calls.append({"rid": rid, "cache_salt": cache_salt, **terms})
        if self.gate is not None:
            await self.gate.wait()
        n = min(self.tokens, params.max_tokens)
        for i in range(n):
            yield RequestOutput(rid, [42], "x", i == n - 1, "length" if i == n - 1 else None, None, len(prompt), 0,
                                i + 1)

    async def get_metrics(self) -> str:
        return ""


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_dir(model_dir)


@pytest.fixture
async def api(tokenizer, tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    clock = [1000.0]
    tenants = TenantRegistry.load(str(path), [MODEL, "another-model"], clock=lambda: clock[0])
    edge = FakeEdge(tokenizer)
    http = EdgeHTTP(edge, MODEL, [b"sk-operator"], max_concurrent=8, tenants=tenants)
    runner, port = await start_http(http, "127.0.0.1", 0)
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield {"session": s, "edge": edge, "http": http, "clock": clock, "path": path, "tenants": tenants}
    await runner.cleanup()


async def complete(session, key, **body):
    payload = {"model": MODEL, "prompt": "Hello there", "max_tokens": 3, **body}
    async with session.post("/v1/completions", json=payload, headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, dict(r.headers), await r.json()


async def test_a_key_no_tenant_holds_is_a_401_and_tenants_keys_pass(api):
    s = api["session"]
    assert (await complete(s, "sk-nobody"))[0] == 401
    assert (await complete(s, "sk-acme-2"))[0] == 200
    assert (await complete(s, "sk-operator"))[0] == 200          # --api-key-file's keys stay valid, unlimited
    async with s.post("/v1/completions", json={"prompt": "x"}) as r:
        assert r.status == 401
    assert [c.get("tenant") for c in api["edge"].calls] == ["acme", None]


async def test_requests_per_minute_is_a_429_with_retry_after_then_refills(api):
    s, clock = api["session"], api["clock"]
    for _ in range(3):
        assert (await complete(s, "sk-acme"))[0] == 200
    status, headers, body = await complete(s, "sk-acme")
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "requests"
    assert "requests_per_minute" in body["error"]["message"] and "acme" in body["error"]["message"]
    assert headers["Retry-After"] == "20" and headers["x-ratelimit-limit-requests"] == "3"   # 3/min: one per 20 s
    assert (await complete(s, "sk-tok"))[0] == 200                 # another tenant is not limited by it
    clock[0] += 20
    assert (await complete(s, "sk-acme"))[0] == 200
    assert api["edge"].errors.count("429") == 1
    metrics = api["http"].tenant_metrics.text()
    assert 'edgecore:tenant_rate_limited_total{limit="requests_per_minute",model_name="pydoc-llama",' \
           'tenant="acme"} 1.0' in metrics


async def test_tokens_per_minute_counts_prompt_and_max_tokens_and_returns_the_unused(api):
    s, clock = api["session"], api["clock"]
    prompt_tokens = len(api["edge"].tokenizer.encode("Hello there"))
    status, _, body = await complete(s, "sk-tok", max_tokens=100)     # alone over the limit: never fits
    assert status == 429 and body["error"]["type"] == "tokens" and "tokens_per_minute" in body["error"]["message"]
    # asks for 60 output tokens, generates 3: the 57 it did not use return to the bucket
    assert (await complete(s, "sk-tok", max_tokens=60))[0] == 200
    bucket = api["tenants"].states["tok"].tokens
    assert bucket.remaining() == 100 - prompt_tokens - 3
    status, headers, body = await complete(s, "sk-tok", max_tokens=100 - prompt_tokens)
    assert status == 429 and int(headers["Retry-After"]) == pytest.approx((prompt_tokens + 3) * 60 / 100, abs=1)
    clock[0] += 60
    assert (await complete(s, "sk-tok", max_tokens=100 - prompt_tokens))[0] == 200


async def test_max_concurrent_counts_sequences_in_flight(api):
    s, edge = api["session"], api["edge"]
    edge.gate = asyncio.Event()
    first = asyncio.create_task(complete(s, "sk-one"))
    while not edge.calls:
        await asyncio.sleep(0.01)
    status, headers, body = await complete(s, "sk-one")
    assert status == 429 and headers["Retry-After"] == "1" and "max_concurrent" in body["error"]["message"]
    edge.gate.set()
    assert (await first)[0] == 200
    assert (await complete(s, "sk-one"))[0] == 200                  # freed when the first ended
    status, _, body = await complete(s, "sk-one", n=2)               # 2 sequences never fit in 1
    assert status == 429 and "max_concurrent" in body["error"]["message"]
    assert api["tenants"].states["one"].in_flight == 0


async def test_engine_terms_carry_tenant_weight_band_and_request_priority(api):
    s, edge = api["session"], api["edge"]
    assert (await complete(s, "sk-one", priority=7))[0] == 200
    assert (await complete(s, "sk-acme"))[0] == 200
    call_one, call_acme = edge.calls
    assert (call_one["tenant"], call_one["weight"], call_one["priority"]) == ("one", 1.0, 2 * BAND_SPAN + 7)
    assert (call_acme["tenant"], call_acme["weight"], call_acme["priority"]) == ("acme", 3.0, 0)
    assert call_one["cache_salt"] == "one\0" and call_acme["cache_salt"] == "acme\0"   # tenants share no cache
    status, _, body = await complete(s, "sk-acme", priority=-1)
    assert status == 400 and body["error"]["param"] == "priority"


async def test_a_tenant_sees_only_its_models(api):
    status, _, body = await complete(api["session"], "sk-other")
    assert status == 404 and body["error"]["code"] == "model_not_found"


async def test_per_tenant_metrics(api):
    s = api["session"]
    await complete(s, "sk-acme")
    await complete(s, "sk-acme", n=2)
    async with s.get("/metrics") as r:
        text = await r.text()
    assert 'edgecore:tenant_requests_total{model_name="pydoc-llama",tenant="acme"} 2.0' in text
    assert 'edgecore:tenant_generation_tokens_total{model_name="pydoc-llama",tenant="acme"} 9.0' in text
    assert 'edgecore:tenant_sequences_in_flight{model_name="pydoc-llama",tenant="acme"} 0.0' in text
    assert "edgecore:tenant_prompt_tokens_total" in text and 'tenant="tok"' not in text
    api["http"].tenant_metrics.keep(["tok"])                      # acme left the tenants file: its series go
    assert 'tenant="acme"' not in api["http"].tenant_metrics.text()


async def test_the_file_is_reread_when_it_changes_and_a_bad_one_is_kept_out(api, caplog):
    s, clock, path = api["session"], api["clock"], api["path"]
    assert (await complete(s, "sk-new"))[0] == 401
    path.write_text(TENANTS + f'\n[[tenant]]\nname = "new"\napi_keys = ["{digest("sk-new")}"]\n')
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    clock[0] += 2
    assert (await complete(s, "sk-new"))[0] == 200
    bad = TENANTS + '\n[[tenant]]\nname = "bad"\napi_keys = ["zz"]\n'
    line = bad.splitlines().index('api_keys = ["zz"]') + 1
    with caplog.at_level(logging.WARNING, "edgecore.tenants"):
        path.write_text(bad)
        os.utime(path, ns=(time.time_ns(), time.time_ns() + 2 * 10**9))
        clock[0] += 2
        assert (await complete(s, "sk-new"))[0] == 200                 # the previous file stays in force
        clock[0] += 2
        assert (await complete(s, "sk-new"))[0] == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "edgecore.tenants"]
    assert len(lines) == 1 and f"line {line}:" in lines[0] and "keeping the previous tenants" in lines[0], lines


@pytest.mark.parametrize("text, expected", [
    ("[[tenant]]\nname = = 'a'\n", "(at line 2, column"),
    ("[[tenant]]\nname = 'a'\napi_keys = [\n", "line 4: Invalid value (at end of document)"),
    (f"[[tenant]]\nname = 'a'\napi_keys = ['{digest('k')}']\nmodels = ['gpt-5']\n", "line 4: tenant 'a' names "
                                                                                     "model 'gpt-5'"),
    (f"[[tenant]]\nname = 'a'\napi_keys = ['{digest('k')}']\n[[tenant]]\nname = 'b'\n"
     f"api_keys = [\n  '{digest('j')}',\n  '{digest('K'.lower())}',\n]\n", "line 8: tenant 'b' repeats a key"),
    (f"[[tenant]]\nname = 'a'\napi_keys = ['{digest('k')}']\nweight = 'heavy'\n", "line 4: tenant 1: 'weight'"),
    (f"[[tenant]]\nname = 'a'\napi_keys = ['{digest('k')}']\nrate = 5\n", "line 4: tenant 1: Object contains "
                                                                           "unknown field `rate`"),
    (f"[[tenant]]\nname = 'a'\napi_keys = ['{digest('k')}']\n[[tenant]]\nname = 'a'\n"
     f"api_keys = ['{digest('j')}']\n", "line 5: tenant 'a' is defined twice"),
    ("[[tenant]]\nname = 'a'\napi_keys = ['sk-plain-key']\n", "line 3: tenant 1: 'api_keys'"),
])
def test_a_bad_tenants_file_is_one_line_naming_the_line(tmp_path, text, expected):
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        TenantRegistry.load(str(path), [MODEL])
    assert expected in str(err.value) and "\n" not in str(err.value) and str(path) in str(err.value)


def test_the_edge_refuses_to_start_on_a_bad_tenants_file(tmp_path, model_dir):
    path = tmp_path / "t.toml"
    path.write_text(f"[[tenant]]\nname = 'a'\napi_keys = ['{digest('k')}']\nmodels = ['gpt-5']\n")
    done = subprocess.run([sys.executable, "-m", "edgecore", "edge", "--model", str(model_dir), "--tenants", str(path),
                           "--listen", "127.0.0.1:0"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "ready" not in done.stdout
    assert done.stderr.strip().splitlines()[-1].startswith(f"edgecore: error: tenants file {path}, line 4: ")


def test_token_bucket_refills_continuously_and_caps():
    now = [0.0]
    bucket = TokenBucket(60, clock=lambda: now[0])
    assert bucket.wait_for(60) == 0 and bucket.wait_for(61) is None
    bucket.take(60)
    assert bucket.wait_for(1) == pytest.approx(1.0)
    now[0] += 30
    assert bucket.remaining() == 30
    bucket.give(1000)
    assert bucket.remaining() == 60


def test_digests_are_looked_up_not_compared_and_never_held_in_clear():
    tenants = Tenants.parse(TENANTS, "t", [MODEL, "another-model"])
    assert set(tenants.by_digest) == {hashlib.sha256(k).digest() for k in
                                      (b"sk-acme", b"sk-acme-2", b"sk-tok", b"sk-one", b"sk-other")}
    assert b"sk-acme" not in repr(vars(tenants)).encode()
