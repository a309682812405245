"""The edge's predicted TTFT (`PrefillModel.predict_ttft`, the `edgecore:predicted_ttft_seconds` gauge): the
new request and those waiting ahead of it prefilled at the best measured rate, here or at a healthy core."""

import pytest

from edgecore.edge.placement import PrefillModel


def test_predicted_ttft_is_the_queue_prefilled_at_the_best_measured_rate():
    model = PrefillModel()
    assert model.predict_ttft(100, 3, [("core:1", 0.05)]) is None          # nothing measured yet
    model.observe_local(100, 0.2)                                            # 2 ms per token here
    assert model.predict_ttft(100, 0, []) == pytest.approx(0.2)
    assert model.predict_ttft(100, 3, []) == pytest.approx(0.8)              # three waiting ahead of it
    model.observe_remote("core:1", 100, 0.15, rtt=0.05)                      # 1 ms per token there, 50 ms away
    assert model.predict_ttft(100, 3, [("core:1", 0.05)]) == pytest.approx(0.45)
    assert model.predict_ttft(100, 3, []) == pytest.approx(0.8)              # that core is not healthy now
    assert model.predict_ttft(10, 0, [("core:1", 0.05)]) == pytest.approx(0.02)   # short: here is faster
