"""The measured prefill crossover: local below it, the core above it; the fixed threshold until measured."""

from types import SimpleNamespace

import pytest

from edgecore.edge.metrics import EdgeMetrics
from edgecore.edge.placement import PrefillModel
from edgecore.edge.progress import Progress
from tests.shared.fake_handle import output


def local(m: PrefillModel, tokens: int, rtt: float) -> bool:
    """Local against the core with nothing cached at either and no queue."""
    return m.local_is_faster(tokens, "core", m.predict_core("core", rtt, tokens, 0))


def test_fixed_threshold_until_both_sides_are_measured():
    m = PrefillModel(fallback_threshold=32)
    assert local(m, 10, 0.02) and not local(m, 100, 0.02)
    m.observe_local(100, 0.1)
    assert not local(m, 100, 0.02)          # the core is not measured yet


def test_crossover_from_measurements():
    m = PrefillModel(explore_every=1000)
    m.observe_local(200, 0.2)                 # 1 ms per token here
    m.observe_remote("core", 200, 0.06, 0.02)  # 0.2 ms per token at the core, 20 ms round trip
    assert m.crossover("core", 0.02) == 0.02 / (0.001 - 0.0002)      # 25 tokens
    assert local(m, 20, 0.02) and not local(m, 30, 0.02)
    # A far core (200 ms away) moves the crossover up.
    assert local(m, 200, 0.2) and not local(m, 300, 0.2)


def test_local_always_faster_has_no_crossover_but_still_probes_the_core():
    m = PrefillModel(explore_every=4)
    m.observe_local(100, 0.01)
    m.observe_remote("core", 100, 0.1, 0.02)
    assert m.crossover("core", 0.02) is None
    picks = [local(m, 10_000, 0.02) for _ in range(8)]
    assert picks.count(False) == 2              # one in four goes to the core to refresh its estimate
    assert all(local(m, 5, 0.02) for _ in range(8))   # short prompts never probe


def test_an_edge_that_never_prefilled_itself_tries_now_and_then_to_measure_its_rate():
    m = PrefillModel(fallback_threshold=32, explore_every=8)
    m.observe_remote("core", 200, 0.06, 0.02)
    picks = [local(m, 100, 0.02) for _ in range(16)]
    assert picks.count(True) == 2                       # one in eight, until a local prefill is measured
    assert not any(local(m, 600, 0.02) for _ in range(16))     # never a long one just to measure
    m.observe_local(100, 0.01)
    assert local(m, 100, 0.02)                          # measured: 10 ms here against 20 ms + 20 ms there


def test_a_prefill_is_measured_over_the_queue_it_was_predicted_to_wait_behind():
    for queued, where in ((300, "core"), (0, "core"), (150, None)):
        edge = SimpleNamespace(metrics=EdgeMetrics(), prefill_model=PrefillModel(), active=0)
        progress = Progress(edge, 100)
        progress.core = SimpleNamespace(address="core", rtt=0.02) if where else None
        progress.queued = queued
        progress.arrived -= 0.42                       # its first token 0.42 s after it arrived
        progress.observe(output("r", 5, cached=20))    # 80 of its 100 tokens computed, behind `queued`
        if where:
            rate = edge.prefill_model.remote_per_token["core"]
            assert rate == pytest.approx((0.42 - 0.02) / (80 + queued), rel=0.01)
            # the prediction for the same work gives the time it took
            assert edge.prefill_model.predict_core("core", 0.02, 80, queued) == pytest.approx(0.42, rel=0.01)
        else:
            assert edge.prefill_model.local_per_token == pytest.approx(0.42 / (80 + queued), rel=0.01)
