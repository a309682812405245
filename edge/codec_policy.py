"""Which KV codec a request uses: fixed, or adaptive from the link and the TTFT target.

Adaptive: the time to move a request's KV is bounded by the slowest of the
pipelined stages — encoding at the core, the link, decoding at the edge — so
each codec's estimate is max(raw/encode, ratio·raw/link, raw/decode), with
ratios and speeds measured by bench/kv_codec.py. Lossless is preferred when it
meets the target; otherwise the fastest allowed codec wins.
"""

from __future__ import annotations

# Measured on real KV (bench/kv_codec.py): bytes vs bf16, encode and decode bytes/s per core.
PROFILE = {
    "raw": (1.00, 20e9, 20e9),
    "lossless": (0.68, 550e6, 1300e6),
    "fp8": (0.50, 400e6, 1100e6),
    "int8": (0.51, 380e6, 850e6),
    "int4": (0.29, 380e6, 850e6),
}


def transfer_estimate(codec: str, raw_bytes: int, link_bytes_per_s: float) -> float:
    ratio, enc, dec = PROFILE[codec]
    return max(raw_bytes / enc, raw_bytes * ratio / link_bytes_per_s, raw_bytes / dec)


def choose_codec(allowed: list[str], raw_bytes: int, link_bytes_per_s: float | None,
                 ttft_target_s: float | None = None) -> str:
    allowed = [c for c in allowed if c in PROFILE] or ["lossless"]
    if link_bytes_per_s is None or len(allowed) == 1:
        return allowed[0]
    est = {c: transfer_estimate(c, raw_bytes, link_bytes_per_s) for c in allowed}
    if "lossless" in est and ttft_target_s is not None and est["lossless"] <= ttft_target_s:
        return "lossless"
    return min(allowed, key=lambda c: (est[c], c != "lossless"))
