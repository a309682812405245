"""`q4e` (id 5), `q3e` (id 6), `q2e` (id 7): entropy-coded uniform quantization of KV.

Life cycle: the core encodes one plane (all K or all V of a chunk) per call with the
level's step factors; the edge decodes it from the bytes alone — every step and
centre travels in the payload, so the level's tuning (per-layer allocation
included) is an encoder choice, and any edge on this protocol version decodes
any level. A CRC-32 over the body makes a corrupted or cut payload a
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
  level) but at least max|x − centre| / 7.5, so nothing is clipped; both
  stored as float16.
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

Reached (bench/results/kv_rd*.json, 30 × 256-token prompts, levels with the
model's allocation, per layer and per channel; ratio vs bf16 / perplexity increase / mean KL /
greedy agreement): pydoc-llama q4e 0.240 / −0.07% / 0.00094 / 0.980, q3e 0.199 / +0.16% /
0.00162 / 0.974, q2e 0.180 / +0.37% / 0.00257 / 0.959; pystd-llama q4e 0.200 / +0.01% /
0.00020 / 0.988, q3e 0.158 / +0.09% / 0.00028 / 0.976, q2e 0.142 / −0.01% / 0.00038 / 0.978.
Same run, per-layer allocation only (rows NAME-layers): pydoc q2e KL 0.00283, q3e 0.00185,
q4e 0.00088 (per-channel steps lose there, within its noise); pystd 0.00074 / 0.00050 /
0.00026. So ≤ 0.25× within +0.3% on both (q4e, and q3e); ≤ 0.15× within +1% and ≥ 97%
agreement on pystd-llama (q2e, 0.142 / 97.8%), not on pydoc-llama, whose smallest level
keeping 97% is q3e at 0.199 (no tested setting ≤ 0.16× kept more than 96.4%: factors
1.0/1.1 0.155 / 94.6%, 0.9/0.95 with 32 fine tokens at half the step 0.163 / 96.4%, 0.9/1.0
without fine tokens 0.141 / 94.6%; coarser steps for tokens far from the end, i.e. 32–128 fine
tokens at 0.5–0.6 of a coarser step, 0.146–0.160 / 94.0–95.6%; perplexity differences under
~0.5% are within this bench's noise). Agreement tracks KL: fp8 0.00049 → 98.5%, q4e 0.00094 → 98.0%, q3e
0.0016 → 97.4%, q2e 0.0026 → 96%; 97% at 0.15× would need about 0.002 there, 2.5× below
the 0.005 these settings reach — about 0.7 bit per quantized value.
Where pydoc-llama's q2e bytes go (bench/kv_codec.py `breakdown`, share of bf16
bytes at 256 / 1000 tokens): codes 0.151 / 0.131 (2.46 / 2.11 bit per quantized
value), centres + steps 0.016 / 0.004, exact sinks 0.012 / 0.003, headers 0.001 /
0.0003. Side information is a tenth of the bytes at 256 tokens: 0.15× needs
cheaper codes at equal quality, not cheaper headers.
Speed (bench/results/kv_codec.json: 9 × 1000-token windows, per core, interleaved with the
revision before the last speed work, on a loaded machine): encode q4e 166, q3e 119, q2e 117 MB/s
(before 169 / 116 / 116; another run 166 / 182 / 161), decode 256–367 — encode stays under the
300 MB/s goal, decode mostly over it. Where a 1000-token key plane's q4e encode goes (~600 µs):
statistics ~200 (mean/std 53, max/min 46, the fine span's numpy reductions and the parameters'
float16 rounding ~100), quantize 96, zstd 75, RoPE undo 51, exact sinks 37, widening 29, packing
16, and ~100 of per-call overhead on small arrays (a 40-token plane still takes ~250–350 µs).
Tried and dropped: the rotation blocked to stay in L2 (slower, 84 → 133 µs); the fine span's
mean/std without numpy's Python wrappers (no measurable change); zstd settings faster than level
1 (window/hash logs 15/10: 5% more code bytes for 11% less zstd time; level −1 halves it for 36%
more bytes). Per-call costs weigh less at a larger model's shapes (kv_codec.json `wide_heads`,
synthetic 8 × 128-head planes, 1000 tokens): encode q4e 264, q3e 266, q2e 268, decode 408–430
MB/s in the same run; keys are the slower half (measured apart: q4e K 254 / V 375, q2e K 226 /
V 398): undoing RoPE reads three plane-sized float32 tables, which at 4 MB planes fall out of
cache (the rotation alone 2.3 ms at 1000 tokens against 0.27 ms at 256; blocking did not help).

Byte layout: header `HEADER` (version 1, kind 0 K / 1 V, flags (bit 0: params are
float32; bit 1: keys coded with RoPE removed), 0, group, n_head, n_fine, n_tail,
exact bytes, param bytes, code bytes, CRC-32 of the header's other bytes and
everything after it) | lossless(head tokens ‖ tail tokens) |
centres [layers][groups][heads][dim] | steps (same shape) | zstd(codes).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

from edgecore.protocol.codecs.base import (BITS_DTYPES, Codec, PlaneInfo, bits_to_f32, check_bits, safe_inverse,
                                           scratch, store_f32, zstd_compress, zstd_decompress)
from edgecore.protocol.codecs.columns import column_mean_std, column_reduce
from edgecore.protocol.codecs.lossless import LosslessCodec
from edgecore.protocol.codecs.rope import rotate
from edgecore.protocol.errors import CodecError

HEADER = struct.Struct("<BBBBIIIIIIII")
VERSION = 1
EXACT_HEAD = 4
FLAG_F32, FLAG_UNROTATED = 1, 2
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


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 codes < 16 → two per byte, the first in the low nibble (an odd count is padded with code 8).
    Returns a per-thread scratch array, valid until this thread's next call."""
    if codes.size % 2:
        codes = np.append(codes, np.uint8(8))
    pairs = codes.view(np.uint16)            # little-endian: first code in the low byte
    tmp = scratch("pack", pairs.shape, np.uint16)
    np.right_shift(pairs, 4, out=tmp)
    tmp |= pairs
    out = scratch("packed", pairs.shape, np.uint8)
    np.copyto(out, tmp, casting="unsafe")
    return out


