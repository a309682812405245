"""Running a node until SIGINT/SIGTERM: event loop choice, logging, clean shutdown.

Life cycle: `run_service(start, stop)` installs uvloop when available, sets
up logging, awaits `start()`, waits for a termination signal, then awaits
`stop()`. Used by `edgecore core` and `edgecore edge`.
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


def run_service(start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]) -> int:
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
        await start()
        try:
            await done.wait()
        finally:
            await stop()

    asyncio.run(main())
    return 0
