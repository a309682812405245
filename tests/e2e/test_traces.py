"""OpenTelemetry traces across real processes (`--otlp-endpoint`): a core and an edge (HTTP process and engine
process) export to a small OTLP/HTTP collector run here, which decodes what they send with OpenTelemetry's own
protobuf classes. One disaggregated request under an inbound `traceparent` is one trace whose tree crosses all
three processes."""

from __future__ import annotations

import pytest

from tests.e2e.otlp_collector import Collector
from tests.e2e.procs import post_json, start_core, start_edge, wait_for

pytest.importorskip("opentelemetry.sdk")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced(secret_file):
    mp = pytest.MonkeyPatch()
    mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")          # export within 50 ms instead of 5 s
    collector = Collector()
    core, port, _ = start_core(secret_file, "--otlp-endpoint", collector.url, "--name", "core-a")
    edge, http = start_edge("--local-prefill-below", "0", "--otlp-endpoint", collector.url, "--name", "edge-a",
                            cores=[port], secret_file=secret_file)
    yield collector, http
    edge.stop()
    core.stop()
    collector.stop()
    mp.undo()


def test_one_disaggregated_request_is_one_trace_across_three_processes(traced, tokenizer, heldout):
    collector, http = traced
    prompt = tokenizer.encode(heldout)[:300]
    out = post_json(f"http://127.0.0.1:{http}/v1/completions",
                    {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
                    headers={"traceparent": f"00-{TRACE_ID}-{PARENT}-01"})
    assert out["usage"]["completion_tokens"] == 8
    names = ("POST /v1/completions", "edge.request", "edge.queue", "edge.prefill.remote", "edge.kv_transfer",
             "edge.decode", "core.request", "core.prefill", "core.kv_send")
    assert wait_for(lambda: all(any(s["trace"] == TRACE_ID for s in collector.named(n)) for n in names), 20), \
        sorted({s["name"] for s in collector.spans})
    spans = {n: [s for s in collector.named(n) if s["trace"] == TRACE_ID] for n in names}
    assert all(len(v) == 1 for v in spans.values()), {n: len(v) for n, v in spans.items()}
    one = {n: v[0] for n, v in spans.items()}

    def parent(child: str, of: str) -> None:
        assert one[child]["parent"] == one[of]["id"], (child, of)
        assert one[of]["start"] <= one[child]["start"], (child, of)
    assert one["POST /v1/completions"]["parent"] == PARENT                 # the inbound traceparent is honoured
    parent("edge.request", "POST /v1/completions")                          # HTTP process → engine process
    for child in ("edge.queue", "edge.prefill.remote", "edge.decode"):
        parent(child, "edge.request")
    parent("edge.kv_transfer", "edge.prefill.remote")
    parent("core.request", "edge.prefill.remote")                           # edge → core (PrefillRequest)
    parent("core.prefill", "core.request")
    parent("core.kv_send", "core.request")
    # which node each span comes from
    assert {one[n]["resource"]["service.name"] for n in names if n.startswith("core")} == {"edgecore-core"}
    assert {one[n]["resource"]["service.instance.id"] for n in names if n.startswith("core")} == {"core-a"}
    assert {one[n]["resource"]["service.name"] for n in names if not n.startswith("core")} == {"edgecore-edge"}
    # what they say
    transfer, core_req = one["edge.kv_transfer"]["attrs"], one["core.request"]["attrs"]
    assert transfer["edgecore.codec"] == "lossless" and transfer["edgecore.kv_bytes"] > 0
    assert core_req["edgecore.prompt_tokens"] == 300 and core_req["edgecore.edge"] == "edge-a"
    assert one["core.kv_send"]["attrs"]["edgecore.kv_bytes"] == transfer["edgecore.kv_bytes"]
    layers = [t for name, t in one["edge.kv_transfer"]["events"] if name == "layer_complete"]
    assert len(layers) >= 3 and all(one["edge.kv_transfer"]["start"] <= t <= one["edge.kv_transfer"]["end"]
                                    for t in layers)
    assert one["edge.decode"]["attrs"]["edgecore.output_tokens"] == 8
    assert one["edge.queue"]["attrs"]["edgecore.placement"] == "remote"
    assert one["edge.request"]["attrs"]["edgecore.finish_reason"] == "length"
    assert one["edge.prefill.remote"]["end"] <= one["edge.decode"]["start"] + 1_000_000
    assert all(one[n]["status"] != 2 for n in names)                       # none in error


def test_a_request_without_traceparent_starts_its_own_trace(traced):
    collector, http = traced
    before = {s["trace"] for s in collector.named("POST /v1/chat/completions")}
    post_json(f"http://127.0.0.1:{http}/v1/chat/completions",
              {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
              headers={"traceparent": "00-00000000000000000000000000000000-00f067aa0ba902b7-01"})   # invalid
    new = wait_for(lambda: [s for s in collector.named("POST /v1/chat/completions") if s["trace"] not in before])
    assert len(new) == 1 and new[0]["parent"] == "" and new[0]["trace"] != "0" * 32
    assert wait_for(lambda: [s for s in collector.named("edge.request") if s["trace"] == new[0]["trace"]])
