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
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import Executor

from edgecore.core.kv_sender import LayerStreamer, send_queued
from edgecore.core.metrics import CoreMetrics
from edgecore.core.transfer import KVSend, Transfer
from edgecore.protocol import messages as m
from edgecore.protocol.errors import ErrorCode
from edgecore.protocol.transport import Peer, PeerError
from edgecore.shared.engine.handle import EngineHandle
from edgecore.shared.engine.output import RequestOutput
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.errors import RequestError
from edgecore.shared.kv.transfer import StreamRoute, cut_slice, needed_from

log = logging.getLogger("edgecore.core")


class Session:
    _ids = itertools.count(1)

    def __init__(self, peer: Peer):
        self.id = next(self._ids)
        self.peer = peer
        self.queue: asyncio.Queue = asyncio.Queue()   # KVSend and protocol messages, sent in order
        self.transfers: dict[str, Transfer] = {}       # by the edge's request id


class PrefillService:
    def __init__(self, handle: EngineHandle, streamer: LayerStreamer, metrics: CoreMetrics, encoder_pool: Executor,
                 dtype_name: str, lease_seconds: float, parallel: bool = False, direct_streams: bool = False):
        """`parallel`: the engine spans ranks; `direct_streams`: its other ranks serve stream ports."""
        self.handle, self.streamer, self.metrics = handle, streamer, metrics
        self.encoder_pool, self.dtype_name, self.lease_seconds = encoder_pool, dtype_name, lease_seconds
        self.parallel, self.direct_streams = parallel, direct_streams
        self.sessions: set[Session] = set()

    # ---- one edge connection ---------------------------------------------
    async def serve(self, peer: Peer) -> None:
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
        def counted(req: Transfer, data) -> None:
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
                       gather=self.parallel and not direct)
        session.transfers[rid] = req
        self.streamer.remote[req.internal_id] = req
        if direct:      # the other ranks learn the route with the first step that computes this request
            self.handle.add_stream_route(req.internal_id, StreamRoute(rid, peer.conn.session, codec,
                                                                      msg.skip_tokens, len(msg.token_ids)))
        first = await self._run(session, req, list(msg.token_ids), params, msg.deadline_ms)
        if first is not None and req.prefill_done():
            await self._finish(session, req, first)

    async def _run(self, session: Session, req: Transfer, token_ids: list[int], params: SamplingParams,
                   deadline_ms: int) -> RequestOutput | None:
        """Run the prefill on the engine; its last output, or None after an error was sent to the edge."""
        first = None
        try:
            deadline = deadline_ms / 1000 if deadline_ms > 0 else None
            async with asyncio.timeout(deadline):
                async for out in self.handle.generate(req.internal_id, token_ids, params, prefill_only=True):
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

    async def _finish(self, session: Session, req: Transfer, first: RequestOutput) -> None:
        """The prefill ended: queue any KV kept back, then PrefillDone; start the lease."""
        info = first.logprobs[0] if first.logprobs else None
        done = m.PrefillDone(req.request_id, first.new_token_ids[0], info.logprob if info else 0.0,
                             list(info.top) if info else [], req.total_tokens, first.num_cached_tokens,
                             req.timings(time.perf_counter()))
        if req.gather:
            starts = needed_from(self.handle.config, req.total_tokens)     # windowed layers: their window only
            for whole in await self.handle.read_kv(req.internal_id, req.skip_tokens, req.total_tokens):
                req.held.extend(KVSend(req, piece) for piece in cut_slice(whole, starts))
        for item in req.held:            # baseline mode, gathered KV: all of it after the last layer
            session.queue.put_nowait(item)
        req.held.clear()
        session.queue.put_nowait(done)
        self.metrics.prefill_requests.labels("ok").inc()
        self.metrics.prompt_tokens.inc(req.total_tokens)
        self.metrics.cached_tokens.inc(first.num_cached_tokens)
        self.metrics.prefill_seconds.observe(time.perf_counter() - req.received_at)
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
        if req.lease is not None:
            req.lease.cancel()
            self.metrics.leases.dec()
        self.handle.abort(req.internal_id)

    # ---- what the node reports -------------------------------------------
    def stats(self) -> dict:
        return {"connections": len(self.sessions),
                "remote_requests": sum(len(s.transfers) for s in self.sessions),
                "leases": sum(1 for s in self.sessions for r in s.transfers.values() if r.lease is not None)}

    async def fail_all(self, why: str) -> None:
        for session in list(self.sessions):
            await session.peer.fail(why, ErrorCode.INTERNAL)

    async def close(self) -> None:
        for session in list(self.sessions):
            await session.peer.close()
