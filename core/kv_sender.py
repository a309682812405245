"""Streams each remote request's K/V, layer by layer, as the engine computes it.

Life cycle: the core registers a `RemoteRequest` before the prefill starts.
During every engine step, `LayerStreamer.on_layer(layer, items)` runs on the
engine thread right after a layer has written its K/V: for each remote
request in the step it copies that layer's new token range out of the pool
and queues it for the request's connection; the session's sender task
(event-loop side) encodes it with the request's codec and sends a KVChunk
while the engine computes the next layer. Tokens the edge already holds
(`skip_tokens`) and tokens served from the core's own prefix cache are
handled the same way: everything in [skip_tokens, end of step) not yet sent
is sent.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from shared.engine.engine import LLMEngine


@dataclass
class RemoteRequest:
    internal_id: str
    request_id: str
    session: object                    # core.server.Session
    codec: str
    token_ids: list[int]
    skip_tokens: int = 0
    sent_until: int = 0                # tokens fully queued (all layers); engine thread only
    received_at: float = field(default_factory=time.perf_counter)
    first_chunk_sent_at: float | None = None
    last_layer_at: float | None = None
    done: bool = False
    cancelled: bool = False
    lease: asyncio.TimerHandle | None = None
    held: list = field(default_factory=list)   # chunks kept back when layer streaming is off

    def __post_init__(self):
        self.sent_until = self.skip_tokens


class LayerStreamer:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop, mode: str = "stream"):
        """mode: "stream" (send each layer as computed), "hold" (send all after the prefill: the baseline),
        or "off" (a parallel core gathers KV from its ranks instead)."""
        self.engine = engine
        self.mode = mode
        self.loop = loop
        self.remote: dict[str, RemoteRequest] = {}
        self.last_layer = len(engine.model.model.layers) - 1
        self.layer_offset = engine.model.model.layer_ids[0]

    def on_layer(self, layer: int, items) -> None:
        if self.mode == "off" or not self.remote:    # nothing to ship (e.g. only batch work running)
            return
        pool = self.engine.pool
        for seq, n in items:
            req = self.remote.get(seq.request_id)
            if req is None or req.cancelled:
                continue
            end = seq.num_computed_tokens + n
            if end > req.sent_until:
                slots = pool.slots(seq.table.blocks, req.sent_until, end)
                k, v = pool.read(layer, slots)
                item = ("kv", req, layer + self.layer_offset, req.sent_until, end, k[None], v[None], 0)
                if self.mode == "stream":
                    self.loop.call_soon_threadsafe(req.session.queue.put_nowait, item)
                else:
                    req.held.append(item)
            if layer == self.last_layer:
                req.sent_until = max(req.sent_until, end)
                if end >= len(req.token_ids):
                    req.last_layer_at = time.perf_counter()
