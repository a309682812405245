"""A core that stops answering (SIGSTOP: its connection stays open, nothing arrives) is avoided for new requests
once a ping has waited `UNRESPONSIVE_AFTER` seconds with nothing else arriving, and taken back as soon as it
answers again; the connection itself is kept (closed only after the idle timeout)."""

import asyncio
import os
import signal

import pytest

from edgecore.edge import core_client
from edgecore.edge.core_client import CoreClient, CoreRouter
from edgecore.shared.models.fingerprint import model_fingerprint
from tests.conftest import MODEL_DIR
from tests.e2e.procs import start_core

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


async def test_a_stopped_core_is_avoided_then_taken_back(secret_file, monkeypatch):
    monkeypatch.setattr(core_client, "UNRESPONSIVE_AFTER", 1.0)
    node, port, _ = start_core(secret_file)
    client = CoreClient("127.0.0.1", port, secret=open(secret_file).read().strip().encode(),
                        fingerprint=model_fingerprint(MODEL_DIR), codecs=["lossless"])
    router = CoreRouter([client], check_interval=0.3)
    try:
        await router.start()
        assert client.healthy and router.healthy() == [client]
        os.killpg(node.proc.pid, signal.SIGSTOP)
        for _ in range(50):
            await asyncio.sleep(0.1)
            if not client.healthy:
                break
        assert not client.healthy and client.connected and router.healthy() == []
        os.killpg(node.proc.pid, signal.SIGCONT)
        for _ in range(50):
            await asyncio.sleep(0.1)
            if client.healthy:
                break
        assert client.healthy and router.healthy() == [client] and client.peer.rtt is not None
    finally:
        os.killpg(node.proc.pid, signal.SIGCONT)
        await router.stop()
        node.stop()
