"""Tenants: who may use a node, how much of it, and with what share of its engine.

The tenants file (`--tenants FILE`, TOML) holds one `[[tenant]]` table per tenant:

    [[tenant]]
    name = "acme"                     # 1-64 of A-Z a-z 0-9 _ . : - (a metric label, a log field)
    api_keys = ["9f86d0...", ...]     # SHA-256 hex digests of the tenant's keys (never the keys)
    requests_per_minute = 600         # optional limits (absent: none)
    tokens_per_minute = 200000        # prompt tokens + max_tokens asked, per minute
    max_concurrent = 32               # sequences (prompts × n) in flight
    weight = 3                        # share of the engine under contention (default 1)
    priority = 0                      # band: lower is served first, strictly (default 0)
    models = ["pydoc-llama"]          # allowed model names (default: all)
    cache_salt = "acme"               # prefix-cache scope (default: the name: tenants never share cached KV)

A digest is `sha256(key).hexdigest()` (`printf %s "$KEY" | sha256sum`).

Life cycle: the node loads the file at start-up with `TenantRegistry.load(path, models)`: a file that does not
parse, has an unknown field or a bad value, names a model the node does not serve, or repeats a name or a key
is a `ConfigError` naming its line, and the node does not start. The registry then answers `find(digest)` for
each request (a presented key is hashed once and its digest looked up in a dict: constant time in the key's
content, as `ApiKeys`), and at most once a second checks whether the file changed (mtime, size, inode): a
changed file is parsed again and replaces the old one; a bad one is logged once, in one line naming its line,
and the previous file stays in force. Each tenant's live state (`TenantState`: token buckets for the per-minute
limits, sequences in flight) is kept by name across reloads, its limits updated in place. A request is charged
before it is admitted (`TenantState.admit`: `RateLimited` when a limit is reached, with the seconds until it
would pass) and its `Grant` is finished when it ends, returning the tokens it reserved and did not generate.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta

from edgecore.shared.errors import ConfigError

log = logging.getLogger("edgecore.tenants")

MAX_BAND = 999            # tenant priority bands 0..MAX_BAND
BAND_SPAN = 1000          # a request's own priority (vLLM's `priority`, 0..BAND_SPAN-1) orders it inside its band
RELOAD_CHECK_S = 1.0      # the file is checked for changes at most this often
LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")

Name = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
Digest = Annotated[str, Meta(pattern=r"^[0-9a-fA-F]{64}$")]
PerMinute = Annotated[int, Meta(ge=1)]


class Tenant(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: Name
    api_keys: Annotated[list[Digest], Meta(min_length=1)]
    requests_per_minute: PerMinute | None = None
    tokens_per_minute: PerMinute | None = None
    max_concurrent: PerMinute | None = None
    weight: Annotated[float, Meta(gt=0, le=1e6)] = 1.0
    priority: Annotated[int, Meta(ge=0, le=MAX_BAND)] = 0
    models: list[str] | None = None
    cache_salt: Annotated[str, Meta(min_length=1, max_length=256, pattern=r"^[^\x00]*$")] | None = None

    @property
    def salt(self) -> str:
        """The tenant's prefix-cache scope."""
        return self.cache_salt or self.name

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models

    def engine_priority(self, request_priority: int = 0) -> int:
        """The engine's priority of a request of this tenant: its band, then the request's own priority."""
        return self.priority * BAND_SPAN + request_priority


class _File(msgspec.Struct, forbid_unknown_fields=True):
    tenant: list[Tenant] = []


class RateLimited(Exception):
    """A tenant's limit (`limit`, one of `LIMITS`) refuses a request; `retry_after` seconds until it would pass
    (None: never, the request alone is over the limit)."""

    def __init__(self, tenant: str, limit: str, value: int, retry_after: float | None):
        wait = f"; try again in {math.ceil(retry_after)}s" if retry_after is not None else \
            "; this request alone is over it"
        super().__init__(f"Rate limit reached for tenant '{tenant}' on {limit}: limit {value}{wait}")
        self.tenant, self.limit, self.value, self.retry_after = tenant, limit, value, retry_after


