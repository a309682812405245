"""`edgecore plan`: the trace format, the simulator's invariants and closed forms, failover, search, the CLI."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from edgecore.deploy.cli import main
from edgecore.deploy.plan import report, search, slos
from edgecore.deploy.profile import CodecSpeed, CostModel, Profile, load_profile, save
from edgecore.deploy.simulator import Options, Simulator
from edgecore.deploy.topology import load_topology
from edgecore.deploy.trace import GenerateSpec, Request, Trace, TraceError, generate, read_trace, write_trace

pytestmark = pytest.mark.timeout(120)

COST = CostModel(base_s=0.002, per_row_s=0.0001, per_context_s=1e-7, per_prefill_token_s=0.0002,
                 per_attention_s=1e-8)
PROFILE = Profile(COST, {"lossless": CodecSpeed(0.7, 600e6, 2e9), "int8": CodecSpeed(0.45, 1e9, 2e9),
                         "raw": CodecSpeed(1.0, 1e10, 1e10)},
                  kv_wire_bytes_per_token=2048, kv_memory_bytes_per_token=4096, layers=4)

TWO_REGIONS = """
[[regions.dc.cores]]
name = "core-a"
[[regions.dc.cores]]
name = "core-b"
[[regions.west.edges]]
name = "edge-west"
codecs = ["lossless", "int8"]
[[regions.south.edges]]
name = "edge-south"
[[links]]
from = "west"
to = "dc"
delay_ms = 20
bandwidth_mbit = 100
[[links]]
from = "south"
to = "dc"
delay_ms = 80
bandwidth_mbit = 20
[plan]
core_cost = 4.0
edge_cost = 1.0
slo = { ttft_ms = 2000, tpot_ms = 50, percentile = "p90" }
"""

ONE_REGION = """
[[regions.here.cores]]
name = "core"
[[regions.here.edges]]
name = "edge"
"""


def topo(tmp_path: Path, text: str):
    path = tmp_path / "t.toml"
    path.write_text(text)
    return load_topology(path)


# ---- trace ----------------------------------------------------------------------------------------------

def test_generate_is_seeded_and_round_trips(tmp_path):
    spec = GenerateSpec(("west", "south"), requests=300, rate=50, arrivals="bursty", seed=7)
    a, b = generate(spec), generate(spec)
    assert a == b
    assert generate(replace(spec, seed=8)) != a
    write_trace(a, tmp_path / "w.jsonl")
    back = read_trace(tmp_path / "w.jsonl", {"west", "south"})
    assert back == a
    assert len(back.requests) == 300 and back.regions() == {"west", "south"}
    assert all(r.prefix_tokens <= r.prompt_tokens for r in back.requests)
    assert any(r.prefix_tokens for r in back.requests)          # sessions continue
    times = [r.t for r in back.requests]
    assert times == sorted(times)


@pytest.mark.parametrize("line, words", [
    ('{"region": "west", "prompt_tokens": 5, "output_tokens": 2}', "missing field 't'"),
    ('{"t": -1, "region": "west", "prompt_tokens": 5, "output_tokens": 2}', "'t'"),
    ('{"t": 1, "region": "west", "prompt_tokens": -5, "output_tokens": 2}', "'prompt_tokens'"),
    ('{"t": 1, "region": "west", "prompt_tokens": 5, "output_tokens": 0}', "'output_tokens'"),
    ('{"t": 1, "region": "mars", "prompt_tokens": 5, "output_tokens": 2}', "unknown region 'mars'"),
    ('{"t": 1, "region": "west", "prompt_tokens": 5, "output_tokens": 2, "x": 1}', "unknown field 'x'"),
    ('{"t": 1, "region": "west", "prompt_tokens": 5, "output_tokens": 2, "session": "s", "prefix_tokens": 9}',
     "exceeds"),
    ('{"t": 0.5, "region": "west", "prompt_tokens": 5, "output_tokens": 2}', "earlier"),
    ("not json", "not a JSON object"),
])
def test_bad_trace_lines_are_named(tmp_path, line, words):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"t": 0.9, "region": "west", "prompt_tokens": 5, "output_tokens": 2}\n\n' + line + "\n")
    with pytest.raises(TraceError) as err:
        read_trace(path, {"west"})
    assert f"{path}:3:" in str(err.value) and words in str(err.value)


# ---- simulator ------------------------------------------------------------------------------------------

def test_invariants_no_request_lost_and_queues_conserved(tmp_path):
    t = topo(tmp_path, TWO_REGIONS)
    trace = generate(GenerateSpec(("west", "south"), requests=3000, rate=40, prompt_mean=300, output_mean=40,
                                  seed=3))
    result = Simulator(t, PROFILE).run(trace)
    assert len(result.jobs) == 3000
    assert all(j.done >= j.ttft >= j.arrive and j.where in ("local", "remote", "cache") for j in result.jobs)
    for node in result.nodes:
        assert node.enqueued == node.dequeued, node.name      # everything queued left its queue
        assert not node.prefill and not node.waiting and node.nrun == 0 and node.kv_used == 0
    assert sum(n.served for n in result.nodes if n.kind == "edge") == 3000
    remote = [j for j in result.jobs if j.where == "remote"]
    expected = sum((j.req.prompt_tokens - j.cached) * 2048 * PROFILE.codecs[j.codec].ratio for j in remote)
    assert sum(link.bytes for link in result.links.values()) == pytest.approx(expected)
    rep = report(result, ["west", "south"])
    assert rep["regions"]["west"]["requests"] + rep["regions"]["south"]["requests"] == 3000
    assert set(rep["regions"]["west"]["ttft_ms"]) == {"p50", "p90", "p99"}
    # farther, slower link: later first tokens
    assert rep["regions"]["south"]["ttft_ms"]["p50"] > rep["regions"]["west"]["ttft_ms"]["p50"]


def test_single_request_closed_forms(tmp_path):
    t = topo(tmp_path, ONE_REGION)
    local = Simulator(t, PROFILE, options=Options(local_prefill_below=10 ** 6)).run(
        Trace((Request(1.0, "here", 500, 20),)))
    job = local.jobs[0]
    assert job.where == "local"
    assert job.ttft - 1.0 == pytest.approx(COST.step(0, 0, 500, 0))
    assert job.done - job.ttft == pytest.approx(19 * COST.step(1, 501))
    # remote, with a 30 ms link and no handover: the request crosses, the core prefills, the KV streams
    t2 = topo(tmp_path, TWO_REGIONS.replace("delay_ms = 20", "delay_ms = 30"))
    sim = Simulator(t2, PROFILE, options=Options(handover_tokens=0))
    job = sim.run(Trace((Request(0.0, "west", 500, 1),))).jobs[0]
    compute = COST.prefill(500)
    raw = 500 * 2048
    link = max(raw / 600e6, raw * 0.7 / 12.5e6, raw / 2e9)
    kv_done = max(compute / 4 + link, compute + link / 4)
    assert job.where == "remote"
    assert job.ttft == pytest.approx(0.03 + kv_done + 0.03)
    # with handover the first token does not wait for the KV
    job = Simulator(t2, PROFILE).run(Trace((Request(0.0, "west", 500, 1),))).jobs[0]
    assert job.ttft == pytest.approx(0.03 + compute + 0.03)


def test_prefill_queue_matches_md1(tmp_path):
    """Poisson arrivals of equal prefills at one node: the mean wait is M/D/1's ρS / (2(1 − ρ))."""
    t = topo(tmp_path, ONE_REGION)
    service = COST.step(0, 0, 2048, 0)
    rho, n = 0.6, 20000
    rng = random.Random(5)
    now, reqs = 0.0, []
    for _ in range(n):
        now += rng.expovariate(rho / service)
        reqs.append(Request(now, "here", 2048, 1))
    result = Simulator(t, PROFILE, options=Options(local_prefill_below=10 ** 6)).run(Trace(tuple(reqs)))
    wait = sum(j.ttft - j.arrive - service for j in result.jobs) / n
    assert wait == pytest.approx(rho * service / (2 * (1 - rho)), rel=0.08)


