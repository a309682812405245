"""/tokenize, /detokenize, /version and /v1/models/{id} on the edge; /v1/models on the core's control port."""

import json
from types import SimpleNamespace

import pytest

from edgecore.core.http import build_app
from tests.edge.test_openai_fuzz import FakeEdge, port  # noqa: F401  (the running edge app fixture)
from tests.edge.test_openai_fuzz import post


def get(port_, path):
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port_}{path}", timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_tokenize_detokenize_roundtrip(port, tokenizer):  # noqa: F811
    status, _, raw = post(port, "/tokenize", json.dumps({"prompt": "The for statement", "return_token_strs": True,
                                                         "model": "pydoc-llama"}).encode())
    body = json.loads(raw)
    assert status == 200 and body["tokens"] == tokenizer.encode("The for statement")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == FakeEdge.max_model_len
    assert "".join(body["token_strs"]).endswith("for statement")
    status, _, raw = post(port, "/detokenize", json.dumps({"tokens": body["tokens"]}).encode())
    assert status == 200 and json.loads(raw)["prompt"] == "The for statement"
    messages = [{"role": "user", "content": "Hi"}]
    status, _, raw = post(port, "/tokenize", json.dumps({"messages": messages}).encode())
    assert status == 200 and json.loads(raw)["tokens"] == tokenizer.encode_chat(messages)
    status, _, raw = post(port, "/tokenize", json.dumps({"prompt": "The for", "add_special_tokens": False}).encode())
    assert status == 200 and json.loads(raw)["tokens"] == tokenizer.encode("The for", add_special_tokens=False)


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "x", "messages": [{"role": "user"}]}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"), ("/detokenize", {"tokens": [99999]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"), ("/detokenize", {}, "tokens"),
    ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
])
def test_bad_tokenize_bodies(port, path, body, param):  # noqa: F811
    status, _, raw = post(port, path, json.dumps(body).encode())
    assert status in (400, 404) and json.loads(raw)["error"]["param"] == param


def test_version_and_model_card(port):  # noqa: F811
    status, body = get(port, "/version")
    assert status == 200 and body["version"]
    status, body = get(port, "/v1/models/pydoc-llama")
    assert status == 200 and body["id"] == "pydoc-llama" and body["object"] == "model"
    status, body = get(port, "/v1/models/other")
    assert status == 404 and body["error"]["code"] == "model_not_found"


async def test_core_lists_its_model(aiohttp_client, model_dir):
    core = SimpleNamespace(config=SimpleNamespace(api_keys=[], model_dir=str(model_dir)),
                           handle=SimpleNamespace(max_model_len=1024), started_at=1.0e9, http_extensions=[],
                           prefill=SimpleNamespace(adapters={}))      # no LoRA adapters (--lora)
    client = await aiohttp_client(build_app(core))
    resp = await client.get("/v1/models")
    body = await resp.json()
    assert resp.status == 200 and [m["id"] for m in body["data"]] == ["pydoc-llama"]
    assert body["data"][0]["max_model_len"] == 1024
    resp = await client.get("/v1/models/pydoc-llama")
    assert resp.status == 200 and (await resp.json())["created"] == 1000000000
