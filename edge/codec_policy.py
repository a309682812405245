"""Which KV codec a request uses: fixed, or adaptive from the rate–distortion curve, the link and the TTFT target.

Life cycle: the edge builds the allowed list once per core (its configured codecs that the core also
speaks); per request, `choose_codec` takes the request's KV size and the link bandwidth the edge last
measured on that core. Adaptive: the time to move a request's KV is bounded by the slowest pipelined
stage — encoding at the core, the link, decoding at the edge — so each codec's estimate is
max(raw/encode, ratio·raw/link, raw/decode). Among the codecs within the quality budget (perplexity
increase on held-out text, from the curve), the smallest-bytes one whose estimate meets the TTFT target
wins; when none meets it, the fastest within the budget; with no measured link yet, the first allowed.

The edge's flags set the choice: `--adaptive`, `--ttft-target-ms`, `--kv-quality-budget` (the largest
perplexity increase, 0.01 by default) and `--kv-curve` (a bench/kv_rd.py result for the served model,
instead of the bundled model's curve); edge/cli.py turns them into EdgeConfig fields.

The curve is data: `CURVE` below is bench/kv_rd.py's measurement on the bundled model (ratio vs bf16,
perplexity increase, greedy agreement, encode and decode bytes/s per core); `load_curve` reads the JSON
that bench/kv_rd.py writes for another model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class CurvePoint:
    ratio: float            # encoded bytes / bf16 bytes
    ppl_increase: float     # relative perplexity change on held-out text
    agreement: float        # greedy next-token agreement with uncompressed KV
    encode_bps: float       # bytes of bf16 input per second, one core
    decode_bps: float


# bench/kv_rd.py on pydoc-llama (30 × 256-token prompts, keys coded with RoPE removed, the levels with the
# model's kv_allocation.json, per layer and per channel; lossy codecs without layer 0, which the edge computes
# itself; speeds in thread CPU time on long planes, one 2-core AMD EPYC VM): bench/results/kv_rd.json.
# raw: a copy.
CURVE: dict[str, CurvePoint] = {
    "raw": CurvePoint(1.0, 0.0, 1.0, 20e9, 20e9),
    "lossless": CurvePoint(0.6848, 0.0, 1.0, 645e6, 2391e6),
    "fp8": CurvePoint(0.3752, 0.00156, 0.9868, 460e6, 1169e6),
    "int8": CurvePoint(0.4376, 0.00015, 0.9995, 1079e6, 2369e6),
    "int4": CurvePoint(0.2945, 0.00278, 0.9841, 932e6, 1726e6),
    "q4e": CurvePoint(0.1831, -0.00112, 0.9852, 690e6, 1405e6),
    "q3e": CurvePoint(0.1478, 0.0027, 0.9804, 702e6, 1426e6),
    "q2e": CurvePoint(0.1372, 0.00126, 0.9688, 703e6, 1407e6),
    # the same levels with every layer coded (a transfer whose layer 0 travels: `with_layer0`)
    "q4e+layer0": CurvePoint(0.2287, -0.00142, 0.9783, 681e6, 1357e6),
    "q3e+layer0": CurvePoint(0.1815, 0.00413, 0.9714, 706e6, 1368e6),
    "q2e+layer0": CurvePoint(0.1692, 0.00388, 0.9603, 689e6, 1392e6),
}
DEFAULT_QUALITY_BUDGET = 0.01     # perplexity increase a request may pay for fewer bytes


def load_curve(path: str | Path) -> dict[str, CurvePoint]:
    """The curve from a bench/kv_rd.py result file (bench/results/kv_rd.json or one made with --name). Lossy rows
    are taken as measured without layer 0 (the edge computes it); a run that coded every layer (its
    `edge_layers` 0: a model whose layer 0 costs more than the budget) keeps those rows as NAME+layer0 and
    gives NAME (L − 1)/L of their bytes."""
    from edgecore.protocol.codecs import CODECS
    try:
        data = json.loads(Path(path).read_text())
        curve = {name: CurvePoint(float(r["ratio_vs_bf16"]), float(r["ppl_increase"]), float(r["agreement"]),
                                  float(r["encode_MBps_per_core"]) * 1e6, float(r["decode_MBps_per_core"]) * 1e6)
                 for name, r in data["codecs"].items()}
        layers = int(data.get("layers", 0))
        if data.get("edge_layers", 1) == 0 and layers > 1:
            for name in [n for n in curve if n in CODECS and not CODECS[n].lossless]:
                curve.setdefault(f"{name}+layer0", curve[name])
                curve[name] = replace(curve[name], ratio=curve[name].ratio * (layers - 1) / layers)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"codec curve {path} is not a bench/kv_rd.py result: {exc}") from None
    return {"raw": CURVE["raw"], **curve}


def with_layer0(curve: dict[str, CurvePoint], layers: int) -> dict[str, CurvePoint]:
    """The curve for a transfer that sends layer 0 too: a lossy codec's NAME+layer0 point where the curve has
    one (bench/kv_rd.py measures it for the entropy-coded levels), else its ratio, measured with the edge
    computing layer 0 itself, × L/(L − 1) (quality as measured)."""
    from edgecore.protocol.codecs import CODECS
    scale = layers / (layers - 1) if layers > 1 else 1.0

    def sent(name: str, p: CurvePoint) -> CurvePoint:
        if name not in CODECS or CODECS[name].lossless:
            return p
        return curve.get(f"{name}+layer0") or replace(p, ratio=p.ratio * scale)
    return {name: sent(name, p) for name, p in curve.items()}


def transfer_estimate(codec: str, raw_bytes: int, link_bytes_per_s: float,
                      curve: dict[str, CurvePoint] | None = None) -> float:
    p = (curve or CURVE)[codec]
    return max(raw_bytes / p.encode_bps, raw_bytes * p.ratio / link_bytes_per_s, raw_bytes / p.decode_bps)


def choose_codec(allowed: list[str], raw_bytes: int, link_bytes_per_s: float | None,
                 ttft_target_s: float | None = None, quality_budget: float | None = DEFAULT_QUALITY_BUDGET,
                 curve: dict[str, CurvePoint] | None = None) -> str:
    curve = curve or CURVE
    allowed = [c for c in allowed if c in curve] or ["lossless"]
    if link_bytes_per_s is None or len(allowed) == 1:
        return allowed[0]
    within = [c for c in allowed if quality_budget is None or curve[c].ppl_increase <= quality_budget]
    within = within or [min(allowed, key=lambda c: curve[c].ppl_increase)]
    est = {c: transfer_estimate(c, raw_bytes, link_bytes_per_s, curve) for c in within}
    if ttft_target_s is not None:
        meeting = [c for c in within if est[c] <= ttft_target_s]
        if meeting:
            return min(meeting, key=lambda c: (curve[c].ratio, curve[c].ppl_increase))
    return min(within, key=lambda c: (est[c], curve[c].ppl_increase))
