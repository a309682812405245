"""`edgecore up` restarts its nodes one at a time on SIGHUP, under load: the core is drained (the edge places
its prompts elsewhere: here, at the edge itself) and comes back; the edge drains (its streams finish; new
requests get 503 `server_shutting_down` or, while it is down, a refused connection, and the client retries);
no request fails, each node exits 0 and is ready again before the next; the launcher keeps running."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.e2e.procs import free_port
from tests.e2e.test_up import start_up

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def completion(url: str, ids: list[int]) -> tuple[int, int]:
    """(completion tokens, retries): one request, retried while the edge is draining or restarting."""
    body = json.dumps({"model": "pydoc-llama", "prompt": ids, "max_tokens": 16, "temperature": 0,
                       "ignore_eos": True}).encode()
    for retry in range(300):
        req = urllib.request.Request(f"{url}/completions", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read())["usage"]["completion_tokens"], retry
        except urllib.error.HTTPError as exc:
            error = json.loads(exc.read())["error"]
            if exc.code != 503 or error["code"] != "server_shutting_down":
                raise AssertionError(f"{exc.code}: {error}") from None
        except (ConnectionError, urllib.error.URLError) as exc:   # the edge is down between drain and ready
            if isinstance(exc, urllib.error.URLError) and not isinstance(exc.reason, ConnectionError):
                raise
        time.sleep(0.1)
    raise AssertionError("the edge did not come back")


def test_sighup_restarts_every_node_under_load_without_a_failed_request(tmp_path):
    port = free_port()
    proc = start_up(tmp_path, {"west": port})
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}/v1"
    done, results = threading.Event(), []

    def client(seed: int) -> None:
        k = 0
        while not done.is_set():
            ids = [(seed * 7919 + k * 131 + i * 31) % 2000 + 2 for i in range(400)]
            try:
                results.append(completion(url, ids))
            except Exception as exc:          # noqa: BLE001 - a failed request is what the test counts
                results.append(exc)
            k += 1
    try:
        deadline = time.monotonic() + 150
        while not any("edgecore is up" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-40:])
            time.sleep(0.2)
        clients = [threading.Thread(target=client, args=(s,)) for s in range(3)]
        for t in clients:
            t.start()
        time.sleep(2)
        started = len(results)
        proc.send_signal(signal.SIGHUP)
        while not any("rolling restart done" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline + 120, "".join(lines[-60:])
            time.sleep(0.2)
        time.sleep(1)
        done.set()
        for t in clients:
            t.join(90)
        text = "".join(lines)
        print("".join(line for line in lines if "restart" in line or "exited with" in line or "ready again" in line))
        print(f"{len(results)} requests, {len(results) - started} during or after the restart, "
              f"{sum(r[1] for r in results if not isinstance(r, Exception))} retries")
        failures = [r for r in results if isinstance(r, Exception)]
        errors = [line for line in lines if " ERROR " in line or " WARNING " in line or "Traceback" in line]
        assert not failures, (failures, "".join(errors[-40:]))
        assert all(tokens == 16 for tokens, _ in results)
        assert len(results) > started                                   # served during the restart too
        assert text.count("exited with code 0 after") == 2, text[-3000:]  # the core, then the edge, drained
        assert text.index("restarting dc/core-dc") < text.index("restarting west/edge-west")
        assert "west/edge-west is ready again" in text and proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        done.set()
        if proc.poll() is None:
            proc.kill()
