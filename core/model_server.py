"""Serving the core's model, packed, to edges: `/v1/model/manifest` and `/v1/model/files/{name}`.

Life cycle: on the first request the core makes sure a packed copy of its
model exists (its model directory if already packed, else it packs it into
its data directory, in a worker thread, once per version of the model
directory: a copy packed from files that have changed since is packed again); files are then served with
aiohttp's FileResponse, which honours Range requests so edges can resume.
Only names listed in the manifest are served.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from aiohttp import web

from edgecore.shared.pack import MANIFEST, is_packed, pack_model, packed_from

log = logging.getLogger("edgecore.core")


class ModelServer:
    def __init__(self, model_dir: str, data_dir: Path):
        self.model_dir = Path(model_dir)
        self.packed_dir = self.model_dir if is_packed(model_dir) else data_dir / "packed-model"
        self._lock = asyncio.Lock()

    async def ensure_packed(self) -> Path:
        async with self._lock:
            if self.packed_dir != self.model_dir and not packed_from(self.packed_dir, self.model_dir):
                log.info("packing %s into %s for distribution%s", self.model_dir, self.packed_dir,
                         " (the model changed since it was last packed)" if is_packed(self.packed_dir) else "")
                await asyncio.get_running_loop().run_in_executor(None, pack_model, self.model_dir, self.packed_dir)
        return self.packed_dir

    def routes(self, app: web.Application) -> None:
        async def manifest(_):
            directory = await self.ensure_packed()
            return web.Response(body=(directory / MANIFEST).read_bytes(), content_type="application/json")

        async def file(request: web.Request):
            directory = await self.ensure_packed()
            listed = json.loads((directory / MANIFEST).read_text())["files"]
            name = request.match_info["name"]
            if name not in listed:
                return web.json_response({"error": {"message": f"no model file '{name}'", "type":
                                                    "invalid_request_error", "param": "name", "code": "not_found"}},
                                         status=404)
            return web.FileResponse(directory / name)

        app.router.add_get("/v1/model/manifest", manifest)
        app.router.add_get("/v1/model/files/{name}", file)
