"""The soak's load: streamed completions against a fleet's edges, open loop (Poisson) or closed loop.

Life cycle: `Load(edge_urls, model, prompts)` starts its own event loop on a thread (one aiohttp session: the
client must stay cheap on the machine it shares with the fleet, so no thread per request); `closed(clients,
seconds)` runs that many clients back to back and returns requests/s (the capacity); `start(rate)` sends
Poisson arrivals at `rate` requests/s, each request a task created at its arrival time; `stop()` stops
sending, gives every request in flight up to `LOST_S` s from its arrival to end, and closes the loop;
`results` holds one `Result` per request sent, appended at its arrival.

One request (`send`): a streamed `/v1/completions` (`include_usage`), its TTFT timed from its arrival to the
first token. It goes to one edge (round robin); while that edge drains (503 `server_shutting_down`) or refuses
connections it goes to the next one, as a load balancer in front of the edges would, for at most `RETRY_S`
s; so does one an edge refuses at capacity (503 `server_overloaded`), as the `openai` client retries a 503. Outcomes: completed (every token and `[DONE]`), failed by cause (an HTTP error, an error event in the
stream, a stream cut or stalled after its first byte, no edge for `RETRY_S` s), or lost: no answer at all
within `LOST_S` s of its arrival (the run's end included).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import aiohttp

RETRY_S = 60.0      # how long a request looks for an edge that takes it
LOST_S = 90.0       # no answer this long after its arrival: lost


@dataclass
class Result:
    sent: float                       # time.monotonic() at its arrival
    prompt_tokens: int
    ttft: float | None = None         # seconds from its arrival to the first token
    done: float | None = None         # when it ended (any outcome)
    tokens: int = 0
    retries: int = 0                  # edges that refused it before one took it
    error: str | None = None          # the failure's cause; None when completed
    lost: bool = False
    edge: str = ""                    # the URL of the edge that answered last


class _Refused(Exception):
    """The edge did not take the request (draining, down): another edge may."""


class Load:
    def __init__(self, edge_urls: list[str], model: str, prompts: list[list[int]], max_tokens: int = 16,
                 seed: int = 0):
        self.urls, self.model, self.prompts, self.max_tokens = edge_urls, model, prompts, max_tokens
        self.rng = random.Random(seed)
        self.results: list[Result] = []
        self._counter = itertools.count()
        self._stopping = False
        self._closed = False
        self._tasks: set[asyncio.Task] = set()
        self._arrivals_done: Future | None = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="soak-load", daemon=True)
        self._thread.start()
        self.session: aiohttp.ClientSession = self._run(self._session())

    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @staticmethod
    async def _session() -> aiohttp.ClientSession:
        # a connection per request (a draining edge closes idle ones); no pool limit
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                     timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=LOST_S))

    # ---- closed loop: the capacity --------------------------------------------------------------
    def closed(self, clients: int, seconds: float) -> float:
        """Completed requests/s with `clients` sending back to back for `seconds` (not kept in `results`)."""
        async def run() -> float:
            end, started, count = time.monotonic() + seconds, time.monotonic(), 0

            async def client() -> None:
                nonlocal count
                while time.monotonic() < end:
                    if (await self.send(self._next_prompt(), keep=False)).error is None:
                        count += 1
            await asyncio.gather(*(client() for _ in range(clients)))
            return count / (time.monotonic() - started)
        return self._run(run())

    # ---- open loop ------------------------------------------------------------------------------
    def start(self, rate: float) -> None:
        self._stopping = False
        self._arrivals_done = asyncio.run_coroutine_threadsafe(self._arrivals(rate), self.loop)

    async def _arrivals(self, rate: float) -> None:
        at = time.monotonic()
        while not self._stopping:
            at += self.rng.expovariate(rate)
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            if self._stopping:
                return
            task = asyncio.ensure_future(self.send(self._next_prompt()))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def stop(self) -> None:
        """Stop sending; every request in flight gets up to `LOST_S` s from its arrival; what has no answer by
        then is lost. Then the session and the loop close (once: a second call does nothing)."""
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        if self._arrivals_done is not None:
            self._arrivals_done.result(30)

        async def drain() -> None:
            if self._tasks:
                last = max((r.sent for r in self.results), default=time.monotonic())
                await asyncio.wait(set(self._tasks), timeout=max(0.0, last + LOST_S + 5 - time.monotonic()))
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.session.close()
        self._run(drain())
        for result in self.results:
            if result.done is None:
                result.lost, result.error = True, result.error or "no answer"
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def _next_prompt(self) -> list[int]:
        return self.prompts[self.rng.randrange(len(self.prompts))]

    # ---- one request ------------------------------------------------------------------------------
    async def send(self, ids: list[int], keep: bool = True) -> Result:
        result = Result(time.monotonic(), len(ids))
        if keep:
            self.results.append(result)
        first = next(self._counter)
        deadline = result.sent + RETRY_S
        for attempt in range(10_000):
            url = result.edge = self.urls[(first + attempt) % len(self.urls)]
            try:
                await self._stream(url, ids, result)
                break
            except _Refused as exc:
                if time.monotonic() > deadline:
                    result.error = f"no edge took it: {exc}"
                    break
                result.retries += 1
                await asyncio.sleep(0.05 if attempt % len(self.urls) else 0.2)
        result.done = time.monotonic()
        return result

    async def _stream(self, url: str, ids: list[int], result: Result) -> None:
        body = {"model": self.model, "prompt": ids, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        answered = False                 # the response's head came: from then on a broken stream is a failure
        try:
            async with self.session.post(f"{url}/completions", json=body) as resp:
                answered = True
                if resp.status != 200:
                    try:
                        code = (await resp.json(content_type=None))["error"].get("code")
                    except (ValueError, KeyError, TypeError, aiohttp.ClientError):
                        code = None
                    if resp.status == 503 and code in ("server_shutting_down", "server_overloaded"):
                        raise _Refused(code)      # a load balancer (or the openai client) tries again
                    result.error = f"HTTP {resp.status} {code}"
                    return
                await self._read_events(resp, result)
        except TimeoutError:
            if answered:
                result.error = "stream stalled"
            else:
                result.error, result.lost = "no answer", True
        except aiohttp.ClientError as exc:
            if not answered and isinstance(exc, aiohttp.ClientConnectionError):
                raise _Refused(type(exc).__name__) from None    # refused, reset or closed before any answer
            result.error = f"stream cut ({type(exc).__name__})"

    async def _read_events(self, resp: aiohttp.ClientResponse, result: Result) -> None:
        finished, pending = False, b""
        async for data in resp.content.iter_any():
            *events, pending = (pending + data).split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: "):
                    continue
                if event == b"data: [DONE]":
                    finished = True
                elif b'"choices":[{' in event:          # a token chunk (parsed only when needed)
                    if result.ttft is None:
                        result.ttft = time.monotonic() - result.sent
                else:
                    chunk = json.loads(event[6:])
                    if "error" in chunk:
                        result.error = f"stream error {chunk['error'].get('code')}"
                        return
                    if chunk.get("usage"):
                        result.tokens = chunk["usage"]["completion_tokens"]
        if not finished or result.tokens != self.max_tokens:
            result.error = f"stream ended early ({result.tokens} of {self.max_tokens} tokens)"
