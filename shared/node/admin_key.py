"""The admin credential (`--admin-key-file`): who may change what a node serves (LoRA adapters).

Life cycle: read once at start-up (`AdminKey.read`: the file's first non-empty line is the key; a missing or
empty file stops the start with one line); only its SHA-256 digest is kept. `check(request)` hashes the
request's bearer token and compares the digests with `hmac.compare_digest` (constant time, as the API keys
of shared/openai/http.py are looked up by digest): a 401, OpenAI-shaped, otherwise. The admin routes are
exempt from the API-key check (`ADMIN_PATHS`): the admin key alone opens them.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from aiohttp import web

from edgecore.shared.errors import ConfigError
from edgecore.shared.openai.errors import ApiError

ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


class AdminKey:
    def __init__(self, key: bytes) -> None:
        if not key:
            raise ConfigError("the admin key is empty")
        self._digest = hashlib.sha256(key).digest()

    @classmethod
    def read(cls, path: str) -> AdminKey:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--admin-key-file {path}: cannot read ({exc})") from None
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if not lines:
            raise ConfigError(f"--admin-key-file {path}: holds no key")
        return cls(lines[0].encode())

    def check(self, request: web.Request) -> None:
        """401 unless the request presents the admin key as `Authorization: Bearer KEY`."""
        scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
        given = hashlib.sha256(token.strip().encode() if scheme.lower() == "bearer" else b"").digest()
        if not hmac.compare_digest(given, self._digest):
            raise ApiError(401, "This route needs the admin key ('Authorization: Bearer ADMIN_KEY').", None,
                           "invalid_api_key")