def unpack_nibbles(data, n: int) -> np.ndarray:
    """Inverse of pack_nibbles: the first n codes (a per-thread scratch array, valid until the next call)."""
    src = np.frombuffer(data, dtype=np.uint8)
    packed, tmp = scratch("unpack", src.shape, np.uint16), scratch("unpack_t", src.shape, np.uint16)
    np.copyto(packed, src)
    np.left_shift(packed, 4, out=tmp)
    packed |= tmp
    packed &= 0x0F0F
    return packed.view(np.uint8)[:n]


def _params(x: np.ndarray, factor: np.ndarray, guard: bool, head_step: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """x [layers, n, heads, dim] float32, factor [layers, 1 or heads × dim] → centre, step [layers, 1, heads, dim]
    float32; the centre is rounded to float16 where it fits (as it travels). With `guard`, the step is at least
    max|x − centre| / GUARD, so that no value is clipped (an outlier coarsens its own channel)."""
    layers, n, heads, dim = x.shape
    rows = x.reshape(layers, n, heads * dim)
    if n <= _FEW:           # the fine span: numpy's reductions, fewer calls
        with np.errstate(over="ignore", invalid="ignore"):
            centre, std = rows.mean(axis=1), rows.std(axis=1, dtype=np.float64).astype(np.float32)
        mx, mn = (rows.max(axis=1), rows.min(axis=1)) if guard else (None, None)
    else:
        centre, std = column_mean_std(rows)
        mx, mn = (column_reduce(np.maximum, rows), column_reduce(np.minimum, rows)) if guard else (None, None)
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


def _quantize(x: np.ndarray, spans, centre: np.ndarray, step: np.ndarray) -> np.ndarray:
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
            cs = [_params(x[:, s:e], factor * (self.level.fine_factor if s >= b - a else 1.0), self.level.guard,
                          self.level.head_step)
                  for s, e in spans]
            centre = np.concatenate([m for m, _ in cs], axis=1)
            step = np.concatenate([d for _, d in cs], axis=1)
            with np.errstate(over="ignore"):
                c16, s16 = centre.astype(np.float16), step.astype(np.float16)
            if np.isfinite(c16).all() and np.isfinite(s16).all() and not ((s16 == 0) & (step > 0)).any():
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

    def decode(self, data, info: PlaneInfo) -> np.ndarray:
        view = memoryview(data)
        if len(view) < HEADER.size:
            raise CodecError(f"{self.name} plane is truncated ({len(view)} bytes)")
        version, _, flags, _, group, n_head, n_fine, n_tail, e_len, p_len, c_len, crc = HEADER.unpack_from(view)
        layers, tokens, heads, dim = info.shape
        if version != VERSION or flags > 3:
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
                                 p_len)
            if rope is not None:
                x = rotate(x, rope, info.token_start + n_head, inverse=False, out=scratch("eq_r", x.shape, np.float32))
            store_f32(x, info.dtype, out[:, n_head:tokens - n_tail])
        elif p_len or c_len:
            raise CodecError(f"{self.name} plane has codes but no quantized tokens")
        return out

    def _dequantize(self, view, flags, spans, shape, p_len) -> np.ndarray:
        layers, tq, heads, dim = shape
        ng = len(spans)
        pdtype = np.dtype(np.float32 if flags & FLAG_F32 else np.float16)
        count = layers * ng * heads * dim
        if p_len != 2 * count * pdtype.itemsize:
            raise CodecError(f"{self.name} plane parameters are {p_len} bytes, expected "
                             f"{2 * count * pdtype.itemsize}")
        params = np.frombuffer(view[:p_len], dtype=pdtype).astype(np.float32).reshape(2, layers, ng, heads, dim)
        n = layers * tq * heads * dim
        codes = unpack_nibbles(zstd_decompress(view[p_len:], (n + 1) // 2), n).reshape(shape)
        x = scratch("eq_x", shape, np.float32)
        np.copyto(x, codes)
        for g, (s, e) in enumerate(spans):
            centre, step = params[0, :, g:g + 1], params[1, :, g:g + 1]
            x[:, s:e] *= step
            x[:, s:e] += centre - 8.0 * step
        return x
