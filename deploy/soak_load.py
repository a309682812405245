"""The soak's load: streamed completions against a fleet's edges, open loop (Poisson) or closed loop.

Life cycle: `Load(edge_urls, model, prompts)`; `closed(clients, seconds)` runs that many clients back to back
and returns requests/s (the capacity); `start(rate)` sends Poisson arrivals at `rate` requests/s from a thread,
each request in a pool thread; `stop()` stops sending and waits for the answers (at most `LOST_S`);
`results` holds one `Result` per request sent.

One request (`send`): a streamed `/v1/completions` (`include_usage`), its TTFT timed to the first token. It goes
to one edge (round robin); while that edge drains (503 `server_shutting_down`) or refuses connections it goes
to the next one, as a load balancer in front of the edges would, for at most `RETRY_S` s. Outcomes: completed
(every token and `[DONE]`), failed by cause (an HTTP error, an error event in the stream, a stream cut or
stalled after its first byte, no edge for `RETRY_S` s), or lost: no answer at all within `LOST_S` s, or still
unanswered when `stop()` gives up.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import itertools
import json
import random
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

RETRY_S = 60.0      # how long a request looks for an edge that takes it
LOST_S = 90.0       # no byte of an answer for this long: lost


@dataclass
class Result:
    sent: float                       # time.monotonic() when it was sent
    prompt_tokens: int
    ttft: float | None = None         # seconds to the first token
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
        self._stop = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=256, thread_name_prefix="soak-request")
        self._futures: list[concurrent.futures.Future] = []
        self._thread: threading.Thread | None = None

    # ---- closed loop: the capacity --------------------------------------------------------------
    def closed(self, clients: int, seconds: float) -> float:
        """Completed requests/s with `clients` sending back to back for `seconds` (not kept in `results`)."""
        end = time.monotonic() + seconds
        counts = [0] * clients

        def client(c: int) -> None:
            while time.monotonic() < end:
                if self.send(self._next_prompt(), keep=False).error is None:
                    counts[c] += 1
        threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(counts) / (time.monotonic() - started)

    # ---- open loop ------------------------------------------------------------------------------
    def start(self, rate: float) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._arrivals, args=(rate,), daemon=True)
        self._thread.start()

    def _arrivals(self, rate: float) -> None:
        at = time.monotonic()
        while not self._stop.is_set():
            at += self.rng.expovariate(rate)
            wait = at - time.monotonic()
            if wait > 0 and self._stop.wait(wait):
                return
            self._futures.append(self._pool.submit(self.send, self._next_prompt()))

    def stop(self) -> None:
        """Stop sending; wait for every answer, at most `LOST_S` s; what has none by then is lost."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        concurrent.futures.wait(self._futures, timeout=LOST_S + 10)
        for result in self.results:
            if result.done is None:
                result.lost = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _next_prompt(self) -> list[int]:
        return self.prompts[self.rng.randrange(len(self.prompts))]

    # ---- one request ------------------------------------------------------------------------------
    def send(self, ids: list[int], keep: bool = True) -> Result:
        result = Result(time.monotonic(), len(ids))
        if keep:
            self.results.append(result)
        first = next(self._counter)
        deadline = result.sent + RETRY_S
        for attempt in range(10_000):
            url = result.edge = self.urls[(first + attempt) % len(self.urls)]
            try:
                self._stream(url, ids, result)
                break
            except _Refused as exc:
                if time.monotonic() > deadline:
                    result.error = f"no edge took it: {exc}"
                    break
                result.retries += 1
                time.sleep(0.05 if attempt % len(self.urls) else 0.2)
        result.done = time.monotonic()
        return result

    def _stream(self, url: str, ids: list[int], result: Result) -> None:
        body = json.dumps({"model": self.model, "prompt": ids, "max_tokens": self.max_tokens, "temperature": 0,
                           "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
        req = urllib.request.Request(f"{url}/completions", data=body, headers={"Content-Type": "application/json"})
        try:
            resp = urllib.request.urlopen(req, timeout=LOST_S)
        except urllib.error.HTTPError as exc:
            try:
                code = json.loads(exc.read())["error"].get("code")
            except (ValueError, KeyError, TypeError, OSError):
                code = None
            if exc.code == 503 and code == "server_shutting_down":
                raise _Refused("draining") from None
            result.error = f"HTTP {exc.code} {code}"
            return
        except TimeoutError:
            result.error, result.lost = "no answer", True
            return
        except (ConnectionError, http.client.RemoteDisconnected, urllib.error.URLError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError):
                result.error, result.lost = "no answer", True
                return
            if isinstance(reason, (ConnectionError, http.client.RemoteDisconnected)):
                raise _Refused(type(reason).__name__) from None   # refused or closed before any answer
            raise
        with resp:
            self._read_events(resp, result)

    def _read_events(self, resp: http.client.HTTPResponse, result: Result) -> None:
        finished = False
        try:
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    finished = True
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = f"stream error {event['error'].get('code')}"
                    return
                if event.get("usage"):
                    result.tokens = event["usage"]["completion_tokens"]
                if result.ttft is None and event.get("choices"):
                    result.ttft = time.monotonic() - result.sent
        except TimeoutError:
            result.error = "stream stalled"
            return
        except (ConnectionError, http.client.HTTPException) as exc:
            result.error = f"stream cut ({type(exc).__name__})"
            return
        if not finished or result.tokens != self.max_tokens:
            result.error = f"stream ended early ({result.tokens} of {self.max_tokens} tokens)"
