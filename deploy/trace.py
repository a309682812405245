"""Workload traces for `edgecore plan` and `edgecore replay`: the JSONL format, its checks, and synthetic traces.

Life cycle: `read_trace(path, regions)` reads a trace, one JSON object per line, each checked as it is read
(types, no negative time or count, a known region, times in order); any problem raises `TraceError` naming the
file and line. It returns the requests as a `Trace` (one tuple of `Request`s, in arrival order).
`generate(spec)` builds a synthetic trace from a seeded `GenerateSpec` (Poisson or bursty arrivals per region,
log-normal prompt and output lengths, sessions whose next request shares the previous one's context);
`write_trace` writes any trace in the same format. docs/plan.md documents the format.

One line:
    {"t": 0.125, "region": "edge-west", "prompt_tokens": 812, "output_tokens": 96,
     "session": "s17", "prefix_tokens": 640}
`t` seconds from the start of the trace (non-decreasing), `region` a region of the topology (the one whose
edges the user reaches), `prompt_tokens` ≥ 1, `output_tokens` ≥ 1; optional `session` (any string) and
`prefix_tokens` (how many leading prompt tokens are the session's previous request's prompt and output:
0 ≤ prefix_tokens ≤ prompt_tokens). Blank lines are skipped; unknown keys are errors.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from edgecore.shared.errors import ConfigError


class TraceError(ConfigError):
    pass


class Request(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    t: Annotated[float, Meta(ge=0)]
    region: str
    prompt_tokens: Annotated[int, Meta(ge=1)]
    output_tokens: Annotated[int, Meta(ge=1)]
    session: str | None = None
    prefix_tokens: Annotated[int, Meta(ge=0)] = 0


@dataclass(frozen=True)
class Trace:
    requests: tuple[Request, ...]

    @property
    def duration(self) -> float:
        return self.requests[-1].t if self.requests else 0.0

    def regions(self) -> set[str]:
        return {r.region for r in self.requests}


_DECODER = msgspec.json.Decoder(Request)
_ENCODER = msgspec.json.Encoder()


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    try:
        with path.open("rb") as f:
            yield from enumerate(f, 1)
    except OSError as exc:
        raise TraceError(f"trace {path} cannot be read: {exc}") from None


def read_trace(path: str | Path, regions: Collection[str] | None = None) -> Trace:
    """The requests of a JSONL trace; `regions`: the names a request may use (None: any)."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace {path} " + ("is not a file" if path.exists() else "does not exist"))
    known = set(regions) if regions is not None else None
    out: list[Request] = []
    last = 0.0
    for number, raw in _lines(path):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        try:
            req = _DECODER.decode(raw)
        except msgspec.ValidationError as exc:
            raise TraceError(f"{where}: {_explain(str(exc))}") from None
        except msgspec.DecodeError as exc:
            raise TraceError(f"{where}: not a JSON object ({exc})") from None
        if not math.isfinite(req.t):
            raise TraceError(f"{where}: 't' must be a finite number of seconds")
        if req.prefix_tokens > req.prompt_tokens:
            raise TraceError(f"{where}: 'prefix_tokens' ({req.prefix_tokens}) exceeds 'prompt_tokens' "
                             f"({req.prompt_tokens})")
        if req.prefix_tokens and req.session is None:
            raise TraceError(f"{where}: 'prefix_tokens' needs a 'session' (the tokens are shared with the "
                             f"session's previous request)")
        if known is not None and req.region not in known:
            raise TraceError(f"{where}: unknown region {req.region!r} (the topology's regions with edges: "
                             f"{', '.join(sorted(known)) or 'none'})")
        if req.t < last:
            raise TraceError(f"{where}: 't' {req.t} is earlier than the line before ({last}); sort the trace by time")
        last = req.t
        out.append(req)
    return Trace(tuple(out))


def _explain(message: str) -> str:
    """msgspec's message in the trace's words: 'Expected `int` >= 1 - at `$.prompt_tokens`' →
    "'prompt_tokens': Expected `int` >= 1"."""
    text, _, at = message.partition(" - at `$.")
    if at:
        return f"'{at.rstrip('`')}': {text}"
    if message.startswith("Object missing required field"):
        return "missing field " + message.split("`")[1].join("''")
    if message.startswith("Object contains unknown field"):
        return "unknown field " + message.split("`")[1].join("''")
    return message


