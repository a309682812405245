"""Listening for HTTP (edge API, core control port) with limits a slow or hostile client cannot get around.

Life cycle of a connection: accepted → over `max_connections` open ones it
gets a JSON 503 and is closed at once; otherwise its request headers must be
complete within `header_timeout` of connecting (and, on a kept-alive
connection, within `keepalive_timeout + header_timeout` of the previous
response), else the connection is closed — a slowloris client holds a socket
for seconds, not minutes. While a request is handled no header clock runs
(bodies are bounded by `body_timeout` where they are read, `json_body`).
Requests aiohttp cannot parse get an OpenAI-style JSON 400 and one
rate-limited log line, never a traceback; a traceback is logged only for an
error of our own (500), and those are rate-limited too (`log_budget.py`).

`start_site(app, host, port, limits)` sets this up and returns
(runner, bound port); `runner.cleanup()` stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from ssl import SSLContext
from typing import Any, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from edgecore.shared.node.log_budget import limit_logger
from edgecore.shared.node.tls import ServerTLS

log = logging.getLogger("edgecore.http")


@dataclass(frozen=True)
class ServerLimits:
    header_timeout: float = 10.0        # seconds from connect (or the last response) to complete headers
    body_timeout: float = 30.0          # seconds to read a JSON body (json_body)
    keepalive_timeout: float = 30.0     # an idle kept-alive connection is closed after this
    max_connections: int = 1024         # open connections; more get a 503 and are closed

    def __post_init__(self) -> None:
        for name in ("header_timeout", "body_timeout", "keepalive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")


LIMITS_KEY = web.AppKey("edgecore_server_limits", ServerLimits)

_BUSY = (b'HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n'
         b'Retry-After: 1\r\nContent-Length: %d\r\n\r\n%s')
_BUSY_BODY = (b'{"error":{"message":"The server has too many open connections; retry shortly",'
              b'"type":"server_error","param":null,"code":"too_many_connections"}}')
_BUSY_RESPONSE = _BUSY % (len(_BUSY_BODY), _BUSY_BODY)


def json_error(status: int, message: str, code: str | None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    resp = web.json_response({"error": {"message": message, "type": kind, "param": None, "code": code}},
                             status=status)
    return resp


def _first_line(what: object) -> str:
    lines = str(what or "bad request").strip().splitlines()
    return lines[0][:200] if lines else "bad request"


class GuardedHandler(RequestHandler):
    """aiohttp's connection protocol plus the connection cap, the header clock and JSON parse errors."""

    def __init__(self, manager: web.Server, *, limits: ServerLimits, **kwargs: Any):
        super().__init__(manager, **kwargs)
        self.limits = limits
        self.rejected = False
        self.header_clock: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert self._manager is not None            # set until connection_lost
        if len(self._manager.connections) >= self.limits.max_connections:
            self.rejected = True
            log.warning("refused a connection: %d open (limit %d)", len(self._manager.connections),
                        self.limits.max_connections)
            cast(asyncio.Transport, transport).write(_BUSY_RESPONSE)
            transport.close()
            return
        super().connection_made(transport)
        self._arm(self.limits.header_timeout)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        if not self.rejected:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self.rejected:
            super().data_received(data)

    async def _handle_request(self, request: BaseRequest, start_time: float | None,
                              request_handler: Callable[[BaseRequest], Awaitable[web.StreamResponse]]
                              ) -> tuple[web.StreamResponse, bool]:
        self._disarm()                  # headers are complete: no header clock while we answer
        try:
            resp, reset = await super()._handle_request(request, start_time, request_handler)
            if resp is not None and resp.status == 408:
                self.force_close()      # a body too slow to arrive: no lingering read of the rest
            return resp, reset
        finally:
            if self.transport is not None:
                self._arm(self.limits.keepalive_timeout + self.limits.header_timeout)

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.Response:
        """aiohttp's answer to a request it could not parse (or a handler that escaped our middleware)."""
        if isinstance(exc, ConnectionError) and request.writer.output_size > 0:
            pass                        # the response had started: the connection is closed below
        elif status >= 500:
            log.error("error handling a request from %s", request.remote, exc_info=exc)
        else:
            log.info("bad HTTP request from %s: %s", request.remote, _first_line(message or exc))
        if request.writer.output_size > 0:
            raise ConnectionError("the response was already started; closing the connection")
        text = "internal error" if status >= 500 else f"Malformed HTTP request: {_first_line(message or exc)}"
        resp = json_error(status, text, "internal_error" if status >= 500 else "bad_http_request")
        resp.force_close()
        return resp

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self.header_clock = self._loop.call_later(seconds, self._expire)

    def _disarm(self) -> None:
        if self.header_clock is not None:
            self.header_clock.cancel()
            self.header_clock = None

    def _expire(self) -> None:
        self.header_clock = None
        if not self._request_in_progress and self.transport is not None:
            log.info("closed a connection from %s: no complete request headers within the timeout",
                     (self.transport.get_extra_info("peername") or ("?",))[0])
            self.force_close()


