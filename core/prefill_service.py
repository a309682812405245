"""The core's prefill service: edges' protocol sessions in, prefill-only requests on the engine handle.

Life cycle of one edge connection (a `Session`): handshake (transport) →
loop over incoming messages: PrefillRequest starts `_prefill` (a task),
Cancel cancels its transfer, Ack releases its KV → on disconnect every
transfer of the session is cancelled and its KV freed.

Life cycle of one remote request (its `Transfer`, core/transfer.py, holds the
state): validated → registered with the `LayerSender` (and, for a parallel
core whose edge holds stream connections to every rank, its `DirectRoute` is
queued on the handle) → added to the engine as prefill-only (batched with other
prefills under the step token budget, chunked if long, reusing the core's
prefix cache) → PREFILLING: each layer's K/V leaves as soon as it is computed →
LEASED: PrefillDone with the first token queued behind the last chunk; the KV
is held until the edge's Ack (RELEASED), or Cancel / the lease running out /
a disconnect frees it.

Decode handover (version-3 edges that ask with `core_decode`; on a parallel core
too: rank 0 samples and sends the tokens, the other ranks' direct streams stop
at the prompt's last token as for any request): the request runs as an ordinary
one; PrefillDone and then each decoded
token (a Token frame) go ahead of queued KV (`Outbox.put(urgent=True)`), until
the edge's Handover, Cancel, the `HandoverLimits` bound (tokens, seconds) or the
request's end, each answered with DecodeStop. A core with `refuse_waiting` or more
requests waiting refuses (DecodeStop "refused" right after PrefillDone: the edge
waits for the KV as in the old mode).

Bounds per connection (a peer that sends and stops reading must not grow the
core): at most `max_inflight` requests in flight (from the PrefillRequest to
the Ack, the lease's end or a failure); one beyond is answered at once with an
Error OVERLOADED and never reaches the engine. At most `max_admitted` of them in
the engine at once (prefilling, or decoding for a handover): the rest wait here,
so one connection cannot take every running slot. At most about
`outbox_bytes` of KV copied and queued for the connection's sender
(core/outbox.py): beyond it the engine's layer hook stops copying and the rest
is read back from the pool once the sender drains (core/kv_sender.py). A sender
that cannot write for the idle timeout drops the connection (protocol/transport.py),
which frees everything.

Drain (`start_drain`, the core's SIGTERM): every version-4 edge is sent Draining once (one that connects later
too), every new PrefillRequest is refused with Error SHUTTING_DOWN (an older edge fails over on it), and
`drained()` returns once no connection has a request in flight (prefilling, leased, decoding for a handover).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import sys
import time
from concurrent.futures import Executor

from edgecore.core.kv_sender import LayerSender, queue_rest, send_queued
from edgecore.core.pacer import Pacer
from edgecore.core.metrics import CoreMetrics
from edgecore.core.outbox import Outbox
from edgecore.core.transfer import HandoverLimits, Transfer, TransferState
from edgecore.core.transfer_trace import TransferTrace
from edgecore.protocol import messages as m
from edgecore.protocol.errors import ErrorCode
from edgecore.protocol.events import KVData
from edgecore.protocol.transport import Peer, PeerError
from edgecore.shared.engine.handle import EngineHandle, EngineRequest
from edgecore.shared.engine.output import RequestOutput
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.node.env import kv_pacing_mode
from edgecore.shared.errors import RequestError
from edgecore.shared.kv.transfer import EDGE_LAYERS, DirectRoute

log = logging.getLogger("edgecore.core")


UNSENT_LOWAT = 32 * 1024      # kernel backlog of a version-3 connection
WRITE_BUFFER = 32 * 1024      # asyncio's write buffer of a version-3 connection (its default high mark: 64 KiB)
MAX_INFLIGHT = 64             # requests in flight per connection (default)
OUTBOX_BYTES = 64 * 1024 * 1024   # raw KV bytes copied and queued per connection (default)
PIECE_BYTES = 128 * 1024      # KV frame size of a request whose tokens go ahead of its KV (5 ms at 200 Mbit/s)


def bound_write_path(peer: Peer) -> Pacer | None:
    """A version-3 connection's write path, below its outbox: asyncio's buffer and the kernel's unsent bytes
    kept small, KV cut into frames at send time and paced at the rate the edge reports receiving it (core/pacer.py),
    so urgent frames pass between any two and find no queue on the path (docs/wire-format.md §5a, "Latency-critical
    frames"). Its sender passes the pacer to `send_queued`. `EDGECORE_KV_PACING` (for the measurements that chose
    this): "paced" (the default), "bounded" (frames cut and the unsent bytes bounded, never paced: it fills the
    path's queue) or "off" (the kernel's backlog bounded only, as before)."""
    _limit_unsent(peer.transport)
    mode = kv_pacing_mode()
    if mode == "off":
        return None
    peer.limit_write_buffer(WRITE_BUFFER)
    pacer = Pacer(peer)
    pacer.enabled = mode == "paced"
    return pacer


def _limit_unsent(transport: asyncio.BaseTransport) -> None:
    """Keep the kernel's not-yet-sent backlog small (TCP_NOTSENT_LOWAT), so that a handover's tokens, which
    jump the session queue, do not wait behind megabytes of KV already handed to the socket. Bytes in flight
    (the congestion window) are not limited, so throughput is kept."""
    sock = transport.get_extra_info("socket")
    option = getattr(socket, "TCP_NOTSENT_LOWAT", 25 if sys.platform.startswith("linux") else None)
    if sock is not None and option is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, option, UNSENT_LOWAT)


class Session:
    _ids = itertools.count(1)

    def __init__(self, peer: Peer, outbox_bytes: int | None = OUTBOX_BYTES, admitted: int = MAX_INFLIGHT) -> None:
        self.id = next(self._ids)
        self.peer = peer
        self.outbox = Outbox(outbox_bytes)             # KVSend and protocol messages, sent in order
        self.transfers: dict[str, Transfer] = {}       # by the edge's request id: its requests in flight
        self.engine_slots = asyncio.Semaphore(admitted)   # its requests in the engine at once
        self.pacer: Pacer | None = None                # version 3: KV paced, tokens between any two frames


class PrefillService:
    def __init__(self, handle: EngineHandle, streamer: LayerSender, metrics: CoreMetrics, encoder_pool: Executor,
                 dtype_name: str, lease_seconds: float, parallel: bool = False, direct_streams: bool = False,
                 handover: HandoverLimits | None = None, max_inflight: int = MAX_INFLIGHT,
                 max_admitted: int | None = None, outbox_bytes: int | None = OUTBOX_BYTES) -> None:
        """`parallel`: the engine spans ranks; `direct_streams`: its other ranks serve stream ports;
        `handover`: how much this core decodes for edges before they take over. Per connection:
        `max_inflight` requests in flight, `max_admitted` of them in the engine at once (default: half the
        in-flight cap), `outbox_bytes` of KV queued for its sender (None: no bound)."""
        self.handle, self.streamer, self.metrics = handle, streamer, metrics
        self.encoder_pool, self.dtype_name, self.lease_seconds = encoder_pool, dtype_name, lease_seconds
        self.parallel, self.direct_streams = parallel, direct_streams
        self.limits = handover or HandoverLimits()
        self.max_inflight, self.outbox_bytes = max(1, max_inflight), outbox_bytes
        self.max_admitted = max(1, max_admitted if max_admitted is not None else max_inflight // 2)
        self.adapters: dict[str, str] = {}     # LoRA adapters this core serves (`--lora`): name → fingerprint
        self.sessions: set[Session] = set()
        self.counts = {"decode_requests": 0, "decoded_tokens": 0, "handovers": 0, "refused": 0, "overloaded": 0}
        self.draining: float | None = None      # the drain's timeout (seconds) once `start_drain` ran
        self._idle = asyncio.Event()            # set whenever no connection has a request in flight

    # ---- one edge connection ---------------------------------------------
    async def serve(self, peer: Peer) -> None:
        session = Session(peer, self.outbox_bytes, self.max_admitted)
        if peer.conn.handover:
            session.pacer = bound_write_path(peer)
        self.sessions.add(session)
        self.metrics.connections.inc()
        if self.draining is not None:
            self._announce(session, self.draining)
        sender = asyncio.create_task(self._sender(session))
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                msg = await peer.recv()
                if isinstance(msg, m.PrefillRequest):
                    req = self._accept(session, msg)
                    if req is None:       # refused: while the sender is stuck, stop reading (the peer waits too)
                        await session.outbox.drained(items=self.max_inflight)
                        continue
                    task = asyncio.create_task(self._start(session, req, msg))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                elif isinstance(msg, m.Ack):
                    self._release(session, msg.request_id)
                elif isinstance(msg, m.Cancel):
                    self._release(session, msg.request_id, cancelled=True)
                elif isinstance(msg, m.Handover):
                    self._handover(session, msg)
        except PeerError as exc:
            log.info("edge %s left: %s", peer.peername, exc)
        finally:
            for rid in list(session.transfers):
                self._release(session, rid, True, "disconnected")
            for task in tasks:
                task.cancel()
            sender.cancel()
            self.sessions.discard(session)
            self.metrics.connections.dec()

    async def _sender(self, session: Session) -> None:
        """Encodes and sends queued KV slices and PrefillDone messages, in order."""
        def counted(req: Transfer, data: KVData) -> None:
            self.metrics.kv_chunks.inc()
            self.metrics.kv_bytes_sent.labels(req.codec).inc(len(data.payload))
            self.metrics.kv_raw_bytes.labels(req.codec).inc(data.chunk.raw_len)
            if req.trace is not None:
                req.trace.sent(len(data.payload), data.chunk.raw_len)
        await send_queued(session.outbox, session.peer, self.encoder_pool, self.dtype_name, counted,
                          rope=self.streamer.rope, step_scales=self.streamer.step_scales, pacer=session.pacer)

    # ---- one remote request ------------------------------------------------
    def _refusal(self, session: Session, msg: m.PrefillRequest, codec: str | None) -> m.Error | None:
        rid, error = msg.request_id, None
        if self.draining is not None:
            return m.Error(ErrorCode.SHUTTING_DOWN, "this core is draining (shutting down): it takes no new "
                           "requests; retry elsewhere", rid)
        if rid in session.transfers:
            error = f"request id {rid} is already in flight on this connection"
        elif len(session.transfers) >= self.max_inflight:
            return m.Error(ErrorCode.OVERLOADED, f"busy: this connection has {self.max_inflight} requests in "
                           "flight, the most a core takes from one connection; retry elsewhere or later", rid)
        elif codec is None:
            error = (f"none of the codecs {msg.codecs} is available (negotiated: "
                     f"{session.peer.conn.peer_codecs})")
        elif not 0 <= msg.skip_tokens < len(msg.token_ids):
            error = f"skip_tokens {msg.skip_tokens} must be below the prompt length {len(msg.token_ids)}"
        elif not 0 <= msg.edge_layers <= EDGE_LAYERS:
            error = f"edge_layers {msg.edge_layers} must be between 0 and {EDGE_LAYERS} (layer 0 only)"
        elif msg.adapter and self.adapters.get(msg.adapter) != msg.adapter_fingerprint:
            error = (f"LoRA adapter '{msg.adapter}' is not loaded here" if msg.adapter not in self.adapters else
                     f"LoRA adapter '{msg.adapter}' differs here (fingerprint {self.adapters[msg.adapter]}, the "
                     f"edge's {msg.adapter_fingerprint or 'none'})")
        else:
            try:
                SamplingParams.from_spec(msg.sampling, max_tokens=1)
            except RequestError as exc:
                error = str(exc)
        if error is None:
            return None
        return m.Error(ErrorCode.BAD_REQUEST if codec else ErrorCode.CODEC, error, rid)

    def _accept(self, session: Session, msg: m.PrefillRequest) -> Transfer | None:
        """Check a PrefillRequest and register its Transfer (in the receive loop, no await: the in-flight count
        is exact); a refusal is queued for the edge ahead of any KV, and None returned."""
        peer, rid = session.peer, msg.request_id
        codec = next((c for c in msg.codecs if c in peer.conn.peer_codecs), None)
        refusal = self._refusal(session, msg, codec)
        if refusal is not None or codec is None:      # (no codec always comes with a refusal)
            self.metrics.prefill_requests.labels("rejected").inc()
            if refusal is not None and refusal.code == ErrorCode.OVERLOADED:
                self.counts["overloaded"] += 1
            if refusal is not None and refusal.code == ErrorCode.SHUTTING_DOWN:
                self.counts["refused_draining"] = self.counts.get("refused_draining", 0) + 1
            session.outbox.put(refusal or m.Error(ErrorCode.CODEC, "no codec", rid), urgent=True)
            return None
        direct = self.direct_streams and msg.direct and bool(peer.conn.session)
        req = Transfer(f"s{session.id}/{rid}", rid, session.outbox, codec, len(msg.token_ids), msg.skip_tokens,
                       msg.edge_layers, gather=(self.parallel and not direct) or self.streamer.mode == "hold",
                       group=f"s{session.id}/{msg.group or rid}", cache_salt=msg.cache_salt or None,
                       tenant=msg.tenant or None, adapter=msg.adapter or None,
                       resumable=not direct,
                       piece_bytes=PIECE_BYTES if msg.core_decode else 0)
        req.trace = TransferTrace.begin(msg, req.received_at, codec, peer.conn)
        session.transfers[rid] = req
        self.streamer.register(req)
        if direct:      # the other ranks learn the route with the first step that computes this request
            self.handle.add_direct_route(req.internal_id, DirectRoute(rid, peer.conn.session, codec, msg.skip_tokens,
                                                                      len(msg.token_ids), msg.edge_layers))
        return req

    async def _prefill(self, session: Session, msg: m.PrefillRequest) -> None:
        """One PrefillRequest from check to PrefillDone (the receive loop runs `_accept` itself, then `_start`
        as a task)."""
        req = self._accept(session, msg)
        if req is not None:
            await self._start(session, req, msg)

    async def _start(self, session: Session, req: Transfer, msg: m.PrefillRequest) -> None:
        rid, s = msg.request_id, msg.sampling
        limit, why_not = self._decode_limit(msg, req.gather, session.outbox)
        if limit:
            req.decode = asyncio.current_task()
            await self._decode(session, req, list(msg.token_ids), SamplingParams.from_spec(s, max_tokens=1 + limit, ignore_eos=True),
                               msg.deadline_ms)
            return
        first = await self._run(session, req, list(msg.token_ids), SamplingParams.from_spec(s, max_tokens=1),
                                msg.deadline_ms)
        if first is not None and req.prefill_done():
            await self._finish(session, req, first, urgent=msg.core_decode > 0)
            if msg.core_decode > 0:          # asked for, not given: the edge waits for the KV
                if why_not == "refused":
                    self.counts["refused"] += 1
                    self.metrics.handover_refusals.inc()
                session.outbox.put(m.DecodeStop(rid, 1, why_not), urgent=True)

    # ---- decode handover --------------------------------------------------------------
    def _decode_limit(self, msg: m.PrefillRequest, gather: bool, outbox: Outbox) -> tuple[int, str]:
        """(tokens after the first this core decodes for the request, why none when 0): "refused" under
        prefill pressure or while the connection's outbox is above its low-water mark (its edge reads slowly:
        a decoding request's KV must be queued before the request ends, whatever the bound), "bound" when the limits or the context leave none. None either when the KV is
        gathered after the prefill from a model whose every layer is windowed: decoding on would release the
        blocks the edge still needs before they are read."""
        if msg.core_decode <= 0:
            return 0, "refused"
        if gather and self.handle.config.releases_kv:
            return 0, "bound"
        if self.handle.stats().waiting >= self.limits.refuse_waiting or \
                (outbox.bound is not None and outbox.nbytes > outbox.low_water):
            return 0, "refused"
        limit = min(msg.core_decode, self.limits.max_tokens, self.handle.max_model_len - len(msg.token_ids) - 1)
        return max(0, limit), "bound"

    async def _decode(self, session: Session, req: Transfer, token_ids: list[int], params: SamplingParams,
                      deadline_ms: int) -> None:
        """Prefill, then decode in the batch, streaming PrefillDone and each Token ahead of queued KV until the
        bound, or `_handover`/`_release` cancel this task (they answer DecodeStop). EOS does not stop it: the
        stop rules (EOS, stop ids and strings, ignore_eos) are the edge's, which Cancels when they end the
        request, so where the handover happens depends only on the bound and the KV's arrival."""
        loop, rid = asyncio.get_running_loop(), req.request_id
        reason = "finished"
        self.counts["decode_requests"] += 1
        self.metrics.handover_requests.inc()
        try:
            async with asyncio.timeout(deadline_ms / 1000 if deadline_ms > 0 else None) as scope, \
                    session.engine_slots:
                async for out in self.handle.generate(EngineRequest(req.internal_id, token_ids, params,
                                                                    group=req.group, cache_salt=req.cache_salt,
                                                                    tenant=req.tenant, adapter=req.adapter)):
                    if req.position == 0:
                        if not req.prefill_done():
                            return
                        await self._finish(session, req, out, urgent=True, lease=False)
                        if req.cancelled:
                            return
                        scope.reschedule(loop.time() + self.limits.max_seconds)
                    else:
                        info = out.logprobs[0] if out.logprobs else None
                        session.outbox.put(m.Token(rid, req.position, out.new_token_ids[0], info.logprob if info else
                                                   0.0, list(info.top) if info else []), urgent=True)
                        self.counts["decoded_tokens"] += 1
                        self.metrics.core_decoded_tokens.inc()
                    req.position += 1
                    if out.finished and out.finish_reason == "length":
                        reason = "bound"
        except RequestError as exc:
            self._forget(session, rid, "rejected")
            self.metrics.prefill_requests.labels("rejected").inc()
            await session.peer.send(m.Error(ErrorCode.BAD_REQUEST, str(exc), rid))
            return
        except TimeoutError:
            if req.position == 0:
                self._release(session, rid, True, "timeout")
                self.metrics.prefill_requests.labels("timeout").inc()
                await session.peer.send(m.Error(ErrorCode.TIMEOUT, f"prefill missed its deadline of {deadline_ms} "
                                                "ms", rid))
                return
            reason = "bound"
        self._decode_stopped(session, req, reason)

    def _decode_stopped(self, session: Session, req: Transfer, reason: str) -> None:
        """Decoding ended: tell the edge where, and start the lease that waits for its Ack."""
        req.decode = None
        session.outbox.put(m.DecodeStop(req.request_id, req.position, reason), urgent=True)
        if req.trace is not None:
            req.trace.decode_stopped(req.position, reason)
        if session.transfers.get(req.request_id) is req and req.lease is None:
            req.lease = asyncio.get_running_loop().call_later(self.lease_seconds, self._release, session,
                                                              req.request_id, False, "lease_expired")
            self.metrics.leases.inc()

    def _handover(self, session: Session, msg: m.Handover) -> None:
        """The edge holds tokens [0, msg.position) and the KV: stop decoding and free the request's blocks."""
        req = session.transfers.get(msg.request_id)
        if req is None or req.decode is None:
            return                    # it had stopped already (bound, end): its DecodeStop is on the way
        self.counts["handovers"] += 1
        self.metrics.handovers.inc()
        req.decode.cancel()           # the generate stream's exit aborts the engine request
        self._decode_stopped(session, req, "handover")

    async def _run(self, session: Session, req: Transfer, token_ids: list[int], params: SamplingParams,
                   deadline_ms: int) -> RequestOutput | None:
        """Run the prefill on the engine; its last output, or None after an error was sent to the edge."""
        first = None
        try:
            deadline = deadline_ms / 1000 if deadline_ms > 0 else None
            async with asyncio.timeout(deadline), session.engine_slots:      # a slot of this connection's
                async for out in self.handle.generate(EngineRequest(req.internal_id, token_ids, params,
                                                                    group=req.group, cache_salt=req.cache_salt,
                                                                    tenant=req.tenant, adapter=req.adapter,
                                                                    prefill_only=True)):
                    if out.finished:
                        first = out
        except RequestError as exc:
            self._forget(session, req.request_id, "rejected")
            self.metrics.prefill_requests.labels("rejected").inc()
            await session.peer.send(m.Error(ErrorCode.BAD_REQUEST, str(exc), req.request_id))
            return None
        except TimeoutError:
            self._release(session, req.request_id, True, "timeout")
            self.metrics.prefill_requests.labels("timeout").inc()
            await session.peer.send(m.Error(ErrorCode.TIMEOUT, f"prefill missed its deadline of {deadline_ms} ms",
                                            req.request_id))
            return None
        return first

    async def _finish(self, session: Session, req: Transfer, first: RequestOutput, urgent: bool = False,
                      lease: bool = True) -> None:
        """The prefill ended: queue the KV the layer hook did not (gathered, or paused by a full outbox:
        `queue_rest`, in windows as the sender drains), then PrefillDone (`urgent`: first, ahead of queued KV,
        for a version-3 edge that forwards it at once; a decoding request's rest is read at once, before the
        engine ends the request and frees its KV); start the lease (`lease`; a decoding request's starts
        when it stops)."""
        info = first.logprobs[0] if first.logprobs else None
        done = m.PrefillDone(req.request_id, first.new_token_ids[0], info.logprob if info else 0.0,
                             list(info.top) if info else [], req.total_tokens, first.num_cached_tokens,
                             req.timings(time.perf_counter()))
        if urgent:
            session.outbox.put(done, urgent=True)
        if req.gather or req.paused:
            try:
                await queue_rest(self.handle, req, wait=req.decode is None)
            except KeyError:         # the engine had ended the request (a decoding one) and freed its KV
                self._release(session, req.request_id, True, "kv_lost")
                session.outbox.put(m.Error(ErrorCode.INTERNAL, "the KV left the core's cache before it could "
                                           "be sent", req.request_id), urgent=True)
                return
        if not urgent:
            session.outbox.put(done)
        self.metrics.prefill_requests.labels("ok").inc()
        self.metrics.prompt_tokens.inc(req.total_tokens)
        self.metrics.cached_tokens.inc(first.num_cached_tokens)
        self.metrics.prefill_seconds.observe(time.perf_counter() - req.received_at)
        if req.trace is not None:
            req.trace.prefilled(req.total_tokens, first.num_cached_tokens, req.received_at + done.timings["total_ms"] / 1e3)
        if not lease:
            return
        req.lease = asyncio.get_running_loop().call_later(self.lease_seconds, self._release, session,
                                                          req.request_id, False, "lease_expired")
        self.metrics.leases.inc()

    def _forget(self, session: Session, rid: str, outcome: str | None = None) -> Transfer | None:
        """Drop a request from the connection; `outcome`: why, when it ends here (its trace's last word)."""
        req = session.transfers.pop(rid, None)
        if req is not None and req.trace is not None and outcome is not None:
            req.trace.close(outcome)
        if not session.transfers and self.inflight() == 0:
            self._idle.set()
        if req is not None:
            self.streamer.forget(req.internal_id)
            if self.parallel:
                self.handle.drop_direct_route(req.internal_id)
        return req

    def _release(self, session: Session, rid: str, cancelled: bool = False, outcome: str | None = None) -> None:
        """Free a request's KV at the core (Ack, Cancel, lease expiry, disconnect; `outcome` for its trace)."""
        req = self._forget(session, rid)
        if req is None:
            return
        if cancelled or not req.release():
            req.cancel()
            session.outbox.drop(req)         # its KV queued, not sent: freed now
        if req.decode is not None and req.decode is not asyncio.current_task():   # Cancel, disconnect, lease
            req.decode.cancel()
            req.decode = None
            session.outbox.put(m.DecodeStop(rid, req.position, "cancelled"), urgent=True)
        if req.lease is not None:
            req.lease.cancel()
            self.metrics.leases.dec()
        self.handle.abort(req.internal_id)
        if req.trace is not None:
            req.trace.close(outcome or req.state.value)

    # ---- what the node reports -------------------------------------------
    def stats(self) -> dict:
        return {"connections": len(self.sessions),
                "remote_requests": sum(len(s.transfers) for s in self.sessions),
                "leases": sum(1 for s in self.sessions for r in s.transfers.values() if r.lease is not None),
                "decoding": sum(1 for s in self.sessions for r in s.transfers.values() if r.decode is not None),
                "handover": dict(self.counts), "draining": self.draining is not None}

    # ---- drain (the core's SIGTERM) ------------------------------------------
    def inflight(self) -> int:
        """Edges' requests in flight here: prefilling, leased (KV waiting for its Ack) or decoding for a handover."""
        return sum(len(s.transfers) for s in self.sessions)

    def backlog_tokens(self) -> int:
        """Prompt tokens of requests still prefilling (their whole uncached prompt, whatever part is computed)."""
        return sum(r.total_tokens - r.skip_tokens for s in self.sessions for r in s.transfers.values()
                   if r.state is TransferState.PREFILLING)

    def start_drain(self, timeout: float) -> None:
        """Take no new requests from now on (Error SHUTTING_DOWN) and tell every edge that can hear it."""
        if self.draining is not None:
            return
        self.draining = timeout
        for session in list(self.sessions):
            self._announce(session, timeout)

    def _announce(self, session: Session, timeout: float) -> None:
        if session.peer.conn.drain:          # a version-4 edge; an older one learns from the refusals
            session.outbox.put(m.Draining(max(0, int(timeout * 1000)), "the core is shutting down"), urgent=True)

    async def drained(self) -> None:
        """Returns once no connection has a request in flight (an edge's Ack, Cancel or disconnect ends each)."""
        while self.inflight():
            self._idle.clear()
            with contextlib.suppress(TimeoutError):      # sessions that end take their requests along: re-count
                await asyncio.wait_for(self._idle.wait(), 0.1)

    async def fail_all(self, why: str) -> None:
        for session in list(self.sessions):
            await session.peer.fail(why, ErrorCode.INTERNAL)

    async def close(self) -> None:
        for session in list(self.sessions):
            await session.peer.close()
