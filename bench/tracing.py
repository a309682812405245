"""What OpenTelemetry traces cost (`--otlp-endpoint`): two core + edge pairs on this machine, the same model and
flags, one exporting every request's spans to a local OTLP/HTTP collector (tests/e2e/otlp_collector.py) and one
with traces off (the default). Requests alternate between the pairs, fresh prompts each (`--prompt-tokens` from
the held-out text, `--max-tokens` greedy, prefilled at the core); the metric is the traced pair's median
end-to-end latency over the untraced pair's. Traces off cost the request path nothing but `is None` tests on
its way: measured apart as the time of every check a request makes with traces off (`off_path_ns`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from common import ROOT, emit, progress

from tests.e2e.otlp_collector import Collector
from tests.e2e.procs import post_json, start_core, start_edge, wait_for


def off_path_ns(repeats: int = 200_000) -> float:
    """The checks one request makes with traces off: the HTTP span's `tracer()`, the engine-side trace's `begin`
    and its `is None` tests (Progress: 4, the placement: 2, the core's transfer: 5), in ns."""
    from edgecore.core.transfer_trace import TransferTrace
    from edgecore.edge.request_trace import RequestTrace
    from edgecore.protocol.messages import PrefillRequest
    from edgecore.shared.node.tracing import tracer
    trace, msg, conn = None, PrefillRequest("r", [1, 2, 3]), None
    t = time.perf_counter_ns()
    for _ in range(repeats):
        tracer()
        RequestTrace.begin(None, "r", 10, 0.0)
        TransferTrace.begin(msg, 0.0, "lossless", conn)
        for _ in range(11):
            if trace is not None:
                pass
    return (time.perf_counter_ns() - t) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=60, help="requests per pair (default 60)")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    from edgecore.shared.text.tokenizer import Tokenizer
    model = ROOT / "models" / "pydoc-llama"
    tok = Tokenizer.from_dir(model)
    ids = tok.encode((model / "heldout.txt").read_text())
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "200"
    collector = Collector()
    tmp = Path(tempfile.mkdtemp(prefix="bench-tracing-"))
    (tmp / "secret").write_bytes(b"bench-tracing")
    nodes, edges = [], {}
    try:
        for mode, extra in (("off", []), ("on", ["--otlp-endpoint", collector.url])):
            core, port, _ = start_core(str(tmp / "secret"), *extra, "--name", f"core-{mode}",
                                       data_dir=str(tmp / f"core-{mode}"))
            edge, http = start_edge("--local-prefill-below", "0", *extra, "--name", f"edge-{mode}", cores=[port],
                                    secret_file=str(tmp / "secret"))
            nodes += [edge, core]
            edges[mode] = http
        latency: dict[str, list[float]] = {mode: [] for mode in edges}
        step = args.prompt_tokens // 2
        for i in range(args.requests + 2):             # the first two rounds warm both pairs, not counted
            for mode, http in edges.items():
                start = (i * 2 + (mode == "on")) * step % max(1, len(ids) - args.prompt_tokens)
                body = {"prompt": ids[start:start + args.prompt_tokens], "max_tokens": args.max_tokens,
                        "temperature": 0, "ignore_eos": True}
                t = time.perf_counter()
                post_json(f"http://127.0.0.1:{http}/v1/completions", body)
                if i >= 2:
                    latency[mode].append(time.perf_counter() - t)
            if i % 10 == 0:
                progress(f"{i + 1}/{args.requests + 2} rounds")
        expected = (args.requests + 2) * 9          # spans per traced request (tests/e2e/test_traces.py)
        wait_for(lambda: len(collector.spans) >= expected, 10)
        med = {mode: statistics.median(v) * 1e3 for mode, v in latency.items()}
        p90 = {mode: statistics.quantiles(v, n=10)[-1] * 1e3 for mode, v in latency.items()}
        off_ns = off_path_ns()
        emit("tracing", "traced_over_untraced_median_latency", round(med["on"] / med["off"], 3),
             requests=args.requests, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
             median_ms={k: round(v, 2) for k, v in med.items()}, p90_ms={k: round(v, 2) for k, v in p90.items()},
             spans_exported=len(collector.spans), spans_per_request=round(len(collector.spans) / (args.requests + 2), 1),
             off_path_ns=round(off_ns, 1), off_path_share_of_median=f"{off_ns / (med['off'] * 1e6):.2e}",
             load_average=os.getloadavg())
    finally:
        for node in nodes:
            node.stop()
        collector.stop()


if __name__ == "__main__":
    main()
