"""`edgecore up`'s rolling restart (SIGHUP; deploy/launcher.py `restart_all`) on stand-in nodes (small
processes with a /ready port that drain on SIGTERM): one node at a time in start order, each drained (its
SIGTERM awaited), started again with the same command line and ready before the next one is touched; a node
that ignores SIGTERM is killed after its drain timeout plus the margin; one that does not come back fails the
restart; a stop signal meanwhile ends it after the node in hand."""

from __future__ import annotations

import io
import signal
import sys
import threading
import time

import pytest

from edgecore.deploy import launcher as launcher_mod
from edgecore.deploy.launcher import Launcher, Proc, with_group
from edgecore.deploy.topology import load_topology
from edgecore.shared.errors import EdgecoreError
from tests.deploy.conftest import ROOT
from tests.e2e.procs import free_port

pytestmark = pytest.mark.timeout(60)

NODE = """
import http.server, signal, sys, threading, time
port, log, name, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
def note(what):
    with open(log, "a") as f:
        f.write(f"{time.monotonic():.3f} {name} {what}\\n")
class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
def drain(*_):
    note("draining")
    time.sleep(0.3)              # requests in flight finish
    note("exit")
    sys.exit(0)
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, drain)
time.sleep(0.2)                  # a start that takes a moment
server = http.server.HTTPServer(("127.0.0.1", port), Ready)
threading.Thread(target=server.serve_forever, daemon=True).start()
note("ready")
while True:
    time.sleep(0.1)
"""


def launcher_with(tmp_path, modes: dict[str, str], drain_timeout: float = 5.0) -> tuple[Launcher, str]:
    script, log = tmp_path / "node.py", tmp_path / "events.log"
    script.write_text(NODE)
    topo = (ROOT / "deploy" / "topology.toml").read_text().replace(
        'path = "../models/pydoc-llama"', f'path = "{ROOT / "models" / "pydoc-llama"}"')
    (tmp_path / "topology.toml").write_text(topo)
    launcher = Launcher(load_topology(tmp_path / "topology.toml"), out=io.StringIO(), ready_timeout=10)
    for name, mode in modes.items():
        port = free_port()
        cmd = [sys.executable, str(script), str(port), str(log), name, mode]
        launcher.procs.append(Proc(name, launcher._popen(name, cmd), f"http://127.0.0.1:{port}/", cmd,
                                   drain_timeout))
    launcher._wait_ready(launcher.procs)
    return launcher, str(log)


def events(log: str) -> list[tuple[str, str]]:
    with open(log) as f:
        return [tuple(line.split()[1:]) for line in f]


def test_nodes_restart_one_at_a_time_each_drained_and_ready_before_the_next(tmp_path):
    launcher, log = launcher_with(tmp_path, {"core": "drain", "edge-1": "drain", "edge-2": "drain"})
    try:
        before = [p.popen.pid for p in launcher.procs]
        launcher.restart_all()
        after = [p.popen.pid for p in launcher.procs]
        assert all(a != b for a, b in zip(before, after))
        assert all(p.popen.poll() is None for p in launcher.procs)
        seen = events(log)[3:]                      # after the three first starts
        assert seen == [(name, what) for name in ("core", "edge-1", "edge-2")
                        for what in ("draining", "exit", "ready")]
        out = launcher.out.getvalue()
        assert "exited with code 0" in out and "rolling restart done" in out
    finally:
        launcher.stop()


def test_a_node_that_ignores_sigterm_is_killed_after_its_drain_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher_mod, "RESTART_MARGIN", 0.5)
    launcher, log = launcher_with(tmp_path, {"stubborn": "stubborn"}, drain_timeout=0.5)
    try:
        t = time.monotonic()
        launcher.restart_all()
        assert 1.0 <= time.monotonic() - t < 10
        assert "did not stop within 1 s: killing it" in launcher.out.getvalue()
        assert events(log)[-1] == ("stubborn", "ready")
    finally:
        with_group(launcher.procs[0], signal.SIGKILL)      # (it would ignore the launcher's SIGTERM too)
        launcher.stop()


def test_a_node_that_does_not_come_back_fails_the_restart(tmp_path):
    launcher, _ = launcher_with(tmp_path, {"core": "drain"})
    try:
        launcher.procs[0].cmd = [sys.executable, "-c", "raise SystemExit(3)"]   # (a broken upgrade)
        with pytest.raises(EdgecoreError, match="exited with code 3 before it was ready"):
            launcher.restart_all()
    finally:
        launcher.stop()


def test_a_stop_signal_ends_the_restart_after_the_node_in_hand(tmp_path):
    launcher, log = launcher_with(tmp_path, {"a": "drain", "b": "drain"})
    stop = threading.Event()
    restart_one = launcher.restart

    def restart_then_signal(proc: Proc) -> None:
        restart_one(proc)
        stop.set()                                    # SIGINT while the first node was restarting
    launcher.restart = restart_then_signal            # type: ignore[method-assign]
    try:
        launcher.restart_all(stop)
        assert events(log)[2:] == [("a", "draining"), ("a", "exit"), ("a", "ready")]     # b untouched
        assert "rolling restart interrupted" in launcher.out.getvalue()
    finally:
        launcher.stop()
