"""Fetching a packed model from a core: `edgecore edge --model-from URL`.

Life cycle: GET the manifest; for each listed file, keep a complete local copy
whose SHA-256 matches, resume a partial one with a Range request, or
download it; verify every file's SHA-256 and re-fetch (up to `retries`
times) on mismatch or truncation; only then write the manifest into the cache
directory, so a half-fetched model is never loaded. Tensors are verified again
(CRC-32) when the model loads.
"""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from edgecore.shared.errors import ConfigError, ModelLoadError
from edgecore.shared.pack import MANIFEST
from edgecore.shared.pack.format import sha256_file


def _get(url: str, headers: dict | None = None, timeout: float = 60):
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout)
    except urllib.error.HTTPError as exc:
        raise ModelLoadError(f"{url}: HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ModelLoadError(f"cannot reach {url}: {exc}") from None


def fetch_model(base_url: str, cache_dir: str | Path, progress: Callable[[str], None] | None = None,
                retries: int = 2, api_key: bytes | None = None) -> Path:
    """`api_key`: presented to the core (its control port needs one whenever it listens beyond loopback)."""
    auth = {"Authorization": "Bearer " + api_key.decode()} if api_key else {}
    base = base_url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ConfigError(f"--model-from needs an http(s) URL of a core's control port, got '{base_url}'")
    with _get(f"{base}/v1/model/manifest", auth) as r:
        raw = r.read()
    try:
        manifest = json.loads(raw)
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{base}: malformed model manifest: {exc}") from None
    digest = hashlib.sha256(raw).hexdigest()[:16]
    target = Path(cache_dir) / digest
    target.mkdir(parents=True, exist_ok=True)
    if (target / MANIFEST).is_file() and (target / MANIFEST).read_bytes() == raw:
        return target
    for name, meta in files.items():
        if "/" in name or name.startswith("."):
            raise ModelLoadError(f"manifest names an unsafe file '{name}'")
        _fetch_file(f"{base}/v1/model/files/{name}", target / name, meta["size"], meta["sha256"], progress, retries,
                    auth)
    (target / (MANIFEST + ".tmp")).write_bytes(raw)
    (target / (MANIFEST + ".tmp")).rename(target / MANIFEST)
    return target


def _fetch_file(url: str, path: Path, size: int, sha256: str, progress, retries: int, auth: dict) -> None:
    for attempt in range(retries + 1):
        have = path.stat().st_size if path.exists() else 0
        if have == size and sha256_file(path) == sha256:
            return
        if have > size:
            path.unlink()
            have = 0
        if have < size:
            headers = {**auth, "Range": f"bytes={have}-"} if have else auth
            with _get(url, headers) as r, open(path, "ab" if have and r.status == 206 else "wb") as f:
                if have and r.status != 206:
                    have = 0
                while chunk := r.read(1 << 20):
                    f.write(chunk)
                    have += len(chunk)
                    if progress:
                        progress(f"{path.name} {have / 1e6:.1f}/{size / 1e6:.1f} MB")
        if path.stat().st_size == size and sha256_file(path) == sha256:
            return
        path.unlink(missing_ok=True)   # corrupt or truncated: fetch again from scratch
    raise ModelLoadError(f"{path.name} from {url} failed verification {retries + 1} times")
