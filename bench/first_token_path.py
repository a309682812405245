"""Where a decode handover's first token spends its time: timestamps hop by hop, core process included.

The setup of `bench/ttft.py` row (f) (random 8k-context model, a core in its own
process behind the userspace WAN relay, `--mbit` 200 / `--delay-ms` 20 one way in
BOTH directions, lossless layer-wise streaming, decode handover) with probes
added by wrapping methods in this benchmark only (nothing in the nodes changes):
the core runs as `python bench/first_token_path.py --core-process ...`, which
wraps the core's methods and prints one `STAMP {json}` line per event on stderr.
All stamps are `time.perf_counter()` (CLOCK_MONOTONIC: one clock for every
process on the machine).

Per request, milliseconds from the client's call (`edge.generate`):
  edge_placed           the edge decided to prefill at the core
  edge_reserved         its blocks are reserved (an engine command)
  edge_request_sent     PrefillRequest written
  core_received         the core's protocol layer returned the PrefillRequest
  core_last_layer       the engine thread queued the prompt's last layer (on_layer of the last chunk)
  core_step_out         the engine thread's step returned the first token
  core_first_token      the core's event loop got the first token (PrefillService._finish)
  core_done_written     the core's sender takes PrefillDone (after the KV queued before it)
  relay_done_released   when the relay lets the read holding those bytes out toward the edge (its link model)
  edge_done_received    the edge's protocol layer returned PrefillDone
  edge_push_called      the edge's request task handles it
  edge_engine_push      the edge's engine thread runs push_token
  edge_pushed           push_token returned (the token is in the edge engine's request)
  client_first_token    the output reached the caller
and the splits that matter: link (2 x delay, the floor beyond the prefill), the
relay's queue ahead of PrefillDone (KV bytes already on the emulated link), and
the node time on each side; with `--tokens` > 1 also the gaps between the first
tokens and the edge's engine steps (where the largest gap falls). With
`--compare chunk-decode|push` requests alternate between the code before one of
the changes this probe led to and the code as it is, in one run (`use_variant`).
Prints one JSON line, writes
`bench/results/first_token_path.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

STAMP = "STAMP "


def _stamp(event: str, rid: str) -> None:
    print(STAMP + json.dumps({"event": event, "rid": rid, "t": time.perf_counter()}), file=sys.stderr, flush=True)


def _rid(internal_id: str) -> str:
    return internal_id.split("/", 1)[-1]


def _wrap(cls, name: str, before=None, after=None, is_async: bool = False) -> None:
    orig = getattr(cls, name)
    if is_async:
        @functools.wraps(orig)
        async def wrapper(*a, **kw):
            before and before(*a, **kw)
            result = await orig(*a, **kw)
            after and after(result, *a, **kw)
            return result
    else:
        @functools.wraps(orig)
        def wrapper(*a, **kw):
            before and before(*a, **kw)
            result = orig(*a, **kw)
            after and after(result, *a, **kw)
            return result
    setattr(cls, name, wrapper)


def patch_core() -> None:
    """The core process's probes (run before its CLI)."""
    from edgecore.core.kv_sender import LayerSender
    from edgecore.core.prefill_service import PrefillService
    from edgecore.protocol import messages as m
    from edgecore.protocol.transport import Peer
    from edgecore.shared.engine.engine_thread import EngineThread

    def recv_after(ev, *a, **kw):
        if isinstance(ev, m.PrefillRequest):
            _stamp("core_received", ev.request_id)
    _wrap(Peer, "recv", after=recv_after, is_async=True)

    def send_before(peer, ev, *a, **kw):
        if isinstance(ev, m.PrefillDone):
            _stamp("core_done_written", ev.request_id)
        elif isinstance(ev, m.Token) and ev.position == 1:
            _stamp("core_token1_written", ev.request_id)
    _wrap(Peer, "send", before=send_before, is_async=True)

    def finish_before(self, session, req, first, *a, **kw):
        _stamp("core_first_token", req.request_id)
    _wrap(PrefillService, "_finish", before=finish_before, is_async=True)

    def hold_after(result, self, outputs):
        for out in outputs:
            if out.num_output_tokens == 1 and out.new_token_ids:
                _stamp("core_step_out", _rid(out.request_id))
    _wrap(EngineThread, "_hold_collected", after=hold_after)

    def layer_before(self, layer, items):
        if layer == self.last_layer:
            for seq, n in items:
                req = self.remote.get(seq.request_id)
                if req is not None and req.last_layer_at is None and seq.num_computed_tokens + n >= req.total_tokens:
                    _stamp("core_last_layer", req.request_id)
    _wrap(LayerSender, "on_layer", before=layer_before)


