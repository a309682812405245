"""Graceful drains of real nodes (bundled model, loopback). An edge on SIGTERM (to its process group, as
`edgecore up` sends it): /ready turns 503 at once, new requests get an OpenAI-shaped 503, the streams in flight
all finish, then it exits 0; a second SIGTERM, or a drain timeout of 0, ends it at once. A core on SIGTERM
while an edge sends it requests: every request is answered in full (0 failed), later ones are placed
elsewhere (here: prefilled at the edge), and the core exits 0."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.e2e.procs import Node, post_json, start_core, start_edge, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TOKENS = 600


def open_stream(port: int, max_tokens: int = TOKENS) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": "pydoc-llama", "prompt": "def parse(text):", "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: {")        # tokens are flowing
    return resp


def status(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except (ConnectionError, urllib.error.URLError):
        return 0, {}


def stream_text(resp: http.client.HTTPResponse) -> tuple[bool, int, bool]:
    """(ended with [DONE], completion tokens in its usage chunk or 0, an error event came) for the rest of a
    stream; a cut connection ends it too."""
    tokens, done, error = 0, False, False
    try:
        for line in resp:
            if line.startswith(b"data: [DONE]"):
                done = True
            elif line.startswith(b"data: {"):
                event = json.loads(line[6:])
                error = error or "error" in event
                tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
    except (http.client.IncompleteRead, ConnectionError):
        pass
    return done, tokens, error


def sigterm(node: Node) -> None:
    os.killpg(node.proc.pid, signal.SIGTERM)


def test_edge_drain_finishes_streams_refuses_new_requests_and_exits_0():
    edge, port = start_edge("--drain-timeout", "60")
    base = f"http://127.0.0.1:{port}"
    try:
        streams = [open_stream(port) for _ in range(3)]
        sigterm(edge)
        assert wait_for(lambda: status(f"{base}/ready")[0] == 503, timeout=5)
        assert status(f"{base}/ready")[1] == {"ready": False, "draining": True}
        code, body = status(f"{base}/v1/completions", {"model": "pydoc-llama", "prompt": "x", "max_tokens": 2})
        assert code == 503 and body["error"]["code"] == "server_shutting_down"
        assert body["error"]["type"] and body["error"]["message"]
        assert edge.proc.poll() is None                  # the streams are still running
        results = [stream_text(s) for s in streams]
        assert all(done and tokens == TOKENS and not error for done, tokens, error in results), results
        assert edge.proc.wait(30) == 0
        assert "drained in" in edge.logs()
    finally:
        edge.stop()


@pytest.mark.parametrize("case", ["second SIGTERM", "drain timeout 0"])
def test_edge_drain_cut_short(case):
    edge, port = start_edge("--drain-timeout", "0" if case == "drain timeout 0" else "60")
    try:
        stream = open_stream(port, 900)
        t = time.monotonic()
        sigterm(edge)
        if case == "second SIGTERM":
            assert wait_for(lambda: status(f"http://127.0.0.1:{port}/ready")[0] == 503, timeout=5)
            sigterm(edge)
        assert edge.proc.wait(30) == 0
        assert time.monotonic() - t < 20
        done, tokens, error = stream_text(stream)
        assert tokens == 0 and (error or not done)       # cut (an error event, or closed): it did not wait
    finally:
        edge.stop()


def complete(edge: Node, base: str, ids: list[int]) -> dict:
    """A two-token completion; an HTTP error fails the test with the edge's log."""
    try:
        return post_json(f"{base}/completions", {"model": "pydoc-llama", "prompt": ids, "max_tokens": 2})
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{exc}: {exc.read()!r}\n{edge.logs()[-4000:]}") from None


def test_core_drain_under_load_fails_no_request(secret_file):
    core, core_port, _ = start_core(secret_file, "--drain-timeout", "30")
    edge, port = start_edge("--local-prefill-below", "0", cores=[core_port], secret_file=secret_file)
    base = f"http://127.0.0.1:{port}/v1"
    results: list[object] = []

    def client(seed: int) -> None:
        for k in range(3):
            ids = [(seed * 7919 + k * 131 + i * 31) % 2000 + 2 for i in range(600)]
            try:
                out = post_json(f"{base}/completions", {"model": "pydoc-llama", "prompt": ids, "max_tokens": 40,
                                                        "temperature": 0, "ignore_eos": True}, timeout=60)
                results.append(out["usage"]["completion_tokens"])
            except Exception as exc:      # noqa: BLE001 - any failure is what the test counts
                results.append(exc)
    try:
        before = complete(edge, base, [5] * 600)
        assert before["usage"]["completion_tokens"] == 2
        threads = [threading.Thread(target=client, args=(s,)) for s in range(6)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        os.killpg(core.proc.pid, signal.SIGTERM)
        for t in threads:
            t.join(120)
        assert core.proc.wait(40) == 0
        assert len(results) == 18 and all(r == 40 for r in results), results      # 0 failed
        print("\n".join(line for line in core.logs().splitlines() if "drain" in line))   # requests in flight, time
        after = complete(edge, base, [7] * 600)
        assert after["usage"]["completion_tokens"] == 2                     # placed at the edge now
    finally:
        edge.stop()
        core.stop()
