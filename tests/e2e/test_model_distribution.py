"""A core serves its packed model; an edge fetches, resumes, verifies, and re-fetches corrupt files."""

import asyncio
import hashlib
import json
import threading

import pytest

from edgecore.core.server import CoreConfig, CoreServer
from edgecore.edge.model_fetch import fetch_model
from edgecore.shared.errors import ModelLoadError
from edgecore.shared.models.fingerprint import model_fingerprint

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


class LyingCore:
    """A model server that misbehaves on the one file it lists: `drop` cuts every response after 1,000 bytes
    (honouring Range requests), `endless` sends bytes forever."""

    def __init__(self, mode: str, data: bytes):
        import http.server
        manifest = json.dumps({"files": {"w.bin": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}})
        self.requests = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *_):
                pass

            def do_GET(self):
                if self.path.endswith("manifest"):
                    body = manifest.encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                outer.requests += 1
                start = int(self.headers.get("Range", "bytes=0-")[6:].rstrip("-") or 0)
                self.send_response(206 if start else 200)
                if mode == "endless":
                    self.end_headers()
                    while True:
                        self.wfile.write(b"x" * 65536)
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                self.wfile.write(data[start:start + 1000])
                self.wfile.flush()
                self.close_connection = True

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def test_a_cut_transfer_is_resumed_while_it_progresses_and_an_endless_one_stops_at_the_listed_size(tmp_path):
    data = bytes(range(256)) * 20                       # 5,120 bytes: six cut responses of 1,000
    core = LyingCore("drop", data)
    try:
        got = fetch_model(core.url, tmp_path / "a", retries=1)
        assert (got / "w.bin").read_bytes() == data and core.requests == 6
    finally:
        core.close()
    core = LyingCore("endless", data)
    try:
        with pytest.raises(ModelLoadError, match="w.bin .*failed verification 2 times"):
            fetch_model(core.url, tmp_path / "b", retries=1)
        assert not any(p.stat().st_size > len(data) for p in (tmp_path / "b").rglob("*") if p.is_file())
    finally:
        core.close()
