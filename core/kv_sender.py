"""Streams each remote request's K/V, layer by layer, as the engine computes it, within a bound.

Life cycle: the core registers a `Transfer` (core/transfer.py) before the
prefill starts. During every engine step, `LayerSender.on_layer(layer,
items)` runs on the engine thread right after a layer has written its K/V: for
each remote request in the step it copies that layer's new token range out of
the pool as a `KVSlice` and queues it (`KVSend`) in the connection's `Outbox`
(core/outbox.py); `send_queued` (one task per connection, event-loop side)
encodes it with the transfer's codec and sends a KVChunk while the engine
computes the next layer. Tokens the edge already holds (`skip_tokens`) and
tokens served from the core's own prefix cache are handled the same way:
everything in [skip_tokens, end of step) not yet queued is queued. A
sliding-window or chunked layer sends only from the first token the edge's
decode can still attend to (`needed_from`: the window or chunk of the prompt's
end); earlier tokens of that layer never leave the core. Layers the edge
computes itself (`edge_layers`: layer 0) send nothing.

Threads: the streamer's table of transfers (`remote`) belongs to the engine
thread. The event loop never touches it: `register(transfer)` and
`forget(internal_id)` queue the change (a deque; appends are atomic) and the
engine thread applies the queue at the start of every `on_layer` call (and in
`sync`, for a worker rank's engine thread). A request is registered before it
is added to the engine, whose commands run between steps, so its registration
is applied before the first layer that computes it.

Memory: the hook copies a layer only after the outbox `reserve`d its bytes.
An outbox over its bound (a connection whose edge reads slowly or not at all)
makes the hook stop copying for that transfer for good (`Transfer.paused`;
per-layer progress in `layer_until`); the KV stays in the pool, where it waits
for the edge's Ack anyway, and after the prefill `queue_rest` reads the rest
back in windows of half the bound, each once the sender has drained the outbox
to half its bound. So a connection holds at most about its bound in copies,
however many of its requests run. Gathered transfers (a parallel core without
direct streams; the "hold" baseline at a core) never stream: all their KV
takes the `queue_rest` path. A parallel core's direct streams
(`resumable=False`) and worker ranks' streams are copied without a bound.

A parallel core runs one streamer per rank that holds distinct KV: each
covers its own layers (`layer_offset`) and KV heads (`head_start`), so every
pipeline stage and tensor slice leaves from the process that computed it.
Requests whose edge is not attached to every rank (`gather`) are skipped here
and gathered at rank 0 after the prefill instead.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import Executor
from functools import partial
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from edgecore.core.outbox import Outbox, pieces
from edgecore.core.pacer import Pacer
from edgecore.core.transfer import KVSend, Outgoing, Transfer, TransferState
from edgecore.protocol.events import KVData
from edgecore.protocol.kv import SMALL_CHUNK_BYTES, encode_chunk
from edgecore.protocol.messages import COMPACT_KV_PARAMS
from edgecore.protocol.transport import Peer, PeerError
from edgecore.shared.kv.transfer import KVSlice, cut_slice, needed_from
from edgecore.shared.kv.wire import codec_rope, to_bits

if TYPE_CHECKING:
    from edgecore.shared.engine.handle import EngineHandle
    from edgecore.shared.engine.sequence import Sequence
    from edgecore.shared.kv.pool import KVPool


class LayerSender:
    def __init__(self, pool: KVPool, model: Any, loop: asyncio.AbstractEventLoop | None, mode: str = "stream",
                 head_start: int = 0, forget_when_sent: bool = False) -> None:
        """mode: "stream" (send each layer as computed) or "hold" (keep each layer's slice in `Transfer.held`,
        for in-process use; a core sends all after the prefill by gathering instead: the baseline).
        `forget_when_sent`: drop a request once its last tokens have left (worker ranks, which see no Ack).
        `model`: any architecture's model class (loaded by name, shared/models/registry.py); `loop`: None until
        the core starts (it sets it before the engine runs a step)."""
        self.pool = pool
        self.mode = mode
        self.loop = loop
        self.remote: dict[str, Transfer] = {}     # engine thread only (see the module's docstring)
        self._changes: deque[tuple[str, Transfer | None]] = deque()   # loop → engine thread
        self.last_layer = len(model.model.layers) - 1
        self.layer_offset = model.model.layer_ids[0]
        self.head_start = head_start
        self.forget_when_sent = forget_when_sent
        self.config = model.config
        self.rope = codec_rope(model.config)    # the model's RoPE for the codecs; the edge derives the same
        self.step_scales: dict = {}             # the model's bit allocation (codec_step_scales), encoder only
        self._token_bytes: dict[int, int] = {}  # per local layer: K+V bytes of one token here

    # ---- any thread (the event loop) ----------------------------------------------------------
    def register(self, transfer: Transfer) -> None:
        """Stream `transfer`'s KV from now on (call before the request enters the engine). Queued for the
        engine thread, which owns the table."""
        self._changes.append((transfer.internal_id, transfer))

    def forget(self, internal_id: str) -> None:
        """Stop streaming a request's KV (released or cancelled). Queued for the engine thread."""
        self._changes.append((internal_id, None))

    # ---- engine thread ------------------------------------------------------------------------
    def sync(self) -> None:
        """Apply the queued registrations, in order (engine thread)."""
        while self._changes:
            internal_id, transfer = self._changes.popleft()
            if transfer is None:
                self.remote.pop(internal_id, None)
            else:
                self.remote[internal_id] = transfer

    def on_layer(self, layer: int, items: list[tuple[Sequence, int]]) -> None:
        self.sync()
        if not self.remote:             # nothing to ship (e.g. only batch work running)
            return
        glayer = layer + self.layer_offset
        for seq, n in items:
            req = self.remote.get(seq.request_id)
            if req is None or req.cancelled or req.gather or req.paused:
                continue
            end = min(seq.num_computed_tokens + n, req.total_tokens)   # a decoding request's new tokens stay
            if req.needed is None or req.layer_until is None:
                req.needed = needed_from(self.config, req.total_tokens, req.edge_layers)
                req.layer_until = [req.skip_tokens] * len(req.needed)
            start = max(req.layer_until[glayer], req.needed[glayer])
            if end > start:
                if not self._copy(req, seq, layer, start, end):
                    req.paused = True           # the outbox is full: the rest leaves through `queue_rest`
                    continue
                req.layer_until[glayer] = end
            if layer == self.last_layer:
                req.sent_until = max(req.sent_until, end)
                if end >= req.total_tokens:
                    req.last_layer_at = time.perf_counter()
                    if self.forget_when_sent:
                        req.move(TransferState.SENT)
                        del self.remote[seq.request_id]

    def _copy(self, req: Transfer, seq: Sequence, layer: int, start: int, end: int) -> bool:
        """Copy tokens [start, end) of one layer out of the pool and queue them; False (nothing copied) when
        the transfer's outbox has no room for them."""
        per_token = self._token_bytes.get(layer)
        if per_token is None:
            per_token = self._token_bytes[layer] = self.pool.k[layer][0].nbytes + self.pool.v[layer][0].nbytes
        if self.mode == "stream" and not req.outbox.reserve((end - start) * per_token, force=not req.resumable):
            return False
        slots = self.pool.slots(seq.table.blocks, start, end)
        k, v = self.pool.read(layer, slots)
        item = KVSend(req, KVSlice(layer + self.layer_offset, start, end, self.head_start, k[None], v[None]))
        if self.mode == "stream":
            assert self.loop is not None      # set before the engine's first step
            self.loop.call_soon_threadsafe(partial(req.outbox.extend, pieces(item, req.piece_bytes),
                                                   reserved=True))
        else:
            req.held.append(item)
        return True


