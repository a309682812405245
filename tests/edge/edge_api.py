"""An in-process edge behind its OpenAI API, as deployed but in one process: an `EdgeNode` around a given engine,
served over the frontend ↔ engine-process link (`NodeProcessServer` on one end of a socketpair, the frontend's
`NodeProcessClient` on the other) and `EdgeHTTP` on a loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import aiohttp

from edgecore.edge.http import EdgeHTTP, start_http
from edgecore.edge.node import EdgeConfig, EdgeNode
from edgecore.edge.node_client import NodeProcessClient
from edgecore.edge.node_process import NodeProcessServer


@contextlib.asynccontextmanager
async def edge_api(model_dir, engine, model_name: str = "pydoc-llama", api_keys=None,
                   config: EdgeConfig | None = None) -> AsyncIterator[aiohttp.ClientSession]:
    """An aiohttp session on the edge's HTTP port; everything stops after."""
    edge = EdgeNode(config or EdgeConfig(model_dir=str(model_dir)), engine=engine)
    await edge.start()
    a, b = socket.socketpair()
    server = asyncio.create_task(NodeProcessServer(edge, a).run())
    client = NodeProcessClient(["edge"], str(model_dir))
    await client.connect(b)
    runner, port = await start_http(EdgeHTTP(client, model_name, api_keys or []), "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", timeout=aiohttp.ClientTimeout(total=60)) as s:
            yield s
    finally:
        await runner.cleanup()
        await client.stop()
        await asyncio.wait_for(asyncio.gather(server, return_exceptions=True), 10)
        await edge.stop()
