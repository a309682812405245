"""Per-node credentials between real processes, made with the `edgecore keys` command and no cluster secret:
an edge and a core prove themselves to each other and serve a disaggregated request; revoking the edge closes
its connection within seconds (the core logs one line naming the credential) and it is refused after."""

import subprocess
import sys
import time

import pytest

from tests.conftest import make_engine
from tests.e2e.procs import Node, free_port, get_json, post_json, wait_for
from edgecore.shared.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def keys(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "edgecore", "keys", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_credentials_only_fleet_serves_and_revocation_closes_the_link(tmp_path, tokenizer):
    folder = str(tmp_path / "keys")
    keys("init", "--dir", folder)
    keys("issue", "core-a", "--role", "core", "--dir", folder)
    keys("issue", "edge-a", "--role", "edge", "--region", "eu", "--dir", folder)
    (tmp_path / "keys" / "revoked.txt").write_text("")
    trust = ["--authority", f"{folder}/authority.pub", "--revocations", f"{folder}/revoked.txt"]
    port, http, edge_http = free_port(), free_port(), free_port()
    core = Node(["core", "--listen", f"127.0.0.1:{port}", "--http", f"127.0.0.1:{http}", "--data-dir",
                 str(tmp_path / "data"), "--credential", f"{folder}/core-a.cred", *trust], env={"EDGECORE_SECRET": ""})
    edge = None
    try:
        edge = Node(["edge", "--listen", f"127.0.0.1:{edge_http}", "--core", f"127.0.0.1:{port}",
                     "--local-prefill-below", "0", "--credential", f"{folder}/edge-a.cred", *trust],
                    env={"EDGECORE_SECRET": ""})
        prompt = tokenizer.encode("The for statement iterates over the items of any sequence")
        [ref] = make_engine().generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        out = post_json(f"http://127.0.0.1:{edge_http}/v1/completions",
                        {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert out["choices"][0]["text"] == ref["text"]
        assert get_json(f"http://127.0.0.1:{http}/stats")["remote_requests"] >= 0
        assert wait_for(lambda: get_json(f"http://127.0.0.1:{edge_http}/ready")["cores_healthy"] == 1)

        keys("revoke", "edge-a", "--dir", folder)
        start = time.monotonic()
        assert wait_for(lambda: "was revoked" in core.logs(), timeout=10), core.logs()[-2000:]
        assert time.monotonic() - start < 10
        assert wait_for(lambda: "revoked" in edge.logs() and "edge-a" in core.logs(), timeout=20)
    finally:
        if edge is not None:
            edge.stop()
        core.stop()
