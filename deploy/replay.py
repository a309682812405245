"""`edgecore replay`: send a trace to a running topology and measure what `edgecore plan` predicts.

Life cycle: `replay(trace, urls, ...)` opens one HTTP client (aiohttp session) per region, aimed at that
region's edge, and starts each request at its trace time (scaled by `speed`): a streamed
`POST /v1/completions` whose prompt is token ids of exactly `prompt_tokens` (the ids of a session are one
fixed sequence, so a session's later prompt starts with its earlier one and reaches the edge's prefix cache),
`max_tokens` = `output_tokens`, `ignore_eos`, greedy. It records when the first streamed token and the end
arrive; an HTTP error, a dropped stream, a short answer or `timeout` marks the request failed. `measured`
returns the records as the `Job`-like rows deploy/plan.py's `region_stats` reads, so the report has the
`--json` shape of `edgecore plan` (regions; nodes and links are empty: a client cannot see them).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass

from edgecore.deploy.trace import Request, Trace


@dataclass
class Measured:
    req: Request
    arrive: float             # seconds from the replay's start (when the request was sent)
    ttft: float = -1.0        # first token, same clock
    done: float = -1.0
    where: str = "failed"     # "remote": served (a client does not see where it was prefilled)
    error: str = ""


def prompt_ids(req: Request, index: int, vocab: int) -> list[int]:
    """`prompt_tokens` ids in [2, vocab): a session's fixed sequence, else one of the request's own."""
    key = req.session if req.session is not None else f"#{index}"
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little")
    span = vocab - 2
    return [(seed + i * 7919) % span + 2 for i in range(req.prompt_tokens)]


async def _one(session: object, url: str, model: str, req: Request, ids: list[int], start: float,
               timeout: float, record: Measured) -> None:
    import aiohttp
    assert isinstance(session, aiohttp.ClientSession)
    body = {"model": model, "prompt": ids, "max_tokens": req.output_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    tokens = 0
    try:
        async with asyncio.timeout(timeout):
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    record.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("choices"):
                        tokens += 1
                        if record.ttft < 0:
                            record.ttft = time.perf_counter() - start
        record.done = time.perf_counter() - start
        if record.ttft < 0 or tokens == 0:
            record.error = "no tokens streamed"
        else:
            record.where = "remote"
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"


async def replay(trace: Trace, urls: dict[str, str], model: str, vocab: int, api_key: str | None = None,
                 timeout: float = 120.0, speed: float = 1.0) -> list[Measured]:
    import aiohttp
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sessions = {region: aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None))
                for region in urls}
    records: list[Measured] = []
    tasks = []
    start = time.perf_counter()
    try:
        for i, req in enumerate(trace.requests):
            wait = start + req.t / speed - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            record = Measured(req, time.perf_counter() - start)
            records.append(record)
            tasks.append(asyncio.create_task(_one(sessions[req.region], urls[req.region].rstrip("/"), model, req,
                                                  prompt_ids(req, i, vocab), start, timeout, record)))
        await asyncio.gather(*tasks)
    finally:
        for s in sessions.values():
            await s.close()
    return records
