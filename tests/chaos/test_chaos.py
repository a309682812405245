"""Seeded fault injection between a real edge and core: never a silent difference, nothing leaked.

Each trial draws one fault from its seed (relay: drop, delay, duplicate, reorder, truncate, bit flips
in header or payload, close at any frame including the handshake; processes: SIGKILL/SIGSTOP of the
core, SIGKILL of the edge's engine process). A failing seed replays with `bench/chaos.py --seed N`.
`bench/chaos.py --trials 10000` is the long run; CI runs a bounded number here.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

from edgecore.deploy.chaos import ChaosCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
TRIALS = int(os.environ.get("EDGECORE_CHAOS_TRIALS", "24"))


def _prompts(tokenizer, heldout) -> list[list[int]]:
    ids = tokenizer.encode(heldout)
    lengths = [40, 64, 90, 128, 170, 220, 300, 64, 100, 150]
    return [ids[i * 97: i * 97 + n] for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def cluster(model_dir, tokenizer, heldout, tmp_path_factory):
    c = ChaosCluster(str(model_dir), tmp_path_factory.mktemp("chaos"))
    c.reference(_prompts(tokenizer, heldout))
    c.start()
    yield c
    assert c.stop() == [], "processes left behind"


def test_seeded_faults_never_give_a_silent_difference_or_leak(cluster):
    results = [cluster.run_trial(seed) for seed in range(TRIALS)]
    kinds = Counter(r.fault.split(":")[0] for r in results)
    silent = [r for r in results if r.silent_differences]
    leaks = [r for r in results if r.leaked]
    assert not silent, f"silent differences: {silent}"
    assert not leaks, f"leaked after trials: {leaks}"
    assert sum(r.identical for r in results) > 0          # the cluster did serve through the faults
    assert len(kinds) >= 5, kinds                          # the seeds exercised several kinds of fault
