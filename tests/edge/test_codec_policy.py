"""Adaptive KV codec choice: quality budget, TTFT target and link speed, against the shipped curve."""

import json

import pytest

from edgecore.edge.codec_policy import CURVE, CurvePoint, choose_codec, load_curve, transfer_estimate
from edgecore.protocol.codecs import CODECS

ALL = ["lossless", "fp8", "int8", "int4", "q4e", "q3e", "q2e"]
MB = 1e6


def test_curve_covers_every_codec():
    assert {name.removesuffix("+layer0") for name in CURVE} == set(CODECS)
    for name, p in CURVE.items():
        assert 0 < p.ratio <= 1 and p.encode_bps > 0 and p.decode_bps > 0, name
    assert CURVE["q2e"].ratio < CURVE["q3e"].ratio < CURVE["q4e"].ratio < CURVE["int4"].ratio


def test_no_link_measurement_takes_the_first_allowed():
    assert choose_codec(["int8", "q2e"], 10 * MB, None) == "int8"
    assert choose_codec(["gzip"], 10 * MB, 1e6) == "lossless"


def test_slow_link_takes_the_smallest_within_budget():
    """On a slow link every codec misses a tight target: the fastest overall is the smallest one within budget."""
    budget = CURVE["q3e"].ppl_increase
    got = choose_codec(ALL, 100 * MB, 1 * MB, ttft_target_s=0.01, quality_budget=budget)
    within = [c for c in ALL if CURVE[c].ppl_increase <= budget]
    assert got == min(within, key=lambda c: transfer_estimate(c, 100 * MB, 1 * MB))
    assert CURVE[got].ppl_increase <= budget


def test_target_met_picks_smallest_bytes_within_budget():
    link = 1e9    # fast: every codec meets a loose target; bytes decide
    got = choose_codec(ALL, 10 * MB, link, ttft_target_s=10.0, quality_budget=1.0)
    assert got == min(ALL, key=lambda c: CURVE[c].ratio)
    strict = choose_codec(ALL, 10 * MB, link, ttft_target_s=10.0, quality_budget=0.0)
    assert CURVE[strict].ppl_increase <= 0.0
    assert strict == min((c for c in ALL if CURVE[c].ppl_increase <= 0), key=lambda c: CURVE[c].ratio)


def test_target_excludes_codecs_too_slow_for_it():
    """A codec whose estimate misses the target is not chosen when another within budget meets it."""
    curve = {"lossless": CurvePoint(0.7, 0.0, 1.0, 500 * MB, 500 * MB),
             "slowsmall": CurvePoint(0.1, 0.0, 1.0, 10 * MB, 10 * MB)}
    raw, link = 100 * MB, 1000 * MB
    assert transfer_estimate("slowsmall", raw, link, curve) > 1.0 >= transfer_estimate("lossless", raw, link, curve)
    assert choose_codec(["lossless", "slowsmall"], raw, link, ttft_target_s=1.0, curve=curve) == "lossless"
    assert choose_codec(["lossless", "slowsmall"], raw, link, ttft_target_s=20.0, curve=curve) == "slowsmall"


def test_load_curve_from_bench_result(tmp_path):
    path = tmp_path / "kv_rd.json"
    path.write_text(json.dumps({"codecs": {"q2e": {"ratio_vs_bf16": 0.14, "ppl_increase": 0.004, "agreement": 0.98,
                                                   "encode_MBps_per_core": 400, "decode_MBps_per_core": 800}}}))
    curve = load_curve(path)
    assert curve["q2e"] == CurvePoint(0.14, 0.004, 0.98, 400e6, 800e6)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a bench/kv_rd.py result"):
        load_curve(tmp_path / "bad.json")


def edge_args(*argv):
    from edgecore.deploy.cli import build_parser
    return build_parser().parse_args(["edge", *argv])


