"""Serving the core's model, packed, to edges: `/v1/model/manifest` and `/v1/model/files/{name}`.

Life cycle: on the first request the core makes sure a packed copy of its
model exists (its model directory if already packed, else it packs it into
its data directory, in a worker thread, and swaps it in; a copy packed from
other files is packed again). If the model directory changed since the core
loaded it, it answers 503 rather than ship weights it does not serve. Files
are served with aiohttp's FileResponse, which honours Range requests so edges
can resume. Only names listed in the manifest are served.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path

from aiohttp import web

from edgecore.shared.openai.errors import ApiError
from edgecore.shared.pack import MANIFEST, is_packed, pack_model, packed_from
from edgecore.shared.pack.writer import source_state

log = logging.getLogger("edgecore.core")


class ModelServer:
    def __init__(self, model_dir: str, data_dir: Path):
        """Made once the engine has loaded the model: the files as they are now are the weights it serves."""
        self.model_dir = Path(model_dir)
        self.packed_dir = self.model_dir if is_packed(model_dir) else data_dir / "packed-model"
        self.gguf = self.model_dir.suffix == ".gguf"      # not shipped (yet): an edge loads the same file itself
        self.loaded = {} if self.gguf else source_state(self.model_dir)
        self._lock = asyncio.Lock()

    async def ensure_packed(self) -> Path:
        """The packed copy of the weights this core serves: packed (again) if the copy is of other files. If the
        model directory changed since the core loaded it, edges would get weights it does not serve: a 503."""
        if self.gguf:
            raise ApiError(501, f"this core serves the GGUF file {self.model_dir.name}, which it does not ship to "
                           "edges: give each edge the same file with --model", None, "model_not_shippable")
        if source_state(self.model_dir) != self.loaded:
            raise ApiError(503, f"the model directory {self.model_dir} changed since this core loaded it; "
                           "restart the core to serve (and ship) the new weights", None, "model_changed")
        async with self._lock:
            if self.packed_dir != self.model_dir and not packed_from(self.packed_dir, self.model_dir):
                log.info("packing %s into %s for distribution%s", self.model_dir, self.packed_dir,
                         " (the model changed since it was last packed)" if is_packed(self.packed_dir) else "")
                await asyncio.get_running_loop().run_in_executor(None, self._pack)
        return self.packed_dir

    def _pack(self) -> None:
        """Pack beside the old copy and swap it in: a download of the old one keeps its open file."""
        fresh = self.packed_dir.with_name(self.packed_dir.name + ".new")
        shutil.rmtree(fresh, ignore_errors=True)
        pack_model(self.model_dir, fresh)
        old = self.packed_dir.with_name(self.packed_dir.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if self.packed_dir.exists():
            self.packed_dir.rename(old)
        fresh.rename(self.packed_dir)
        shutil.rmtree(old, ignore_errors=True)

    def routes(self, app: web.Application) -> None:
        async def manifest(_: web.Request) -> web.Response:
            directory = await self.ensure_packed()
            return web.Response(body=(directory / MANIFEST).read_bytes(), content_type="application/json")

        async def file(request: web.Request) -> web.StreamResponse:
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
