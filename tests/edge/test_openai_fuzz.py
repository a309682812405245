"""No request body, however wrong, gets a 500 or a non-JSON answer (hypothesis over bodies, real aiohttp app).

The edge's HTTP app runs in a thread with a stand-in engine (every request yields one finished token), so the
whole path a body takes is exercised: JSON decode, schema, tokenization, context checks, response building.
"""

import asyncio
import json
import threading
import urllib.error
import urllib.request

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgecore.edge.http import EdgeHTTP
from edgecore.shared.engine.output import RequestOutput, TokenLogprob
from edgecore.shared.openai.extra_routes import DetokenizeRequest, TokenizeRequest
from edgecore.shared.openai.schemas import ChatRequest, CompletionRequest

pytestmark = pytest.mark.timeout(300)


class FakeEdge:
    ready, active, vocab_size, max_model_len, fingerprint = True, 0, 2048, 1024, "f" * 64
    adapters: dict[str, str] = {}      # LoRA adapters served (none)

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def count_error(self, status):
        pass

    async def generate(self, rid, prompt, params, group=None, cache_salt=None):
        lps = [TokenLogprob(65, -0.5, [(65, -0.5)] * (params.logprobs or 0))] if params.logprobs is not None \
            else None
        yield RequestOutput(rid, [65], "A", True, "length", lps, len(prompt), 0, 1)


@pytest.fixture(scope="module")
def port(tokenizer):
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box = {}

    async def start():
        runner = web.AppRunner(EdgeHTTP(FakeEdge(tokenizer), "pydoc-llama").build_app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        box["runner"], box["port"] = runner, site._server.sockets[0].getsockname()[1]
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    assert ready.wait(30)
    yield box["port"]
    asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)


def post(port, path, body: bytes):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()


FIELDS = sorted(set(ChatRequest.__struct_fields__) | set(CompletionRequest.__struct_fields__)
                | set(TokenizeRequest.__struct_fields__) | set(DetokenizeRequest.__struct_fields__))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2 ** 80, max_value=2 ** 80),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
                    st.sampled_from([0, 1, -1, 2 ** 31, 2 ** 63, 2 ** 64, 1e30, -1e30, 0.5, "", "text", "5"]))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(["type", "role", "content", "text", "5",
                                                                  "include_usage", "name", "x"]), inner,
                                                 max_size=4)), max_leaves=12)
VALID = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
         "/v1/completions": {"prompt": "The class", "max_tokens": 2},
         "/tokenize": {"prompt": "The class"}, "/detokenize": {"tokens": [5, 6]}}


def check(status, ctype, raw):
    assert status != 500 and status < 600
    assert ctype.startswith(("application/json", "text/event-stream")), (status, ctype, raw[:200])
    if status >= 400:
        assert set(json.loads(raw)["error"]) == {"message", "type", "param", "code"}


@settings(max_examples=300, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(sorted(VALID)), base=st.booleans(),
       fields=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=5))
def test_any_body_gets_json_and_no_500(port, path, base, fields):
    body = {**(VALID[path] if base else {}), **fields}
    check(*post(port, path, json.dumps(body).encode()))


@settings(max_examples=60, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(sorted(VALID)), body=JSON)
def test_any_json_value_as_body(port, path, body):
    check(*post(port, path, json.dumps(body).encode()))


@pytest.mark.parametrize("path, fields", [
    ("/v1/completions", {"stop_token_ids": 5}), ("/v1/completions", {"stop_token_ids": [2 ** 70]}),
    ("/v1/completions", {"top_k": 1e30}), ("/v1/chat/completions", {"logit_bias": {"1": "x"}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
    ("/v1/completions", {"prompt": [[1, 2], "a"]}), ("/v1/completions", {"seed": 2 ** 64 - 1, "n": 2}),
])
def test_known_bad_bodies(port, path, fields):
    status, ctype, raw = post(port, path, json.dumps({**VALID[path], **fields}).encode())
    check(status, ctype, raw)
    assert status == 400


def test_valid_bodies_still_work(port):
    for path in ("/v1/chat/completions", "/v1/completions"):
        body = {**VALID[path], "logit_bias": {"65": 5}, "min_p": 0.1}
        status, _, raw = post(port, path, json.dumps(body).encode())
        assert status == 200 and json.loads(raw)["choices"]
