"""One prefill at a core, seen from the edge: the I/O around a sans-IO `KVReceiver`.

Life cycle: `run()` reserves blocks for the prompt through the engine handle
(the locally cached prefix becomes `skip_tokens`; the request's `OutputSink`,
chosen by the caller, is given with it), sends the PrefillRequest with the chosen codec, and then feeds every
event of the request to the receiver: a KVChunk's header is checked and
counted before its payload is decoded (its frame MAC-verified on arrival; in a worker thread
unless it is small, not awaited, so PrefillDone and Tokens behind it are handled meanwhile)
and written into the paged cache as a `KVSlice` between decode steps. For a lossy codec the edge may
compute layer 0's KV itself (`edge_layers`, shared/kv/transfer.py: it depends on the tokens alone),
queued on the engine right after the PrefillRequest leaves; the core then sends none of that layer.
Every write is queued before the activation or takeover that reads the KV (`_written`). PrefillDone, a
core Error, a broken connection or the transfer timeout go to the receiver too. Once the receiver is
COMPLETE the request is activated with the core's first token (it joins the decode batch) and the core
hears Ack; on any failure the reservation is released, the core hears Cancel,
and `RemotePrefillFailed` tells the caller to try elsewhere. The link estimate
and the transfer metrics are recorded either way.

Decode handover (a version-3 core, `core_decode` > 0; the per-request rules in
the sans-IO `CoreDecode`, protocol/handover.py): the PrefillRequest lets the core
decode up to `core_decode` tokens after the first. `run()` returns as soon as the first token is pushed into the reserved request
(`push_token`: its output rules run here, the client sees it at once), and a
task (`follow`) goes on: each Token is pushed in position order, KV chunks are
written as before; once the KV is complete the edge sends Handover(position)
and `take_over` joins the request to the batch (the tokens the core decoded are
recomputed here as one short chunk); the core's DecodeStop (its answer, or an
earlier refusal) is awaited for the metrics, then Ack. A request that finishes before
that never moves (Cancel). If the transfer fails after the first token (core
died, Error, timeout) the edge keeps the tokens it has and computes the rest
itself from its own cached prefix (`take_over(cached)`), Cancel at the core; a
cancelled `follow` (client gone) sends Cancel at once. Each handover ends with
one outcome counted (edge/metrics.py `HANDOVER_OUTCOMES`, and /stats).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from concurrent.futures import Executor

import numpy as np

from edgecore.edge.core_client import CoreClient
from edgecore.edge.kv_receiver import KVReceiver, TransferFailed
from edgecore.edge.metrics import EdgeMetrics
from edgecore.protocol import messages as m
from edgecore.protocol.errors import ProtocolError
from edgecore.protocol.handover import CoreDecode, Phase
from edgecore.protocol.codecs import get_codec
from edgecore.protocol.kv import SMALL_CHUNK_BYTES, decode_chunk
from edgecore.protocol.state import KVData
from edgecore.protocol.transport import PeerError
from edgecore.shared.engine.handle import EngineHandle, EngineRequest, FirstToken, OutputSink
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.errors import RequestError
from edgecore.shared.kv.transfer import KVSlice, layers_at_edge, needed_from
from edgecore.shared.kv.wire import from_bits


STOP_WAIT_SECONDS = 2.0     # how long a takeover waits for the core's DecodeStop (its reason is counted)


class RemotePrefillFailed(Exception):
    pass


class RemotePrefill:
    def __init__(self, handle: EngineHandle, client: CoreClient, request_id: str, prompt_ids: list[int],
                 params: SamplingParams, timeout: float, decoder_pool: Executor, metrics: EdgeMetrics,
                 core_decode: int = 0, counts: dict | None = None, rope: tuple[float, ...] | None = None,
                 first_layer_budget: float = 0.0, group: str | None = None):
        """`core_decode`: tokens after the first the core may decode before the edge takes over (0: the old
        mode); `counts`: the edge's handover counters (stats); `rope`: the model's RoPE for the codecs, what
        the core's encoder took (`codec_rope`, derived once per edge); `first_layer_budget`: the most
        multiply-adds this edge spends computing layer 0's KV of a lossy transfer itself (`edge_layers`);
        `group`: the request's fairness group, here and at the core."""
        self.handle, self.client = handle, client
        self.request_id, self.prompt_ids, self.params = request_id, prompt_ids, params
        self.timeout, self.decoder_pool, self.metrics = timeout, decoder_pool, metrics
        self.core_decode, self.counts = core_decode, counts if counts is not None else {}
        self.rope, self.first_layer_budget, self.group = rope, first_layer_budget, group
        self.edge_layers = 0
        self.receiver: KVReceiver | None = None
        self.decode: CoreDecode | None = None
        self.follow: asyncio.Task | None = None   # decode handover: the rest of the transfer, after run()
        self.decoding: set[asyncio.Future] = set()   # chunk decodes in worker threads (see `_written`)
        self.decode_error: BaseException | None = None
        self.dropped = False

    async def run(self, choose_codec: Callable[[CoreClient, int], str], sink: OutputSink | None) -> None:
        """Prefill at the core and receive the KV; with a `sink`, the request then decodes here, its outputs going
        to `sink` (None: it is never activated, a prefetch). `choose_codec(client, tokens)` picks the codec."""
        rid, handle, client = self.request_id, self.handle, self.client
        activate = sink is not None
        cached = await handle.reserve(EngineRequest(rid, self.prompt_ids, self.params, group=self.group), sink)
        codec = choose_codec(client, len(self.prompt_ids) - cached)
        cfg = handle.config
        assert client.peer is not None          # a picked core is connected
        limit = min(self.core_decode, self.params.max_tokens - 1) if activate and client.peer.conn.handover else 0
        self.edge_layers = layers_at_edge(handle.first_layer_macs, len(self.prompt_ids) - cached,
                                          self.first_layer_budget, get_codec(codec).lossless)
        receiver = self.receiver = KVReceiver(rid, cfg.num_hidden_layers, cfg.num_key_value_heads,
                                              len(self.prompt_ids), cached, direct=client.direct or limit > 0,
                                              needed_from=needed_from(cfg, len(self.prompt_ids), self.edge_layers),
                                              values_per_head=cfg.kv_bytes_per_token(1) // (
                                                  cfg.num_hidden_layers * cfg.num_key_value_heads))
        started = time.perf_counter()
        try:
            if limit > 0:
                await self._first_token(receiver, codec, cached, limit)
                self.follow = asyncio.create_task(self._follow(receiver, codec, cached, started))
                return
            await self._receive(receiver, codec, cached)
            await self._written()
            done = receiver.done
            if activate and done is not None:          # COMPLETE: PrefillDone is in
                try:
                    await handle.activate(rid, FirstToken(
                        done.first_token, done.logprob if self.params.logprobs is not None else None,
                        [(int(t), float(p)) for t, p in done.top_logprobs]))
                except RequestError as exc:      # the core's token is not one of ours: fail over
                    receiver.fail(str(exc))
        except BaseException as exc:
            self._drop()
            receiver.abandon(str(exc) or type(exc).__name__)
            handle.release(rid)
            await self._close(receiver)
            if isinstance(exc, (TransferFailed, asyncio.TimeoutError, PeerError, ProtocolError)):
                raise RemotePrefillFailed(str(exc) or type(exc).__name__) from None
            raise
        await self._close(receiver)
        self._count(codec, receiver, time.perf_counter() - started)

    async def _request(self, codec: str, cached: int, limit: int = 0) -> asyncio.Queue:
        spec = m.SamplingSpec(**self.params.spec_fields())
        events = await self.client.prefill(m.PrefillRequest(
            self.request_id, self.prompt_ids, spec, [codec], int(self.timeout * 1000), cached,
            direct=self.client.direct, core_decode=limit, edge_layers=self.edge_layers, group=self.group or ""))
        if self.edge_layers:        # while the core computes: queued before every write, activate or take-over
            task = asyncio.ensure_future(self.handle.write_first_layer_kv(self.request_id))
            self.decoding.add(task)     # `_written` waits for it: a failure fails the transfer, never activates
            task.add_done_callback(self._first_layer_done)
        return events

    def _first_layer_done(self, task: asyncio.Future) -> None:
        self.decoding.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.decode_error = self.decode_error or TransferFailed(f"layer 0's KV at the edge: {task.exception()}")

    async def _receive(self, receiver: KVReceiver, codec: str, cached: int) -> None:
        events = await self._request(codec, cached)
        while not receiver.complete:
            await self._on_event(receiver, await asyncio.wait_for(events.get(), self.timeout))

    # ---- decode handover ----------------------------------------------------------------------
    async def _first_token(self, receiver: KVReceiver, codec: str, cached: int, limit: int) -> None:
        self.decode = CoreDecode(self.request_id, limit)
        self.events = await self._request(codec, cached, limit)
        while self.decode.phase is Phase.FIRST:
            await self._on_event(receiver, await asyncio.wait_for(self.events.get(), self.timeout))

    async def _follow(self, receiver: KVReceiver, codec: str, cached: int, started: float) -> None:
        """After the first token: the core's tokens and the KV until the KV is complete, then Handover and
        take over; on a failure, compute the rest here (see the module's docstring)."""
        decode, rid = self.decode, self.request_id
        assert decode is not None               # `_first_token` began it
        try:
            while not receiver.complete and decode.phase is not Phase.FINISHED:
                await self._on_event(receiver, await asyncio.wait_for(self.events.get(), self.timeout))
            if decode.phase is Phase.FINISHED:
                self._drop()
                receiver.abandon("the request finished before the handover")
                self._tally(decode.core_tokens, "finished_before", "finished_on_core")
                self._count(codec, receiver, time.perf_counter() - started)
            else:
                await self._written()
                await self.client.send(decode.handover())
                await self.handle.take_over(rid, len(self.prompt_ids))
                # Counted before the wait for the core's stop below, which the client's reply may outlast.
                self._count(codec, receiver, time.perf_counter() - started)
                await self._stop_reason(decode)
                self._tally(decode.core_tokens, "handovers",
                            "refused" if decode.stop_reason == "refused" else "taken_over")
        except asyncio.CancelledError:
            self._drop()
            receiver.abandon("the request was cancelled")
            await self._close(receiver)
            raise
        except (TimeoutError, TransferFailed, PeerError, ProtocolError) as exc:
            self._drop()
            receiver.abandon(str(exc) or type(exc).__name__)
            await self._close(receiver)
            self.metrics.failovers.inc()
            if decode.phase is not Phase.FINISHED:
                self.metrics.local_prefills.labels("core_failed").inc()
                decode.finish()
                try:                    # the tokens the client has are kept; the rest is computed here
                    await self.handle.take_over(rid, cached)
                    self._tally(decode.core_tokens, "recovered", "core_failed")
                except RequestError:    # the request ended (aborted) meanwhile
                    pass
            return
        await self._close(receiver)

    async def _stop_reason(self, decode: CoreDecode) -> None:
        """After the takeover, for the metrics only: the core's DecodeStop says whether it had refused to decode
        (sent right after PrefillDone, it may come after a small prompt's KV) or answers the Handover."""
        with contextlib.suppress(asyncio.TimeoutError, ProtocolError):
            async with asyncio.timeout(STOP_WAIT_SECONDS):
                while decode.stop_reason is None:
                    ev = await self.events.get()
                    if isinstance(ev, m.DecodeStop):
                        decode.on_stop(ev)
                    elif not isinstance(ev, m.Token):     # an error or a lost link: no answer is coming
                        return

    def _tally(self, core_tokens: int, key: str, outcome: str) -> None:
        """Count a handover's end: `key` in the /stats tallies ("handovers" counts every Handover sent, a
        refused one too, which also counts as "refused"), `outcome` in the metrics (HANDOVER_OUTCOMES)."""
        c = self.counts
        for k in (key, "refused") if outcome == "refused" else (key,):
            c[k] = c.get(k, 0) + 1
        c["core_tokens"] = c.get("core_tokens", 0) + core_tokens
        c["last_core_tokens"] = core_tokens
        self.metrics.handover_requests.labels(outcome).inc()
        if outcome == "taken_over":
            self.metrics.handover_core_tokens.observe(core_tokens)

    async def _push(self, receiver: KVReceiver, token: int, logprob: float, top: list[tuple[int, float]]) -> None:
        first = FirstToken(token, logprob if self.params.logprobs is not None else None,
                           [(int(t), float(p)) for t, p in top])
        try:
            finished = await self.handle.push_token(self.request_id, first)
        except RequestError as exc:      # the core's token is not one of ours: the transfer failed
            receiver.fail(str(exc))
        if finished:
            assert self.decode is not None      # pushed tokens come from the core's decode
            self.decode.finish()         # it ended before the handover: it never moves

    async def _on_event(self, receiver: KVReceiver, ev: m.Message | KVData | BaseException) -> None:
        decode = self.decode
        if isinstance(ev, m.Token):
            if decode is None:
                receiver.fail("a Token for a request that did not ask the core to decode")
            if decode.on_token(ev):
                await self._push(receiver, ev.token_id, ev.logprob, ev.top_logprobs)
                self.metrics.handover_tokens.inc()
        elif isinstance(ev, m.DecodeStop):
            if decode is None:
                receiver.fail("a DecodeStop for a request that did not ask the core to decode")
            decode.on_stop(ev)
        elif isinstance(ev, m.PrefillDone) and decode is not None:
            receiver.on_done(ev)
            decode.on_first(ev)
            await self._push(receiver, ev.first_token, ev.logprob, ev.top_logprobs)
        else:
            await self._on_kv_event(receiver, ev)

    async def _on_kv_event(self, receiver: KVReceiver, ev: m.Message | KVData | BaseException) -> None:
        if isinstance(ev, KVData):
            c = ev.chunk
            receiver.on_chunk(c, len(ev.payload), time.perf_counter())
            if c.raw_len < SMALL_CHUNK_BYTES:    # costs less to decode here than to hand to a thread and back
                self._write(c, decode_chunk(ev, self.rope))
                return
            # In a worker thread, not awaited here: the events behind it (PrefillDone, a Token) are handled
            # meanwhile; `_written` waits for it before anything reads the KV.
            fut = asyncio.get_running_loop().run_in_executor(self.decoder_pool, decode_chunk, ev, self.rope)
            self.decoding.add(fut)
            fut.add_done_callback(functools.partial(self._decoded, c))
        elif isinstance(ev, m.PrefillDone):
            receiver.on_done(ev)
        elif isinstance(ev, m.Error):
            receiver.fail(f"core error {ev.code}: {ev.message}")
        elif isinstance(ev, BaseException):
            receiver.fail(str(ev))

    def _decoded(self, chunk: m.KVChunk, fut: asyncio.Future[tuple[np.ndarray, np.ndarray]]) -> None:
        """A worker's decode of `chunk` ended: write it into the cache (nothing once the transfer was dropped:
        a retry may already hold the same request id); a failure waits for `_written`."""
        self.decoding.discard(fut)
        if fut.cancelled():
            return
        exc = fut.exception()
        if self.dropped:
            return
        if exc is not None:
            self.decode_error = self.decode_error or exc
            return
        self._write(chunk, fut.result())

    def _write(self, c: m.KVChunk, kv: tuple[np.ndarray, np.ndarray]) -> None:
        k, v = kv
        self.handle.write_kv(self.request_id, KVSlice(c.layer_start, c.token_start, c.token_end, c.head_start,
                                                      from_bits(k, c.dtype), from_bits(v, c.dtype)))

    async def _written(self) -> None:
        """Every chunk decode in flight has ended and its write is queued on the engine (before the command
        that comes next: activate, take_over, a prefix commit); a failed decode is raised here."""
        while self.decoding:
            await asyncio.wait(set(self.decoding))
        if self.decode_error is not None:
            raise self.decode_error

    def _drop(self) -> None:
        """The transfer is given up: chunk decodes still running write nothing."""
        self.dropped = True
        for fut in self.decoding:
            fut.cancel()
        self.decoding.clear()

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