def test_quality_budget_flag_reaches_the_choice(tmp_path):
    """`--kv-quality-budget` (and `--kv-curve`) become the EdgeConfig fields the adaptive choice reads."""
    from types import SimpleNamespace

    from edgecore.edge.cli import codec_policy
    from edgecore.edge.node import EdgeConfig, EdgeNode
    from edgecore.shared.errors import ConfigError

    assert codec_policy(edge_args()) == {"kv_quality_budget": 0.01, "kv_curve": None}
    tight = CURVE["q3e"].ppl_increase
    assert codec_policy(edge_args("--kv-quality-budget", str(tight)))["kv_quality_budget"] == tight
    for bad in ("-0.1", "nan"):
        with pytest.raises(ConfigError, match="--kv-quality-budget"):
            codec_policy(edge_args(f"--kv-quality-budget={bad}"))
    with pytest.raises(ConfigError, match="--kv-curve"):
        codec_policy(edge_args("--kv-curve", str(tmp_path / "missing.json")))

    # Through the edge's per-request choice: a fast link and a loose TTFT target make bytes decide.
    client = SimpleNamespace(peer=SimpleNamespace(conn=SimpleNamespace(peer_codecs=ALL)), bandwidth=1e9)

    def chosen(*argv):
        config = EdgeConfig(model_dir="unused", codecs=ALL, adaptive=True, ttft_target_ms=10_000,
                            **codec_policy(edge_args(*argv)))
        handle = SimpleNamespace(layer0_macs_per_token=98304, config=SimpleNamespace(num_hidden_layers=4))
        return EdgeNode._codec(SimpleNamespace(config=config, kv_bytes_per_token=16384, handle=handle), client, 1000)

    loose = chosen("--kv-quality-budget", "1")
    assert loose == min(ALL, key=lambda c: CURVE[c].ratio)
    strict = chosen("--kv-quality-budget", "0")
    assert CURVE[strict].ppl_increase <= 0 and CURVE[strict].ratio > CURVE[loose].ratio
    mid = chosen(f"--kv-quality-budget={tight}")
    assert CURVE[mid].ppl_increase <= tight
    assert mid == min((c for c in ALL if CURVE[c].ppl_increase <= tight), key=lambda c: CURVE[c].ratio)
    # A model's own curve (bench/kv_rd.py --model) replaces the bundled one.
    path = tmp_path / "kv_rd.json"
    path.write_text(json.dumps({"codecs": {c: {"ratio_vs_bf16": 0.5 if c != "int8" else 0.05, "ppl_increase": 0.0,
                                               "agreement": 1.0, "encode_MBps_per_core": 400,
                                               "decode_MBps_per_core": 800} for c in ALL}}))
    assert chosen("--kv-curve", str(path)) == "int8"


def test_edge_cli_rejects_a_bad_budget_in_one_line():
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "edgecore.deploy.cli", "edge", "--kv-quality-budget=-1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--kv-quality-budget" in lines[0], proc.stderr


def test_a_transfer_that_sends_layer0_reads_larger_lossy_ratios():
    """The shipped curve leaves layer 0 to the edge; when it travels, a level reads its measured NAME+layer0
    point, another lossy codec L/(L-1) of its bytes."""
    from edgecore.edge.codec_policy import with_layer0
    sent = with_layer0(CURVE, 4)
    assert sent["q3e"] == CURVE["q3e+layer0"] and sent["q3e"].ratio > CURVE["q3e"].ratio
    assert sent["int8"].ratio == pytest.approx(CURVE["int8"].ratio * 4 / 3)
    assert sent["lossless"] == CURVE["lossless"] and sent["raw"] == CURVE["raw"]
    assert with_layer0({"int8": CURVE["int8"]}, 1) == {"int8": CURVE["int8"]}


def test_a_curve_measured_with_every_layer_coded_is_read_without_layer0(tmp_path):
    """kv_rd on a model whose layer 0 costs more than the budget codes every layer (edge_layers 0): those rows
    become NAME+layer0, and NAME (L-1)/L of their bytes, so both kinds of transfer read the right one."""
    from edgecore.edge.codec_policy import with_layer0
    row = {"ratio_vs_bf16": 0.2, "ppl_increase": 0.004, "agreement": 0.98, "encode_MBps_per_core": 400,
           "decode_MBps_per_core": 800}
    path = tmp_path / "rd.json"
    path.write_text(json.dumps({"codecs": {"q3e": row, "lossless": dict(row, ratio_vs_bf16=0.7)},
                                "layers": 16, "edge_layers": 0}))
    curve = load_curve(path)
    assert curve["q3e"].ratio == pytest.approx(0.2 * 15 / 16) and curve["q3e+layer0"].ratio == 0.2
    assert curve["lossless"].ratio == 0.7
    assert with_layer0(curve, 16)["q3e"].ratio == 0.2
