"""Running a node until SIGINT/SIGTERM: event loop choice, logging, clean shutdown.

Life cycle: `run_service(start, stop)` installs uvloop when available, sets
up logging, awaits `start()`, waits for a termination signal (or for the
future `start()` may return, e.g. a connection the node lives for), then
awaits `stop()`; the exit status is 0, or an int that future ended with. A signal that comes while `start()`
is still running cancels it, then awaits `stop()`. Used by `edgecore core` and `edgecore edge`.

Graceful drain (`drain`, `drain_timeout` > 0): SIGTERM after the start first awaits `drain()` (the node refuses
new work and finishes what it has) for at most `drain_timeout` seconds, then `stop()`, exit status 0. A second
SIGTERM (or SIGINT) during the drain, or the node's own future ending, cuts it short: `stop()` at once, which
fails over what is left. SIGINT, and SIGTERM with `drain_timeout` 0, stop at once as before.
`ignore_sigterm`: a helper process that its parent stops (an edge's engine process, which lives until its
frontend leaves) ignores SIGTERM, so that a signal to the whole process group drains the node instead of
cutting the helper from under it.
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


def run_service(start: Callable[[], Awaitable[asyncio.Future | None]], stop: Callable[[], Awaitable[None]],
                drain: Callable[[float], Awaitable[None]] | None = None, drain_timeout: float = 0.0, *,
                ignore_sigterm: bool = False) -> int:
    """`drain(timeout)`: what SIGTERM runs before `stop()` when `drain_timeout` > 0 (see the module's docstring)."""
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass

    async def main() -> int:
        loop = asyncio.get_running_loop()
        done, again = asyncio.Event(), asyncio.Event()
        received: list[int] = []

        def on_signal(sig: int) -> None:
            received.append(sig)
            (again if done.is_set() else done).set()
        if ignore_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for sig in (signal.SIGINT,) if ignore_sigterm else (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
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
            if received[:1] == [signal.SIGTERM] and drain is not None and drain_timeout > 0:
                await _drain(drain, drain_timeout, again, finished)
        finally:
            waiters[0].cancel()
            await stop()
        # A future that ended the service may carry an exit status (e.g. 1: a helper process died);
        # one that failed re-raises here.
        return (finished.result() or 0) if finished is not None and finished.done() else 0

    try:
        return asyncio.run(main())
    finally:
        from edgecore.shared.node.tracing import shutdown
        shutdown()          # spans still buffered (--otlp-endpoint) leave before the process does


async def _drain(drain: Callable[[float], Awaitable[None]], timeout: float, again: asyncio.Event,
                 finished: asyncio.Future | None) -> None:
    """`drain(timeout)` until it returns, `timeout` passes, a second signal comes (`again`) or the node's own
    future ends; whichever is first."""
    log = logging.getLogger("edgecore")
    log.info("SIGTERM: draining (at most %g s; a second SIGTERM stops at once)", timeout)
    started = asyncio.get_running_loop().time()
    draining = asyncio.ensure_future(drain(timeout))
    interrupted = asyncio.ensure_future(again.wait())
    waiters: list[asyncio.Future] = [draining, interrupted] + ([finished] if finished is not None else [])
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        interrupted.cancel()
        if not draining.done():
            draining.cancel()
        await asyncio.gather(draining, return_exceptions=True)
    took = asyncio.get_running_loop().time() - started
    if draining.done() and not draining.cancelled() and draining.exception() is None:
        log.info("drained in %.1f s", took)
    elif again.is_set():
        log.warning("second signal after %.1f s of draining: stopping now; what is left fails over", took)
    elif finished is not None and finished.done():
        log.warning("the node ended during the drain (after %.1f s)", took)
    elif draining.done() and not draining.cancelled():
        log.warning("drain failed after %.1f s: %s", took, draining.exception())
    else:
        log.warning("drain timeout (%g s) reached: stopping; what is left fails over", timeout)