def test_core_failure_fails_over_without_losing_requests(tmp_path):
    t = topo(tmp_path, TWO_REGIONS)
    trace = generate(GenerateSpec(("west", "south"), requests=1500, rate=30, prompt_mean=400, output_mean=30,
                                  seed=11))
    cut = trace.requests[700].t
    result = Simulator(t, PROFILE, options=Options(failures=(("core-a", cut),))).run(trace)
    assert all(j.done >= j.ttft >= j.arrive for j in result.jobs)
    assert all(j.where != "failed" for j in result.jobs)
    after = [j for j in result.jobs if j.arrive > cut + 0.2 and j.where == "remote"]
    assert after and all(j.core is not None and j.core.name == "core-b" for j in after)
    # both cores gone: everything after falls back to local prefill
    both = Simulator(t, PROFILE, options=Options(failures=(("core-a", cut), ("core-b", cut)))).run(trace)
    late = [j for j in both.jobs if j.arrive > cut + 0.2]
    assert late and all(j.where in ("local", "cache") for j in late)
    assert all(j.done >= j.arrive for j in both.jobs)


def test_edge_failure_counts_failed_requests(tmp_path):
    t = topo(tmp_path, TWO_REGIONS)
    trace = generate(GenerateSpec(("west", "south"), requests=400, rate=30, seed=2))
    cut = trace.requests[200].t
    rep = report(Simulator(t, PROFILE, options=Options(failures=(("edge-west", cut),))).run(trace),
                 ["west", "south"])
    assert rep["regions"]["west"]["failed"] > 0 and rep["regions"]["south"]["failed"] == 0
    assert rep["requests"] == 400