def write_trace(trace: Trace, path: str | Path) -> None:
    with Path(path).open("wb") as f:
        for req in trace.requests:
            f.write(_ENCODER.encode(req) + b"\n")


@dataclass(frozen=True)
class GenerateSpec:
    """A synthetic workload: `requests` in all, arriving at `rate` per second over all `regions` (weights
    ∝ 1/(rank+1)^`skew`: 0 is uniform), Poisson or bursty (on/off: `burst_factor` × the rate while on, a
    share 1/burst_factor of the time); prompt and output lengths log-normal around their means (σ `spread`,
    capped at `max_prompt` / `max_output`); `session_share` of requests continue a session of their region
    (their prompt starts with the session's previous prompt and output)."""
    regions: tuple[str, ...]
    requests: int = 1000
    rate: float = 10.0
    arrivals: Literal["poisson", "bursty"] = "poisson"
    burst_factor: float = 4.0
    prompt_mean: int = 512
    output_mean: int = 64
    spread: float = 0.6
    max_prompt: int = 4096
    max_output: int = 1024
    session_share: float = 0.3
    skew: float = 0.0
    seed: int = 0

    def check(self) -> None:
        if not self.regions:
            raise TraceError("--generate needs at least one region with an edge")
        if self.requests < 0 or self.rate <= 0 or self.burst_factor < 1 or self.prompt_mean < 1 \
                or self.output_mean < 1 or self.spread < 0 or not 0 <= self.session_share <= 1 or self.skew < 0:
            raise TraceError("--generate: requests ≥ 0, rate > 0, burst factor ≥ 1, lengths ≥ 1, spread ≥ 0, "
                             "session share in [0, 1], skew ≥ 0")


def _length(rng: random.Random, mean: int, spread: float, cap: int) -> int:
    mu = math.log(mean) - spread * spread / 2          # the log-normal's mean is `mean`
    return max(1, min(cap, round(rng.lognormvariate(mu, spread))))


def generate(spec: GenerateSpec) -> Trace:
    spec.check()
    rng = random.Random(spec.seed)
    weights = [1 / (i + 1) ** spec.skew for i in range(len(spec.regions))]
    sessions: dict[str, list[tuple[str, int]]] = {r: [] for r in spec.regions}   # region → (session, context)
    t, on, switch = 0.0, True, 0.0
    on_rate = spec.rate * spec.burst_factor
    mean_on = 1.0                                     # seconds per on period (off periods last (factor − 1)×)
    out: list[Request] = []
    for i in range(spec.requests):
        if spec.arrivals == "poisson" or spec.burst_factor == 1:
            t += rng.expovariate(spec.rate)
        else:
            while True:                               # arrivals only while on
                if t >= switch:
                    on = not on
                    switch = t + rng.expovariate(1 / (mean_on if on else mean_on * (spec.burst_factor - 1)))
                    continue
                gap = rng.expovariate(on_rate) if on else math.inf
                if t + gap < switch:
                    t += gap
                    break
                t = switch
        region = rng.choices(spec.regions, weights)[0]
        output = _length(rng, spec.output_mean, spec.spread, spec.max_output)
        fresh = _length(rng, spec.prompt_mean, spec.spread, spec.max_prompt)
        open_sessions = sessions[region]
        if open_sessions and rng.random() < spec.session_share:
            k = rng.randrange(len(open_sessions))
            session, context = open_sessions[k]
            prefix = min(context, spec.max_prompt - 1)
            prompt = min(spec.max_prompt, prefix + max(1, fresh // 4))   # a follow-up adds a short turn
            open_sessions[k] = (session, prompt + output)
            out.append(Request(round(t, 6), region, prompt, output, session, prefix))
        else:
            session = f"s{i}"
            open_sessions.append((session, fresh + output))
            if len(open_sessions) > 64:
                open_sessions.pop(0)
            out.append(Request(round(t, 6), region, fresh, output, session))
    return Trace(tuple(out))
