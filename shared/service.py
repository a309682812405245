"""Running a node until SIGINT/SIGTERM: event loop choice, logging, clean shutdown.

Life cycle: `run_service(start, stop)` installs uvloop when available, sets
up logging, awaits `start()`, waits for a termination signal (or for the
future `start()` may return, e.g. a connection the node lives for), then
awaits `stop()`; the exit status is 0, or an int that future ended with. A signal that comes while `start()`
is still running cancels it, then awaits `stop()`. Used by `edgecore core` and `edgecore edge`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable


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

    async def main() -> int:
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, done.set)
        signalled = asyncio.ensure_future(done.wait())
        # A signal while starting (a model loading, a decode step compiling) stops the node there.
        starting = asyncio.ensure_future(start())
        await asyncio.wait([starting, signalled], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            try:
                await stop()
            except Exception as exc:       # parts never started: stopping them may fail; leaving must not
                logging.getLogger("edgecore").warning("stopping a node that had not started: %s", exc)
            return 0
        finished = starting.result()    # optionally a future: when it completes, the service ends too
        waiters = [signalled] + ([finished] if finished is not None else [])
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiters[0].cancel()
            await stop()
        # A future that ended the service may carry an exit status (e.g. 1: a helper process died);
        # one that failed re-raises here.
        return (finished.result() or 0) if finished is not None and finished.done() else 0

    return asyncio.run(main())