class TokenBucket:
    """`per_minute` units a minute: holds at most that many, refilled continuously; starts full."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.capacity = float(per_minute)
        self.level = self.capacity
        self.stamp = clock()

    @property
    def rate(self) -> float:
        return self.capacity / 60.0

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_for(self, cost: float) -> float | None:
        """Seconds until `cost` units are there (0: now; None: never, more than the bucket holds)."""
        if cost > self.capacity:
            return None
        self._refill()
        return 0.0 if self.level >= cost else (cost - self.level) / self.rate

    def take(self, cost: float) -> None:
        self._refill()
        self.level -= cost

    def give(self, units: float) -> None:
        """Units taken and not used (a request that generated fewer tokens than it reserved)."""
        self._refill()
        self.level = min(self.capacity, self.level + units)

    def resize(self, per_minute: int) -> None:
        self._refill()
        self.capacity = float(per_minute)
        self.level = min(self.level, self.capacity)

    def remaining(self) -> int:
        self._refill()
        return max(0, int(self.level))


def _bucket(old: TokenBucket | None, per_minute: int | None, clock: Callable[[], float]) -> TokenBucket | None:
    if per_minute is None:
        return None
    if old is None:
        return TokenBucket(per_minute, clock)
    old.resize(per_minute)
    return old


class TenantState:
    """One tenant's live state: its configuration (replaced on reload), buckets and sequences in flight."""

    def __init__(self, tenant: Tenant, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.in_flight = 0                  # sequences of this tenant's requests being served
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        self.configure(tenant)

    def configure(self, tenant: Tenant) -> None:
        self.tenant = tenant
        self.requests = _bucket(self.requests, tenant.requests_per_minute, self.clock)
        self.tokens = _bucket(self.tokens, tenant.tokens_per_minute, self.clock)

    @property
    def name(self) -> str:
        return self.tenant.name

    def admit(self, sequences: int, prompt_tokens: int, max_tokens: int) -> Grant:
        """Charge a request (its sequences, its prompt tokens and the output tokens it may generate) or raise
        `RateLimited` with nothing charged."""
        t = self.tenant
        if t.max_concurrent is not None and self.in_flight + sequences > t.max_concurrent:
            raise RateLimited(t.name, "max_concurrent", t.max_concurrent,
                              1.0 if sequences <= t.max_concurrent else None)
        cost = prompt_tokens + max_tokens
        for bucket, limit, units in ((self.requests, "requests_per_minute", 1),
                                     (self.tokens, "tokens_per_minute", cost)):
            if bucket is not None:
                wait = bucket.wait_for(units)
                if wait != 0.0:
                    raise RateLimited(t.name, limit, int(bucket.capacity), wait)
        if self.requests is not None:
            self.requests.take(1)
        if self.tokens is not None:
            self.tokens.take(cost)
        self.in_flight += sequences
        return Grant(self, sequences, max_tokens)


@dataclass
class Grant:
    """An admitted request's charge on its tenant, undone (in part) by `finish`."""
    state: TenantState
    sequences: int
    max_tokens: int                  # output tokens reserved in the token bucket
    generated: int = 0               # output tokens generated so far (counted by the caller)
    finished: bool = False

    def finish(self) -> None:
        """The request ended: its sequences leave, the tokens it reserved and did not generate return."""
        if self.finished:
            return
        self.finished = True
        self.state.in_flight -= self.sequences
        if self.state.tokens is not None and self.generated < self.max_tokens:
            self.state.tokens.give(self.max_tokens - self.generated)


class Tenants:
    """One parsed tenants file: the tenants in file order and their keys' digests."""

    def __init__(self, tenants: Iterable[Tenant]):
        self.tenants = tuple(tenants)
        self.by_digest = {bytes.fromhex(d): t for t in self.tenants for d in t.api_keys}

    @classmethod
    def load(cls, path: str, models: Iterable[str] | None = None) -> Tenants:
        p = Path(path)
        try:
            text = p.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"tenants file {path}: cannot be read ({exc})") from None
        return cls.parse(text, f"tenants file {path}", models)

    @classmethod
    def parse(cls, text: str, where: str, models: Iterable[str] | None = None) -> Tenants:
        """`where` names the file in errors; `models`: the model names this node serves (None: any)."""
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            at_end = str(exc).endswith("(at end of document)")
            raise ConfigError(f"{where}{f', line {len(text.splitlines()) + 1}' if at_end else ''}: {exc}") from None
        lines = _Lines(text)
        try:
            parsed = msgspec.convert(data, _File)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"{where}, {lines.of_error(str(exc))}") from None
        served = None if models is None else set(models)
        names: set[str] = set()
        seen: set[str] = set()
        for i, t in enumerate(parsed.tenant):
            if t.name in names:
                raise ConfigError(f"{where}, line {lines.key(i, 'name')}: tenant '{t.name}' is defined twice")
            names.add(t.name)
            for digest in t.api_keys:
                if digest.lower() in seen:
                    raise ConfigError(f"{where}, line {lines.key(i, 'api_keys', digest)}: tenant '{t.name}' "
                                      f"repeats a key digest already listed (each key belongs to one tenant)")
                seen.add(digest.lower())
            for model in t.models or ():
                if served is not None and model not in served:
                    raise ConfigError(f"{where}, line {lines.key(i, 'models', model)}: tenant '{t.name}' names "
                                      f"model '{model}', which this node does not serve ({', '.join(sorted(served))})")
        return cls(parsed.tenant)


