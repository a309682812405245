"""Start real edgecore processes for end-to-end tests and stop them without leaving orphans."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    def __init__(self, args: list[str], env: dict | None = None, ready_timeout: float = 60,
                 launcher: tuple[str, ...] = (sys.executable, "-m", "edgecore")):
        """`launcher`: the command before `args` (a bench's own script can start a node with probes in it)."""
        self.args = args
        full_env = {"EDGECORE_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log = open(f"/tmp/edgecore-test-{os.getpid()}-{free_port()}.log", "w+")
        self.proc = subprocess.Popen([*launcher, *args], cwd=ROOT, env=full_env,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, start_new_session=True)
        deadline = time.monotonic() + ready_timeout
        self.ready_line = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if "ready" in line:
                self.ready_line = line
                return
            if not line and self.proc.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"node {args} did not start: {self.logs()}")

    def logs(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


def _on_free_ports(start, count: int, attempts: int = 3):
    """start(*ports) with `count` ports free a moment ago. Between that moment and the node's bind another
    process may take one (a parallel core's gloo connections take ephemeral ports): then again, with
    others."""
    for attempt in range(attempts):
        try:
            return start(*(free_port() for _ in range(count)))
        except RuntimeError as exc:
            if "address already in use" not in str(exc) or attempt == attempts - 1:
                raise


def start_core(secret_file: str, *extra: str, data_dir: str | None = None, **node_args: Any) -> tuple[Node, int, int]:
    """`node_args`: Node's keywords (env, ready_timeout, launcher)."""
    import tempfile
    data_dir = data_dir or tempfile.mkdtemp(prefix="edgecore-core-")

    def start(port: int, http: int) -> tuple[Node, int, int]:
        return Node(["core", "--listen", f"127.0.0.1:{port}", "--http", f"127.0.0.1:{http}", "--secret-file",
                     secret_file, "--data-dir", data_dir, *extra], **node_args), port, http
    return _on_free_ports(start, 2)


def start_edge(*extra: str, cores: list[int] = (), secret_file: str | None = None) -> tuple[Node, int]:
    def start(http: int) -> tuple[Node, int]:
        args = ["edge", "--listen", f"127.0.0.1:{http}", *extra]
        for p in cores:
            args += ["--core", f"127.0.0.1:{p}"]
        if secret_file:
            args += ["--secret-file", secret_file]
        return Node(args), http
    return _on_free_ports(start, 1)


def metric(http: int, prefix: str) -> float:
    """The sum of the samples on 127.0.0.1:http/metrics whose line starts with `prefix` (a metric name,
    optionally with the first labels: every sample also carries `model_name`, so leave the `}` open)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def get_json(url: str, timeout: float = 10, headers: dict | None = None) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
        return json.loads(r.read())


def post_json(url: str, body: dict, timeout: float = 60, headers: dict | None = None) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_for(predicate, timeout: float = 15, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()
