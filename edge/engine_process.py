"""The edge's engine process: an `EdgeEngine` served to the HTTP frontend over a socket.

Why a process of its own: the engine thread drives the model from Python and
takes the GIL back after every tensor op; an HTTP loop in the same process
that writes to dozens of sockets per step hands the GIL back and forth with
it, and the engine ran 25-35% slower for it. Here the engine process's event
loop does little per token (no HTTP, one socket write per step).

Life cycle: `edgecore edge` (the frontend, edge/engine_client.py) starts this
process with its own flags plus `--engine-fd`, the child end of a socketpair.
The process loads the model, starts the `EdgeEngine` (engine thread, core
connections), sends `Hello`, then serves frames until the socket closes:
`Generate` starts a task forwarding that request's outputs, `Abort` cancels
it (which aborts the request here and at its core), `Call` runs one of
`CALLS`. Outputs produced in one event-loop turn leave in one `Outputs` frame.
When the frontend goes away, every request is cancelled and the process ends.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from edge.engine import EdgeEngine
from edge.ipc import Abort, Call, Failed, FrameBuffer, Generate, Hello, IpcError, Message, Outputs, Reply, encode
from shared.engine.output import RequestOutput
from shared.errors import RequestError

log = logging.getLogger("edgecore.edge.engine_process")

# Call.method → coroutine function of (edge, arg)
CALLS = {
    "stats": lambda edge, _: edge.get_stats(),
    "metrics": lambda edge, _: edge.get_metrics(),
    "readiness": lambda edge, _: edge.get_readiness(),
    "prefetch": lambda edge, ids: edge.prefetch(ids),
}


class EngineServer:
    def __init__(self, edge: EdgeEngine, sock: socket.socket):
        self.edge = edge
        self.sock = sock
        self.tasks: dict[str, asyncio.Task] = {}
        self.pending: list[RequestOutput] = []
        self.writer: asyncio.StreamWriter | None = None

    async def run(self) -> None:
        """Serve the frontend until it closes the socket."""
        reader, self.writer = await asyncio.open_connection(sock=self.sock)
        cfg = self.edge.engine.config
        self._send(Hello(self.edge.max_model_len, cfg.vocab_size, self.edge.fingerprint))
        frames = FrameBuffer()
        try:
            while data := await reader.read(1 << 16):
                for msg in frames.feed(data):
                    self._handle(msg)
        except (ConnectionError, IpcError) as exc:
            log.error("frontend connection failed: %s", exc)
        finally:
            tasks = list(self.tasks.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.writer.close()

    def _handle(self, msg: Message) -> None:
        if isinstance(msg, Generate):
            self.tasks[msg.request_id] = asyncio.create_task(self._forward(msg))
        elif isinstance(msg, Abort):
            task = self.tasks.get(msg.request_id)
            if task is not None:
                task.cancel()
        elif isinstance(msg, Call):
            if msg.method == "count_error":          # fire and forget
                self.edge.count_error(str(msg.arg))
            else:
                asyncio.create_task(self._call(msg))
        else:
            raise IpcError(f"unexpected {type(msg).__name__} from the frontend")

    async def _forward(self, msg: Generate) -> None:
        rid = msg.request_id
        try:
            async for out in self.edge.generate(rid, msg.prompt_ids, msg.params):
                if not self.pending:
                    asyncio.get_running_loop().call_soon(self._flush)
                self.pending.append(out)
        except asyncio.CancelledError:
            pass                                     # aborted by the frontend (client went away)
        except RequestError as exc:
            self._send(Failed(rid, str(exc), "request", exc.param, exc.code))
        except Exception as exc:
            log.exception("request %s failed", rid)
            self._send(Failed(rid, str(exc) or type(exc).__name__))
        finally:
            self.tasks.pop(rid, None)

    async def _call(self, msg: Call) -> None:
        fn = CALLS.get(msg.method)
        if fn is None:
            self._send(Reply(msg.id, error=f"unknown call {msg.method!r}"))
            return
        try:
            result = await fn(self.edge, msg.arg)
        except Exception as exc:
            log.exception("call %s failed", msg.method)
            self._send(Reply(msg.id, error=str(exc) or type(exc).__name__))
        else:
            self._send(Reply(msg.id, result))

    def _flush(self) -> None:
        if self.pending:
            items, self.pending = self.pending, []
            self.writer.write(encode(Outputs(items)))

    def _send(self, msg: Message) -> None:
        self._flush()                                # keep order: earlier outputs first
        if not self.writer.is_closing():
            self.writer.write(encode(msg))
