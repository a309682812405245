"""A worker rank's KV stream server: the rank sends its own layers' and heads' KV straight to edges.

Life cycle: a worker rank of a parallel core that holds distinct KV (each
pipeline stage; each tensor slice whose KV heads are not a replica of another
rank's) starts a `DirectServer` before it joins the step loop: a protocol
server on its own port, run by an event loop in a background thread. The driver
advertises the ports in its Welcome; an edge connects to each with the session
id of its main connection (Hello.session) and from then on asks for direct
streaming (PrefillRequest.direct). For such a request the driver sends the
route (request id, session, codec, token range) with the first step plan that
computes it; `apply(routes)` registers it with this rank's `LayerSender`
(on the engine thread, which owns the streamer's table: `register`/`forget`,
then `sync`), whose `on_layer` hook queues each layer's new K/V, as computed,
in the session's `Outbox` (no bound here: a rank has no way to read skipped KV
back; the edge's main connection caps its requests in flight instead). A route is forgotten once its last tokens have left, or when
the driver drops it (the request was cancelled). Edges send nothing on a
stream connection but pings; anything else is answered with an Error.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edgecore.core.kv_sender import LayerSender, send_queued
from edgecore.core.outbox import Outbox
from edgecore.core.prefill_service import bound_write_path
from edgecore.core.transfer import Transfer
from edgecore.protocol import messages as m
from edgecore.protocol.errors import ErrorCode
from edgecore.protocol.transport import Peer, PeerError, serve
from edgecore.shared.node.env import link_sealed

if TYPE_CHECKING:
    from edgecore.shared.engine.sequence import Sequence
    from edgecore.shared.engine.step_plan import StepRoutes
    from edgecore.shared.kv.pool import KVPool

log = logging.getLogger("edgecore.streams")


@dataclass
class _Session:
    peer: Peer
    outbox: Outbox


class DirectServer:
    def __init__(self, pool: KVPool, model: Any, host: str, secret: bytes, fingerprint: str, codecs: list[str],
                 dtype_name: str, head_start: int, name: str) -> None:
        self.host, self.secret, self.fingerprint, self.codecs = host, secret, fingerprint, codecs
        self.dtype_name, self.name = dtype_name, name
        self.sessions: dict[str, _Session] = {}
        self.encoder_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="edgecore-encode")
        self.loop = asyncio.new_event_loop()
        self.streamer = LayerSender(pool, model, self.loop, "stream", head_start, forget_when_sent=True)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="edgecore-streams", daemon=True)

    def start(self) -> int:
        """Start serving; returns the bound port."""
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._start(), self.loop)
        self.port = future.result(30)
        return self.port

    async def _start(self) -> int:
        self._server = await serve(self._session, host=self.host, port=0, secret=self.secret,
                                   fingerprint=self.fingerprint, codecs=self.codecs, name=self.name,
                                   sealed=link_sealed())
        return self._server.sockets[0].getsockname()[1]

    async def _session(self, peer: Peer) -> None:
        key = peer.conn.session
        if not key:
            await peer.fail("a stream connection needs a session id in its Hello", ErrorCode.BAD_REQUEST)
            return
        session = _Session(peer, Outbox())
        self.sessions[key] = session
        pacer = bound_write_path(peer) if peer.conn.handover else None    # shares the bottleneck with rank 0's
        if pacer is not None:
            pacer.probe = False         # rank 0's connection probes the link: a train per rank would queue ahead of it
        sender = asyncio.create_task(send_queued(session.outbox, peer, self.encoder_pool, self.dtype_name,
                                                 rope=self.streamer.rope, step_scales=self.streamer.step_scales,
                                                 pacer=pacer))
        try:
            while True:
                msg = await peer.recv()
                if not isinstance(msg, (m.Ack, m.Cancel)):
                    await peer.send(m.Error(ErrorCode.BAD_REQUEST, "a stream connection only carries KV from "
                                            "the core", getattr(msg, "request_id", "")))
        except PeerError as exc:
            log.info("stream %s closed: %s", key[:8], exc)
        finally:
            sender.cancel()
            if self.sessions.get(key) is session:
                del self.sessions[key]

    # ---- engine (worker main) thread ---------------------------------------
    def apply(self, routes: StepRoutes) -> None:
        """Register the step's new routes and forget dropped ones (before the step runs)."""
        streamer = self.streamer
        streamer.sync()
        for stream_id in routes.drop:
            req = streamer.remote.get(stream_id)
            if req is not None:
                req.cancel()
            streamer.forget(stream_id)
        for stream_id, route in routes.new.items():
            session = self.sessions.get(route.session)
            if session is None:       # the edge's stream connection is gone: its transfer fails over
                log.warning("no stream connection for session %s (request %s)", route.session[:8], route.request_id)
                continue
            streamer.register(Transfer(stream_id, route.request_id, session.outbox, route.codec,
                                       route.total_tokens, route.skip_tokens, route.edge_layers, resumable=False))
        streamer.sync()

    def on_layer(self, layer: int, items: list[tuple[Sequence, int]]) -> None:
        self.streamer.on_layer(layer, items)

    def close(self) -> None:
        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for session in list(self.sessions.values()):
                await session.peer.close()
        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(5)
        except Exception:          # noqa: BLE001 - best effort on the way out
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.encoder_pool.shutdown(wait=False)
