"""A core serves its packed model; an edge fetches, resumes, verifies, and re-fetches corrupt files."""

import asyncio
import hashlib
import json
import threading

import pytest

from edgecore.core.server import CoreConfig, CoreServer
from edgecore.edge.model_fetch import fetch_model
from edgecore.shared.errors import ModelLoadError
from edgecore.shared.fingerprint import model_fingerprint

pytestmark = pytest.mark.timeout(120)


class CoreInThread:
    """A core running its own event loop in a thread, so the synchronous fetcher can call it."""

    def __init__(self, model_dir, data_dir):
        self.core = CoreServer(CoreConfig(str(model_dir), b"s", port=0, http_port=0, data_dir=str(data_dir)))
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(60)
        self.url = f"http://127.0.0.1:{self.core.http_port}"

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.core.start())
        self.ready.set()
        self.loop.run_forever()

    def close(self):
        asyncio.run_coroutine_threadsafe(self.core.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def core(model_dir, tmp_path):
    c = CoreInThread(model_dir, tmp_path / "core-data")
    yield c
    c.close()


def test_fetch_resume_and_refetch(core, tmp_path, model_dir):
    cache = tmp_path / "cache"
    got = fetch_model(core.url, cache)
    assert model_fingerprint(got) == model_fingerprint(model_dir)
    manifest = json.loads((got / "edgecore-pack.json").read_text())
    pack = got / "model.edgepack"
    full = pack.read_bytes()
    # Interrupted download: half a file and no manifest → resumed with a Range request.
    (got / "edgecore-pack.json").unlink()
    pack.write_bytes(full[: len(full) // 2])
    seen = []
    fetch_model(core.url, cache, progress=seen.append)
    assert pack.read_bytes() == full
    assert seen and seen[0].startswith("model.edgepack") and float(seen[0].split()[1].split("/")[0]) > 0.5 * len(full) / 1e6 - 0.2
    # A corrupted file (wrong checksum) is fetched again, never kept.
    (got / "edgecore-pack.json").unlink()
    bad = bytearray(full)
    bad[100] ^= 1
    pack.write_bytes(bytes(bad))
    fetch_model(core.url, cache)
    assert hashlib.sha256(pack.read_bytes()).hexdigest() == manifest["files"]["model.edgepack"]["sha256"]


def test_unknown_file_and_bad_url(core, tmp_path):
    import urllib.error
    import urllib.request
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(f"{core.url}/v1/model/files/..%2F..%2Fetc%2Fpasswd")
    assert exc.value.code == 404
    with pytest.raises(ModelLoadError, match="cannot reach"):
        fetch_model("http://127.0.0.1:9", tmp_path / "c")
