"""A parallel core whose worker ranks are started elsewhere (`edgecore core --external-workers`, as a
LeaderWorkerSet's worker pods start them): the workers are started first and wait for the driver's rendezvous,
learn the KV pool's size from it, and the edge's greedy output through that core equals one process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from edgecore.shared.engine.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.e2e.procs import ROOT, free_port, get_json, post_json, start_core, start_edge

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
MODEL = ROOT / "models" / "pydoc-llama"


def test_core_with_external_workers_equals_one_process(secret_file, tokenizer, heldout, tmp_path):
    tp, pp, rendezvous = 2, 2, free_port()
    env = {**os.environ, "EDGECORE_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    logs = [open(tmp_path / f"worker-{rank}.log", "w+") for rank in range(1, tp * pp)]
    workers = [subprocess.Popen([sys.executable, "-m", "edgecore", "core-worker", "--rank", str(rank), "--tp",
                                 str(tp), "--pp", str(pp), "--master", f"127.0.0.1:{rendezvous}", "--model",
                                 str(MODEL), "--join-timeout", "120", "--pool-from-driver"], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
               for rank, log in zip(range(1, tp * pp), logs)]
    core = edge = None
    try:
        core, port, core_http = start_core(secret_file, "--tp", str(tp), "--pp", str(pp), "--external-workers",
                                           "--rendezvous", f"127.0.0.1:{rendezvous}", ready_timeout=150)
        assert all(w.poll() is None for w in workers)             # joined, not exited
        stats = get_json(f"http://127.0.0.1:{core_http}/stats")
        assert stats["layout"]["tp"] == tp and stats["layout"]["pp"] == pp
        edge, http = start_edge("--local-prefill-below", "0", cores=[port], secret_file=secret_file)
        ids = tokenizer.encode(heldout)
        prompts = [ids[i * 100: i * 100 + n] for i, n in enumerate((9, 70, 200))]
        ref = make_engine().generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        outs = [post_json(f"http://127.0.0.1:{http}/v1/completions", {
            "prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True}) for p in prompts]
        assert [o["choices"][0]["text"] for o in outs] == [r["text"] for r in ref]
        # every rank's KV reached the edge through rank 0: no stream connection to a worker
        assert get_json(f"http://127.0.0.1:{http}/stats")["cores"][0]["stream_connections"] == 0
    finally:
        for node in (edge, core):
            if node is not None:
                node.stop()
        for w in workers:
            if w.poll() is None:
                w.kill()
            w.wait(10)
    text = "".join(log.seek(0) or log.read() for log in logs)
    assert "Traceback" not in text.split("stopping")[0], text[-3000:]


def test_external_workers_need_a_rendezvous_port(secret_file):
    r = subprocess.run([sys.executable, "-m", "edgecore", "core", "--model", str(MODEL), "--tp", "2",
                        "--external-workers", "--secret-file", secret_file], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "--rendezvous" in r.stderr and "Traceback" not in r.stderr
