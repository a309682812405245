"""HTTP routes of the batch ingestion API on the core's control port (OpenAI Files + Batches), and contexts.

Life cycle of an upload: multipart `purpose` + `file` streamed to a temporary
file under the data directory (limit checked while streaming: 413 and the
partial file removed), fsynced, renamed, then recorded. Batches are created in
`validating` and handed to the `BatchRunner`.

A full data volume: any route whose write it refuses (an upload, a batch, a
cancel, a context) answers 507 with an OpenAI error object, code
`insufficient_storage`, whose message starts "no space left on device
(ENOSPC)" and gives the free space; the partial upload is removed and the
store's WAL truncated. Counted in `edgecore:core_batch_failures_total{cause="disk_full"}`.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import BodyPartReader, MultipartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from edgecore.core.batch_runner import ENDPOINTS, BatchRunner
from edgecore.core.batch_store import BatchStore, DiskFull, is_disk_full
from edgecore.shared.engine.handle import EngineHandle
from edgecore.shared.openai.http import json_body
from edgecore.shared.openai.request import ApiError
from edgecore.shared.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from edgecore.core.contexts import Contexts

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _not_found(kind: str, ident: str) -> ApiError:
    return ApiError(404, f"No {kind} with id '{ident}'", "id", "not_found")


def _limit(request: web.Request, maximum: int, default: int) -> int:
    """A list's `limit` query parameter (OpenAI's ranges: files 1–10000, batches 1–100)."""
    try:
        limit = int(request.query.get("limit", str(default)))
    except ValueError:
        raise ApiError(400, "'limit' must be an integer", "limit", "invalid_type") from None
    if not 1 <= limit <= maximum:
        raise ApiError(400, f"'limit' must be between 1 and {maximum}", "limit", "invalid_value")
    return limit


def _tokenizer(engine: EngineHandle, param: str) -> Tokenizer:
    """The engine's tokenizer; a core without tokenizer files takes contexts as token ids only."""
    if engine.tokenizer is None:
        raise ApiError(400, "this core has no tokenizer: give 'token_ids'", param, "invalid_value")
    return engine.tokenizer


def _page(data: list[dict], more: bool) -> web.Response:
    return web.json_response({"object": "list", "data": data, "has_more": more,
                              "first_id": data[0]["id"] if data else None,
                              "last_id": data[-1]["id"] if data else None})


