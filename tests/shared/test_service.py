"""run_service: a termination signal that comes while the node is still starting (a decode step compiling
for a minute, say) stops it there, through its `stop`, instead of after the start finishes."""

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
    print("starting", flush=True)
    await asyncio.sleep(120)           # a start that takes long: a compile

async def stop():
    print("stopped", flush=True)

sys.exit(run_service(start, stop))
"""


def test_a_signal_while_starting_stops_the_node():
    proc = subprocess.Popen([sys.executable, "-c", NODE], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "starting"
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert time.monotonic() - t < 10
        assert proc.stdout.read().strip() == "stopped"
    finally:
        if proc.poll() is None:
            proc.kill()
