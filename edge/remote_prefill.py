"""One prefill at a core, seen from the edge: the I/O around a sans-IO `KVReceiver`.

Life cycle: `run()` reserves blocks for the prompt through the engine handle
(the locally cached prefix becomes `skip_tokens`), opens the request's output
stream, sends the PrefillRequest with the chosen codec, and then feeds every
event of the request to the receiver: a KVChunk's header is checked and
counted before its payload is decoded (its frame MAC-verified on arrival; in a worker thread
unless it is small) and written into the paged cache as a `KVSlice` between
decode steps; PrefillDone, a core Error, a broken connection or the transfer
timeout go to the receiver too. Once the receiver is COMPLETE the request is
activated with the core's first token (it joins the decode batch) and the core
hears Ack; on any failure the reservation is released, the core hears Cancel,
and `RemotePrefillFailed` tells the caller to try elsewhere. The link estimate
and the transfer metrics are recorded either way.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor

from edgecore.edge.core_client import CoreClient
from edgecore.edge.kv_receiver import KVReceiver, TransferFailed
from edgecore.edge.metrics import EdgeMetrics
from edgecore.protocol import messages as m
from edgecore.protocol.errors import ProtocolError
from edgecore.protocol.kv import SMALL_CHUNK_BYTES, decode_chunk
from edgecore.protocol.state import KVData
from edgecore.protocol.transport import PeerError
from edgecore.shared.engine.handle import EngineHandle, FirstToken
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.kv.transfer import KVSlice, needed_from
from edgecore.shared.kv.wire import codec_rope, from_bits


class RemotePrefillFailed(Exception):
    pass


class RemotePrefill:
    def __init__(self, handle: EngineHandle, client: CoreClient, request_id: str, prompt_ids: list[int],
                 params: SamplingParams, timeout: float, decoder_pool: Executor, metrics: EdgeMetrics):
        self.handle, self.client = handle, client
        self.request_id, self.prompt_ids, self.params = request_id, prompt_ids, params
        self.timeout, self.decoder_pool, self.metrics = timeout, decoder_pool, metrics
        self.receiver: KVReceiver | None = None

    async def run(self, choose_codec, activate: bool = True) -> asyncio.Queue | None:
        """Prefill at the core and receive the KV; with `activate`, the request then decodes here and this
        returns the queue its outputs arrive in. `choose_codec(client, tokens)` picks the codec."""
        rid, handle, client = self.request_id, self.handle, self.client
        cached = await handle.reserve(rid, self.prompt_ids, self.params)
        queue = handle.open_stream(rid)
        codec = choose_codec(client, len(self.prompt_ids) - cached)
        cfg = handle.config
        receiver = self.receiver = KVReceiver(rid, cfg.num_hidden_layers, cfg.num_key_value_heads,
                                              len(self.prompt_ids), cached, direct=client.direct,
                                              needed_from=needed_from(cfg, len(self.prompt_ids)))
        started = time.perf_counter()
        try:
            await self._receive(receiver, codec, cached)
            done = receiver.done
            if activate and done is not None:          # COMPLETE: PrefillDone is in
                await handle.activate(rid, FirstToken(
                    done.first_token, done.logprob if self.params.logprobs is not None else None,
                    [(int(t), float(p)) for t, p in done.top_logprobs]))
        except BaseException as exc:
            receiver.abandon(str(exc) or type(exc).__name__)
            handle.close_stream(rid)
            handle.release(rid)
            await self._close(receiver)
            if isinstance(exc, (TransferFailed, asyncio.TimeoutError, PeerError, ProtocolError)):
                raise RemotePrefillFailed(str(exc) or type(exc).__name__) from None
            raise
        await self._close(receiver)
        self._count(codec, receiver, time.perf_counter() - started)
        if not activate:
            handle.close_stream(rid)
            return None
        return queue

    async def _receive(self, receiver: KVReceiver, codec: str, cached: int) -> None:
        spec = m.SamplingSpec(**self.params.spec_fields())
        events = await self.client.prefill(m.PrefillRequest(
            self.request_id, self.prompt_ids, spec, [codec], int(self.timeout * 1000), cached,
            direct=self.client.direct))
        loop = asyncio.get_running_loop()
        rope = codec_rope(self.handle.config)    # what the core's encoder took (core/kv_sender.py)
        while not receiver.complete:
            ev = await asyncio.wait_for(events.get(), self.timeout)
            if isinstance(ev, KVData):
                c = ev.chunk
                receiver.on_chunk(c, len(ev.payload), time.perf_counter())
                # A small chunk costs less to decode here than to hand to a thread and back.
                k, v = decode_chunk(ev, rope) if c.raw_len < SMALL_CHUNK_BYTES else \
                    await loop.run_in_executor(self.decoder_pool, decode_chunk, ev, rope)
                self.handle.write_kv(self.request_id, KVSlice(c.layer_start, c.token_start, c.token_end,
                                                              c.head_start, from_bits(k, c.dtype),
                                                              from_bits(v, c.dtype)))
            elif isinstance(ev, m.PrefillDone):
                receiver.on_done(ev)
            elif isinstance(ev, m.Error):
                receiver.fail(f"core error {ev.code}: {ev.message}")
            elif isinstance(ev, BaseException):
                receiver.fail(str(ev))

    async def _close(self, receiver: KVReceiver) -> None:
        """Ack or Cancel at the core (the receiver decides), and the link estimate from this transfer."""
        sample_bytes, span = receiver.bandwidth_sample()
        self.client.finish(self.request_id, sample_bytes, span)
        await self.client.send(receiver.closing_message())   # a lost connection frees the core's copy too

    def _count(self, codec: str, receiver: KVReceiver, seconds: float) -> None:
        metrics, encoded, raw = self.metrics, receiver.encoded_bytes, receiver.raw_bytes
        metrics.remote_prefills.labels(codec).inc()
        metrics.kv_bytes.labels(codec).inc(encoded)
        metrics.kv_raw_bytes.labels(codec).inc(raw)
        if encoded:
            metrics.compression.labels(codec).set(raw / encoded)
        metrics.transfer.labels(codec).observe(seconds)
