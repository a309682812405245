"""`edgecore profile`, `edgecore plan` and `edgecore replay`: argument parsing and output (the work is in deploy/profile.py,
deploy/trace.py, deploy/simulator.py and deploy/plan.py).

Life cycle: `register` adds both subcommands; `run_profile` measures and writes a profile; `run_plan` either
writes a synthetic trace (`--generate`), or reads topology, trace and profiles, warns about a profile made
for another model or version, simulates (or searches), and prints the report as text or one JSON object.
`run_replay` sends a trace to a running topology's edges (deploy/replay.py) and prints the same report,
measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure this machine's cost model for a model (for `edgecore plan`)",
                       description="Time prefill, decode steps and the KV codecs on this machine with the real "
                                   "engine and write the fitted cost model as JSON (docs/plan.md).")
    p.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    p.add_argument("--device", default="cpu", help="torch device to measure on (cpu, cuda)")
    p.add_argument("--dtype", default="auto", help="weights dtype (auto: the checkpoint's, float32 on CPU)")
    p.add_argument("--codecs", nargs="+", default=None, metavar="CODEC",
                   help="KV codecs to measure (default: every codec edgecore has)")
    p.add_argument("--repeats", type=int, default=3, help="timings per point (the fastest/median is kept)")
    p.add_argument("--quick", action="store_true", help="fewer points (seconds, for tests and smoke runs)")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--serving", action="store_true",
                   help="also measure the serving path's latency beyond the engine (HTTP, the node hops, the "
                        "protocol): a core and an edge started with `edgecore up` on loopback ports, 12 requests "
                        "one at a time; the simulator adds it to each request (about half a minute)")
    p.add_argument("--serving-port", type=int, default=7650, help="--serving: first of the 3 ports it uses")
    p.set_defaults(func=run_profile)

    q = sub.add_parser("plan", help="simulate a fleet (topology + trace + profile) or write a synthetic trace",
                       description="Simulate a topology's cores, edges and WAN links driven by a trace, with the "
                                   "cost model of `edgecore profile`; print per-region TTFT, TPOT and end-to-end "
                                   "percentiles, node utilisation and queues, link bytes (docs/plan.md).")
    q.add_argument("--topology", default="example", help="topology TOML (default: 'example', the bundled one)")
    q.add_argument("--trace", help="JSONL trace (docs/plan.md)")
    q.add_argument("--profile", help="profile JSON from `edgecore profile` (edges; cores too without "
                                     "--profile-core)")
    q.add_argument("--profile-core", help="profile JSON for the cores (e.g. measured on a GPU)")
    q.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    q.add_argument("--fail", action="append", default=[], metavar="NODE@SECONDS",
                   help="remove a node (all its replicas) at that time; repeatable, adds to [[plan.failures]]")
    q.add_argument("--local-prefill-below", default="32", metavar="TOKENS|auto",
                   help="the edges' local prefill threshold, as `edgecore edge` takes it (auto: the measured "
                        "crossover)")
    q.add_argument("--handover-tokens", type=int, default=64,
                   help="tokens a core may decode while the KV travels (0: no decode handover)")
    q.add_argument("--adaptive", action="store_true",
                   help="edges choose codecs adaptively (edge/codec_policy.py) instead of their first")
    q.add_argument("--ttft-target-ms", type=float, default=None, help="the adaptive codec choice's TTFT target")
    q.add_argument("--shared-cpus", type=int, default=None, metavar="N",
                   help="every node runs on one machine of N cores, as `edgecore up` runs a topology: nodes busy "
                        "at once share them (default: each node on its own machine, as profiled)")
    q.add_argument("--search", action="store_true",
                   help="find the cheapest replica counts meeting every region's SLO ([plan] in the topology)")
    q.add_argument("--slo-ttft-ms", type=float, default=None, help="--search: TTFT SLO for every region")
    q.add_argument("--slo-tpot-ms", type=float, default=None, help="--search: TPOT SLO for every region")
    q.add_argument("--slo-percentile", choices=["p50", "p90", "p99"], default=None,
                   help="--search: the percentile the SLOs apply to (default: the topology's, p99)")
    q.add_argument("--plot", metavar="DIR", default=None,
                   help="write PNG plots there (TTFT CDF per region, utilisation, search frontier; matplotlib)")
    g = q.add_argument_group("synthetic traces (--generate)")
    g.add_argument("--generate", metavar="OUT", default=None,
                   help="write a synthetic trace to OUT for the topology's edge regions, then exit")
    g.add_argument("--requests", type=int, default=1000, help="requests in the generated trace")
    g.add_argument("--rate", type=float, default=10.0, help="arrivals per second over all regions")
    g.add_argument("--arrivals", choices=["poisson", "bursty"], default="poisson", help="arrival process")
    g.add_argument("--burst-factor", type=float, default=4.0, help="bursty: rate multiple while a burst is on")
    g.add_argument("--prompt-mean", type=int, default=512, help="mean prompt tokens (log-normal)")
    g.add_argument("--output-mean", type=int, default=64, help="mean output tokens (log-normal)")
    g.add_argument("--max-prompt", type=int, default=4096, help="largest prompt")
    g.add_argument("--max-output", type=int, default=1024, help="largest output")
    g.add_argument("--session-share", type=float, default=0.3,
                   help="share of requests that continue a session (their prompt starts with its context)")
    g.add_argument("--skew", type=float, default=0.0, help="region popularity ∝ 1/rank^skew (0: uniform)")
    g.add_argument("--seed", type=int, default=0, help="random seed (same seed, same trace)")
    q.set_defaults(func=run_plan)

    r = sub.add_parser("replay", help="send a trace to a running topology and print the measured plan report",
                       description="Replay a JSONL trace against the edges of a running topology (`edgecore "
                                   "up`): one client per region, token-id prompts of the traced lengths, "
                                   "ignore_eos; prints the report of `edgecore plan`, measured (docs/plan.md).")
    r.add_argument("--topology", default="example", help="the topology that is running (regions, edge ports)")
    r.add_argument("--trace", required=True, help="JSONL trace (docs/plan.md)")
    r.add_argument("--edge", action="append", default=[], metavar="REGION=URL",
                   help="a region's edge URL (default: http://127.0.0.1:PORT of its first edge); repeatable")
    r.add_argument("--api-key-file", default=None, help="file holding the edges' API key (first line)")
    r.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take before it fails")
    r.add_argument("--speed", type=float, default=1.0, help="replay the trace this many times faster")
    r.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    r.set_defaults(func=run_replay)


def run_profile(args: argparse.Namespace) -> int:
    from edgecore.deploy.profile import measure, save
    from edgecore.shared.node.env import default_model
    model = args.model or default_model()
    t = time.perf_counter()
    profile = measure(model, args.device, args.dtype, args.codecs, max(1, args.repeats), args.quick,
                      log=lambda m: print(m, file=sys.stderr))
    if args.serving:
        from edgecore.deploy.serving_probe import measure_serving
        print("serving path: a core and an edge, 12 requests one at a time", file=sys.stderr)
        profile = measure_serving(profile, model, args.serving_port)
        print(f"serving path: {profile.serving_ttft_s * 1e3:.1f} ms before the first token, "
              f"{profile.serving_tpot_s * 1e3:.2f} ms per later token", file=sys.stderr)
    save(profile, args.out)
    print(f"wrote {args.out} ({time.perf_counter() - t:.0f} s): step = {profile.cost.base_s * 1e3:.3f} ms + "
          f"{profile.cost.per_row_s * 1e6:.2f} µs/row + {profile.cost.per_prefill_token_s * 1e6:.2f} µs/prefill "
          f"token")
    return 0


def _failures(topology_failures: list, flags: list[str]) -> tuple[tuple[str, float], ...]:
    from edgecore.shared.errors import ConfigError
    out = [(f.node, f.at_s) for f in topology_failures]
    for flag in flags:
        node, sep, at = flag.rpartition("@")
        try:
            seconds = float(at)
        except ValueError:
            seconds = -1.0
        if not sep or not node or not seconds >= 0:
            raise ConfigError(f"--fail {flag!r}: expected NODE@SECONDS (e.g. core-east@30)")
        out.append((node, seconds))
    return tuple(out)


def run_plan(args: argparse.Namespace) -> int:
    from edgecore.deploy.plan import edge_regions, plot, report, render_text, search, slos
    from edgecore.deploy.profile import compare, load_profile
    from edgecore.deploy.simulator import Options, Simulator
    from edgecore.deploy.topology import load_topology
    from edgecore.deploy.trace import GenerateSpec, generate, read_trace, write_trace
    from edgecore.shared.errors import ConfigError
    topology = load_topology(args.topology)
    regions = edge_regions(topology)
    if args.generate:
        trace = generate(GenerateSpec(tuple(regions), args.requests, args.rate, args.arrivals, args.burst_factor,
                                      args.prompt_mean, args.output_mean, 0.6, args.max_prompt, args.max_output,
                                      args.session_share, args.skew, args.seed))
        write_trace(trace, args.generate)
        print(f"wrote {len(trace.requests)} requests over {trace.duration:.1f} s to {args.generate}")
        return 0
    if not args.trace or not args.profile:
        raise ConfigError("plan needs --trace and --profile (or --generate OUT to write a trace)")
    below = args.local_prefill_below
    if below != "auto" and not below.isdigit():
        raise ConfigError(f"--local-prefill-below {below!r}: a token count or 'auto'")
    if args.handover_tokens < 0:
        raise ConfigError("--handover-tokens must be ≥ 0")
    if args.shared_cpus is not None and args.shared_cpus < 1:
        raise ConfigError("--shared-cpus must be ≥ 1")
    profile = load_profile(args.profile)
    core_profile = load_profile(args.profile_core) if args.profile_core else None
    for prof, which in ((profile, args.profile), (core_profile, args.profile_core)):
        for warning in compare(prof, topology.model) if prof is not None else []:
            print(f"edgecore: warning: {which}: {warning}", file=sys.stderr)
    trace = read_trace(args.trace, regions)
    options = Options(local_prefill_below=None if below == "auto" else int(below),
                      handover_tokens=args.handover_tokens, adaptive=args.adaptive,
                      ttft_target_ms=args.ttft_target_ms, failures=_failures(topology.plan.failures, args.fail),
                      shared_cpus=args.shared_cpus)
    t = time.perf_counter()
    frontier = None
    if args.search:
        targets = slos(topology, args.slo_ttft_ms, args.slo_tpot_ms, args.slo_percentile)
        out = search(topology, trace, profile, core_profile, options, targets,
                     log=None if args.json else lambda m: print(m, file=sys.stderr))
        frontier = out["frontier"]
        if args.plot:
            options = Options(**{**options.__dict__, "replicas": out["replicas"], "adaptive": True})
    else:
        result = Simulator(topology, profile, core_profile, options).run(trace)
        out = report(result, regions)
    elapsed = time.perf_counter() - t
    if args.plot:
        result = Simulator(topology, profile, core_profile, options).run(trace) if args.search else result
        for path in plot(result, args.plot, frontier):
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print(json.dumps(out))
    elif args.search:
        print(f"{'feasible' if out['feasible'] else 'NOT feasible'}: cost {out['cost']:g}, worst SLO ratio "
              f"{out['worst_slo_ratio']} after {out['evaluations']} simulations")
        if out["limited_by"]:
            print(f"  limited by {out['limited_by']}")
        for name, n in out["replicas"].items():
            print(f"  {name}: {n} replica{'s' if n > 1 else ''}")
        for link, codec in out["codecs"].items():
            print(f"  link {link}: {codec}")
        print()
        print(render_text(out["plan"]))
    else:
        print(render_text(out))
        print(f"\nsimulated in {elapsed:.1f} s")
    return 0


def run_replay(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from edgecore.deploy.plan import edge_regions, measured_report, render_text
    from edgecore.deploy.replay import replay
    from edgecore.deploy.topology import load_topology
    from edgecore.deploy.trace import read_trace
    from edgecore.shared.models.config import ModelConfig
    from edgecore.shared.errors import ConfigError
    topology = load_topology(args.topology)
    regions = edge_regions(topology)
    urls = {r: f"http://127.0.0.1:{next(e.port for e in topology.edges if e.region == r)}" for r in regions}
    for flag in args.edge:
        region, sep, url = flag.partition("=")
        if not sep or region not in urls or not url.startswith(("http://", "https://")):
            raise ConfigError(f"--edge {flag!r}: expected REGION=http(s)://HOST:PORT for a region with edges "
                              f"({', '.join(regions)})")
        urls[region] = url
    if args.speed <= 0 or args.timeout <= 0:
        raise ConfigError("--speed and --timeout must be > 0")
    key = Path(args.api_key_file).read_text().splitlines()[0].strip() if args.api_key_file else None
    trace = read_trace(args.trace, regions)
    vocab = ModelConfig.from_dir(topology.model).vocab_size
    t = time.perf_counter()
    records = asyncio.run(replay(trace, urls, topology.model_name, vocab, key, args.timeout, args.speed))
    out = measured_report(records, regions, time.perf_counter() - t)
    errors = [r.error for r in records if r.error]
    if errors:
        print(f"edgecore: warning: {len(errors)} requests failed, e.g. {errors[0]}", file=sys.stderr)
    print(json.dumps(out) if args.json else render_text(out))
    return 0
