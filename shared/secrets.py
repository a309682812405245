"""Reading secrets (cluster secret, API keys) from files or the environment; HOST:PORT and loopback checks.

Secrets never come from command-line values (they would show in `ps`); a file
path or EDGECORE_SECRET / EDGECORE_API_KEYS is required.
"""

from __future__ import annotations

import os
from pathlib import Path

from edgecore.shared.errors import ConfigError


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
    """One key per line (blank lines and # comments ignored), or EDGECORE_API_KEYS (comma-separated)."""
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"API key file {path} does not exist")
        keys = [line.strip() for line in p.read_text().splitlines()]
        keys = [k for k in keys if k and not k.startswith("#")]
        if not keys:
            raise ConfigError(f"API key file {path} holds no key")
        return [k.encode() for k in keys]
    env = os.environ.get("EDGECORE_API_KEYS", "")
    return [k.strip().encode() for k in env.split(",") if k.strip()]


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
