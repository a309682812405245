"""The edge's engine process: an `EdgeNode` served to the HTTP frontend over a socket.

Why a process of its own: the engine thread drives the model from Python and
takes the GIL back after every tensor op; an HTTP loop in the same process
that writes to dozens of sockets per step hands the GIL back and forth with
it, and the engine ran 25-35% slower for it. Here the engine process's event
loop does little per token (no HTTP, one socket write per step).

Life cycle: `edgecore edge` (the frontend, edge/node_client.py) starts this
process with its own flags plus `--engine-fd`, the child end of a socketpair.
The process loads the model, starts the `EdgeNode` (engine thread, core
connections), sends `Hello`, then serves frames until the socket closes:
`Generate` starts a task that places the request (`EdgeNode.submit`); from
then on the engine's dispatch hands its outputs straight to this server (no
task switch per token), and outputs produced in one event-loop turn leave in
one `Outputs` frame. `Abort` cancels that task, or the request (which
aborts it here and at its core). `CountError` is counted; each request
(`GetStats`, `GetMetrics`, `GetReadiness`, `Prefetch`, `LoadAdapter`, `UnloadAdapter`) runs as a task and is
answered with its typed reply, or `RequestFailed`.
When the frontend goes away, every request is cancelled and the process ends.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from functools import partial
from typing import TYPE_CHECKING

from edgecore.edge.node import EdgeNode
from edgecore.edge.ipc import (Abort, AdapterReply, Call, CountError, Failed, FrameBuffer, Generate, GetMetrics,
                               GetReadiness, GetStats, Hello, IpcError, LoadAdapter, Message, MetricsReply, Outputs,
                               PrefetchReply, ReadinessReply, Reply, Request, RequestFailed, StatsReply,
                               UnloadAdapter, encode)
from edgecore.shared.engine.handle import EngineRequest, Output
from edgecore.shared.engine.output import RequestOutput
from edgecore.shared.errors import EngineDead, RequestError
from edgecore.shared.errors import AdapterError

if TYPE_CHECKING:
    from edgecore.edge.node_client import NodeProcessClient
    from edgecore.edge.service import EdgeService

log = logging.getLogger("edgecore.edge.node_process")

# The GIL switch interval of this process. The engine thread releases the GIL for every tensor op and
# wants it back when the op ends; with Python's default (5 ms) it then waits for the whole of the event
# loop's turn (all of a step's outputs). At 50 us the loop thread must hand the GIL over within 50 us of
# being asked, so its Python interleaves with the engine's tensor ops instead of stalling them:
# bench/serve gained 4-6% (0.81-0.84 → 0.88-0.89 in runs side by side).
SWITCH_INTERVAL_S = 50e-6



async def answer(edge: EdgeNode, msg: Request) -> Reply:
    """The typed reply to one request of the frontend."""
    if isinstance(msg, GetStats):
        return StatsReply(msg.id, await edge.get_stats())
    if isinstance(msg, GetMetrics):
        return MetricsReply(msg.id, await edge.get_metrics())
    if isinstance(msg, (LoadAdapter, UnloadAdapter)):
        try:
            if isinstance(msg, LoadAdapter):
                return AdapterReply(msg.id, await edge.load_adapter(msg.name, msg.path))
            await edge.unload_adapter(msg.name)
            return AdapterReply(msg.id)
        except AdapterError as exc:
            return AdapterReply(msg.id, error=str(exc), param=exc.param)
    if isinstance(msg, GetReadiness):
        r = await edge.get_readiness()
        return ReadinessReply(msg.id, r["ready"], r["cores_healthy"])
    r = await edge.prefetch(msg.prompt_ids)
    return PrefetchReply(msg.id, r["tokens"], r["cached_tokens"], r["source"])


class NodeProcessServer:
    def __init__(self, edge: EdgeNode, sock: socket.socket):
        self.edge = edge
        self.sock = sock
        self.starting: dict[str, asyncio.Task] = {}   # being placed / prefilled (edge.submit not returned)
        self.pending: list[RequestOutput] = []
        self.writer: asyncio.StreamWriter | None = None

    async def run(self) -> None:
        """Serve the frontend until it closes the socket."""
        reader, self.writer = await asyncio.open_connection(sock=self.sock)
        self._send(Hello(self.edge.max_model_len, self.edge.vocab_size, self.edge.fingerprint, self.edge.adapters))
        frames = FrameBuffer()
        try:
            while data := await reader.read(1 << 16):
                for msg in frames.feed(data):
                    self._handle(msg)
        except (ConnectionError, IpcError) as exc:
            log.error("frontend connection failed: %s", exc)
        finally:
            tasks = list(self.starting.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.edge.cancel_all()
            self.writer.close()

    def _handle(self, msg: Message) -> None:
        if isinstance(msg, Generate):
            self.starting[msg.request_id] = asyncio.create_task(self._start(msg))
        elif isinstance(msg, Abort):
            task = self.starting.get(msg.request_id)
            if task is not None:
                task.cancel()
            else:
                self.edge.cancel(msg.request_id)
        elif isinstance(msg, CountError):            # fire and forget
            self.edge.count_error(msg.status)
        elif isinstance(msg, Call):
            asyncio.create_task(self._answer(msg))
        else:
            raise IpcError(f"unexpected {type(msg).__name__} from the frontend")

    async def _start(self, msg: Generate) -> None:
        rid = msg.request_id
        try:
            await self.edge.submit(EngineRequest(rid, msg.prompt_ids, msg.params, group=msg.group,
                                                 priority=msg.priority, cache_salt=msg.cache_salt,
                                                 tenant=msg.tenant, weight=msg.weight, adapter=msg.adapter,
                                                 traceparent=msg.traceparent),
                                   partial(self._emit, rid))
        except asyncio.CancelledError:
            pass                                     # aborted by the frontend (client went away)
        except RequestError as exc:
            self._send(Failed(rid, str(exc), "request", exc.param, exc.code))
        except Exception as exc:
            log.exception("request %s failed", rid)
            self._send(Failed(rid, str(exc) or type(exc).__name__))
        finally:
            self.starting.pop(rid, None)

    def _emit(self, rid: str, item: Output) -> None:
        """The request's sink, called from the engine's dispatch for each output."""
        if isinstance(item, EngineDead):
            self._send(Failed(rid, str(item) or type(item).__name__))
            return
        if not self.pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self.pending.append(item)

    async def _answer(self, msg: Request) -> None:
        try:
            reply = await answer(self.edge, msg)
        except Exception as exc:
            log.exception("%s failed", type(msg).__name__)
            self._send(RequestFailed(msg.id, str(exc) or type(exc).__name__))
        else:
            self._send(reply)

    def _flush(self) -> None:
        if self.pending:
            items, self.pending = self.pending, []
            assert self.writer is not None          # outputs come only once `run` serves
            self.writer.write(encode(Outputs(items)))

    def _send(self, msg: Message) -> None:
        self._flush()                                # keep order: earlier outputs first
        assert self.writer is not None
        if not self.writer.is_closing():
            self.writer.write(encode(msg))


def _serves_edge_service(client: NodeProcessClient) -> EdgeService:
    """Never called: the type checker proves here that the frontend's `NodeProcessClient` implements `EdgeService`,
    the calls this process answers for the `EdgeNode` it serves."""
    return client
