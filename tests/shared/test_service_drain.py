"""run_service's graceful drain: SIGTERM runs `drain` before `stop` (exit 0), bounded by the drain timeout; a
second SIGTERM cuts it short; a drain timeout of 0, and SIGINT, stop at once as before."""

import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(60)

NODE = """
import asyncio, sys
from edgecore.shared.node.service import run_service

async def start():
    print("started", flush=True)

async def drain(timeout):
    print(f"draining {timeout:g}", flush=True)
    await asyncio.sleep(float(sys.argv[2]))      # the work in flight takes this long
    print("drained", flush=True)

async def stop():
    print("stopped", flush=True)

sys.exit(run_service(start, stop, drain, float(sys.argv[1])))
"""


def run(drain_timeout: float, work: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", NODE, str(drain_timeout), str(work)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "started"
    return proc


def finish(proc: subprocess.Popen) -> tuple[int, list[str], float]:
    t = time.monotonic()
    code = proc.wait(20)
    return code, proc.stdout.read().split(), time.monotonic() - t


def test_sigterm_drains_then_stops_with_status_0():
    proc = run(10, 1.0)
    proc.send_signal(signal.SIGTERM)
    code, lines, _ = finish(proc)
    assert code == 0
    assert lines == ["draining", "10", "drained", "stopped"]


def test_the_drain_timeout_bounds_the_drain():
    proc = run(0.5, 30)
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code, lines, _ = finish(proc)
    assert code == 0 and time.monotonic() - t < 10
    assert lines == ["draining", "0.5", "stopped"]           # cut at the timeout: never "drained"


def test_a_second_sigterm_stops_at_once():
    proc = run(30, 30)
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline().split() == ["draining", "30"]
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code, lines, _ = finish(proc)
    assert code == 0 and time.monotonic() - t < 5
    assert lines == ["stopped"]


@pytest.mark.parametrize("case", ["timeout 0", "SIGINT"])
def test_drain_timeout_0_and_sigint_stop_at_once(case):
    proc = run(0 if case == "timeout 0" else 30, 30)
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM if case == "timeout 0" else signal.SIGINT)
    code, lines, _ = finish(proc)
    assert code == 0 and time.monotonic() - t < 5
    assert lines == ["stopped"]                               # today's behaviour: no drain at all


@pytest.mark.parametrize("node", ["core", "edge"])
def test_a_drain_timeout_out_of_range_is_one_line(node):
    r = subprocess.run([sys.executable, "-m", "edgecore", node, "--drain-timeout", "-1"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "--drain-timeout must be between 0" in r.stderr
