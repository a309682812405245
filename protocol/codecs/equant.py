"""`q4e` (id 5), `q3e` (id 6), `q2e` (id 7): entropy-coded uniform quantization of KV.

Life cycle: the core encodes one plane (all K or all V of a chunk) per call with the
level's step factors; the edge decodes it from the bytes alone — every step and
centre travels in the payload, so the level's tuning (per-layer allocation
included) is an encoder choice, and any edge on this protocol version decodes
any level (compact parameters: those that advertise them). A CRC-32 over the body makes a corrupted or cut payload a
`CodecError`, never garbage.

Scheme (per plane [layers, tokens, heads, dim]):
* The first 4 prompt tokens (attention sinks) and the last `recent` tokens are
  exact (the `lossless` codec); the tokens between are quantized, the last
  `fine` of them with a finer step (the newest tokens draw the most attention).
* Keys are coded with RoPE removed when both ends know the model's RoPE
  (`PlaneInfo.rope`): un-rotated, a key channel keeps its bias instead of
  spinning it into variance.
* Quantized tokens form groups of `group` consecutive tokens (1024; 128 for
  keys with RoPE in, whose channels drift with position; the fine span forms
  its own groups). For each layer, group, head and channel: centre = mean,
  step = factor × standard deviation (factor per kind and layer, from the
  level) but at least max|x − centre| / 7.5, so nothing is clipped. Centres
  travel as float16; steps as one byte each, rounded up to the next power of
  2^(1/8) (`log_step_codes`), and the fine span's groups share the main span's
  last centre: 3/4 and 1/2 of float16 parameters' bytes (float16 or float32
  parameters where values or steps leave those ranges). Compact parameters go
  only to a peer that advertises `kv-compact-params` (`PlaneInfo.compact_params`).
  code = clip(round((x − centre) / step), −8, 7): a 4-bit signed code whose
  entropy, not its width, sets the rate.
* Codes are packed two per byte and compressed with zstd (level 1), whose
  Huffman stage codes the skewed code distribution and whose matcher finds
  repeated rows (layer-0 values depend on the token alone).

Why this shape — measured on the bundled model's KV (4 × 1000-token windows of
heldout.txt, bf16), on this 2-core machine:
* Keys have outlier channels (per-channel std max/median 1.6–4.2 by layer),
  values do not (1.2–2.0) and their per-token range varies little (p99/median
  ≈ 1.6): a per-channel step suits both, and costs 32 bits per channel per
  group (0.13 bit/value at 256 tokens) where KIVI's per-token value groups cost
  1 bit/value at head_dim 32.
* Step-size (entropy-constrained) quantization beats min/max quantization at
  equal rate: values 2.2 bit/value at relative MSE 0.039 against min/max 2-bit
  at 2.4 bit/value and 0.16; for keys the two are even, min/max only when its
  groups are ≤ 128 tokens.
* Token-to-token deltas do not help here: std(delta)/std is 0.77–1.36 (keys
  rotate with RoPE, values are anti-correlated), so codes are not delta-coded.
* Coders on 4-bit codes (bit/value, encode / decode MB/s of bf16 input): zstd-1
  on packed nibbles 1.91, ~1000 / ~4000 — below the order-0 entropy of 2.59
  thanks to repeats; zstd-1 on one code per byte 2.05, 55 / 1500; constriction
  range / ANS coder at the entropy 2.59, 17–60 / 9–14 (per-symbol cost through
  its Python API). zstd on packed nibbles is smaller and ~50× faster.

* Pre-RoPE keys (measured on the same KV): at equal code rate, relative MSE
  halves (s=0.5: 0.0064 pre-RoPE at 2.5 bit/value against 0.012 post-RoPE in
  128-token groups at 3.3), and one group per chunk suffices.
* Per-layer sensitivity (bench/kv_rd.py --sensitivity: mean KL with one layer's
  K or V coded at 0.75/0.85): pydoc-llama k 0.00022 0.00046 0.00034 0.00062, v
  0.00057 0.00032 0.00019 0.0004 (layers 0–3); pystd-llama k 0.00047 0.00017
  0.00036, v 0.00006 0.00002 0.00002. The layer order differs between models, so
  the allocation is per model: `bench/kv_rd.py --allocate` sets step_i ∝ KL_i^-1/2
  (equal KL shares, geometric mean 1) and writes the model's kv_allocation.json;
  a core hands it to the encoder (`PlaneInfo.step_scales`). pystd-llama's values
  get 1.1–2.8× coarser steps, its keys 0.4–0.8×; pydoc-llama's spread is small.
* Per-channel importance (bench/kv_alloc.py, `PlaneInfo.channel_scales`): equal-SNR steps (factor × std)
  ignore how much a channel's error reaches the layer's output; weighting keys by E[q²] of their RoPE pair
  (summed over the GQA query heads) and values by their o_proj columns' squared norms, and setting
  step ∝ std^a · w^-b (bench/kv_rd.py --channels A:B, 30 prompts, calibrated on other windows), mean KL
  at equal bytes (within +1%) drops by 8–15% on pydoc-llama and 25–55% on pystd-llama for a = 0,
  b = 1/2 (reverse water-filling's optimum); b = 1/4 or 3/4 and a = −1/2…1/2 were no better (pydoc q2e KL
  0.00276 → 0.00249 / 0.00241–0.00263; factors 1.0/1.1 at 0.152: 0.0058 → 0.0050). The guard (step ≥
  max|x − c| / 7.5) floors a fine step, so importance mostly coarsens unimportant channels. Greedy
  agreement moves within its noise (±0.5% at 1890 positions) on pydoc-llama: no setting near 0.15× keeps
  97% (best 95.3% at 0.155, 94.1% at 0.140); pystd-llama at factors 1.0/1.1 reaches 0.126× with 97.1% (uniform channels: 94.6%).
* Per-head allocation, not taken: q2e with the model's allocation coded one KV head at a time
  (pydoc-llama, 10 calibration windows) gives head KLs within 1.2–3× of each other per layer
  (k3: 0.000229 / 0.000086, v3: 0.000228 / 0.000075); equalising them predicts −6% of the total
  KL, less than the channel scales' −9% and far from the 2.5× that 0.15× at 97% would need.
* Coding gains not taken (measured on 256-token q2e codes): zstd-19 saves 1.5%
  of the code bytes, lzma 0–10% (slow); per-channel order-0 entropy is above
  zstd-1 (repeated rows). A calibrated per-head KLT (bench/kv_klt.py) predicts
  0.5–1 bit/value for keys by the high-rate formula, but with per-channel steps
  it buys nothing and with one step per head (`Level.head_step`) about 5–8% of
  the bytes at equal KL: not enough to ship.

Reached (bench/results/kv_rd*.json, 30 × 256-token prompts, levels with the model's allocation, per
layer and per channel, as the live path sends them: layer 0 computed at the edge, docs/wire-format.md
§11; ratio vs bf16 of all layers / perplexity increase / mean KL / greedy agreement): pydoc-llama q4e
0.183 / −0.11% / 0.00071 / 0.985, q3e 0.148 / +0.27% / 0.00137 / 0.980, q2e 0.137 / +0.13% / 0.00197 /
0.969; pystd-llama (3 layers) q4e 0.131 / +0.02% / 0.00010 / 0.989, q3e 0.097 / +0.10% / 0.00017 /
0.982, q2e 0.090 / +0.04% / 0.00026 / 0.979. So ≤ 0.25× within +0.3% and ≤ 0.15× within +1% at ≥ 97%
agreement on both (pydoc: q3e; pystd: q2e). With every layer coded (rows NAME+layer0, the edge's
`--layer0-budget-macs 0`): pydoc q3e 0.182 / 97.1%, pystd q2e 0.132 / 97.3%. What got pydoc there from
0.199 / 97.4% (q3e before): compact parameters (one-byte log steps, a shared fine-span centre: −0.009 of
bf16 at 256 tokens, KL unchanged at equal factors), no exact recent tokens in q3e (its 16 fine tokens
instead: −0.009), factors 0.52/0.62 and layer 0 off the wire (−1/4 of the rest). Agreement tracks KL
(about 97% at 0.0016–0.0020; ±0.4% noise at 1890 positions).
Tried and dropped: per-token steps from the attention the prompt's last 32 queries pay each token
(SnapKV's signal; step × (p_mean/p)^b in half-octaves up to 8×, side information 2 bits per token and
head): at 0.144–0.151 of bf16 mean KL 0.0054–0.012 against 0.005 for plain coarser factors at 0.155
— the next 64 tokens' queries attend elsewhere.
Where pydoc-llama's q3e bytes go (layers 1–3, share of bf16 bytes of all 4 layers, 256 tokens, before
the compact parameters): codes 0.131 (zstd on packed nibbles, at the codes' per-channel order-0
entropy), centres + steps 0.012, exact sinks 0.009, recent 0.009, headers 0.001.
Speed (bench/results/kv_codec.json, 9 × 1000-token windows of the bundled model, per core in thread CPU
time, numpy's BLAS on one thread, on a 2-core AMD EPYC VM): encode q4e 524, q3e 540, q2e 541 MB/s of bf16
input, decode 1086–1120; int8 828 / 1829; same-run baselines memcpy 29 GB/s, lz4 5.9 / 32 GB/s,
quantize_floor 1.7 GB/s. At a larger model's shapes (`wide_heads`, synthetic 8 × 128 heads): encode
905–976, decode 1583–1596. So
every level is over the 300 MB/s goal both ways here; on the slower shared VM of earlier measurements
the same code encoded at 117–182 MB/s (per-call costs on small planes: below). Where a 1000-token key
plane's q4e encode went on that VM (~600 µs):
statistics ~200 (mean/std 53, max/min 46, the fine span's numpy reductions and the parameters'
float16 rounding ~100), quantize 96, zstd 75, RoPE undo 51, exact sinks 37, widening 29, packing
16, and ~100 of per-call overhead on small arrays (a 40-token plane still takes ~250–350 µs).
Tried and dropped: the rotation blocked to stay in L2 (slower, 84 → 133 µs); the fine span's
mean/std without numpy's Python wrappers (no measurable change); zstd settings faster than level
1 (window/hash logs 15/10: 5% more code bytes for 11% less zstd time; level −1 halves it for 36%
more bytes). Per-call costs weigh less at a larger model's shapes (on that VM, `wide_heads`: encode
q4e 264, q3e 266, q2e 268, decode 408–430 MB/s in the same run); keys are the slower half (measured apart: q4e K 254 / V 375, q2e K 226 /
V 398): undoing RoPE reads three plane-sized float32 tables, which at 4 MB planes fall out of
cache (the rotation alone 2.3 ms at 1000 tokens against 0.27 ms at 256; blocking did not help).

Byte layout: header `HEADER` (version 1, kind 0 K / 1 V, flags (bit 0: params are
float32; bit 1: keys coded with RoPE removed; bit 2: log-coded steps; bit 3: the fine
groups share the last main centre), 0, group, n_head, n_fine, n_tail,
exact bytes, param bytes, code bytes, CRC-32 of the header's other bytes and
everything after it) | lossless(head tokens ‖ tail tokens) |
centres [layers][groups (main only, bit 3)][heads][dim] | steps [layers][groups][heads][dim]
(uint8 codes with bit 2) | zstd(codes). docs/wire-format.md has it byte for byte.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

from edgecore.protocol.codecs.base import (BITS_DTYPES, Codec, PlaneInfo, bits_to_f32, check_bits, safe_inverse,
                                           scratch, store_f32, zstd_compress, zstd_decompress)
from edgecore.protocol.codecs.codes import log_step_codes, log_steps, pack_nibbles, unpack_nibbles
from edgecore.protocol.codecs.columns import column_mean_std, column_reduce
from edgecore.protocol.codecs.lossless import LosslessCodec
from edgecore.protocol.codecs.rope import rotate
from edgecore.protocol.errors import CodecError

HEADER = struct.Struct("<BBBBIIIIIIII")
VERSION = 1
EXACT_HEAD = 4
FLAG_F32, FLAG_UNROTATED, FLAG_LOG_STEPS, FLAG_SHARED_CENTRE = 1, 2, 4, 8
FLAGS = 15
# The guard: step ≥ max|x − centre| / GUARD. It sets the step of every channel with a heavy tail (most, at
# 256+ tokens), and quality is sharply sensitive to it (bench/kv_rd.py, pydoc-llama, mean KL of q4e / q3e /
# q2e: 7.49 → 0.00103 / 0.00205 / 0.00310, 7.5 → 0.00098 / 0.00183 / 0.00276, 7.51 → 0.00094 / 0.00174 /
# 0.00263, 8 → 0.0011 / 0.0021 / 0.0032, 9 → 0.0022 / 0.0044 / 0.0065, at equal bytes within 1%): clipping
# outliers costs far more than it saves. At 7.5 the extreme value lands on the clip edge, so codes are clipped.
GUARD = 7.5
_FEW = 64           # tokens of a group up to which plain numpy reductions beat columns.py's (call overhead)
_CRC = struct.Struct("<I")
_lossless = LosslessCodec()


@dataclass(frozen=True)
class Level:
    """Encoder settings of one named level: step = factor × std of the group (a decoder needs none of them)."""
    key_factor: float
    value_factor: float
    recent: int = 0             # last prompt tokens kept exact (lossless)
    fine: int = 0               # prompt tokens before those, quantized with factor × fine_factor
    fine_factor: float = 0.25
    group: int = 1024           # tokens per group
    rotated_key_group: int = 128    # tokens per group of keys coded with RoPE in (they drift with position)
    guard: bool = True          # step ≥ max deviation / GUARD: no value clipped
    head_step: bool = False     # experiment: one step per head (factor × RMS of its channels' std), not per channel
    compact: bool = False       # log-coded steps, and the fine span coded around the main span's last centre
    key_layers: tuple[float, ...] = ()      # per-layer multipliers of key_factor (layer i; 1.0 beyond)
    value_layers: tuple[float, ...] = ()


def token_spans(info: PlaneInfo, level: Level) -> tuple[int, int, int]:
    """Chunk-local a ≤ b ≤ c: [0, a) sinks (exact), [a, b) quantized, [b, c) quantized finely, [c, end) exact."""
    tokens = info.shape[1]
    total = info.total_tokens or (info.token_start + tokens)
    a = min(tokens, max(0, EXACT_HEAD - info.token_start))
    c = min(tokens, max(a, total - level.recent - info.token_start))
    b = min(c, max(a, total - level.recent - level.fine - info.token_start))
    return a, b, c


def groups(n_main: int, n_fine: int, group: int) -> list[tuple[int, int]]:
    """[start, end) of each parameter group within the quantized tokens: the main span, then the fine span."""
    out = [(s, min(s + group, n_main)) for s in range(0, n_main, group)]
    return out + [(n_main + s, n_main + min(s + group, n_fine)) for s in range(0, n_fine, group)]


def _params(x: np.ndarray, factor: np.ndarray, guard: bool, head_step: bool = False,
            centre: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """x [layers, n, heads, dim] float32, factor [layers, 1 or heads × dim] → centre, step [layers, 1, heads, dim]
    float32; the centre is rounded to float16 where it fits (as it travels), or is the given `centre` (another
    group's, [layers, 1, heads, dim]). With `guard`, the step is at least max|x − centre| / GUARD, so that no
    value is clipped (an outlier coarsens its own channel)."""
    layers, n, heads, dim = x.shape
    rows = x.reshape(layers, n, heads * dim)
    if n <= _FEW:           # the fine span: numpy's reductions, fewer calls
        with np.errstate(over="ignore", invalid="ignore"):
            mean, std = rows.mean(axis=1), rows.std(axis=1, dtype=np.float64).astype(np.float32)
        mx, mn = (rows.max(axis=1), rows.min(axis=1)) if guard else (None, None)
    else:
        mean, std = column_mean_std(rows)
        mx, mn = (column_reduce(np.maximum, rows), column_reduce(np.minimum, rows)) if guard else (None, None)
    if centre is not None:
        centre = centre.reshape(layers, heads * dim)
    else:
        centre = mean
        with np.errstate(over="ignore"):
            c16 = centre.astype(np.float16)
        if np.isfinite(c16).all():
            centre = c16.astype(np.float32)
    step = std * factor
    shape = (layers, 1, heads, dim)
    if head_step:       # equal absolute steps within a head: MSE-optimal for entropy-coded channels
        step = step.reshape(shape)
        step = np.broadcast_to(np.sqrt((step * step).mean(axis=-1, keepdims=True)), shape).reshape(layers, -1)
    if guard:
        dev = np.maximum(mx - centre, centre - mn)
        step = np.maximum(step, dev * np.float32(1 / GUARD))
    return centre.reshape(shape), np.ascontiguousarray(step, dtype=np.float32).reshape(shape)


def _quantize(x: np.ndarray, spans: list[tuple[int, int]], centre: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Codes + 8 (0..15) of x [layers, tq, heads, dim] (scratch, clobbered) with group g's centre/step
    [layers, g, heads, dim] over tokens spans[g] → a scratch uint8 array of x's shape."""
    inv = safe_inverse(step)
    off = 8.5 - centre * inv
    for g, (s, e) in enumerate(spans):
        block = x[:, s:e]
        block *= inv[:, g:g + 1]
        block += off[:, g:g + 1]
    np.clip(x, 0.0, 15.5, out=x)
    codes = scratch("eq_codes", x.shape, np.uint8)
    np.copyto(codes, x, casting="unsafe")     # truncation of x ≥ 0: round half up
    return codes


class EntropyQuantCodec(Codec):
    lossless = False

    def __init__(self, name: str, codec_id: int, level: Level):
        self.name, self.codec_id, self.level = name, codec_id, level

    def _factors(self, info: PlaneInfo) -> np.ndarray:
        """Step factors of this plane's layers: [layers, 1] (per layer) or [layers, heads × dim] when the
        encoder has per-channel scales (`PlaneInfo.channel_scales`)."""
        lv = self.level
        base, scales = (lv.key_factor, lv.key_layers) if info.kind == "k" else (lv.value_factor, lv.value_layers)
        layers = range(info.layer_start, info.layer_start + info.shape[0])
        mult = np.array([(scales[i] if i < len(scales) else 1.0) *
                         (info.step_scales[i] if i < len(info.step_scales) else 1.0) for i in layers], dtype=np.float32)
        factor = (base * mult).reshape(-1, 1)
        if not any(i < len(info.channel_scales) for i in layers):
            return factor
        width = info.shape[2] * info.shape[3]
        rows = [info.channel_scales[i] if i < len(info.channel_scales) else (1.0,) * width for i in layers]
        if any(len(r) != width for r in rows):
            raise CodecError(f"{self.name}: channel scales have {sorted({len(r) for r in rows})} entries per layer, "
                             f"the plane has {width} channels (heads × head_dim)")
        return factor * np.array(rows, dtype=np.float32)

    def encode(self, bits: np.ndarray, info: PlaneInfo) -> bytes:
        check_bits(bits, info)
        layers, tokens, heads, dim = info.shape
        a, b, c = token_spans(info, self.level)
        exact = bits[:, :a] if c == tokens else np.concatenate([bits[:, :a], bits[:, c:]], axis=1)
        exact_bytes = _lossless.encode(exact, PlaneInfo(info.dtype, exact.shape)) if exact.size else b""
        group = self.level.group
        params, codes_z, flags = b"", b"", 0
        if c > a:
            x = bits_to_f32(bits[:, a:c], info.dtype, scratch("eq_x", (layers, c - a, heads, dim), np.float32))
            if info.kind == "k" and info.rope is not None and dim % 2 == 0:
                x = rotate(x, info.rope, info.token_start + a, inverse=True, out=scratch("eq_r", x.shape, np.float32))
                flags |= FLAG_UNROTATED
            elif info.kind == "k":
                group = self.level.rotated_key_group
            factor = self._factors(info)
            spans = groups(b - a, c - b, group)
            compact = self.level.compact and info.compact_params
            shared = compact and b > a       # the fine span takes the main span's last centre
            cs: list[tuple[np.ndarray, np.ndarray]] = []
            for s, e in spans:
                fine = s >= b - a
                cs.append(_params(x[:, s:e], factor * (self.level.fine_factor if fine else 1.0), self.level.guard,
                                  self.level.head_step, cs[-1][0] if fine and shared and cs else None))
            centre = np.concatenate([m for m, _ in cs], axis=1)
            step = np.concatenate([d for _, d in cs], axis=1)
            n_centres = len(groups(b - a, 0, group)) if shared else len(spans)
            with np.errstate(over="ignore"):
                c16, s16 = centre.astype(np.float16), step.astype(np.float16)
            codes8 = log_step_codes(step) if compact else None
            if np.isfinite(c16).all() and codes8 is not None:
                flags |= FLAG_LOG_STEPS | (FLAG_SHARED_CENTRE if shared else 0)
                centre, step = c16.astype(np.float32), log_steps(codes8)
                params = np.ascontiguousarray(c16[:, :n_centres]).tobytes() + codes8.tobytes()
            elif np.isfinite(c16).all() and np.isfinite(s16).all() and not ((s16 == 0) & (step > 0)).any():
                centre, step = c16.astype(np.float32), s16.astype(np.float32)
                params = c16.tobytes() + s16.tobytes()
            else:
                flags |= FLAG_F32
                params = centre.tobytes() + step.tobytes()
            codes = _quantize(x, spans, centre, step)
            codes_z = zstd_compress(pack_nibbles(codes.reshape(-1)))
        body = b"".join((exact_bytes, params, codes_z))
        head = HEADER.pack(VERSION, 0 if info.kind == "k" else 1, flags, 0, group, a, c - b, tokens - c,
                           len(exact_bytes), len(params), len(codes_z), 0)[:-4]
        return b"".join((head, _CRC.pack(zlib.crc32(body, zlib.crc32(head))), body))

    def decode(self, data: bytes | memoryview, info: PlaneInfo) -> np.ndarray:
        view = memoryview(data)
        if len(view) < HEADER.size:
            raise CodecError(f"{self.name} plane is truncated ({len(view)} bytes)")
        version, _, flags, _, group, n_head, n_fine, n_tail, e_len, p_len, c_len, crc = HEADER.unpack_from(view)
        layers, tokens, heads, dim = info.shape
        if version != VERSION or flags > FLAGS or (flags & FLAG_F32 and flags & (FLAG_LOG_STEPS | FLAG_SHARED_CENTRE)) \
                or (flags & FLAG_SHARED_CENTRE and not flags & FLAG_LOG_STEPS):
            raise CodecError(f"{self.name} plane has version {version} flags {flags}, expected {VERSION}")
        if HEADER.size + e_len + p_len + c_len != len(view):
            raise CodecError(f"{self.name} plane is {len(view)} bytes, its header says "
                             f"{HEADER.size + e_len + p_len + c_len}")
        if zlib.crc32(view[HEADER.size:], zlib.crc32(view[:HEADER.size - 4])) != crc:
            raise CodecError(f"{self.name} plane fails its CRC-32 (corrupted)")
        if n_head + n_fine + n_tail > tokens or group == 0:
            raise CodecError(f"{self.name} plane header is inconsistent with its shape {info.shape}")
        out = np.empty(info.shape, dtype=BITS_DTYPES[info.dtype])
        pos = HEADER.size
        n_exact = n_head + n_tail
        if n_exact:
            exact = _lossless.decode(view[pos:pos + e_len], PlaneInfo(info.dtype, (layers, n_exact, heads, dim)))
            out[:, :n_head], out[:, tokens - n_tail:] = exact[:, :n_head], exact[:, n_head:]
        elif e_len:
            raise CodecError(f"{self.name} plane has exact bytes but no exact tokens")
        pos += e_len
        tq = tokens - n_exact
        if tq:
            rope = info.rope if flags & FLAG_UNROTATED else None
            if flags & FLAG_UNROTATED and (rope is None or dim % 2):
                raise CodecError(f"{self.name} keys were coded without RoPE; decoding needs the model's RoPE")
            x = self._dequantize(view[pos:], flags, groups(tq - n_fine, n_fine, group), (layers, tq, heads, dim),
                                 p_len, len(groups(tq - n_fine, 0, group)))
            if rope is not None:
                x = rotate(x, rope, info.token_start + n_head, inverse=False, out=scratch("eq_r", x.shape, np.float32))
            store_f32(x, info.dtype, out[:, n_head:tokens - n_tail])
        elif p_len or c_len:
            raise CodecError(f"{self.name} plane has codes but no quantized tokens")
        return out

    def _dequantize(self, view: memoryview, flags: int, spans: list[tuple[int, int]], shape: tuple[int, int, int, int],
                    p_len: int, n_main_groups: int) -> np.ndarray:
        layers, tq, heads, dim = shape
        ng = len(spans)
        pdtype = np.dtype(np.float32 if flags & FLAG_F32 else np.float16)
        width = layers * heads * dim
        # Centres: one per group, or with a shared centre one per main group (the fine groups take the last).
        nc = n_main_groups if flags & FLAG_SHARED_CENTRE else ng
        if flags & FLAG_SHARED_CENTRE and nc == 0:
            raise CodecError(f"{self.name} plane shares a centre but has no main span")
        sdtype = np.dtype(np.uint8) if flags & FLAG_LOG_STEPS else pdtype
        c_bytes = nc * width * pdtype.itemsize
        if p_len != c_bytes + ng * width * sdtype.itemsize:
            raise CodecError(f"{self.name} plane parameters are {p_len} bytes, expected "
                             f"{c_bytes + ng * width * sdtype.itemsize}")
        params = np.empty((2, layers, ng, heads, dim), dtype=np.float32)
        centres = np.frombuffer(view[:c_bytes], dtype=pdtype).reshape(layers, nc, heads, dim)
        params[0, :, :nc] = centres
        if nc < ng:                             # the fine groups take the last main centre
            params[0, :, nc:] = centres[:, nc - 1:nc]
        steps = np.frombuffer(view[c_bytes:p_len], dtype=sdtype).reshape(layers, ng, heads, dim)
        params[1] = log_steps(steps) if flags & FLAG_LOG_STEPS else steps
        if not flags & FLAG_F32 and not np.isfinite(params).all():    # this encoder sends finite float16 only
            raise CodecError(f"{self.name} plane has non-finite float16 parameters")
        n = layers * tq * heads * dim
        codes = unpack_nibbles(zstd_decompress(view[p_len:], (n + 1) // 2), n).reshape(shape)
        x = scratch("eq_x", shape, np.float32)
        np.copyto(x, codes)
        for g, (s, e) in enumerate(spans):
            centre, step = params[0, :, g:g + 1], params[1, :, g:g + 1]
            x[:, s:e] *= step
            x[:, s:e] += centre - 8.0 * step
        return x
