"""Fetching a packed model from a core: `edgecore edge --model-from URL`.

Life cycle: GET the manifest (waiting while the core packs its model) and
check it (plain file names, sizes, digests); a cached copy whose manifest
and file sizes match is used as it is. Otherwise, for each listed file, keep a
complete local copy whose SHA-256 matches, or download it: never past its
listed size, resuming a cut or stalled transfer with a Range request while
attempts make progress, re-fetching a copy that fails its SHA-256; `retries`
attempts without progress, or a transfer slower than `MIN_RATE`, fail with one
line. Only then is the manifest written into the cache directory, so a
half-fetched model is never loaded. Tensors are verified again (CRC-32) when
the model loads.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from collections.abc import Callable

from edgecore.shared.errors import ConfigError, ModelLoadError
from edgecore.shared.pack import MANIFEST
from edgecore.shared.pack.format import plain_name, sha256_file


MANIFEST_TIMEOUT = 3600     # seconds: a core packs its model when first asked (minutes for a large one)
READ_TIMEOUT = 60           # seconds without a byte from the core: the attempt failed (resumed next)
MIN_RATE = 1024             # bytes/s: a download slower than this over its first READ_TIMEOUT s is given up
MAX_MANIFEST = 256 << 20    # bytes: a larger manifest is refused (it lists tensors, not their data)


def _get(url: str, headers: dict[str, str] | None = None, timeout: float = READ_TIMEOUT
         ) -> http.client.HTTPResponse:
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout)
    except urllib.error.HTTPError as exc:
        raise ModelLoadError(f"{url}: HTTP {exc.code}{_error_message(exc)}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:     # ValueError: a malformed URL
        raise ModelLoadError(f"cannot reach {url}: {exc}") from None


def fetch_model(base_url: str, cache_dir: str | Path, progress: Callable[[str], None] | None = None,
                retries: int = 2, api_key: bytes | None = None) -> Path:
    """`api_key`: presented to the core (its control port needs one whenever it listens beyond loopback)."""
    auth = {"Authorization": "Bearer " + api_key.decode()} if api_key else {}
    base = base_url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ConfigError(f"--model-from needs an http(s) URL of a core's control port, got '{base_url}'")
    try:
        with _get(f"{base}/v1/model/manifest", auth, MANIFEST_TIMEOUT) as r:
            raw = r.read(MAX_MANIFEST + 1)
    except (OSError, http.client.HTTPException) as exc:
        raise ModelLoadError(f"{base}: reading the model manifest failed: {exc}") from None
    if len(raw) > MAX_MANIFEST:
        raise ModelLoadError(f"{base}: the model manifest is larger than {MAX_MANIFEST >> 20} MiB")
    files = _listed_files(base, raw)
    digest = hashlib.sha256(raw).hexdigest()[:16]
    target = Path(cache_dir) / digest
    target.mkdir(parents=True, exist_ok=True)
    if (target / MANIFEST).is_file() and (target / MANIFEST).read_bytes() == raw and all(
            (target / name).is_file() and (target / name).stat().st_size == meta["size"] for name, meta in files.items()):
        return target               # (the tensors' checksums are verified again when the model loads)
    (target / MANIFEST).unlink(missing_ok=True)
    for name, meta in files.items():
        _fetch_file(f"{base}/v1/model/files/{name}", target / name, meta["size"], meta["sha256"], progress, retries,
                    auth)
    (target / (MANIFEST + ".tmp")).write_bytes(raw)
    (target / (MANIFEST + ".tmp")).rename(target / MANIFEST)
    return target


def _listed_files(base: str, raw: bytes) -> dict[str, dict]:
    """The manifest's `files` (name → size, SHA-256), checked: plain names, integer sizes, hex digests."""
    try:
        files = json.loads(raw)["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not an object")
        for name, meta in files.items():
            if not plain_name(name):
                raise ModelLoadError(f"{base}: the model manifest names an unsafe file {name!r}")
            if not (isinstance(meta["size"], int) and meta["size"] >= 0 and isinstance(meta["sha256"], str)):
                raise TypeError(f"file {name!r} has no valid size and sha256")
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{base}: malformed model manifest: {type(exc).__name__}: {exc}") from None
    return files


def _fetch_file(url: str, path: Path, size: int, sha256: str, progress: Callable[[str], None] | None, retries: int,
                auth: dict[str, str]) -> None:
    """Download `path` until its SHA-256 matches: a short copy is resumed (Range) for as long as attempts make
    progress; one that makes none, or a complete copy that fails the check (fetched again from scratch),
    counts against `retries`."""
    failures, why = 0, "no attempt"
    while failures <= retries:
        have = path.stat().st_size if path.exists() else 0
        if have > size:                  # not this file (a copy left by an older fetch): start over
            path.unlink()
            continue
        if have == size:
            if sha256_file(path) == sha256:
                return
            path.unlink()
            failures, why = failures + 1, "its SHA-256 did not match"
            continue
        try:
            got = _download(url, path, have, size, progress, auth)
        except (OSError, http.client.HTTPException) as exc:    # dropped, stalled, cut short: resumed next time
            got, why = (path.stat().st_size if path.exists() else 0), f"{type(exc).__name__}: {exc}"
        else:
            why = "the server sent fewer bytes than the manifest lists"
        if got <= have:
            failures += 1
    path.unlink(missing_ok=True)
    raise ModelLoadError(f"{path.name} from {url} failed verification {retries + 1} times ({why})")


def _download(url: str, path: Path, have: int, size: int, progress: Callable[[str], None] | None,
              auth: dict[str, str]) -> int:
    """One GET from byte `have` (a Range request) to `size`, and never past it; the bytes held after it."""
    headers = {**auth, "Range": f"bytes={have}-"} if have else auth
    try:
        response = _get(url, headers, READ_TIMEOUT)
    except ModelLoadError as exc:       # unreachable, refused, 5xx: an attempt without progress, retried
        raise ConnectionError(str(exc)) from None
    with response as r:
        if have and r.status != 206:       # the server ignored the range: start over
            have = 0
        started, first = time.monotonic(), have
        with open(path, "ab" if have else "wb") as f:
            while have < size and (chunk := r.read1(min(1 << 20, size - have))):   # what has arrived
                f.write(chunk)
                have += len(chunk)
                if progress:
                    progress(f"{path.name} {have / 1e6:.1f}/{size / 1e6:.1f} MB")
                elapsed = time.monotonic() - started
                if elapsed > READ_TIMEOUT and (have - first) / elapsed < MIN_RATE:
                    raise ModelLoadError(f"{url}: the download is too slow ({(have - first) / elapsed:.0f} B/s)")
    return have


def _error_message(exc: urllib.error.HTTPError) -> str:
    """": message" of an OpenAI-style error body (a core says why it refuses), else nothing."""
    try:
        return ": " + str(json.loads(exc.read(65536))["error"]["message"])
    except (OSError, ValueError, KeyError, TypeError, http.client.HTTPException):
        return ""
