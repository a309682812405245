"""The KV of one remote prefill into the edge's paged cache: chunk payloads unpacked and written, with a barrier.

Life cycle: a `ChunkWriter` is made for one request. A KVChunk whose header the `KVReceiver` accepted comes to
`write`: a small payload is unpacked (`decode_chunk`: the codec's inverse; its frame MAC-verified on arrival)
on the spot, a larger one in a worker of the unpack pool, not awaited, so the events behind it (PrefillDone,
a Token) are handled meanwhile; each unpacked chunk is queued on the engine as a `KVSlice` (`write_kv`, run
between engine steps). When the edge computes layer 0's KV itself (`edge_layers`), `first_layer` queues that
too, right after the PrefillRequest leaves. `written()` is the barrier: it returns once every write in flight
is queued on the engine, so the command that comes next (activate, take_over, a prefix commit) reads the
whole KV; a failed unpack or layer-0 write is kept and raised there, never before.

    OPEN --write / first_layer--> OPEN (writes in flight) --written()--> OPEN (none in flight, or raises)
      |
      +-- drop() --> DROPPED   (the transfer was given up: unpacks still running are cancelled or write
                                nothing, since a retry may already hold the same request id)
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Executor

import numpy as np

from edgecore.protocol.kv_receiver import TransferFailed
from edgecore.protocol import messages as m
from edgecore.protocol.events import KVData
from edgecore.protocol.kv import SMALL_CHUNK_BYTES, decode_chunk as unpack
from edgecore.shared.engine.handle import EngineHandle
from edgecore.shared.kv.transfer import KVSlice
from edgecore.shared.kv.wire import from_bits


class ChunkWriter:
    def __init__(self, handle: EngineHandle, request_id: str, pool: Executor, rope: tuple[float, ...] | None):
        """`pool`: the edge's unpack workers; `rope`: the model's RoPE for the codecs (`codec_rope`)."""
        self.handle, self.request_id, self.pool, self.rope = handle, request_id, pool, rope
        self.in_flight: set[asyncio.Future] = set()     # unpacks in workers and layer 0's write (see `written`)
        self.error: BaseException | None = None         # the first failure in flight, raised by `written`
        self.dropped = False

    def first_layer(self) -> None:
        """Queue layer 0's KV computed at the edge (`edge_layers`); `written` waits for it: a failure fails the
        transfer, it never activates."""
        task = asyncio.ensure_future(self.handle.write_first_layer_kv(self.request_id))
        self.in_flight.add(task)
        task.add_done_callback(self._first_layer_done)

    def _first_layer_done(self, task: asyncio.Future) -> None:
        self.in_flight.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.error = self.error or TransferFailed(f"layer 0's KV at the edge: {task.exception()}")

    def write(self, data: KVData) -> None:
        """Unpack a chunk whose header was accepted and write it into the cache."""
        c = data.chunk
        if c.raw_len < SMALL_CHUNK_BYTES:    # costs less to unpack here than to hand to a thread and back
            self._write(c, unpack(data, self.rope))
            return
        # In a worker thread, not awaited here: the events behind it (PrefillDone, a Token) are handled
        # meanwhile; `written` waits for it before anything reads the KV.
        fut = asyncio.get_running_loop().run_in_executor(self.pool, unpack, data, self.rope)
        self.in_flight.add(fut)
        fut.add_done_callback(functools.partial(self._unpacked, c))

    def _unpacked(self, chunk: m.KVChunk, fut: asyncio.Future[tuple[np.ndarray, np.ndarray]]) -> None:
        """A worker's unpack of `chunk` ended: write it into the cache (nothing once the transfer was dropped:
        a retry may already hold the same request id); a failure waits for `written`."""
        self.in_flight.discard(fut)
        if fut.cancelled():
            return
        exc = fut.exception()
        if self.dropped:
            return
        if exc is not None:
            self.error = self.error or exc
            return
        self._write(chunk, fut.result())

    def _write(self, c: m.KVChunk, kv: tuple[np.ndarray, np.ndarray]) -> None:
        k, v = kv
        self.handle.write_kv(self.request_id, KVSlice(c.layer_start, c.token_start, c.token_end, c.head_start,
                                                      from_bits(k, c.dtype), from_bits(v, c.dtype)))

    async def written(self) -> None:
        """Every write in flight has ended and is queued on the engine (before the command that comes next:
        activate, take_over, a prefix commit); a failed unpack or layer-0 write is raised here."""
        while self.in_flight:
            await asyncio.wait(set(self.in_flight))
        if self.error is not None:
            raise self.error

    def drop(self) -> None:
        """The transfer is given up: unpacks still running write nothing."""
        self.dropped = True
        for fut in self.in_flight:
            fut.cancel()
        self.in_flight.clear()