async def queue_rest(handle: EngineHandle, req: Transfer, wait: bool = True) -> None:
    """Queue what the layer hook did not queue of a finished prefill (`paused` or gathered): each layer's
    tokens from where it stopped, read back from the pool in windows of about half the outbox's bound, each
    once the outbox has drained to half its bound (event loop; a windowed layer from its window on).
    `wait=False` (a decoding request, whose KV the engine frees when it ends): all of it at once."""
    outbox = req.outbox
    needed = req.needed or needed_from(handle.config, req.total_tokens, req.edge_layers)
    until = req.layer_until or [req.skip_tokens] * len(needed)
    starts = [max(a, b) for a, b in zip(needed, until)]
    window = req.total_tokens
    if wait and outbox.bound is not None:
        window = max(1, outbox.low_water // max(1, handle.kv_bytes_per_token))
    for a in range(min(starts), req.total_tokens, window):
        if wait:
            await outbox.drained()
        if req.state in (TransferState.CANCELLED, TransferState.RELEASED) or outbox.closed:
            return
        b = min(a + window, req.total_tokens)
        claim = (b - a) * handle.kv_bytes_per_token      # at most what the read brings: others wait meanwhile
        outbox.reserve(claim, force=True)
        try:
            sends = [KVSend(req, piece) for whole in await handle.read_kv(req.internal_id, a, b)
                     for piece in cut_slice(whole, starts)]
        finally:
            outbox.unreserve(claim)
        for item in sends:
            outbox.extend(pieces(item, req.piece_bytes))
    req.layer_until = [max(s, req.total_tokens) for s in starts]
    req.sent_until = req.total_tokens


class Source(Protocol):
    """What a sender takes its items from: an `Outbox` (or any queue of `Outgoing`)."""

    async def get(self) -> Outgoing: ...


async def _send_piece(outbox: Source, peer: Peer, pacer: Pacer | None, data: KVData) -> None:
    """Write one encoded KV frame: with a pacer, once it allows, sending every urgent item queued first."""
    if pacer is not None and isinstance(outbox, Outbox):
        while not await pacer.wait(outbox):
            urgent = outbox.take_urgent()
            if urgent is not None and not isinstance(urgent, KVSend):     # (urgent items are messages)
                await peer.send(urgent)
    await peer.send(data)
    if pacer is not None:
        pacer.sent(len(data.payload))


async def send_queued(queue: Source, peer: Peer, encoder_pool: Executor, dtype_name: str,
                      on_chunk: Callable[[Transfer, KVData], None] | None = None,
                      rope: tuple[float, ...] | None = None, step_scales: dict | None = None,
                      pacer: Pacer | None = None) -> None:
    """One connection's sender: encodes and sends queued `KVSend`s (and queued protocol messages) in order,
    until the peer fails. `rope`, `step_scales`: the model's RoPE and bit allocation for the codecs (the
    `LayerSender`'s). `pacer`: KV is cut into frames of `pacer.piece_bytes` and paced (urgent items go
    between any two frames); without one, frames go as queued."""
    loop = asyncio.get_running_loop()
    compact = COMPACT_KV_PARAMS in peer.conn.peer_capabilities      # an older edge decodes float16 parameters
    try:
        while True:
            if pacer is not None and isinstance(queue, Outbox) and queue.empty():
                await pacer.idle(queue)
            item = await queue.get()
            if not isinstance(item, KVSend):
                await peer.send(item)
                continue
            for cut in (pieces(item, pacer.piece_bytes) if pacer is not None else [item]):
                req, piece = cut.transfer, cut.piece
                if req.cancelled:
                    break
                kb, vb = to_bits(piece.k), to_bits(piece.v)
                encode = partial(encode_chunk, req.request_id, kb, vb, layer_start=piece.layer,
                                 token_start=piece.token_start, head_start=piece.head_start, dtype=dtype_name,
                                 codec=req.codec, total_tokens=req.total_tokens, rope=rope,
                                 step_scales=step_scales, compact_params=compact)
                # A small chunk costs less to encode here than to hand to a thread and back.
                data = encode() if kb.nbytes + vb.nbytes < SMALL_CHUNK_BYTES else \
                    await loop.run_in_executor(encoder_pool, encode)
                await _send_piece(queue, peer, pacer, data)
                if req.first_chunk_sent_at is None:
                    req.first_chunk_sent_at = time.perf_counter()
                if on_chunk is not None:
                    on_chunk(req, data)
    except PeerError:
        pass
    finally:
        if isinstance(queue, Outbox):
            queue.close()
