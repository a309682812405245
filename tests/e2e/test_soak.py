"""The soak under faults, CI-sized (bench/soak.py runs it for 30 minutes): `edgecore up`'s launcher with two cores
and two edges over emulated WAN links, at 70% of the capacity it measures, while every kind of fault is
injected once (a core killed, a core drained, an edge drained, a link cut, a link slowed), then every node
restarted one at a time under the same load: no request lost, none failed, every node sampled."""

from __future__ import annotations

import os
import shutil

import pytest

from edgecore.deploy.soak import FAULTS, Soak, soak_prompts
from tests.e2e.procs import ROOT

MODEL = ROOT / "models" / "pydoc-llama"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420),
              pytest.mark.skipif(os.geteuid() != 0, reason="WAN emulation needs root (namespaces, tc, nftables)"),
              pytest.mark.skipif(shutil.which("ip") is None or shutil.which("tc") is None,
                                 reason="WAN emulation needs iproute2")]


def test_soak_under_every_fault_fails_no_request(tmp_path):
    soak = Soak(str(MODEL), tmp_path)
    try:
        soak.start(soak_prompts(str(MODEL)))
        rate = 0.7 * soak.calibrate(8.0)
        soak.run(80.0, 15.0, rate)
        soak.rolling_restart()
        report = soak.report(warmup_s=30.0)
    finally:
        soak.stop()
    log = (tmp_path / "fleet.log").read_text()
    assert [f["kind"] for f in report["faults"]] == list(FAULTS), report["faults"]
    assert all(f["error"] is None for f in report["faults"]), report["faults"]
    req = report["requests"]
    assert req["sent"] > 100 and req["lost"] == 0, (req, log[-5000:])
    assert req["failed"] == 0 and req["completed"] == req["sent"], (req, log[-5000:])
    assert report["rolling_restart"]["requests"] > 0 and report["rolling_restart"]["failed"] == 0
    assert req["retried"] > 0              # the drained edge sent its requests to the other one
    for label, node in report["nodes"].items():
        assert node["restarts"] >= 1, label   # the rolling restart, at least
    sampled = [n for n in report["nodes"].values() if n["minutes"]]
    assert sampled and all(n["rss_mb"][0] > 50 and n["fds"][0] > 3 and n["threads"][0] >= 1 for n in sampled)