def test_session_prefix_is_cached_at_the_edge(tmp_path):
    t = topo(tmp_path, ONE_REGION)
    reqs = (Request(0.0, "here", 400, 10, "s"), Request(5.0, "here", 420, 10, "s", 410))
    result = Simulator(t, PROFILE).run(Trace(reqs))
    assert result.jobs[0].where == "remote"
    assert result.jobs[1].where == "cache" and result.jobs[1].cached == 400     # whole blocks of 410


def test_unreachable_region_is_an_error(tmp_path):
    t = topo(tmp_path, ONE_REGION + '[[regions.far.edges]]\nname = "edge-far"\n')
    with pytest.raises(Exception, match="'far' has edges but no core"):
        Simulator(t, PROFILE)


def test_search_finds_a_fleet_meeting_the_slo(tmp_path):
    t = topo(tmp_path, TWO_REGIONS)
    trace = generate(GenerateSpec(("west", "south"), requests=600, rate=12, prompt_mean=800, output_mean=20,
                                  seed=4))
    targets = slos(t, ttft_ms=1500)
    out = search(t, trace, PROFILE, None, Options(), targets)
    assert out["feasible"] and out["worst_slo_ratio"] <= 1
    assert out["cost"] >= 4 + 2
    assert set(out["codecs"]) <= {"dc->west", "dc->south"}
    assert all(r["ttft_ms"]["p90"] <= 1500 for r in out["plan"]["regions"].values())


# ---- profile file and CLI -------------------------------------------------------------------------------

def test_profile_round_trip_and_warnings(tmp_path):
    from edgecore.deploy.profile import compare
    save(replace(PROFILE, edgecore_version="0.0.1", model={"path": "x", "fingerprint": "ab" * 32}),
         tmp_path / "p.json")
    back = load_profile(tmp_path / "p.json")
    assert back.cost == COST and back.codecs == PROFILE.codecs
    from edgecore.models import bundled_model_dir
    warnings = compare(back, str(bundled_model_dir()))
    assert any("0.0.1" in w for w in warnings) and any("fingerprint" in w for w in warnings)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(Exception, match="not an edgecore-profile/1"):
        load_profile(tmp_path / "bad.json")