def patch_edge(stamps: dict) -> None:
    """The bench process's probes: the edge and the relay's link toward it."""
    from edgecore.deploy import wan_relay
    from edgecore.edge.core_client import CoreClient
    from edgecore.edge.node import EdgeNode
    from edgecore.edge.handover_follower import HandoverFollower
    from edgecore.edge.remote_prefill import RemotePrefill
    from edgecore.shared.engine.engine_thread import EngineThread
    from edgecore.protocol import messages as m
    from edgecore.protocol.transport import Peer

    from edgecore.shared.engine.engine import LLMEngine

    def put(event, rid, t=None):
        stamps.setdefault(rid, {}).setdefault(event, time.perf_counter() if t is None else t)

    def on(cls, name, event, rid=lambda self, request_id, *a, **kw: request_id, when="after", is_async=True):
        """Stamp `event` for the request `rid(*args)` names, before or after each call of cls.name."""
        hook = (lambda *a, **kw: put(event, rid(*a, **kw))) if when == "before" else \
            (lambda _, *a, **kw: put(event, rid(*a, **kw)))
        _wrap(cls, name, is_async=is_async, **{when: hook})
    own = lambda self, *a, **kw: self.request_id       # noqa: E731 (a RemotePrefill's or follower's own request)
    of_request = lambda self, request, *a, **kw: request.request_id     # noqa: E731 (an EngineRequest argument)
    on(EngineThread, "activate", "edge_activated")
    on(RemotePrefill, "_request", "edge_request_sent", own)
    on(HandoverFollower, "_push", "edge_push_called", own, when="before")
    on(HandoverFollower, "_push", "edge_pushed", own)
    on(LLMEngine, "push_token", "edge_engine_push", when="before", is_async=False)
    on(EdgeNode, "_placement", "edge_placed", of_request)
    on(EngineThread, "reserve", "edge_reserved", of_request)
    on(EngineThread, "take_over", "edge_taken_over")

    def recv_after(ev, *a, **kw):
        if isinstance(ev, m.PrefillDone):
            put("edge_done_received", ev.request_id)
        elif isinstance(ev, m.Token) and ev.position == 1:
            put("edge_token1_received", ev.request_id)
    _wrap(Peer, "recv", after=recv_after, is_async=True)

    def dispatch_before(self, outputs):
        for out in outputs:
            if out.num_output_tokens == 1:
                put("edge_output_dispatched", out.request_id)
    _wrap(EngineThread, "_dispatch", before=dispatch_before)

    def send_before(self, msg):
        if isinstance(msg, m.Handover):
            put("edge_handover_sent", msg.request_id)
    _wrap(CoreClient, "send", before=send_before, is_async=True)

    steps = stamps.setdefault("_edge_steps", [])
    orig_step = LLMEngine.step

    def step(self, *a, **kw):
        t = time.perf_counter()
        out = orig_step(self, *a, **kw)
        steps.append((t, time.perf_counter(), sum(len(o.new_token_ids) for o in out)))
        return out
    LLMEngine.step = step

    reads = stamps.setdefault("_relay_reads", [])
    orig = wan_relay.Link.release_time

    def release_time(self, nbytes, now):
        at = orig(self, nbytes, now)
        if getattr(self, "_toward_edge", False):
            reads.append((now, nbytes, at))
        return at
    wan_relay.Link.release_time = release_time
    orig_init = wan_relay.Link.__init__

    def init(self, spec, seed=0):
        orig_init(self, spec, seed)
        self._toward_edge = seed == 2          # WanRelay: Link(self.reverse, 2) pumps target → client
    wan_relay.Link.__init__ = init


def core_process(argv: list[str]) -> None:
    patch_core()
    from edgecore.deploy.cli import main
    sys.exit(main(argv))


def start_core(secret_file: str, *extra: str, data_dir: str):
    """tests/e2e/procs.start_core, through this script so that the core's methods carry the probes."""
    from tests.e2e.procs import start_core
    return start_core(secret_file, *extra, data_dir=data_dir, ready_timeout=120,
                      launcher=(sys.executable, __file__, "--core-process"))