class BatchAPI:
    def __init__(self, handle: EngineHandle, store: BatchStore, runner: BatchRunner, contexts: Contexts,
                 max_file_bytes: int) -> None:
        self.handle, self.store, self.runner, self.contexts = handle, store, runner, contexts
        self.max_file_bytes = max_file_bytes

    def routes(self, app: web.Application) -> None:
        for method, path, handler in (
                ("POST", "/v1/files", self.upload), ("GET", "/v1/files", self.list_files),
                ("GET", "/v1/files/{id}", self.get_file), ("GET", "/v1/files/{id}/content", self.file_content),
                ("DELETE", "/v1/files/{id}", self.delete_file), ("POST", "/v1/batches", self.create_batch),
                ("GET", "/v1/batches", self.list_batches), ("GET", "/v1/batches/{id}", self.get_batch),
                ("POST", "/v1/batches/{id}/cancel", self.cancel_batch),
                ("POST", "/v1/contexts", self.create_context), ("GET", "/v1/contexts", self.list_contexts),
                ("GET", "/v1/contexts/{id}", self.get_context),
                ("DELETE", "/v1/contexts/{id}", self.delete_context),
                ("POST", "/v1/contexts/{id}/push", self.push_context)):
            app.router.add_route(method, path, self._no_space(handler))

    def _no_space(self, handler: Handler) -> Handler:
        """`handler`, answering a write the full volume refused with 507 (not a 500 with a traceback)."""
        @functools.wraps(handler)
        async def answer(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request)
            except DiskFull as exc:
                raise ApiError(507, str(exc), None, "insufficient_storage") from None
            except OSError as exc:
                if not is_disk_full(exc):
                    raise
                full = self.store.full(exc, f"answering {request.method} {request.path}")
                raise ApiError(507, str(full), None, "insufficient_storage") from None
        return answer

    # ---- files ----------------------------------------------------------------------
    async def upload(self, request: web.Request) -> web.Response:
        if not request.content_type.startswith("multipart/"):
            raise ApiError(415, "Upload files as multipart/form-data with 'purpose' and 'file'", None,
                           "invalid_content_type")
        purpose: str | None = None
        file_id: str | None = None
        filename: str | None = None
        size = 0
        tmp = None
        try:
            try:
                async for part in _parts(await request.multipart()):
                    if not isinstance(part, BodyPartReader):     # a nested multipart has no name: ignored
                        continue
                    name = part.name
                    if name == "purpose":
                        purpose = (await part.text()).strip()
                    elif name == "file":
                        if tmp is not None:
                            raise ApiError(400, "more than one 'file' part", "file", "invalid_value")
                        file_id = f"file-{uuid.uuid4().hex[:24]}"
                        filename = part.filename or "upload.jsonl"
                        tmp = self.store.files_dir / f"{file_id}.part"
                        size = await self._receive(part, tmp)
            except (ValueError, AssertionError, web.RequestPayloadError, HttpProcessingError) as exc:
                # no or bad boundary, a cut part, a 'purpose' that is not UTF-8, an undecodable part encoding
                raise ApiError(400, f"malformed multipart body: {exc}", None, "invalid_body") from None
            if purpose != "batch":
                raise ApiError(400, f"'purpose' must be 'batch', got {purpose!r}", "purpose", "invalid_value")
            if tmp is None:
                raise ApiError(400, "missing 'file' part", "file", "missing_required_parameter")
            assert file_id is not None and filename is not None      # set with `tmp`
            tmp = tmp.rename(self.store.file_path(file_id))     # removed unless its row is written
            obj = self.store.add_file(file_id, filename, purpose, size)
            tmp = None
            return web.json_response(obj)
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)

    async def _receive(self, part: BodyPartReader, tmp: Path) -> int:
        """Stream the file part to `tmp` (fsynced); its size. Over the limit: 413; a full disk: `DiskFull`."""
        size = 0
        try:
            with open(tmp, "wb") as f:
                while chunk := await part.read_chunk(1 << 20):
                    size += len(chunk)
                    if size > self.max_file_bytes:
                        raise ApiError(413, f"File exceeds the limit of {self.max_file_bytes} bytes", "file",
                                       "file_too_large")
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            tmp.unlink(missing_ok=True)     # its space back before the WAL is checkpointed
            raise self.store.full(exc, "storing the upload", size) from None
        return size

    async def list_files(self, request: web.Request) -> web.Response:
        order = request.query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(400, "'order' must be 'asc' or 'desc'", "order", "invalid_value")
        data, more = self.store.list_files(request.query.get("purpose"), request.query.get("after"),
                                           _limit(request, 10000, 10000), order == "asc")
        return _page(data, more)

    def _file(self, request: web.Request) -> dict:
        obj = self.store.get_file(request.match_info["id"])
        if obj is None:
            raise _not_found("file", request.match_info["id"])
        return obj

    async def get_file(self, request: web.Request) -> web.Response:
        return web.json_response(self._file(request))

    async def file_content(self, request: web.Request) -> web.FileResponse:
        obj = self._file(request)
        return web.FileResponse(self.store.file_path(obj["id"]), headers={"Content-Type": "application/jsonl"})

    async def delete_file(self, request: web.Request) -> web.Response:
        obj = self._file(request)
        self.store.delete_file(obj["id"])
        return web.json_response({"id": obj["id"], "object": "file", "deleted": True})

    # ---- batches ----------------------------------------------------------------------
    async def create_batch(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
        window = body.get("completion_window", "24h")
        if not isinstance(file_id, str):
            raise ApiError(400, "'input_file_id' is required", "input_file_id", "missing_required_parameter")
        if endpoint not in ENDPOINTS:
            raise ApiError(400, f"'endpoint' must be one of {sorted(ENDPOINTS)}", "endpoint", "invalid_value")
        if window != "24h":
            raise ApiError(400, "'completion_window' must be '24h'", "completion_window", "invalid_value")
        metadata = body.get("metadata")
        if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or not all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items())):
            raise ApiError(400, "'metadata' must map up to 16 strings to strings", "metadata", "invalid_value")
        if self.store.get_file(file_id) is None:
            raise ApiError(404, f"No file with id '{file_id}'", "input_file_id", "not_found")
        batch = self.store.create_batch(file_id, endpoint, window, metadata)
        self.runner.notify()
        return web.json_response(batch)

    async def list_batches(self, request: web.Request) -> web.Response:
        data, more = self.store.list_batches(request.query.get("after"), _limit(request, 100, 20))
        return _page(data, more)

    async def get_batch(self, request: web.Request) -> web.Response:
        batch = self.store.get_batch(request.match_info["id"])
        if batch is None:
            raise _not_found("batch", request.match_info["id"])
        return web.json_response(batch)

    async def cancel_batch(self, request: web.Request) -> web.Response:
        batch_id = request.match_info["id"]
        batch = self.store.get_batch(batch_id)
        if batch is None:
            raise _not_found("batch", batch_id)
        if batch["status"] in ("validating", "in_progress"):
            self.store.set_status(batch_id, "cancelling")
            self.runner.cancel(batch_id)
        elif batch["status"] != "cancelling":
            raise ApiError(409, f"Batch {batch_id} is {batch['status']} and cannot be cancelled", None,
                           "invalid_state")
        return web.json_response(self.store.get_batch(batch_id))

    # ---- contexts ----------------------------------------------------------------------
    async def create_context(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        engine = self.handle
        if isinstance(body.get("token_ids"), list):
            ids = body["token_ids"]
            if not ids or any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < engine.config.vocab_size
                              for t in ids):
                raise ApiError(400, "'token_ids' must be a non-empty list of token ids", "token_ids", "invalid_value")
        elif isinstance(body.get("text"), str) and body["text"]:
            ids = _tokenizer(engine, "text").encode(body["text"])
        elif isinstance(body.get("messages"), list) and body["messages"]:
            msgs = body["messages"]
            if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in msgs):
                raise ApiError(400, "'messages' must be role/content objects", "messages", "invalid_value")
            ids = _tokenizer(engine, "messages").encode_chat(msgs, add_generation_prompt=False)
        else:
            raise ApiError(400, "give one of 'text', 'messages' or 'token_ids'", None, "missing_required_parameter")
        if len(ids) >= engine.max_model_len:
            raise ApiError(400, f"context of {len(ids)} tokens exceeds the model's {engine.max_model_len}", None,
                           "context_length_exceeded")
        return web.json_response(await self.contexts.ingest(ids))

    async def list_contexts(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self.contexts.describe(c) for c in self.contexts.pinned]})

    async def get_context(self, request: web.Request) -> web.Response:
        obj = self.contexts.describe(request.match_info["id"])
        if obj is None:
            raise _not_found("context", request.match_info["id"])
        return web.json_response(obj)

    async def push_context(self, request: web.Request) -> web.Response:
        """Push an ingested context to edges the core knows by name (core/contexts.py: `Contexts.push`)."""
        body = await json_body(request)
        return web.json_response(await self.contexts.push(request.match_info["id"], body.get("edges")))

    async def delete_context(self, request: web.Request) -> web.Response:
        ctx = request.match_info["id"]
        if not await self.contexts.delete(ctx):
            raise _not_found("context", ctx)
        return web.json_response({"id": ctx, "object": "context", "deleted": True})


async def _parts(reader: MultipartReader) -> AsyncIterator[BodyPartReader | MultipartReader]:
    """The parts of a multipart body, until its end."""
    while (part := await reader.next()) is not None:
        yield part
