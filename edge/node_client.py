"""The HTTP frontend's handle on the edge engine process (see edge/node_process.py).

Life cycle: `start()` makes a socketpair, starts `edgecore edge <same flags>
--engine-fd N` with the child end, and `connect()`s: waits for its `Hello`
(the model is loaded). `generate()` sends `Generate` and yields the request's outputs as
they arrive; a caller that stops early sends `Abort`. `get_stats()`,
`get_metrics()`, `get_readiness()` and `prefetch()` send typed requests
(edge/ipc.py) answered by the engine process with typed replies. If that
process exits, every waiting request gets
`EngineDead`, `ready` turns false, and `on_death` runs (the CLI shuts the
frontend down, so a supervisor restarts the pair). `stop()` closes the socket
(the engine process then ends) and reaps the process.

It implements `EdgeService` (edge/service.py), as the in-process `EdgeNode`
does, so `EdgeHTTP` serves either.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import subprocess
import sys
from typing import TypeVar
from collections.abc import AsyncIterator, Callable

from edgecore.edge.ipc import (Abort, AdapterReply, CallReply, CountError, Failed, FrameBuffer, Generate, GetMetrics,
                               GetReadiness, GetStats, Hello, IpcError, LoadAdapter, Message, MetricsReply, Outputs,
                               Prefetch, PrefetchReply, ReadinessReply, RequestFailed, StatsReply, UnloadAdapter,
                               encode)
from edgecore.shared.engine.output import RequestOutput
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.errors import EdgecoreError, EngineDead, RequestError
from edgecore.shared.errors import AdapterError
from edgecore.shared.text.tokenizer import Tokenizer

log = logging.getLogger("edgecore.edge.node_client")

R = TypeVar("R", StatsReply, MetricsReply, ReadinessReply, PrefetchReply, AdapterReply)


class NodeProcessClient:
    def __init__(self, argv: list[str], model_dir: str):
        """argv: the `edgecore` arguments of this edge (from `edge` on); model_dir: the model to serve."""
        self.argv, self.model_dir = argv, model_dir
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.active = 0
        self.hello: Hello | None = None
        self._adapters: dict[str, str] = {}
        self.dead: str | None = None
        self.on_death: Callable[[], None] | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._replies: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._proc: subprocess.Popen | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._stopping = False

    # ---- life cycle ------------------------------------------------------------
    async def start(self) -> None:
        parent, child = socket.socketpair()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "edgecore", *self.argv, "--model", self.model_dir,
                 "--engine-fd", str(child.fileno())], pass_fds=[child.fileno()], stdout=subprocess.DEVNULL)
        finally:
            child.close()
        await self.connect(parent)

    async def connect(self, sock: socket.socket) -> None:
        """Talk to an engine process (or an `NodeProcessServer` in this process, in tests) over `sock`; returns
        once it said `Hello`."""
        reader, self._writer = await asyncio.open_connection(sock=sock)
        frames = FrameBuffer()
        first: list[Message] = []
        while not first:                      # the engine process loads the model, then says Hello
            data = await reader.read(1 << 16)
            if not data:
                code = await asyncio.to_thread(self._proc.wait) if self._proc is not None else None
                raise EdgecoreError(f"the engine process exited (code {code}) before it was ready; "
                                    "its error is above")
            first = frames.feed(data)
        if not isinstance(first[0], Hello) or len(first) > 1:     # nothing was asked of it yet
            raise IpcError(f"the engine process began with {type(first[0]).__name__}, not Hello")
        self.hello = first[0]
        self._adapters = dict(self.hello.adapters)
        self._reader_task = asyncio.create_task(self._read(reader, frames))

    async def stop(self) -> None:
        self._stopping = True
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            await asyncio.gather(self._reader_task, return_exceptions=True)
        if self._proc is not None and self._proc.poll() is None:
            try:
                await asyncio.wait_for(asyncio.to_thread(self._proc.wait), 15)
            except TimeoutError:
                self._proc.kill()
                await asyncio.to_thread(self._proc.wait)

    # ---- what EdgeHTTP uses ---------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.hello is not None and self.dead is None

    @property
    def max_model_len(self) -> int:
        assert self.hello is not None            # connected
        return self.hello.max_model_len

    @property
    def vocab_size(self) -> int:
        assert self.hello is not None            # connected
        return self.hello.vocab_size

    @property
    def fingerprint(self) -> str:
        assert self.hello is not None            # connected
        return self.hello.fingerprint

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, group: str | None = None,
                       cache_salt: str | None = None, *, tenant: str | None = None, weight: float = 1.0,
                       priority: int = 0, adapter: str | None = None, traceparent: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        if self.dead is not None:
            raise EngineDead(self.dead)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        self.active += 1
        finished = False
        try:
            self._send(Generate(request_id, prompt_ids, params, group, cache_salt, tenant, weight, priority, adapter,
                                traceparent))
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self.active -= 1
            self._streams.pop(request_id, None)
            if not finished and self.dead is None:
                self._send(Abort(request_id))

    async def prefetch(self, prompt_ids: list[int]) -> dict:
        r = await self._request(lambda i: Prefetch(i, prompt_ids), PrefetchReply)
        return {"tokens": r.tokens, "cached_tokens": r.cached_tokens, "source": r.source}

    @property
    def adapters(self) -> dict[str, str]:
        """LoRA adapters the engine process serves: name → fingerprint (from Hello, then loads and unloads)."""
        return self._adapters

    async def load_adapter(self, name: str, path: str) -> str:
        reply = await self._request(lambda i: LoadAdapter(i, name, path), AdapterReply)
        if reply.error is not None:
            raise AdapterError(reply.error, reply.param or "lora_path")
        self._adapters[name] = reply.fingerprint
        return reply.fingerprint

    async def unload_adapter(self, name: str) -> None:
        reply = await self._request(lambda i: UnloadAdapter(i, name), AdapterReply)
        if reply.error is not None:
            raise AdapterError(reply.error, reply.param or "lora_name")
        self._adapters.pop(name, None)

    async def get_stats(self) -> dict:
        stats = (await self._request(GetStats, StatsReply)).stats
        if self._proc is not None:
            stats["engine_pid"] = self._proc.pid
        return stats

    async def get_metrics(self) -> str:
        return (await self._request(GetMetrics, MetricsReply)).text

    async def get_readiness(self) -> dict:
        if not self.ready:
            return {"ready": False, "cores_healthy": 0}
        r = await self._request(GetReadiness, ReadinessReply)
        return {"ready": r.ready, "cores_healthy": r.cores_healthy}

    def count_error(self, status: str) -> None:
        """Fire and forget: an error answered while the engine process is going away (a drain's last moments)
        is not counted, and never turns the answer into another error."""
        if self.dead is None and self._writer is not None and not self._writer.is_closing():
            self._send(CountError(status))

    # ---- internals -------------------------------------------------------------
    def _send(self, msg: Message) -> None:
        assert self._writer is not None         # connected
        if self._writer.is_closing():
            raise EngineDead(self.dead or "the engine process connection is closed")
        self._writer.write(encode(msg))

    async def _request(self, make: Callable[[int], Message], expect: type[R]) -> R:
        """Send the request `make(id)` and wait for its reply, which must be an `expect`."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        call_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._replies[call_id] = fut
        try:
            self._send(make(call_id))
            reply = await fut
        finally:
            self._replies.pop(call_id, None)
        if not isinstance(reply, expect):
            raise IpcError(f"the engine process answered {type(reply).__name__} to a {expect.__name__} request")
        return reply

    async def _read(self, reader: asyncio.StreamReader, frames: FrameBuffer) -> None:
        reason = "the engine process closed its connection"
        try:
            while data := await reader.read(1 << 16):
                for msg in frames.feed(data):
                    self._dispatch(msg)
        except (ConnectionError, IpcError) as exc:
            reason = f"the engine process connection failed: {exc}"
        finally:
            self._die(reason)

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, Outputs):
            streams = self._streams
            for out in msg.items:
                queue = streams.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
        elif isinstance(msg, CallReply):
            fut = self._replies.get(msg.id)
            if fut is not None and not fut.done():
                if isinstance(msg, RequestFailed):
                    fut.set_exception(EngineDead(f"engine call failed: {msg.error}"))
                else:
                    fut.set_result(msg)
        elif isinstance(msg, Failed):
            queue = self._streams.get(msg.request_id)
            if queue is not None:
                queue.put_nowait(RequestError(msg.message, msg.param, msg.code) if msg.kind == "request"
                                 else EngineDead(f"engine failed: {msg.message}"))
        else:
            log.warning("ignoring unexpected %s from the engine process", type(msg).__name__)

    def _die(self, reason: str) -> None:
        if self.dead is not None:
            return
        if self._proc is not None and self._proc.poll() is not None:
            reason = f"{reason} (exit code {self._proc.returncode})"
        self.dead = reason
        error = EngineDead(reason)
        for queue in self._streams.values():
            queue.put_nowait(error)
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(error)
        if self.on_death is not None and not self._stopping:
            log.error("%s; shutting the edge down", reason)
            self.on_death()