class GuardedSite(web.TCPSite):
    """A TCP site whose connections are `GuardedHandler`s."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, limits: ServerLimits,
                 ssl: SSLContext | None = None):
        super().__init__(runner, host, port, ssl_context=ssl)
        self.limits = limits
        self.ssl = ssl

    async def start(self) -> None:
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None           # the runner is set up (as aiohttp's TCPSite.start asserts too)
        kwargs = dict(server._kwargs)     # aiohttp's handler settings (keep-alive, access log, sizes)

        def factory() -> GuardedHandler:
            return GuardedHandler(server, loop=loop, limits=self.limits, **kwargs)
        self._server = await loop.create_server(
            factory, self._host, self._port, reuse_address=True, ssl=self.ssl,
            ssl_handshake_timeout=self.limits.header_timeout if self.ssl else None)   # a slow handshake: dropped


async def start_site(app: web.Application, host: str, port: int, limits: ServerLimits,
                     handler_cancellation: bool = False, tls: ServerTLS | None = None) -> tuple[web.AppRunner, int]:
    """Bind `app` on host:port with `limits` (HTTPS with `tls`, its certificate re-read while the site
    runs). Returns (runner, bound port)."""
    limit_logger("edgecore.http")
    limit_logger("aiohttp.server")
    app[LIMITS_KEY] = limits
    if tls is not None:
        async def reloads(_: web.Application) -> AsyncIterator[None]:
            task = asyncio.create_task(tls.watch())
            yield
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        app.cleanup_ctx.append(reloads)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=handler_cancellation,
                           keepalive_timeout=limits.keepalive_timeout)
    await runner.setup()
    site = GuardedSite(runner, host, port, limits, tls.context if tls is not None else None)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    server = cast(asyncio.Server, site._server)     # set by GuardedSite.start (loop.create_server)
    return runner, server.sockets[0].getsockname()[1]


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """The server-limit flags of `edgecore edge` and `edgecore core` (control port)."""
    d = ServerLimits()
    p.add_argument("--max-connections", type=int, default=d.max_connections,
                   help=f"open HTTP connections; more get a 503 and are closed (default {d.max_connections})")
    p.add_argument("--header-timeout", type=float, default=d.header_timeout,
                   help=f"seconds a client has to send complete request headers (default {d.header_timeout:g})")
    p.add_argument("--body-timeout", type=float, default=d.body_timeout,
                   help=f"seconds a client has to send a JSON request body (default {d.body_timeout:g})")
    p.add_argument("--keepalive-timeout", type=float, default=d.keepalive_timeout,
                   help=f"seconds an idle kept-alive connection stays open (default {d.keepalive_timeout:g})")


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    from edgecore.shared.errors import ConfigError
    try:
        return ServerLimits(args.header_timeout, args.body_timeout, args.keepalive_timeout, args.max_connections)
    except ValueError as exc:
        flag = "--" + str(exc).split()[0].replace("_", "-")
        raise ConfigError(f"{flag}: {exc}") from None
