"""Streams each remote request's K/V, layer by layer, as the engine computes it.

Life cycle: the core registers a `Transfer` (core/transfer.py) before the
prefill starts. During every engine step, `LayerStreamer.on_layer(layer,
items)` runs on the engine thread right after a layer has written its K/V: for
each remote request in the step it copies that layer's new token range out of
the pool as a `KVSlice` and queues it (`KVSend`) for the request's connection;
`send_queued` (one task per connection, event-loop side) encodes it with the
transfer's codec and sends a KVChunk while the engine computes the next layer. Tokens the edge already
holds (`skip_tokens`) and tokens served from the core's own prefix cache are
handled the same way: everything in [skip_tokens, end of step) not yet sent
is sent. A sliding-window or chunked layer sends only from the first token
the edge's decode can still attend to (`needed_from`: the window or chunk of
the prompt's end); earlier tokens of that layer never leave the core. Layers
the edge computes itself (`edge_layers`: layer 0) send nothing.

A parallel core runs one streamer per rank that holds distinct KV: each
covers its own layers (`layer_offset`) and KV heads (`head_start`), so every
pipeline stage and tensor slice leaves from the process that computed it.
Requests whose edge is not attached to every rank (`gather`) are skipped here
and gathered at rank 0 after the prefill instead.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from functools import partial
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from edgecore.core.transfer import KVSend, Outgoing, Transfer, TransferState
from edgecore.protocol.events import KVData
from edgecore.protocol.kv import SMALL_CHUNK_BYTES, encode_chunk
from edgecore.protocol.messages import COMPACT_KV_PARAMS
from edgecore.protocol.transport import Peer, PeerError
from edgecore.shared.kv.transfer import KVSlice, needed_from
from edgecore.shared.kv.wire import codec_rope, to_bits

if TYPE_CHECKING:
    from edgecore.shared.engine.sequence import Sequence
    from edgecore.shared.kv.pool import KVPool


class LayerStreamer:
    def __init__(self, pool: KVPool, model: Any, loop: asyncio.AbstractEventLoop | None, mode: str = "stream",
                 head_start: int = 0, forget_when_sent: bool = False) -> None:
        """mode: "stream" (send each layer as computed) or "hold" (send all after the prefill: the baseline).
        `forget_when_sent`: drop a request once its last tokens have left (worker ranks, which see no Ack).
        `model`: any architecture's model class (loaded by name, shared/models/registry.py); `loop`: None until
        the core starts (it sets it before the engine runs a step)."""
        self.pool = pool
        self.mode = mode
        self.loop = loop
        self.remote: dict[str, Transfer] = {}
        self.last_layer = len(model.model.layers) - 1
        self.layer_offset = model.model.layer_ids[0]
        self.head_start = head_start
        self.forget_when_sent = forget_when_sent
        self.config = model.config
        self.rope = codec_rope(model.config)    # the model's RoPE for the codecs; the edge derives the same
        self.step_scales: dict = {}             # the model's bit allocation (codec_step_scales), encoder only

    def on_layer(self, layer: int, items: list[tuple[Sequence, int]]) -> None:
        if not self.remote:             # nothing to ship (e.g. only batch work running)
            return
        pool = self.pool
        for seq, n in items:
            req = self.remote.get(seq.request_id)
            if req is None or req.cancelled or req.gather:
                continue
            end = min(seq.num_computed_tokens + n, req.total_tokens)   # a decoding request's new tokens stay
            if req.needed is None:
                req.needed = needed_from(self.config, req.total_tokens, req.edge_layers)
            start = max(req.sent_until, req.needed[layer + self.layer_offset])
            if end > start:
                slots = pool.slots(seq.table.blocks, start, end)
                k, v = pool.read(layer, slots)
                item = KVSend(req, KVSlice(layer + self.layer_offset, start, end, self.head_start,
                                           k[None], v[None]))
                if self.mode == "stream":
                    assert self.loop is not None      # set before the engine's first step
                    self.loop.call_soon_threadsafe(req.queue.put_nowait, item)
                else:
                    req.held.append(item)
            if layer == self.last_layer:
                req.sent_until = max(req.sent_until, end)
                if end >= req.total_tokens:
                    req.last_layer_at = time.perf_counter()
                    if self.forget_when_sent:
                        req.move(TransferState.SENT)
                        del self.remote[seq.request_id]



async def send_queued(queue: asyncio.Queue[Outgoing], peer: Peer, encoder_pool: Executor, dtype_name: str,
                      on_chunk: Callable[[Transfer, KVData], None] | None = None,
                      rope: tuple[float, ...] | None = None, step_scales: dict | None = None) -> None:
    """One connection's sender: encodes and sends queued `KVSend`s (and queued protocol messages) in order,
    until the peer fails. `rope`, `step_scales`: the model's RoPE and bit allocation for the codecs (the
    `LayerStreamer`'s)."""
    loop = asyncio.get_running_loop()
    compact = COMPACT_KV_PARAMS in peer.conn.peer_capabilities      # an older edge decodes float16 parameters
    try:
        while True:
            item = await queue.get()
            if not isinstance(item, KVSend):
                await peer.send(item)
                continue
            req, piece = item.transfer, item.piece
            if req.cancelled:
                continue
            kb, vb = to_bits(piece.k), to_bits(piece.v)
            encode = partial(encode_chunk, req.request_id, kb, vb, layer_start=piece.layer,
                             token_start=piece.token_start, head_start=piece.head_start, dtype=dtype_name,
                             codec=req.codec, total_tokens=req.total_tokens, rope=rope,
                             step_scales=step_scales, compact_params=compact)
            # A small chunk costs less to encode here than to hand to a thread and back.
            data = encode() if kb.nbytes + vb.nbytes < SMALL_CHUNK_BYTES else \
                await loop.run_in_executor(encoder_pool, encode)
            await peer.send(data)
            if req.first_chunk_sent_at is None:
                req.first_chunk_sent_at = time.perf_counter()
            if on_chunk is not None:
                on_chunk(req, data)
    except PeerError:
        pass
