"""aiohttp plumbing shared by the edge API and the core's batch API.

`error_middleware(api_keys, max_body, on_error)` checks the bearer key on
`/v1/` paths (compared with every configured key in constant time) and turns
`ApiError`, oversized bodies (413) and aiohttp's own HTTP errors (404, 405, …)
into OpenAI error objects, so no client ever sees aiohttp's plain text.
"""

from __future__ import annotations

import hmac
from typing import Callable

import msgspec
from aiohttp import web

from edgecore.shared.openai.request import ApiError


def check_bearer(request: web.Request, keys: list[bytes]) -> None:
    if not keys:
        return
    header = request.headers.get("Authorization", "")
    given = header[7:].strip().encode() if header.startswith("Bearer ") else b""
    ok = False
    for key in keys:   # every key compared: timing does not reveal which one matched
        ok |= hmac.compare_digest(given, key)
    if not ok:
        raise ApiError(401, "Incorrect or missing API key. Pass it as 'Authorization: Bearer KEY'.", None,
                       "invalid_api_key")


def error_middleware(api_keys: list[bytes], max_body: int, on_error: Callable[[int], None] | None = None):
    @web.middleware
    async def middleware(request: web.Request, handler):
        try:
            if request.path.startswith("/v1/"):
                check_bearer(request, api_keys)
            return await handler(request)
        except ApiError as exc:
            err = exc
        except web.HTTPRequestEntityTooLarge:
            err = ApiError(413, f"Request body exceeds the limit of {max_body} bytes", None, "request_too_large")
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            err = ApiError(exc.status, exc.reason or "error", None, None)
        if on_error is not None:
            on_error(err.status)
        return web.json_response(err.body(), status=err.status, headers=err.headers)
    return middleware


async def json_body(request: web.Request) -> dict:
    """The request's JSON object, or an ApiError (415 wrong type, 400 bad UTF-8 / JSON / not an object)."""
    ctype = request.content_type
    if ctype not in ("application/json", "", "application/octet-stream") and not ctype.endswith("+json"):
        raise ApiError(415, f"Content-Type must be application/json, got {ctype}", None, "invalid_content_type")
    raw = await request.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "The request body is not valid UTF-8", None, "invalid_encoding") from None
    try:
        body = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"We could not parse the JSON body of your request: {exc}", None,
                       "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The JSON body must be an object", None, "invalid_json")
    return body
