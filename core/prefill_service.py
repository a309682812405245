"""The core's prefill service: edges' protocol sessions in, prefill-only requests on the engine handle.

Life cycle of one edge connection (a `Session`): handshake (transport) →
loop over incoming messages: PrefillRequest starts `_prefill` (a task),
Cancel cancels its transfer, Ack releases its KV → on disconnect every
transfer of the session is cancelled and its KV freed.

Life cycle of one remote request (its `Transfer`, core/transfer.py, holds the
state): validated → registered with the `LayerStreamer` (and, for a parallel
core whose edge holds stream connections to every rank, its `StreamRoute` is
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
token (a Token frame) go ahead of queued KV (`SessionQueue.put_urgent`), until
the edge's Handover, Cancel, the `HandoverLimits` bound (tokens, seconds) or the
request's end, each answered with DecodeStop. A core with `refuse_waiting` or more
requests waiting refuses (DecodeStop "refused" right after PrefillDone: the edge
waits for the KV as in the old mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import sys
import time
from collections import deque
from concurrent.futures import Executor

from edgecore.core.kv_sender import LayerStreamer, send_queued
from edgecore.core.metrics import CoreMetrics
from edgecore.core.transfer import HandoverLimits, KVSend, Outgoing, Transfer
from edgecore.protocol import messages as m
from edgecore.protocol.errors import ErrorCode
from edgecore.protocol.events import KVData
from edgecore.protocol.transport import Peer, PeerError
from edgecore.shared.engine.handle import EngineHandle, EngineRequest
from edgecore.shared.engine.output import RequestOutput
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.errors import RequestError
from edgecore.shared.kv.transfer import EDGE_LAYERS, KVSlice, StreamRoute, cut_slice, needed_from

log = logging.getLogger("edgecore.core")


UNSENT_LOWAT = 32 * 1024      # kernel backlog of a version-3 connection
PIECE_BYTES = 128 * 1024      # KV frame size of a request whose tokens go ahead of its KV (5 ms at 200 Mbit/s)


def _limit_unsent(transport: asyncio.BaseTransport) -> None:
    """Keep the kernel's not-yet-sent backlog small (TCP_NOTSENT_LOWAT), so that a handover's tokens, which
    jump the session queue, do not wait behind megabytes of KV already handed to the socket. Bytes in flight
    (the congestion window) are not limited, so throughput is kept."""
    sock = transport.get_extra_info("socket")
    option = getattr(socket, "TCP_NOTSENT_LOWAT", 25 if sys.platform.startswith("linux") else None)
    if sock is not None and option is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, option, UNSENT_LOWAT)


class SessionQueue(asyncio.Queue[Outgoing]):
    """FIFO of KVSend and messages, except that `put_urgent` items (a handover's tokens) go ahead of every
    ordinary item queued, in order among themselves: the first tokens do not wait behind the KV."""

    _queue: deque[Outgoing]             # asyncio.Queue's own storage (made by `_init`), which typeshed leaves out

    def _init(self, maxsize: int) -> None:
        super()._init(maxsize)
        self._urgent = 0
        self._next_urgent = False

    def _put(self, item: Outgoing) -> None:
        if self._next_urgent:
            self._queue.insert(self._urgent, item)
            self._urgent += 1
        elif isinstance(item, KVSend) and item.transfer.piece_bytes:
            self._queue.extend(_pieces(item, item.transfer.piece_bytes))
        else:
            self._queue.append(item)

    def _get(self) -> Outgoing:
        if self._urgent:
            self._urgent -= 1
        return self._queue.popleft()

    def put_urgent(self, item: Outgoing) -> None:
        self._next_urgent = True
        try:
            self.put_nowait(item)
        finally:
            self._next_urgent = False


def _pieces(item: KVSend, piece_bytes: int) -> list[KVSend]:
    """A slice cut by token ranges into frames of about `piece_bytes`: a token queued behind it waits for
    one piece on the wire, not a whole layer."""
    p = item.piece
    per_token = max(1, (p.k[:, :1].nbytes + p.v[:, :1].nbytes))
    step = max(1, piece_bytes // per_token)
    if p.token_end - p.token_start <= step:
        return [item]
    return [KVSend(item.transfer, KVSlice(p.layer, a, min(a + step, p.token_end), p.head_start,
                                          p.k[:, a - p.token_start:a - p.token_start + step],
                                          p.v[:, a - p.token_start:a - p.token_start + step]))
            for a in range(p.token_start, p.token_end, step)]


class Session:
    _ids = itertools.count(1)

    def __init__(self, peer: Peer) -> None:
        self.id = next(self._ids)
        self.peer = peer
        self.queue = SessionQueue()                    # KVSend and protocol messages, sent in order
        self.transfers: dict[str, Transfer] = {}       # by the edge's request id


class PrefillService:
    def __init__(self, handle: EngineHandle, streamer: LayerStreamer, metrics: CoreMetrics, encoder_pool: Executor,
                 dtype_name: str, lease_seconds: float, parallel: bool = False, direct_streams: bool = False,
                 handover: HandoverLimits | None = None) -> None:
        """`parallel`: the engine spans ranks; `direct_streams`: its other ranks serve stream ports;
        `handover`: how much this core decodes for edges before they take over."""
        self.handle, self.streamer, self.metrics = handle, streamer, metrics
        self.encoder_pool, self.dtype_name, self.lease_seconds = encoder_pool, dtype_name, lease_seconds
        self.parallel, self.direct_streams = parallel, direct_streams
        self.limits = handover or HandoverLimits()
        self.sessions: set[Session] = set()
        self.counts = {"decode_requests": 0, "decoded_tokens": 0, "handovers": 0, "refused": 0}

    # ---- one edge connection ---------------------------------------------
    async def serve(self, peer: Peer) -> None:
        if peer.conn.handover:
            _limit_unsent(peer.transport)
        session = Session(peer)
        self.sessions.add(session)
        self.metrics.connections.inc()
        sender = asyncio.create_task(self._sender(session))
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                msg = await peer.recv()
                if isinstance(msg, m.PrefillRequest):
                    task = asyncio.create_task(self._prefill(session, msg))
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
                self._release(session, rid, cancelled=True)
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
        await send_queued(session.queue, session.peer, self.encoder_pool, self.dtype_name, counted,
                          rope=self.streamer.rope, step_scales=self.streamer.step_scales)

    # ---- one remote request ------------------------------------------------
    def _refusal(self, session: Session, msg: m.PrefillRequest, codec: str | None) -> m.Error | None:
        rid, error = msg.request_id, None
        if rid in session.transfers:
            error = f"request id {rid} is already in flight on this connection"
        elif codec is None:
            error = (f"none of the codecs {msg.codecs} is available (negotiated: "
                     f"{session.peer.conn.peer_codecs})")
        elif not 0 <= msg.skip_tokens < len(msg.token_ids):
            error = f"skip_tokens {msg.skip_tokens} must be below the prompt length {len(msg.token_ids)}"
        elif not 0 <= msg.edge_layers <= EDGE_LAYERS:
            error = f"edge_layers {msg.edge_layers} must be between 0 and {EDGE_LAYERS} (layer 0 only)"
        if error is None:
            return None
        return m.Error(ErrorCode.BAD_REQUEST if codec else ErrorCode.CODEC, error, rid)

    async def _prefill(self, session: Session, msg: m.PrefillRequest) -> None:
        peer, rid = session.peer, msg.request_id
        codec = next((c for c in msg.codecs if c in peer.conn.peer_codecs), None)
        refusal = self._refusal(session, msg, codec)
        s = msg.sampling
        try:
            params = SamplingParams.from_spec(s, max_tokens=1)
        except RequestError as exc:
            refusal = refusal or m.Error(ErrorCode.BAD_REQUEST, str(exc), rid)
        if refusal is not None or codec is None:      # (no codec always comes with a refusal)
            self.metrics.prefill_requests.labels("rejected").inc()
            await peer.send(refusal or m.Error(ErrorCode.CODEC, "no codec", rid))
            return
        direct = self.direct_streams and msg.direct and bool(peer.conn.session)
        req = Transfer(f"s{session.id}/{rid}", rid, session.queue, codec, len(msg.token_ids), msg.skip_tokens,
                       msg.edge_layers, gather=self.parallel and not direct, group=f"s{session.id}/{msg.group or rid}",
                       piece_bytes=PIECE_BYTES if msg.core_decode else 0)
        session.transfers[rid] = req
        self.streamer.remote[req.internal_id] = req
        if direct:      # the other ranks learn the route with the first step that computes this request
            self.handle.add_stream_route(req.internal_id, StreamRoute(rid, peer.conn.session, codec, msg.skip_tokens,
                                                                      len(msg.token_ids), msg.edge_layers))
        limit, why_not = self._decode_limit(msg, req.gather)
        if limit:
            req.decode = asyncio.current_task()
            await self._decode(session, req, list(msg.token_ids), SamplingParams.from_spec(s, max_tokens=1 + limit, ignore_eos=True),
                               msg.deadline_ms)
            return
        first = await self._run(session, req, list(msg.token_ids), params, msg.deadline_ms)
        if first is not None and req.prefill_done():
            await self._finish(session, req, first, urgent=msg.core_decode > 0)
            if msg.core_decode > 0:          # asked for, not given: the edge waits for the KV
                if why_not == "refused":
                    self.counts["refused"] += 1
                    self.metrics.handover_refusals.inc()
                session.queue.put_urgent(m.DecodeStop(rid, 1, why_not))

    # ---- decode handover --------------------------------------------------------------
    def _decode_limit(self, msg: m.PrefillRequest, gather: bool) -> tuple[int, str]:
        """(tokens after the first this core decodes for the request, why none when 0): "refused" under
        prefill pressure, "bound" when the limits or the context leave none. None either when the KV is
        gathered after the prefill from a model whose every layer is windowed: decoding on would release the
        blocks the edge still needs before they are read."""
        if msg.core_decode <= 0:
            return 0, "refused"
        if gather and self.handle.config.releases_kv:
            return 0, "bound"
        if self.handle.stats().waiting >= self.limits.refuse_waiting:
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
            async with asyncio.timeout(deadline_ms / 1000 if deadline_ms > 0 else None) as scope:
                async for out in self.handle.generate(EngineRequest(req.internal_id, token_ids, params,
                                                                    group=req.group)):
                    if req.position == 0:
                        if not req.prefill_done():
                            return
                        await self._finish(session, req, out, urgent=True, lease=False)
                        scope.reschedule(loop.time() + self.limits.max_seconds)
                    else:
                        info = out.logprobs[0] if out.logprobs else None
                        session.queue.put_urgent(m.Token(rid, req.position, out.new_token_ids[0],
                                                         info.logprob if info else 0.0, list(info.top) if info else []))
                        self.counts["decoded_tokens"] += 1
                        self.metrics.core_decoded_tokens.inc()
                    req.position += 1
                    if out.finished and out.finish_reason == "length":
                        reason = "bound"
        except RequestError as exc:
            self._forget(session, rid)
            self.metrics.prefill_requests.labels("rejected").inc()
            await session.peer.send(m.Error(ErrorCode.BAD_REQUEST, str(exc), rid))
            return
        except TimeoutError:
            if req.position == 0:
                self._release(session, rid, cancelled=True)
                self.metrics.prefill_requests.labels("timeout").inc()
                await session.peer.send(m.Error(ErrorCode.TIMEOUT, f"prefill missed its deadline of {deadline_ms} "
                                                "ms", rid))
                return
            reason = "bound"
        self._decode_stopped(session, req, reason)

    def _decode_stopped(self, session: Session, req: Transfer, reason: str) -> None:
        """Decoding ended: tell the edge where, and start the lease that waits for its Ack."""
        req.decode = None
        session.queue.put_urgent(m.DecodeStop(req.request_id, req.position, reason))
        if session.transfers.get(req.request_id) is req and req.lease is None:
            req.lease = asyncio.get_running_loop().call_later(self.lease_seconds, self._release, session,
                                                              req.request_id)
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
            async with asyncio.timeout(deadline):
                async for out in self.handle.generate(EngineRequest(req.internal_id, token_ids, params,
                                                                    group=req.group, prefill_only=True)):
                    if out.finished:
                        first = out
        except RequestError as exc:
            self._forget(session, req.request_id)
            self.metrics.prefill_requests.labels("rejected").inc()
            await session.peer.send(m.Error(ErrorCode.BAD_REQUEST, str(exc), req.request_id))
            return None
        except TimeoutError:
            self._release(session, req.request_id, cancelled=True)
            self.metrics.prefill_requests.labels("timeout").inc()
            await session.peer.send(m.Error(ErrorCode.TIMEOUT, f"prefill missed its deadline of {deadline_ms} ms",
                                            req.request_id))
            return None
        return first

    async def _finish(self, session: Session, req: Transfer, first: RequestOutput, urgent: bool = False,
                      lease: bool = True) -> None:
        """The prefill ended: queue any KV kept back, then PrefillDone (`urgent`: ahead of queued KV, for a
        version-3 edge that forwards it at once); start the lease (`lease`; a decoding request's starts
        when it stops)."""
        info = first.logprobs[0] if first.logprobs else None
        done = m.PrefillDone(req.request_id, first.new_token_ids[0], info.logprob if info else 0.0,
                             list(info.top) if info else [], req.total_tokens, first.num_cached_tokens,
                             req.timings(time.perf_counter()))
        if req.gather:
            starts = needed_from(self.handle.config, req.total_tokens, req.edge_layers)   # windowed: the window
            for whole in await self.handle.read_kv(req.internal_id, req.skip_tokens, req.total_tokens):
                req.held.extend(KVSend(req, piece) for piece in cut_slice(whole, starts))
        for item in req.held:            # baseline mode, gathered KV: all of it after the last layer
            session.queue.put_nowait(item)
        req.held.clear()
        if urgent:
            session.queue.put_urgent(done)
        else:
            session.queue.put_nowait(done)
        self.metrics.prefill_requests.labels("ok").inc()
        self.metrics.prompt_tokens.inc(req.total_tokens)
        self.metrics.cached_tokens.inc(first.num_cached_tokens)
        self.metrics.prefill_seconds.observe(time.perf_counter() - req.received_at)
        if not lease:
            return
        req.lease = asyncio.get_running_loop().call_later(self.lease_seconds, self._release, session,
                                                          req.request_id)
        self.metrics.leases.inc()

    def _forget(self, session: Session, rid: str) -> Transfer | None:
        req = session.transfers.pop(rid, None)
        if req is not None:
            self.streamer.remote.pop(req.internal_id, None)
            if self.parallel:
                self.handle.drop_stream_route(req.internal_id)
        return req

    def _release(self, session: Session, rid: str, cancelled: bool = False) -> None:
        """Free a request's KV at the core (Ack, Cancel, lease expiry, disconnect)."""
        req = self._forget(session, rid)
        if req is None:
            return
        if cancelled or not req.release():
            req.cancel()
        if req.decode is not None and req.decode is not asyncio.current_task():   # Cancel, disconnect, lease
            req.decode.cancel()
            req.decode = None
            session.queue.put_urgent(m.DecodeStop(rid, req.position, "cancelled"))
        if req.lease is not None:
            req.lease.cancel()
            self.metrics.leases.dec()
        self.handle.abort(req.internal_id)

    # ---- what the node reports -------------------------------------------
    def stats(self) -> dict:
        return {"connections": len(self.sessions),
                "remote_requests": sum(len(s.transfers) for s in self.sessions),
                "leases": sum(1 for s in self.sessions for r in s.transfers.values() if r.lease is not None),
                "decoding": sum(1 for s in self.sessions for r in s.transfers.values() if r.decode is not None),
                "handover": dict(self.counts)}

    async def fail_all(self, why: str) -> None:
        for session in list(self.sessions):
            await session.peer.fail(why, ErrorCode.INTERNAL)

    async def close(self) -> None:
        for session in list(self.sessions):
            await session.peer.close()
