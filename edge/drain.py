"""The edge's drain (SIGTERM): what its HTTP endpoint refuses from the moment it begins.

Life cycle: `Drain()` with the endpoint; `check()` at the start of every generation or context request
refuses it with 503 `server_shutting_down` (Retry-After 1) once `start()` was called; `first_output(outputs)`
awaits a request's first output and, if the drain begins first, aborts the request (the pending `anext` is
cancelled: the engine frees it) and refuses it the same way: nothing of it was sent, so another replica can
serve it whole, and the drain does not wait for a queue. Requests past their first output are the drain's
to wait for (`EdgeHTTP.drained`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

from edgecore.shared.openai.request import ApiError

T = TypeVar("T")


class Drain:
    def __init__(self) -> None:
        self.draining = False
        self._unstarted: set[asyncio.Future[None]] = set()   # one per request waiting for its first output

    def start(self) -> None:
        self.draining = True
        for waiter in self._unstarted:
            if not waiter.done():
                waiter.set_result(None)

    def check(self) -> None:
        if self.draining:
            raise ApiError(503, "The server is shutting down; retry on another replica", None,
                           "server_shutting_down", headers={"retry-after": "1"})

    async def first_output(self, outputs: AsyncIterator[T]) -> T | None:
        """The first of `outputs` (None if there is none), or the drain's 503 if the drain begins before it."""
        self.check()
        first = asyncio.ensure_future(anext(outputs, None))
        drain = asyncio.get_running_loop().create_future()
        self._unstarted.add(drain)
        try:
            await asyncio.wait((first, drain), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._unstarted.discard(drain)
            if not first.done():         # the drain came first (or this handler is being cancelled): abort it
                first.cancel()
                await asyncio.gather(first, return_exceptions=True)
        if first.cancelled():
            self.check()
        return first.result()
