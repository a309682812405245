"""Prefix caches scoped by tenant, through the edge's OpenAI API: API keys from a key file with `salt=`
entries and the body's `cache_salt` reach the engine across the frontend ↔ engine-process link (an
`NodeProcessServer` in this process over a socketpair, as in test_node_process.py), and the cached prompt tokens
the API reports (`usage.prompt_tokens_details.cached_tokens`) show which requests shared cached KV."""

from __future__ import annotations

import json

import pytest

from edgecore.shared.node.secrets import read_api_keys
from tests.conftest import make_engine
from tests.edge.edge_api import edge_api

pytestmark = pytest.mark.timeout(120)

PROMPT = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"
          "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\ndef factorial(n):\n")


@pytest.fixture
async def api(model_dir, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-acme salt=acme\nsk-acme-2 salt=acme\nsk-beta salt=beta\nsk-open\nsk-open-2\n")
    async with edge_api(model_dir, make_engine(num_blocks=256), api_keys=read_api_keys(str(keys))) as session:
        yield session


async def cached(session, key: str, salt: str | None = None, prompt: str = PROMPT, chat: bool = False,
                 stream: bool = False) -> int:
    """One request with `key`; the prompt tokens the API says were cached."""
    body: dict = {"max_tokens": 1, "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if salt is not None:
        body["cache_salt"] = salt
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with session.post(path, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
        assert resp.status == 200, await resp.text()
        if not stream:
            return (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
        events = [json.loads(line[6:]) for line in (await resp.text()).splitlines()
                  if line.startswith("data: {")]
        return next(e for e in events if e.get("usage"))["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_tenants_never_share_cached_prefixes(api):
    assert await cached(api, "sk-acme") == 0
    hit = await cached(api, "sk-acme-2")              # the same tenant (another of its keys): a hit
    assert hit > 0
    assert await cached(api, "sk-beta") == 0          # another tenant: no hit
    assert await cached(api, "sk-open") == 0          # an unsalted key: no hit on a tenant's blocks
    assert await cached(api, "sk-open-2") == hit      # unsalted keys share, as before
    assert await cached(api, "sk-beta", stream=True) == hit      # beta's own blocks, now cached (streamed usage)


async def test_the_request_salt_narrows_the_keys_scope(api):
    prompt = PROMPT + "    return 1\n"
    assert await cached(api, "sk-acme", "session-1", prompt) == 0
    assert await cached(api, "sk-acme", None, prompt) == 0          # the tenant's blocks without a request salt
    hit = await cached(api, "sk-acme-2", "session-1", prompt)
    assert hit > 0
    assert await cached(api, "sk-open", "acme", prompt) == 0        # naming a tenant's salt does not reach it
    assert await cached(api, "sk-open", "session-1", prompt) == 0   # nor a tenant's request salt
    assert await cached(api, "sk-open-2", "session-1", prompt) == hit   # an unsalted key's request salt is shared
    assert await cached(api, "sk-open", None, prompt) == 0          # and distinct from no salt at all


async def test_chat_is_scoped_too_and_a_bad_cache_salt_is_a_400(api):
    assert await cached(api, "sk-acme", chat=True) == 0
    assert await cached(api, "sk-beta", chat=True) == 0
    assert await cached(api, "sk-acme-2", chat=True) > 0
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        for bad in ("", 12, "x" * 257):
            async with api.post(path, json={**body, "cache_salt": bad},
                                headers={"Authorization": "Bearer sk-open"}) as resp:
                assert resp.status == 400
                err = (await resp.json())["error"]
                assert err["param"] == "cache_salt" and err["type"] == "invalid_request_error"