_HEADER = re.compile(r"^\s*\[\[\s*tenant\s*\]\]")
_ASSIGN = re.compile(r"^\s*([A-Za-z0-9_-]+)\s*=")
_PATH = re.compile(r"\$\.tenant\[(\d+)\](?:\.([A-Za-z0-9_]+))?")


class _Lines:
    """Line numbers of the tenants file's tables and keys (tomllib gives values, not positions)."""

    def __init__(self, text: str):
        self.text = text.splitlines()
        self.headers = [n for n, line in enumerate(self.text, 1) if _HEADER.match(line)]

    def key(self, index: int, key: str | None = None, needle: str | None = None) -> int:
        """The line of tenant `index`'s `key` (of `needle` after it, for a list's item); else its header's."""
        if index >= len(self.headers):
            return 1
        start = self.headers[index]
        end = self.headers[index + 1] if index + 1 < len(self.headers) else len(self.text) + 1
        at = start
        for n in range(start + 1, end):
            match = _ASSIGN.match(self.text[n - 1])
            if match and match.group(1) == key:
                at = n
                break
        if needle is not None:
            for n in range(at, end):
                if needle in self.text[n - 1]:
                    return n
        return at

    def of_error(self, message: str) -> str:
        """'line N: ...' for a msgspec validation message (its path names the tenant and key)."""
        match = _PATH.search(message)
        text = re.sub(r" - at `\$[^`]*`$", "", message)
        if match is None:
            return f"line 1: {text}"
        key = match.group(2) or (re.findall(r"`([^`]+)`", message) or [None])[0]
        where = f"'{key}': " if match.group(2) else ""
        return f"line {self.key(int(match.group(1)), key)}: tenant {int(match.group(1)) + 1}: {where}{text}"


class TenantRegistry:
    """The live tenants of a node: the file in force, each tenant's state, and the reload on change."""

    def __init__(self, path: str, tenants: Tenants, models: Iterable[str] | None = None,
                 clock: Callable[[], float] = time.monotonic, on_change: Callable[[], None] | None = None):
        self.path, self.models, self.clock = path, None if models is None else list(models), clock
        self.on_change = on_change           # called after a reload took effect (metrics drop removed tenants)
        self.states: dict[str, TenantState] = {}
        self._digests: dict[bytes, TenantState] = {}
        self._apply(tenants)
        self._signature = self._stat()
        self._checked = clock()

    @classmethod
    def load(cls, path: str, models: Iterable[str] | None = None,
             clock: Callable[[], float] = time.monotonic) -> TenantRegistry:
        """The file read and checked (a `ConfigError` naming its line when it is bad)."""
        models = None if models is None else list(models)
        return cls(path, Tenants.load(path, models), models, clock)

    def __bool__(self) -> bool:
        return True

    @property
    def names(self) -> list[str]:
        return list(self.states)

    def find(self, digest: bytes) -> TenantState | None:
        """The tenant whose key has SHA-256 `digest` (None: no tenant's); first re-reads a changed file."""
        self.maybe_reload()
        return self._digests.get(digest)

    def _apply(self, tenants: Tenants) -> None:
        states = {}
        for t in tenants.tenants:
            state = self.states.get(t.name)
            if state is None:
                state = TenantState(t, self.clock)
            else:
                state.configure(t)
            states[t.name] = state
        self.states = states
        self._digests = {d: states[t.name] for d, t in tenants.by_digest.items()}

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def maybe_reload(self, force: bool = False) -> bool:
        """Re-read the file if it changed (checked at most every `RELOAD_CHECK_S`); True when a new file took
        effect. A bad or missing file is logged once and the previous one stays."""
        now = self.clock()
        if not force and now - self._checked < RELOAD_CHECK_S:
            return False
        self._checked = now
        signature = self._stat()
        if signature == self._signature:
            return False
        self._signature = signature          # a bad file is reported once, until it changes again
        try:
            tenants = Tenants.load(self.path, self.models)
        except ConfigError as exc:
            log.warning("%s; keeping the previous tenants", exc)
            return False
        self._apply(tenants)
        log.info("tenants file %s reloaded: %d tenant(s)", self.path, len(self.states))
        if self.on_change is not None:
            self.on_change()
        return True
