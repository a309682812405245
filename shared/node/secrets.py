"""Reading secrets (cluster secret, API keys) from files or the environment; HOST:PORT and loopback checks.

Secrets never come from command-line values (they would show in `ps`); a file
path or EDGECORE_SECRET / EDGECORE_API_KEYS is required.

API key file: one entry per line (blank lines and `#` comments ignored); an entry is `KEY`, or
`KEY salt=TENANT` to give that key's requests the cache salt TENANT (its tenant's prefix-cache scope: the
edge combines it with any request's own `cache_salt`, so a key's requests never share cached KV with
another tenant's, and no request can name another tenant's salt). The salt is the last field, starting with
`salt=`: a non-empty run of non-blank characters, at most `MAX_CACHE_SALT`. Several keys may share a salt
(one tenant's keys); a key given twice must have one salt. EDGECORE_API_KEYS holds the same entries,
comma-separated. Keys without a salt behave as before (one shared, unsalted cache).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from edgecore.shared.errors import ConfigError

MAX_CACHE_SALT = 256        # characters of a cache salt: an API key's, or a request's `cache_salt`
_SALTED = re.compile(r"(.*\S)\s+salt=(\S*)")


class ApiKey(bytes):
    """One API key as configured: its bytes (what a client presents), with its tenant's cache salt (`salt`;
    None: none). A bytes object everywhere a key is used as one."""
    salt: str | None

    def __new__(cls, key: bytes, salt: str | None = None) -> ApiKey:
        self = super().__new__(cls, key)
        self.salt = salt
        return self

    def __repr__(self) -> str:         # never the key itself (logs, tracebacks)
        return f"ApiKey(<{len(self)} bytes>, salt={self.salt!r})"


def parse_api_key(entry: str, where: str) -> ApiKey:
    """One entry, `KEY` or `KEY salt=TENANT` (see the module docstring); `where` names it in errors."""
    match = _SALTED.fullmatch(entry)
    if match is None:
        return ApiKey(entry.encode())
    key, salt = match.groups()
    if not salt or len(salt) > MAX_CACHE_SALT or "\0" in salt:
        raise ConfigError(f"{where}: the salt after 'salt=' must be 1-{MAX_CACHE_SALT} non-blank characters")
    return ApiKey(key.encode(), salt)


def read_secret(path: str | None, env: str = "EDGECORE_SECRET", required: bool = True) -> bytes | None:
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"secret file {path} does not exist")
        value = p.read_bytes().strip()
        if not value:
            raise ConfigError(f"secret file {path} is empty")
        return value
    text = os.environ.get(env, "").strip()
    if text:
        return text.encode()
    if required:
        raise ConfigError(f"a cluster secret is required: pass --secret-file or set {env}")
    return None


def read_api_keys(path: str | None) -> list[bytes]:
    """One entry per line (blank lines and # comments ignored), or EDGECORE_API_KEYS (comma-separated); each
    `KEY` or `KEY salt=TENANT` (module docstring). Every key returned is an `ApiKey`, carrying its salt."""
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"API key file {path} does not exist")
        lines = [(i, line.strip()) for i, line in enumerate(p.read_text().splitlines(), 1)]
        keys = [parse_api_key(e, f"API key file {path}, line {i}") for i, e in lines if e and not e.startswith("#")]
        if not keys:
            raise ConfigError(f"API key file {path} holds no key")
    else:
        env = os.environ.get("EDGECORE_API_KEYS", "")
        keys = [parse_api_key(e.strip(), "EDGECORE_API_KEYS") for e in env.split(",") if e.strip()]
    salts: dict[bytes, str | None] = {}
    for key in keys:
        if salts.setdefault(bytes(key), key.salt) != key.salt:
            raise ConfigError(f"{f'API key file {path}' if path else 'EDGECORE_API_KEYS'}: a key is listed twice "
                              f"with different salts")
    return list(keys)


def parse_hostport(value: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = default_host, value
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(f"'{value}' is not HOST:PORT") from None
    if not 0 <= number < 65536:
        raise ConfigError(f"port {number} in '{value}' is out of range")
    return (host.strip("[]") or default_host), number


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or 'localhost') reaches this machine only; '' and 0.0.0.0 are every interface."""
    import ipaddress
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False            # a host name: it may resolve to any interface
