"""The edge's HTTP layer under hostile input: JSON errors always, counted; sequence limits; slow clients;
connection cap; API key on /stats; lower-case bearer. An in-process server over a real engine (bundled model)."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest

from edgecore.edge.http import EdgeHTTP, start_http
from edgecore.shared.node.http_server import ServerLimits
from edgecore.shared.node.log_budget import limit_logger
from tests.conftest import make_engine

pytestmark = pytest.mark.timeout(60)
KEY = "sk-test"


class EngineEdge:
    """The surface EdgeHTTP uses, over an in-thread LLMEngine stepped on the event loop."""

    def __init__(self, engine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.config.vocab_size
        self.max_model_len = engine.max_model_len
        self.fingerprint = ""
        self.adapters: dict[str, str] = {}     # LoRA adapters served (none)
        self.ready = True
        self.active = 0
        self.errors: list[str] = []
        self.gate: asyncio.Event | None = None      # when set: generation waits for it (to hold capacity)
        self.queues: dict[str, asyncio.Queue] = {}
        self.stepper: asyncio.Task | None = None

    def count_error(self, status: str) -> None:
        self.errors.append(status)

    async def generate(self, rid, prompt, params, group=None, cache_salt=None):
        self.active += 1
        queue = self.queues[rid] = asyncio.Queue()
        try:
            if self.gate is not None:
                await self.gate.wait()
            self.engine.add_request(rid, prompt, params)
            if self.stepper is None or self.stepper.done():
                self.stepper = asyncio.create_task(self._step())
            while True:
                out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                yield out
                if out.finished:
                    return
        finally:
            self.active -= 1
            self.queues.pop(rid, None)
            self.engine.abort(rid)

    async def _step(self):
        """One loop steps the engine for every stream (as the engine thread does) and routes outputs."""
        while self.engine.has_unfinished():
            try:
                outs = self.engine.step()
            except Exception as exc:        # an engine failure reaches every open stream
                for q in self.queues.values():
                    q.put_nowait(exc)
                return
            for out in outs:
                if out.request_id in self.queues:
                    self.queues[out.request_id].put_nowait(out)
            await asyncio.sleep(0)

    async def get_stats(self):
        return {"pid": 1, "cores": []}


@pytest.fixture(scope="module")
def engine():
    return make_engine(num_blocks=256)


@pytest.fixture
async def server(engine):
    edge = EngineEdge(engine)
    http = EdgeHTTP(edge, "pydoc-llama", [KEY.encode()], max_body=1 << 20, max_concurrent=8, max_seqs_per_request=4,
                    limits=ServerLimits(header_timeout=0.5, body_timeout=0.5, keepalive_timeout=5,
                                        max_connections=6))
    runner, port = await start_http(http, "127.0.0.1", 0)
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", timeout=aiohttp.ClientTimeout(total=30),
                                     headers={"Authorization": f"Bearer {KEY}"}) as session:
        yield {"edge": edge, "http": http, "port": port, "session": session}
    await runner.cleanup()


async def post_raw(session, path, data: bytes, headers=None):
    async with session.post(path, data=data, headers={"Content-Type": "application/json", **(headers or {})}) as r:
        return r.status, r.headers.get("Content-Type", ""), await r.read()


HOSTILE = [
    ("top_k float 1e30", b'{"prompt": "x", "max_tokens": 2, "top_k": 1e30}'),
    ("top_k 10**30", b'{"prompt": "x", "max_tokens": 2, "top_k": 1000000000000000000000000000000}'),
    ("stop_token_ids scalar", b'{"prompt": "x", "max_tokens": 2, "stop_token_ids": 5}'),
    ("stop_token_ids 2**70", b'{"prompt": "x", "max_tokens": 2, "stop_token_ids": [1180591620717411303424]}'),
    ("100k-deep JSON", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("not an object", b"[1, 2]"),
    ("bad JSON", b'{"prompt": '),
]


@pytest.mark.parametrize("name,body", HOSTILE, ids=[h[0] for h in HOSTILE])
async def test_hostile_body_gets_counted_json_400(server, name, body):
    before = len(server["edge"].errors)
    status, ctype, raw = await post_raw(server["session"], "/v1/completions", body)
    assert status == 400, (name, raw[:300])
    assert ctype.startswith("application/json")
    err = json.loads(raw)["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert server["edge"].errors[before:] == ["400"]


async def test_our_own_bug_is_a_counted_json_500_with_request_id(server, monkeypatch, caplog):
    async def broken(*_):
        raise KeyError("a bug of ours")
        yield
    monkeypatch.setattr(server["edge"], "generate", broken)
    monkeypatch.setattr(limit_logger("edgecore.http"), "tokens", 10.0)     # a full log budget for this one
    before = len(server["edge"].errors)
    with caplog.at_level(logging.ERROR, logger="edgecore.http"):
        status, ctype, raw = await post_raw(server["session"], "/v1/completions",
                                            b'{"prompt": "x", "max_tokens": 2}')
    assert status == 500 and ctype.startswith("application/json")
    err = json.loads(raw)["error"]
    assert err["code"] == "internal_error" and "request id" in err["message"]
    assert "KeyError" not in err["message"]                # no internals to the client ...
    assert any("KeyError" in (r.exc_text or "") or r.exc_info for r in caplog.records)   # ... but in the log
    assert server["edge"].errors[before:] == ["500"]


async def test_malformed_http_gets_json_400_without_traceback(server, caplog):
    with caplog.at_level(logging.DEBUG):
        reader, writer = await asyncio.open_connection("127.0.0.1", server["port"])
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header Without Colon\r\n\r\n")
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(), 5)
        writer.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"400" and b"application/json" in head
    assert json.loads(body)["error"]["code"] == "bad_http_request"
    assert not any(r.exc_info for r in caplog.records if r.name in ("aiohttp.server", "edgecore.http"))


async def test_too_many_sequences_in_one_request_is_400_naming_n(server):
    body = json.dumps({"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2}).encode()
    status, _, raw = await post_raw(server["session"], "/v1/completions", body)
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == "n" and err["code"] == "too_many_sequences"
    assert "6 sequences" in err["message"] and "at most 4" in err["message"]


async def test_capacity_counts_sequences_not_requests(server):
    edge, session = server["edge"], server["session"]
    edge.gate = asyncio.Event()
    body = json.dumps({"prompt": ["a", "b"], "n": 2, "max_tokens": 2}).encode()      # 4 sequences each
    first = [asyncio.create_task(post_raw(session, "/v1/completions", body)) for _ in range(2)]
    await asyncio.sleep(0.3)
    assert server["http"].sequences == 8
    status, _, raw = await post_raw(session, "/v1/completions", json.dumps({"prompt": "a", "max_tokens": 2}).encode())
    assert status == 503 and json.loads(raw)["error"]["code"] == "server_overloaded"
    edge.gate.set()
    assert [s for s, _, _ in await asyncio.gather(*first)] == [200, 200]
    assert server["http"].sequences == 0
    status, _, _ = await post_raw(session, "/v1/completions", json.dumps({"prompt": "a", "max_tokens": 2}).encode())
    assert status == 200


async def test_slowloris_connection_closed_after_header_timeout(server):
    reader, writer = await asyncio.open_connection("127.0.0.1", server["port"])
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")           # headers never finish
    await writer.drain()
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        while not reader.at_eof() and loop.time() - start < 5:     # keep trickling, as a slowloris client does
            await asyncio.sleep(0.1)
            writer.write(b"X-a: b\r\n")
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    elapsed = loop.time() - start
    try:
        rest = await asyncio.wait_for(reader.read(), 2)
    except ConnectionError:     # our trickle reached the closed socket first: reset, and nothing was sent
        rest = b""
    assert rest == b""                                              # closed by the server, nothing sent
    assert elapsed < 3
    writer.close()


async def test_slow_body_gets_408(server):
    reader, writer = await asyncio.open_connection("127.0.0.1", server["port"])
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                 b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
    await writer.drain()
    reply = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"408" and json.loads(body)["error"]["code"] == "request_timeout"


async def test_connection_cap(server):
    conns = [await asyncio.open_connection("127.0.0.1", server["port"]) for _ in range(6)]
    await asyncio.sleep(0.05)
    reader, writer = await asyncio.open_connection("127.0.0.1", server["port"])
    reply = await asyncio.wait_for(reader.read(), 5)
    assert reply.split(b" ")[1] == b"503" and b"too_many_connections" in reply
    for _, w in conns + [(reader, writer)]:
        w.close()
    await asyncio.sleep(0.1)
    async with server["session"].get("/health") as r:      # a freed slot serves again
        assert r.status == 200


async def test_stats_needs_key_and_bearer_scheme_is_case_insensitive(server):
    port = server["port"]
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as anon:
        async with anon.get("/stats") as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        for scheme in ("bearer", "BEARER", "Bearer"):
            async with anon.get("/stats", headers={"Authorization": f"{scheme} {KEY}"}) as r:
                assert r.status == 200, scheme
            async with anon.get("/v1/models", headers={"Authorization": f"{scheme} {KEY}"}) as r:
                assert r.status == 200, scheme
        async with anon.get("/v1/models", headers={"Authorization": f"Basic {KEY}"}) as r:
            assert r.status == 401
        async with anon.get("/health") as r:
            assert r.status == 200


async def test_a_flood_of_malformed_requests_logs_a_bounded_number_of_lines(server, caplog):
    with caplog.at_level(logging.DEBUG):
        for _ in range(60):
            reader, writer = await asyncio.open_connection("127.0.0.1", server["port"])
            writer.write(b"NOT HTTP AT ALL\r\n\r\n")
            await writer.drain()
            assert (await asyncio.wait_for(reader.read(), 5)).split(b" ")[1] == b"400"
            writer.close()
    lines = [r for r in caplog.records if r.name in ("aiohttp.server", "edgecore.http")]
    assert len(lines) <= 20 and not any(r.exc_info for r in lines)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_body_its_content_encoding_cannot_decode_is_a_json_400(server, encoding):
    before = len(server["edge"].errors)
    status, ctype, raw = await post_raw(server["session"], "/v1/completions", b"xx",
                                        headers={"Content-Encoding": encoding})
    assert status == 400 and ctype.startswith("application/json"), raw[:300]
    assert json.loads(raw)["error"]["code"] == "invalid_body"
    assert server["edge"].errors[before:] == ["400"]


async def test_a_content_encoding_it_cannot_decode_is_a_415_not_read_as_plain_bytes(server):
    status, _, raw = await post_raw(server["session"], "/v1/completions", b'{"prompt": "x"}',
                                    headers={"Content-Encoding": "foo"})
    assert status == 415 and json.loads(raw)["error"]["code"] == "unsupported_content_encoding"


async def test_a_declared_body_over_the_limit_is_a_413_before_it_is_sent(server):
    reader, writer = await asyncio.open_connection("127.0.0.1", server["port"])
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                 b"\r\nContent-Type: application/json\r\nContent-Length: 100000000\r\n\r\n")   # no body follows
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.split(b" ")[1] == b"413"
    writer.close()


async def test_a_huge_prompt_is_refused_without_stalling_other_requests(server):
    """Megabytes of prompt: the context-length error comes from a prefix (no full encode), parsed off the
    event loop, while /health keeps answering."""
    body = json.dumps({"prompt": "ab " * 300_000, "max_tokens": 1}).encode()     # 900 KB, under max_body

    async def health_times():
        times = []
        for _ in range(5):
            t = asyncio.get_running_loop().time()
            async with server["session"].get("/health") as r:
                assert r.status == 200
            times.append(asyncio.get_running_loop().time() - t)
        return times

    (status, _, raw), times = await asyncio.gather(post_raw(server["session"], "/v1/completions", body),
                                                    health_times())
    err = json.loads(raw)["error"]
    assert status == 400 and err["code"] == "context_length_exceeded" and "at least" in err["message"], err
    assert max(times) < 5
    for text in ("a" * 900_000, " " * 900_000):        # no whitespace to cut at; nothing but whitespace
        status, _, raw = await post_raw(server["session"], "/v1/completions",
                                        json.dumps({"prompt": text, "max_tokens": 1}).encode())
        assert status == 400 and json.loads(raw)["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("extra,param", [
    ({"guided_regex": "[^\\s\\S]"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "response_format.json_schema.schema"),
])
async def test_a_grammar_no_text_matches_is_a_400_not_an_empty_stop(server, extra, param, n):
    body = json.dumps({"prompt": "x", "max_tokens": 4, "n": n, **extra}).encode()
    status, ctype, raw = await post_raw(server["session"], "/v1/completions", body)
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == param and "matches no text" in err["message"], raw[:300]


async def test_a_streamed_request_the_engine_refuses_gets_its_400_before_any_200(server):
    body = json.dumps({"prompt": "x", "max_tokens": 4, "stream": True, "guided_regex": "[^\\s\\S]"}).encode()
    status, ctype, raw = await post_raw(server["session"], "/v1/completions", body)
    assert status == 400 and ctype.startswith("application/json"), raw[:300]
    assert json.loads(raw)["error"]["param"] == "guided_regex"


async def test_a_prefetched_text_certainly_over_the_context_is_refused(server, monkeypatch):
    async def never(ids):
        raise AssertionError("prefetched")
    monkeypatch.setattr(server["edge"], "prefetch", never, raising=False)
    status, _, raw = await post_raw(server["session"], "/v1/contexts",
                                    json.dumps({"text": "ab " * 200_000}).encode())
    err = json.loads(raw)["error"]
    assert status == 400 and err["code"] == "context_length_exceeded" and err["param"] == "text", err


async def test_tokenize_and_detokenize_need_the_key_while_probes_stay_open(server):
    async with aiohttp.ClientSession(f"http://127.0.0.1:{server['port']}") as anon:
        for path, body in (("/tokenize", {"prompt": "hello"}), ("/detokenize", {"tokens": [1, 2]})):
            async with anon.post(path, json=body) as r:
                assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key", path
            async with server["session"].post(path, json=body) as r:
                assert r.status == 200, path
        for path in ("/health", "/version"):
            async with anon.get(path) as r:
                assert r.status == 200, path


async def test_health_is_503_as_soon_as_the_engine_is_known_dead(server):
    edge = server["edge"]
    async with server["session"].get("/health") as r:
        assert r.status == 200 and (await r.json())["status"] == "ok"
    edge.ready = False                  # what NodeProcessClient reports the moment its engine process is gone
    try:
        async with server["session"].get("/health") as r:
            assert r.status == 503 and (await r.json())["status"] == "engine_dead"
    finally:
        edge.ready = True
