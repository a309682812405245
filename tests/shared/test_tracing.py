"""shared/node/tracing.py with the SDK's in-memory exporter: traceparent parsing, spans on explicit perf_counter times,
parents across a traceparent string, the node's resource, and nothing at all when traces are off."""

from __future__ import annotations

import time

import pytest

from edgecore.shared.node import tracing
from edgecore.shared.errors import ConfigError

pytest.importorskip("opentelemetry.sdk")


@pytest.fixture
def exported():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    exporter = InMemorySpanExporter()
    tracing.configure("http://unused:4318", "edge", "edge-7", exporter=exporter)
    yield exporter
    tracing.shutdown()
    assert tracing.tracer() is None


@pytest.mark.parametrize("value, ok", [
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", True),
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", True),
    ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", False),     # zero trace id
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", False),     # zero span id
    ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", False),     # upper case
    ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", False),     # another version
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x", False), ("", False), (None, False),
])
def test_traceparent(value, ok):
    assert (tracing.parse_traceparent(value) is not None) is ok


def test_spans_take_perf_counter_times_and_parents_from_a_traceparent(exported):
    tr = tracing.tracer()
    assert tr is not None
    t0 = time.perf_counter()
    root = tr.start("root", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", t0, kind="server",
                    request_id="r1", **{"gen_ai.request.model": "m"})
    child = tr.start("child", root.traceparent, t0 + 0.25, tokens=3, missing=None)   # across a "process"
    child.event("layer_complete", t0 + 0.5, layer=2)
    child.fail("core error")
    child.end(t0 + 1.0)
    child.end(t0 + 9.0)                     # once only
    root.end(t0 + 2.0, outcome="released")
    spans = {s.name: s for s in exported.get_finished_spans()}
    r, c = spans["root"], spans["child"]
    assert r.context.trace_id == c.context.trace_id == 0x4bf92f3577b34da6a3ce929d0e0e4736
    assert r.parent.span_id == 0x00f067aa0ba902b7 and c.parent.span_id == r.context.span_id
    assert c.end_time - c.start_time == pytest.approx(0.75e9, abs=1e4)
    assert r.end_time - r.start_time == pytest.approx(2.0e9, abs=1e4)
    assert abs(r.start_time - time.time_ns() + (time.perf_counter() - t0) * 1e9) < 5e7     # on the epoch clock
    assert dict(r.attributes) == {"edgecore.request_id": "r1", "gen_ai.request.model": "m",
                                  "edgecore.outcome": "released"}
    assert dict(c.attributes) == {"edgecore.tokens": 3}
    assert [(e.name, dict(e.attributes)) for e in c.events] == [("layer_complete", {"edgecore.layer": 2})]
    assert c.status.status_code.name == "ERROR" and c.status.description == "core error"
    assert r.resource.attributes["service.name"] == "edgecore-edge"
    assert r.resource.attributes["service.instance.id"] == "edge-7"


def test_a_bad_parent_starts_a_new_trace(exported):
    span = tracing.tracer().start("alone", "not-a-traceparent")
    span.end()
    (s,) = exported.get_finished_spans()
    assert s.parent is None


def test_off_by_default_and_endpoint_checked():
    assert tracing.tracer() is None
    assert tracing.traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert tracing.traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"
    with pytest.raises(ConfigError, match="--otlp-endpoint"):
        tracing.traces_url("c:4318")


def test_request_spans_end_in_error_for_failures(exported):
    """The core's request span: its outcome, in error unless the edge acknowledged or cancelled it; the prefill
    span ends when the first token was sampled; an edge's handover whose core failed is in error."""
    from types import SimpleNamespace

    from edgecore.core.transfer_trace import TransferTrace
    from edgecore.edge.request_trace import RequestTrace
    from edgecore.protocol.messages import PrefillRequest
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    t0 = time.perf_counter()
    for outcome in ("released", "cancelled", "timeout", "lease_expired"):
        trace = TransferTrace.begin(PrefillRequest(outcome, [1, 2, 3], traceparent=parent), t0, "lossless",
                                    SimpleNamespace(peer_name="edge-a"))
        trace.sent(100, 400)
        trace.prefilled(3, 0, t0 + 0.01)
        trace.close(outcome)
        trace.close("released")                       # once only
    assert TransferTrace.begin(PrefillRequest("x", [1], traceparent="00-bad"), t0, "lossless",
                               SimpleNamespace(peer_name="")) is None
    requests = {s.attributes["edgecore.request_id"]: s for s in exported.get_finished_spans()
                if s.name == "core.request"}
    assert {k: s.status.status_code.name for k, s in requests.items()} == {
        "released": "UNSET", "cancelled": "UNSET", "timeout": "ERROR", "lease_expired": "ERROR"}
    assert all(s.attributes["edgecore.outcome"] == k for k, s in requests.items())
    prefill = [s for s in exported.get_finished_spans() if s.name == "core.prefill"]
    assert len(prefill) == 4 and all(s.end_time - s.start_time == pytest.approx(1e7, abs=1e4) for s in prefill)
    assert len([s for s in exported.get_finished_spans() if s.name == "core.kv_send"]) == 4
    edge = RequestTrace.begin(parent, "r", 3, t0)
    edge.first_token(t0 + 0.02, 0)
    edge.handover(-1, "core_failed")
    edge.close()
    (handover,) = [s for s in exported.get_finished_spans() if s.name == "edge.handover"]
    assert handover.status.status_code.name == "ERROR" and "edgecore.core_tokens" not in handover.attributes
