"""aiohttp plumbing shared by the edge API and the core's batch API.

`error_middleware(api_keys, max_body, on_error)` checks the bearer key on
`/v1/` paths, `/stats`, `/tokenize` and `/detokenize` (the scheme case-insensitively; the key's SHA-256
looked up among the configured keys' digests, `ApiKeys`; a key's tenant salt, if it has one, is left on the
request under `KEY_SALT` for `effective_cache_salt`; with a tenants file, `shared/node/tenants.py`, the same digest
finds the key's tenant, left under `TENANT`, whose cache scope becomes the key's salt: a key that is neither a
tenant's nor configured is a 401), refuses a declared Content-Length over the limit (413
at once) and a Content-Encoding it cannot decode (415), and turns `ApiError`, oversized bodies
(413), bodies that cannot be read (400: a cut or corrupt compressed body),
aiohttp's own HTTP errors (404, 405, …) and, as a last resort, any exception of
ours (500 "internal error" with a request id; traceback logged, rate-limited)
into OpenAI error objects, each counted through `on_error`, so no client ever
sees plain text. `json_body` reads a body within the server's body timeout
(408) and refuses JSON nested too deeply for the parser (400). `off_loop` runs a
request's parsing (tokenization: seconds for megabytes of prompt) on a worker
thread when its body is large, so the event loop keeps serving everyone else.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections.abc import Callable, Iterable
from typing import TypeVar

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler, Middleware

from edgecore.shared.node.admin_key import ADMIN_PATHS
from edgecore.shared.node.http_server import LIMITS_KEY
from edgecore.shared.openai.request import ApiError
from edgecore.shared.node.secrets import ApiKey
from edgecore.shared.node.tenants import TenantRegistry, TenantState

log = logging.getLogger("edgecore.http")

_T = TypeVar("_T")

OFF_LOOP_BODY = 1 << 16      # bytes of body from which parsing runs on a worker thread
PROTECTED = ("/v1/", "/stats", "/tokenize", "/detokenize")   # need the API key when keys are configured;
# /health, /ready, /metrics and /version stay open (probes and scrapers hold no key)
KEY_SALT = web.RequestKey("edgecore_key_salt", str)   # the presented key's cache salt (absent: none)
TENANT = web.RequestKey("edgecore_tenant", TenantState)   # the presented key's tenant (absent: none)


class ApiKeys:
    """The configured API keys, held as SHA-256 digests in a dict (digest → the key's cache salt, for an
    `ApiKey` that has one): a check hashes the presented key once and looks the digest up, so it costs the same
    with one key or 100,000 and its timing depends on the digest (which the client cannot steer toward a
    key's), never on how much of a key matched. The keys themselves are not kept."""

    def __init__(self, keys: Iterable[bytes]):
        self._salts: dict[bytes, str | None] = {
            hashlib.sha256(k).digest(): k.salt if isinstance(k, ApiKey) else None for k in keys}

    def __len__(self) -> int:
        return len(self._salts)

    def accepts(self, given: bytes) -> bool:
        return hashlib.sha256(given).digest() in self._salts

    def lookup(self, given: bytes) -> tuple[bool, str | None]:
        """(whether `given` is a configured key, its cache salt)."""
        return self.lookup_digest(hashlib.sha256(given).digest())

    def lookup_digest(self, digest: bytes) -> tuple[bool, str | None]:
        """`lookup` of a key already hashed (its SHA-256 `digest`)."""
        return digest in self._salts, self._salts.get(digest)


def check_bearer(request: web.Request, keys: ApiKeys, tenants: TenantRegistry | None = None) -> None:
    """401 unless the request presents a configured key or a tenant's (none of either configured: anything
    passes); a key with a salt leaves it on the request (`KEY_SALT`), a tenant's key its tenant (`TENANT`) and
    the tenant's cache scope as its salt. The key is hashed once, whatever the number of keys and tenants."""
    if not keys and tenants is None:
        return
    scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
    digest = hashlib.sha256(token.strip().encode() if scheme.lower() == "bearer" else b"").digest()
    tenant = tenants.find(digest) if tenants is not None else None
    known, salt = keys.lookup_digest(digest)
    if tenant is not None:
        request[TENANT] = tenant
        salt = tenant.tenant.salt
    elif not known:
        raise ApiError(401, "Incorrect or missing API key. Pass it as 'Authorization: Bearer KEY'.", None,
                       "invalid_api_key")
    if salt is not None:
        request[KEY_SALT] = salt


def effective_cache_salt(request: web.Request, cache_salt: str | None) -> str | None:
    """The prefix-cache scope of a request: the salt of its API key combined with the body's `cache_salt`, so a
    request can only narrow its key's scope, never name another tenant's: key salt ‖ NUL ‖ request salt (each
    "" when absent), unambiguous since a key's salt holds no NUL. None when neither is given: the shared,
    unsalted cache."""
    key_salt = request.get(KEY_SALT)
    if key_salt is None and cache_salt is None:
        return None
    return f"{key_salt or ''}\0{cache_salt or ''}"


def error_middleware(api_keys: Iterable[bytes], max_body: int, on_error: Callable[[int], None] | None = None,
                     tenants: TenantRegistry | None = None) -> Middleware:
    keys = ApiKeys(api_keys)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            if request.path.startswith(PROTECTED) and request.path not in ADMIN_PATHS:   # those: the admin key
                check_bearer(request, keys, tenants)
            _check_body_headers(request, max_body)
            return await handler(request)
        except ApiError as exc:
            err = exc
        except ConnectionError:
            raise                       # the client went away: nothing to answer
        except (web.RequestPayloadError, HttpProcessingError) as exc:    # e.g. a body its Content-Encoding cannot decode
            err = ApiError(400, f"The request body could not be read: {exc}", None, "invalid_body")
        except web.HTTPRequestEntityTooLarge:
            err = ApiError(413, f"Request body exceeds the limit of {max_body} bytes", None, "request_too_large")
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            err = ApiError(exc.status, exc.reason or "error", None, None)
        except Exception:               # a bug of ours: logged (rate-limited), answered as JSON, counted
            rid = uuid.uuid4().hex[:16]
            tenant = request.get(TENANT)
            log.exception("internal error answering %s %s (request id %s%s)", request.method, request.path, rid,
                          f", tenant {tenant.name}" if tenant is not None else "")
            err = ApiError(500, f"internal error (request id {rid})", None, "internal_error",
                           headers={"x-request-id": rid})
            if request.writer is not None and request.writer.output_size > 0:
                if on_error is not None:
                    on_error(500)
                raise ConnectionResetError("response already started; connection closed") from None
        if on_error is not None:
            on_error(err.status)
        resp = web.json_response(err.body(), status=err.status, headers=err.headers)
        if err.status == 408 or (err.status in (413, 415) and request.body_exists):
            resp.force_close()          # a body too slow, too large or unreadable is not read to its end
        return resp
    return middleware


# What aiohttp decodes (it reads any other Content-Encoding as identity): br and zstd need optional packages.
ENCODINGS = frozenset({"", "identity", "gzip", "deflate"})


def _check_body_headers(request: web.Request, max_body: int) -> None:
    """413 at once for a declared Content-Length over the limit (not after waiting for the body), 415 for a
    Content-Encoding this server cannot decode (it would be read as plain bytes)."""
    if not request.body_exists:
        return
    streamed = request.content_type.startswith("multipart/")     # uploads, limited where they are streamed
    if request.content_length is not None and request.content_length > max_body and not streamed:
        raise ApiError(413, f"Request body exceeds the limit of {max_body} bytes", None, "request_too_large")
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in ENCODINGS:
        raise ApiError(415, f"Content-Encoding {encoding!r} is not supported (use gzip or deflate)", None,
                       "unsupported_content_encoding")


async def json_body(request: web.Request) -> dict:
    """The request's JSON object, or an ApiError (415 wrong type, 400 bad UTF-8 / JSON / not an object)."""
    ctype = request.content_type
    if ctype not in ("application/json", "", "application/octet-stream") and not ctype.endswith("+json"):
        raise ApiError(415, f"Content-Type must be application/json, got {ctype}", None, "invalid_content_type")
    limits = request.app.get(LIMITS_KEY)
    timeout = limits.body_timeout if limits is not None else None
    try:
        async with asyncio.timeout(timeout):
            raw = await request.read()
    except TimeoutError:
        raise ApiError(408, f"The request body did not arrive within {timeout:g} s", None,
                       "request_timeout") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "The request body is not valid UTF-8", None, "invalid_encoding") from None
    try:
        body = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"We could not parse the JSON body of your request: {exc}", None,
                       "invalid_json") from None
    except RecursionError:
        raise ApiError(400, "The JSON body is nested too deeply", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The JSON body must be an object", None, "invalid_json")
    return body


async def off_loop(request: web.Request, fn: Callable[..., _T], *args: object) -> _T:
    """`fn(*args)`, on a worker thread when the request's body is large (or of unknown length): long texts
    are encoded with the GIL released (`Tokenizer.encode`), so the loop turns meanwhile."""
    size = request.content_length      # of the bytes sent: a compressed body may inflate far beyond it
    if size is not None and size < OFF_LOOP_BODY and not request.headers.get("Content-Encoding"):
        return fn(*args)
    return await asyncio.to_thread(fn, *args)