def test_cli_generate_plan_json_and_errors(tmp_path, capsys):
    from edgecore.deploy.profile import edgecore_version
    save(replace(PROFILE, edgecore_version=edgecore_version()), tmp_path / "p.json")
    (tmp_path / "t.toml").write_text(TWO_REGIONS)
    tpath, wpath = str(tmp_path / "t.toml"), str(tmp_path / "w.jsonl")
    assert main(["plan", "--topology", tpath, "--generate", wpath, "--requests", "200", "--seed", "1"]) == 0
    capsys.readouterr()
    assert main(["plan", "--topology", tpath, "--trace", wpath, "--profile", str(tmp_path / "p.json"), "--json",
                 "--fail", "core-a@3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["regions"]) == {"west", "south"}
    for region in out["regions"].values():
        assert set(region) >= {"requests", "ttft_ms", "tpot_ms", "e2e_ms"}
        assert set(region["ttft_ms"]) == {"p50", "p90", "p99"}
    assert {"core-a", "core-b", "edge-west", "edge-south"} <= set(out["nodes"])
    assert "utilisation" in out["nodes"]["core-a"] and out["requests"] == 200
    (tmp_path / "bad.jsonl").write_text('{"t": 0, "region": "dc", "prompt_tokens": 3, "output_tokens": 1}\n')
    assert main(["plan", "--topology", tpath, "--trace", str(tmp_path / "bad.jsonl"), "--profile",
                 str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:1:" in err and "unknown region 'dc'" in err and err.count("\n") == 1
    assert main(["plan", "--topology", tpath, "--trace", wpath, "--profile", str(tmp_path / "p.json"),
                 "--fail", "nowhere"]) == 2


@pytest.mark.slow
def test_profile_measures_the_bundled_model(tmp_path):
    from edgecore.deploy.profile import measure
    from edgecore.models import bundled_model_dir
    profile = measure(str(bundled_model_dir()), codecs=["lossless", "int8"], repeats=1, quick=True)
    assert profile.kv_wire_bytes_per_token == 2 * 4 * 2 * 32 * 2
    assert set(profile.codecs) == {"lossless", "int8"} and 0 < profile.codecs["int8"].ratio < 1
    assert profile.cost.step(1, 100) > 0 and profile.model["fingerprint"]
    assert profile.measurements["prefill"] and profile.measurements["decode"]
    save(profile, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").cost == profile.cost


def test_cli_search_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    save(PROFILE, tmp_path / "p.json")
    (tmp_path / "t.toml").write_text(TWO_REGIONS)
    tpath, wpath = str(tmp_path / "t.toml"), str(tmp_path / "w.jsonl")
    write_trace(generate(GenerateSpec(("west", "south"), requests=200, rate=10, prompt_mean=600, seed=9)), wpath)
    assert main(["plan", "--topology", tpath, "--trace", wpath, "--profile", str(tmp_path / "p.json"), "--search",
                 "--json", "--plot", str(tmp_path / "plots"), "--slo-percentile", "p50"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["feasible"] and set(out["replicas"]) == {"core-a", "core-b", "edge-west", "edge-south"}
    assert out["plan"]["regions"]["south"]["ttft_ms"]["p50"] <= 2000       # the topology's [plan.slo]
    assert out["plan"]["regions"]["south"]["tpot_ms"]["p50"] <= 50
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {"ttft_cdf.png", "utilisation.png",
                                                                 "search_frontier.png"}
    assert all(p.stat().st_size > 1000 for p in (tmp_path / "plots").iterdir())


def test_search_says_when_no_replica_helps(tmp_path):
    """South's 20 Mbit/s link stalls its decodes once the core's handover tokens run out: more replicas do not
    help, and the search says so instead of growing the fleet to its bound."""
    t = topo(tmp_path, TWO_REGIONS)
    trace = generate(GenerateSpec(("west", "south"), requests=200, rate=10, prompt_mean=600, seed=9))
    out = search(t, trace, PROFILE, None, Options(), slos(t))
    assert not out["feasible"] and "region south" in out["limited_by"]
    assert out["evaluations"] < 30 and max(out["replicas"].values()) < t.plan.max_replicas


def test_topology_plan_table(tmp_path):
    t = topo(tmp_path, TWO_REGIONS + '[[plan.failures]]\nnode = "core-a"\nat_s = 12.5\n')
    assert t.plan.core_cost == 4.0 and t.plan.slo.ttft_ms == 2000 and t.plan.slo.percentile == "p90"
    assert [(f.node, f.at_s) for f in t.plan.failures] == [("core-a", 12.5)]
    with pytest.raises(Exception, match=r"t.toml:\d+: 'plan.failures\[0\].node' names unknown node 'core-z'"):
        topo(tmp_path, TWO_REGIONS + '[[plan.failures]]\nnode = "core-z"\nat_s = 1\n')
    with pytest.raises(Exception, match="plan.edge_cost"):
        topo(tmp_path, TWO_REGIONS.replace("edge_cost = 1.0", "edge_cost = -1"))


def test_nodes_on_one_machine_share_its_cores(tmp_path):
    """`--shared-cpus`: while two nodes of 2 threads each have work on a 2-core machine, each step takes twice
    its time: the second prompt, arriving half-way through the first's prefill, stretches the rest of it."""
    import dataclasses
    t = topo(tmp_path, ONE_REGION.replace('name = "edge"', 'name = "edge"\nreplicas = 2'))
    profile = dataclasses.replace(PROFILE, machine={"torch_threads": 2})
    alone = COST.step(0, 0, 500, 0)
    trace = Trace((Request(1.0, "here", 500, 1), Request(1.0 + alone / 2, "here", 500, 1)))
    local = 10 ** 6

    def ttfts(cpus):
        jobs = Simulator(t, profile, options=Options(local_prefill_below=local, shared_cpus=cpus)).run(trace).jobs
        assert {j.where for j in jobs} == {"local"} and len({j.edge.name for j in jobs}) == 2
        return [j.ttft - j.req.t for j in jobs]
    assert ttfts(None) == pytest.approx([alone, alone])         # each node on its own machine
    assert ttfts(4) == pytest.approx([alone, alone])            # cores enough for both
    # (a re-planned step restarts with the rest of the prompt: a few % over the 1.5x of a divisible prefill)
    assert ttfts(2) == pytest.approx([1.5 * alone, 1.5 * alone], rel=0.05)
    assert min(ttfts(2)) > 1.45 * alone


def test_the_serving_terms_of_a_profile_reach_every_request(tmp_path):
    """`edgecore profile --serving` measures the serving path beyond the engine; the simulator adds it to each
    request's first token and to each later token."""
    import dataclasses
    t = topo(tmp_path, ONE_REGION)
    trace = Trace((Request(1.0, "here", 500, 20),))
    options = Options(local_prefill_below=10 ** 6)
    base = Simulator(t, PROFILE, options=options).run(trace).jobs[0]
    served = Simulator(t, dataclasses.replace(PROFILE, serving_ttft_s=0.025, serving_tpot_s=0.001),
                       options=options).run(trace).jobs[0]
    assert served.ttft - base.ttft == pytest.approx(0.025)
    assert (served.done - served.ttft) - (base.done - base.ttft) == pytest.approx(19 * 0.001)
    path = tmp_path / "p.json"
    save(dataclasses.replace(PROFILE, serving_ttft_s=0.025, serving_tpot_s=0.001), path)
    assert load_profile(path).serving_ttft_s == 0.025 and load_profile(path).serving_tpot_s == 0.001
