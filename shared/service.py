"""Running a node until SIGINT/SIGTERM: event loop choice, logging, clean shutdown.

Life cycle: `run_service(start, stop)` installs uvloop when available, sets
up logging, awaits `start()`, waits for a termination signal (or for the
future `start()` may return, e.g. a connection the node lives for), then
awaits `stop()`; the exit status is 0, or an int that future ended with. Used by `edgecore core` and `edgecore edge`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import Awaitable, Callable


def setup_logging(prefix: str = "") -> None:
    level = os.environ.get("EDGECORE_LOG_LEVEL", "INFO").upper()
    fmt = f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=getattr(logging, level, logging.INFO), format=fmt, stream=sys.stderr)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def run_service(start: Callable[[], Awaitable[asyncio.Future | None]], stop: Callable[[], Awaitable[None]]) -> int:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass

    async def main():
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, done.set)
        finished = await start()        # optionally a future: when it completes, the service ends too
        waiters = [asyncio.ensure_future(done.wait())] + ([finished] if finished is not None else [])
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiters[0].cancel()
            await stop()
        # A future that ended the service may carry an exit status (e.g. 1: a helper process died);
        # one that failed re-raises here.
        return (finished.result() or 0) if finished is not None and finished.done() else 0

    return asyncio.run(main())
