"""The edge as two processes (HTTP frontend + engine process): neither outlives the other, and a
dead engine ends open streams with an error instead of a hang. `--engine-in-process` still serves."""

import http.client
import json
import os
import signal

import pytest

from tests.e2e.procs import get_json, post_json, start_edge, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:        # a zombie child of the frontend counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def open_stream(port: int) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": "pydoc-llama", "prompt": "def parse(text):", "max_tokens": 900, "temperature": 0,
        "ignore_eos": True, "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: {")        # tokens are flowing
    return resp


def test_a_dead_engine_process_ends_streams_and_the_frontend():
    edge, port = start_edge()
    try:
        engine_pid = get_json(f"http://127.0.0.1:{port}/stats")["engine_pid"]
        assert engine_pid != edge.proc.pid and alive(engine_pid)
        resp = open_stream(port)
        os.kill(engine_pid, signal.SIGKILL)
        rest = resp.read()                      # ends (error event or closed connection), never hangs
        assert b"[DONE]" not in rest or b'"error"' in rest
        assert edge.proc.wait(20) == 1          # the frontend shuts down, non-zero, for a supervisor
    finally:
        edge.stop()


def test_the_engine_process_does_not_outlive_its_frontend():
    edge, port = start_edge()
    try:
        engine_pid = get_json(f"http://127.0.0.1:{port}/stats")["engine_pid"]
        os.kill(edge.proc.pid, signal.SIGKILL)  # only the frontend, not the process group
        edge.proc.wait(10)
        assert wait_for(lambda: not alive(engine_pid), timeout=20)
    finally:
        edge.kill()


def test_engine_in_process_still_serves():
    edge, port = start_edge("--engine-in-process")
    try:
        out = post_json(f"http://127.0.0.1:{port}/v1/completions",
                        {"model": "pydoc-llama", "prompt": "import os", "max_tokens": 5, "temperature": 0})
        assert out["usage"]["completion_tokens"] == 5
        assert "engine_pid" not in get_json(f"http://127.0.0.1:{port}/stats")
    finally:
        edge.stop()
