"""A server's engine thread owns the torch intra-op threads; its main thread keeps one."""

import subprocess
import sys

from tests.conftest import ROOT

PROBE = """
import asyncio, torch
from edgecore.shared.node.env import reserve_threads_for_engine
from edgecore.shared.engine.engine_thread import EngineThread
from tests.conftest import make_engine
torch.set_num_threads(2)
threads = reserve_threads_for_engine()
main_after = torch.get_num_threads()
engine = make_engine()
async def run():
    aengine = EngineThread(engine, threads=threads)
    aengine.start()
    seen = []
    engine.block_manager.match_prefix = lambda ids, salt=None: seen.append(torch.get_num_threads()) or []
    await aengine.cached_prefix([1])    # runs on the engine thread
    seen = seen[0]
    aengine.stop()
    return seen
print(threads, main_after, asyncio.run(run()))
"""


def test_engine_thread_gets_the_threads_and_main_keeps_one():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "1", "2"]
