"""An engine thread that fails (a bug or a resource failure inside a step) takes its node out of service
instead of leaving it up with a dead engine: the core stops serving edges and its /health turns 503 (a
supervisor's liveness check restarts it); the edge tells its CLI, which exits with status 1."""

import asyncio

import aiohttp
import pytest

from edgecore.core.server import CoreConfig, CoreServer
from edgecore.edge.node import EdgeConfig, EdgeNode
from edgecore.shared.engine.handle import EngineRequest
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.errors import EngineDead
from tests.conftest import make_engine

pytestmark = pytest.mark.timeout(60)


def break_steps(engine) -> None:
    def step(*_, **__):
        raise RuntimeError("injected step failure")
    engine.step = step


async def drain(stream) -> None:
    async for _ in stream:
        pass


async def test_a_failed_engine_thread_stops_the_core_and_fails_its_health(model_dir, tmp_path):
    core = CoreServer(CoreConfig(str(model_dir), b"s", port=0, http_port=0, data_dir=str(tmp_path)))
    await core.start()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{core.http_port}/health") as r:
                assert r.status == 200
            reader, writer = await asyncio.open_connection("127.0.0.1", core.port)   # serving edges
            writer.close()
            break_steps(core.handle.engine)
            with pytest.raises(EngineDead, match="injected"):
                await drain(core.handle.generate(EngineRequest("r", [5, 6, 7], SamplingParams(max_tokens=2))))
            for _ in range(50):                                 # on_failure runs on the event loop
                if core.failure:
                    break
                await asyncio.sleep(0.02)
            assert "injected step failure" in core.failure and not core.alive
            async with s.get(f"http://127.0.0.1:{core.http_port}/health") as r:
                assert r.status == 503
                assert (await r.json())["status"] == "failed"
        with pytest.raises(OSError):                            # no longer serving edges: they fail over
            await asyncio.open_connection("127.0.0.1", core.port)
    finally:
        await core.stop()


async def test_a_failed_engine_thread_tells_the_edge_to_exit(model_dir):
    edge = EdgeNode(EdgeConfig(model_dir=str(model_dir)), engine=make_engine())
    deaths = []
    edge.on_death = lambda: deaths.append(True)
    await edge.start()
    try:
        break_steps(edge.handle.engine)
        with pytest.raises(EngineDead, match="injected"):
            await drain(edge.generate("r", [5, 6, 7], SamplingParams(max_tokens=2)))
        for _ in range(50):
            if deaths:
                break
            await asyncio.sleep(0.02)
        assert deaths == [True] and not edge.ready
    finally:
        await edge.stop()