def core_stamps(node) -> dict:
    out: dict = {}
    for line in node.logs().splitlines():
        if line.startswith(STAMP):
            s = json.loads(line[len(STAMP):])
            out.setdefault(s["rid"], {}).setdefault(s["event"], s["t"])
    return out


ORDER = ["edge_placed", "edge_reserved", "edge_request_sent", "core_received", "core_last_layer", "core_step_out",
         "core_first_token", "core_done_written", "relay_done_released", "edge_done_received", "edge_push_called",
         "edge_engine_push", "edge_pushed", "edge_output_dispatched", "client_first_token"]


def relay_release(reads: list, written: float) -> tuple[float | None, int]:
    """The relay's release time of the first read at or after `written` (the read holding PrefillDone, to within
    one read), and the bytes it had queued toward the edge then (read, not yet released)."""
    for t, _n, at in reads:
        if t >= written:
            queued = sum(nb for t2, nb, at2 in reads if t2 < t and at2 > t)
            return at, queued
    return None, 0


async def run(args, model_dir: Path) -> dict:
    import torch
    from edgecore.deploy.wan_relay import LinkSpec, WanRelay
    from edgecore.edge.node import EdgeConfig, EdgeNode
    from edgecore.shared.models.config import CacheConfig, EngineConfig
    from edgecore.shared.engine.engine import LLMEngine

    stamps: dict = {}
    patch_edge(stamps)
    cache = CacheConfig(num_blocks=(8192 + 256) // 16 * 2)
    budget = EngineConfig(max_num_batched_tokens=1024, max_num_seqs=4)
    secret_file = model_dir.parent / "secret"
    secret_file.write_bytes(b"probe")
    os.environ["EDGECORE_THREADS"] = str(torch.get_num_threads())
    core, port, http = start_core(str(secret_file), "--model", str(model_dir), "--dtype", "bf16",
                                  "--max-batched-tokens", str(budget.max_num_batched_tokens),
                                  "--kv-blocks", str(cache.num_blocks), "--lease", "5", *args.core_args.split(),
                                  data_dir=str(model_dir.parent / "core"))
    relay = WanRelay(LinkSpec(delay_ms=args.delay_ms, bandwidth_mbit=args.mbit))
    relay_port = await relay.start(("127.0.0.1", 0), ("127.0.0.1", port))
    edge = EdgeNode(EdgeConfig(str(model_dir), cores=[("127.0.0.1", relay_port)], secret=b"probe",
                                 codecs=["lossless"], local_prefill_below=0, cache=cache, engine=budget,
                                 transfer_timeout=300, handover_tokens=64),
                      engine=LLMEngine.from_dir(model_dir, "bf16", "cpu", cache, budget))
    await edge.start()
    gen = torch.Generator().manual_seed(1)
    variants = {"chunk-decode": ["chunks_inline", "current"], "push": ["push_output_next_turn", "current"],
                "": ["current"]}[args.compare]
    runs: dict = {v: {} for v in variants}
    try:
        for n in args.lengths:
            for r in range(args.repeats):
                for variant in variants:     # interleaved: both see the same load
                    use_variant(variant)
                    prompt = torch.randint(5, 4000, (n,), generator=gen).tolist()
                    row = await one_request(edge, core, stamps, f"probe-{variant}-{n}-{r}", prompt, args)
                    runs[variant].setdefault(str(n), []).append(row)
                    print(f"{n} {variant} #{r}: {row}", file=sys.stderr, flush=True)
    finally:
        use_variant("current")
        await edge.stop()
        await relay.stop()
        core.stop()
    return {v: {n: summarize(per, args.delay_ms) for n, per in by_n.items()} for v, by_n in runs.items()}


_CURRENT: dict = {}


def use_variant(variant: str) -> None:
    """The code as it was before a change, for `--compare`: `chunks_inline`, every KV chunk is unpacked on the
    event loop as it arrives (a PrefillDone or Token behind a chunk waits for it), where the chunk writer hands
    chunks over its small-chunk size to worker threads; `push_output_next_turn`, a pushed token's output
    leaves with the engine thread's next turn (a step), not with the command's reply. `current`: the code as
    it is."""
    from edgecore.edge.chunk_writer import ChunkWriter, unpack
    from edgecore.shared.engine.engine_thread import EngineThread
    if not _CURRENT:
        _CURRENT.update(kv=ChunkWriter.write, push=EngineThread.push_token)

    def inline(self, data):
        self._write(data.chunk, unpack(data, self.rope))

    async def next_turn(self, request_id, token):
        return await self._call(lambda e: e.push_token(request_id, token.token, token.logprob, token.top))
    ChunkWriter.write = inline if variant == "chunks_inline" else _CURRENT["kv"]
    EngineThread.push_token = next_turn if variant == "push_output_next_turn" else _CURRENT["push"]


async def one_request(edge, core, stamps: dict, rid: str, prompt: list[int], args) -> dict:
    from edgecore.shared.engine.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    tokens = []
    async for out in edge.generate(rid, prompt, params):
        tokens += [time.perf_counter()] * len(out.new_token_ids)
    stamps.setdefault(rid, {})["client_first_token"] = tokens[0]
    await asyncio.sleep(0.2)
    s = {**core_stamps(core).get(rid, {}), **stamps.get(rid, {})}
    at, queued = relay_release(stamps["_relay_reads"], s.get("core_done_written", 1e18))
    if at is not None:
        s["relay_done_released"] = at
    row = {k: round((s[k] - t0) * 1e3, 1) for k in ORDER if k in s}
    row["relay_queued_bytes_ahead"] = queued
    row.update({k: round((s[k] - t0) * 1e3, 1) for k in ("edge_token1_received", "edge_handover_sent",
                                                          "edge_taken_over", "edge_activated") if k in s})
    if len(tokens) > 1:
        gaps = [round((b - a) * 1e3, 1) for a, b in zip(tokens, tokens[1:])]
        at = max(range(len(gaps)), key=gaps.__getitem__)
        row["tokens_ms"] = [round((t - t0) * 1e3, 1) for t in tokens[:8]]
        row["edge_steps_ms"] = [(round((a - t0) * 1e3, 1), round((b - a) * 1e3, 1)) for a, b, _ in
                                stamps["_edge_steps"] if a >= t0 and (b - a) > 0.002][:6]
        row["max_gap"] = {"ms": gaps[at], "before_token": at + 1, "median_ms": statistics.median(gaps)}
    return row


def summarize(per: list[dict], delay_ms: float) -> dict:
    med = {k: round(statistics.median(p[k] for p in per if k in p), 1) for k in per[0]
           if isinstance(per[0][k], (int, float))}
    hops = {}
    for a, b in zip(ORDER, ORDER[1:]):
        vals = [p[b] - p[a] for p in per if a in p and b in p]
        if vals:
            hops[f"{a}->{b}"] = round(statistics.median(vals), 1)
    prefill = [p["core_first_token"] - p["core_received"] for p in per]
    excess = [p["client_first_token"] - (p["core_first_token"] - p["core_received"]) - 2 * delay_ms for p in per]
    return {"median_ms_from_call": med, "median_hop_ms": hops, "core_prefill_ms": round(statistics.median(prefill), 1),
            "excess_over_prefill_plus_2x_delay_ms": round(statistics.median(excess), 1), "runs": per}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--core-process":
        return core_process(sys.argv[2:])
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import emit
    from ttft import write_model
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,8192")
    ap.add_argument("--mbit", type=float, default=200)
    ap.add_argument("--delay-ms", type=float, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8, help="tokens generated per request")
    ap.add_argument("--name", default="first_token_path", help="result name (bench/results/NAME.json)")
    ap.add_argument("--compare", choices=["chunk-decode", "push"], default="",
                    help="alternate requests between the code before a change and as it is (see use_variant)")
    ap.add_argument("--core-args", default="", help="extra arguments for the core (e.g. '--handover-max-tokens 0')")
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    load_start = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "random-8k"
        write_model(model_dir)
        rows = asyncio.run(run(args, model_dir))
    current = rows[list(rows)[-1]][str(max(args.lengths))]
    emit(args.name, "excess_over_prefill_plus_2x_delay_ms_at_longest",
         current["excess_over_prefill_plus_2x_delay_ms"], link_mbit=args.mbit, delay_ms=args.delay_ms,
         repeats=args.repeats, tokens=args.tokens, core_args=args.core_args,
         load_average={"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]}, results=rows)


if __name__ == "__main__":
    main()
