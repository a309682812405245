"""HTTPS on a node's HTTP port (the edge's OpenAI endpoint, the core's control port): a server TLS context
from a certificate chain and its key, re-read when either file changes.

Life cycle: `ServerTLS(cert, key)` loads both at start (a missing file or a key that does not match the
certificate is a one-line `ConfigError`); the site serves with `.context` (TLS 1.2 or later, the stdlib's
server defaults); `watch()` is a task the node runs for its life: every `interval` seconds it compares the
files' modification times and sizes with what it loaded and, on a change, loads the new chain into the same
context, so new connections get the new certificate while open ones keep theirs (a renewed certificate needs
no restart). A reload that fails (a half-written file) is logged and retried at the next change; the old
certificate stays in use meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl

from edgecore.shared.errors import ConfigError

log = logging.getLogger("edgecore.tls")


class ServerTLS:
    def __init__(self, cert: str, key: str, interval: float = 2.0):
        self.cert, self.key, self.interval = cert, key, interval
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.reloads = 0
        self._stamp = self._files()
        try:
            self.context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot serve HTTPS with --tls-cert {cert} and --tls-key {key}: {exc}") from None

    def _files(self) -> tuple[tuple[float, int], ...]:
        try:
            return tuple((s.st_mtime, s.st_size) for s in (os.stat(self.cert), os.stat(self.key)))
        except OSError:
            return ()

    def reload_if_changed(self) -> bool:
        """Load the files again if they changed since the last load; True when a new chain is in use."""
        stamp = self._files()
        if not stamp or stamp == self._stamp:
            return False
        try:
            self.context.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            log.warning("kept the current certificate: reloading %s failed: %s", self.cert, exc)
            return False
        finally:
            self._stamp = stamp
        self.reloads += 1
        log.info("reloaded the HTTPS certificate from %s", self.cert)
        return True

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.reload_if_changed()


def server_tls(cert: str | None, key: str | None) -> ServerTLS | None:
    """HTTPS from the node's `--tls-cert` / `--tls-key` (both or neither)."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ConfigError("HTTPS needs both --tls-cert and --tls-key")
    return ServerTLS(cert, key)
