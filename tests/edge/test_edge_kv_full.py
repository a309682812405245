"""An edge whose KV pool has no room to receive a prompt's KV (every block reserved by transfers and decodes):
the request is not failed but waits in the edge's own queue, to be prefilled here once blocks free up; no core is
retried (nothing was sent) and the reason is counted. No sockets, no model."""

import time
from types import SimpleNamespace

import pytest

from edgecore.protocol import messages as m
from edgecore.shared.engine.handle import OutputSink
from edgecore.shared.kv.block_manager import NoFreeBlocks
from tests.edge.test_lora_placement import core, edge, request

pytestmark = pytest.mark.timeout(30)


async def test_no_room_for_the_kv_queues_the_request_here_instead_of_failing_it():
    engine, handle, _ = edge(core(1, list(m.CAPABILITIES)), core(2, list(m.CAPABILITIES)))
    tried = []

    async def full(client, request, sink, trace=None):
        tried.append(client.address)
        raise NoFreeBlocks        # as `handle.reserve` does with every block taken
    engine._remote = full
    progress = SimpleNamespace(arrived=time.perf_counter(), placed_at=None, trace=None)
    assert await engine._open(request("r1", None), OutputSink(lambda item: None), progress) is None
    assert len(tried) == 1 and "r1" in handle.requests          # one attempt, then admitted to the local queue
    assert engine.metrics.local_prefills.labels("kv_full")._value.get() == 1
    assert engine.metrics.failovers._value.get() == 0
    assert progress.measured is False                 # its wait for blocks will not be taken for a prefill rate
    assert all(c.cache.sent == 0 for c in engine.router.clients)   # nothing sent: the cores' queues as they were
