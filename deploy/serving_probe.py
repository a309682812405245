"""The serving path's own latency, for the simulator: what a client sees beyond the engine's work.

Life cycle: `edgecore profile --serving` calls `measure_serving(profile, model_dir, port)` after timing the
engine. It starts a one-region topology (a core and an edge on loopback ports from `port`) with `edgecore up`,
replays `REQUESTS` requests one at a time (a second apart: no queue) of `PROMPT` prompt and `OUTPUT` output
tokens through the edge's OpenAI API (deploy/replay.py), stops it, and simulates the same trace with the
profile just measured. The differences of the medians are the serving terms: `serving_ttft_s` (HTTP and SSE,
tokenization, the edge's engine-process hop, the protocol and KV codecs' CPU time, Python between the engine's
steps, before the first token) and `serving_tpot_s` (the same per output token). The simulator adds them to
every request's first token and to each later token (deploy/simulator.py). Measured without load: on a busy
machine they include its contention.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import tempfile
from pathlib import Path

from edgecore.deploy.profile import Profile

REQUESTS = 12
PROMPT = 200
OUTPUT = 32


def measure_serving(profile: Profile, model_dir: str, port: int = 7650) -> Profile:
    """`profile` with its serving terms measured on this machine."""
    from edgecore.deploy.fleet_run import start_fleet, stop_fleet
    from edgecore.deploy.plan import measured_report, report
    from edgecore.deploy.replay import replay
    from edgecore.deploy.simulator import Options, Simulator
    from edgecore.deploy.topology import load_topology
    from edgecore.deploy.trace import Request, Trace
    with tempfile.TemporaryDirectory(prefix="edgecore-serving-") as work:
        path = Path(work) / "serving.toml"
        path.write_text(f'[model]\npath = "{model_dir}"\n[[regions.here.cores]]\nname = "core"\nport = {port}\n'
                        f'http_port = {port + 1}\n[[regions.here.edges]]\nname = "edge"\nport = {port + 2}\n')
        topo = load_topology(path)
        trace = Trace(tuple(Request(1.0 + i, "here", PROMPT, OUTPUT) for i in range(REQUESTS)))
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        proc, urls = start_fleet(path, False, Path(work) / "up.log")
        try:
            records = asyncio.run(replay(trace, {"here": urls["edge"]}, topo.model_name, vocab, timeout=300))
        finally:
            stop_fleet(proc)
        measured = measured_report(records, ["here"], trace.duration)["regions"]["here"]
        predicted = report(Simulator(topo, profile, options=Options()).run(trace), ["here"])["regions"]["here"]
    if measured["failed"]:
        raise RuntimeError(f"the serving probe's requests failed ({measured['failed']} of {REQUESTS})")
    ttft = max(0.0, (measured["ttft_ms"]["p50"] - predicted["ttft_ms"]["p50"]) / 1000)
    tpot = max(0.0, (measured["tpot_ms"]["p50"] - predicted["tpot_ms"]["p50"]) / 1000)
    return dataclasses.replace(profile, serving_ttft_s=ttft, serving_tpot_s=tpot,
                               measurements={**profile.measurements, "serving": {
                                   "requests": REQUESTS, "prompt_tokens": PROMPT, "output_tokens": OUTPUT,
                                   "ttft_ms_measured": measured["ttft_ms"], "ttft_ms_engine": predicted["ttft_ms"],
                                   "tpot_ms_measured": measured["tpot_ms"], "tpot_ms_engine": predicted["tpot_ms"]}})
