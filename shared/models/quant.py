"""Quantized linear weights: GGUF block formats decoded in torch, and weights kept packed for torch's CPU
int4/int8 matmul kernels.

Life cycle: a loader reads a GGUF tensor's raw blocks ([rows, bytes per row] uint8) and calls
`QuantWeight.from_blocks(kind, blocks, rows, cols)`, or quantizes a float weight with
`QuantWeight.from_float(w, "int8" | "int4")` (`--quantize`); the result is set on a projection with
`_Matmul.set_quant` (layers.py), which drops its float parameter. Every matmul of that projection then runs
`QuantWeight.mm`, which reads the weight packed; the float weight never exists whole.

Kernels and how each GGUF format reaches one:
- Q4_0 (w = d·(q − 8), 32 per block) and Q4_K (w = d·sc·q − dmin·m, 32 per sub-block) → torch's groupwise
  int4 kernel (`aten._weight_int4pack_mm_for_cpu`, w = (q − 8)·scale + zero per group of 32): the nibbles
  exactly, the scales and zeros rounded to bfloat16 (the kernel's type: 0.125 bytes per weight on top of
  the nibbles' 0.5; Q4_0's own are float16, 0.0625).
- Q8_0, Q6_K → per-row int8 (`torch._weight_int8pack_mm`, one bfloat16 scale per output row): the kernel
  has no per-block scales, so the block values are requantized to the row's scale (nearly exact: each
  weight moves by at most half the row's int8 step; `requant_error` records the largest such move). Q6_K
  costs memory (1 byte per weight against 0.82); Q8_0 keeps its size (1 against 1.06). Keeping Q8_0's block
  scales through torch ops instead (int8 → float per call, a batched matmul over 32-wide groups, a scaled
  sum) measured 38 ms for a 2048×2048 weight at one row on one thread, against 3.4 ms for the per-row int8
  kernel and 6.0 ms for the float32 matmul (a busy 2-core machine): requantizing is the fast honest choice.
- Both kernels are fast only for bfloat16 activations (float32 ones take a scalar path, 5-30x slower on
  the CPUs measured): activations are rounded to bfloat16 on the way in, the outputs cast back.
- F32/F16/BF16 are not quantized: the loader reads them into the model's float dtype.
`dequantize(kind, blocks)` gives float32 values of every supported format (tests compare it with the
`gguf` package's reference; the loader uses it for the embedding table, which is read by row lookups).
"""

from __future__ import annotations

from typing import Literal, cast

import torch

# GGUF block formats this module decodes: name → (values per block, bytes per block)
BLOCKS: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_K": (256, 144), "Q6_K": (256, 210),
}
INT4_GROUP = 32          # the int4 kernel's group size for GGUF data and for `--quantize int4`
INT4_N_MULTIPLE = 16     # the int4 kernel packs output rows in sixteens (in blocks of 32 or 64: ISA-dependent)

Scheme = Literal["int4", "int8"]


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 from a [..., 2] uint8 tensor, as float32."""
    return b.contiguous().view(torch.float16).float().squeeze(-1)


def _blocks(data: torch.Tensor, kind: str) -> torch.Tensor:
    per, nbytes = BLOCKS[kind]
    flat = data.reshape(-1)
    if flat.numel() % nbytes:
        raise ValueError(f"{flat.numel()} bytes are not whole {kind} blocks of {nbytes} bytes")
    return flat.view(-1, nbytes)


def _q4_0(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 blocks → nibbles q [n, 32] (0..15), scale [n], zero [n] with w = (q − 8)·scale + zero."""
    d = _f16(b[:, :2])
    qs = b[:, 2:18]
    q = torch.cat([qs & 0xF, qs >> 4], 1)
    return q, d, torch.zeros_like(d)


def _q4_k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of a Q4_K block → eight 6-bit sub-block scales and eight 6-bit mins."""
    s = s.to(torch.int32)
    sc = torch.cat([s[:, :4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], 1)
    m = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], 1)
    return sc, m


def _q4_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K super-blocks → nibbles q [n·8, 32], scale and zero per sub-block of 32 (w = (q − 8)·scale + zero)."""
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = _q4_k_scales(b[:, 4:16])
    qs = b[:, 16:144].reshape(n, 4, 32)
    q = torch.stack([qs & 0xF, qs >> 4], 2).reshape(n * 8, 32)      # sub-block 2i: low nibbles, 2i+1: high
    scale = (d[:, None] * sc).reshape(-1)
    zero = (8 * d[:, None] * sc - dmin[:, None] * m).reshape(-1)
    return q, scale, zero


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    """Q6_K super-blocks → float32 [n, 256] (w = d·sc·(q − 32), a signed 8-bit scale per 16)."""
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 64)
    qh = b[:, 128:192].reshape(n, 2, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).float().reshape(n, 16)
    d = _f16(b[:, 208:210])
    low, high = ql[:, :, :32], ql[:, :, 32:]
    q = torch.stack([(low & 0xF) | ((qh & 3) << 4), (high & 0xF) | (((qh >> 2) & 3) << 4),
                     (low >> 4) | (((qh >> 4) & 3) << 4), (high >> 4) | (((qh >> 6) & 3) << 4)], 2)
    q = q.reshape(n, 16, 16).float() - 32
    return (q * (d[:, None] * sc)[:, :, None]).reshape(n, 256)


def dequantize(kind: str, data: torch.Tensor) -> torch.Tensor:
    """float32 values (flat) of raw GGUF tensor bytes (uint8) of format `kind`."""
    if kind not in BLOCKS:
        raise ValueError(f"unsupported GGUF tensor type {kind} (supported: {', '.join(BLOCKS)})")
    b = _blocks(data, kind)
    if kind == "F32":
        return b.contiguous().view(torch.float32).reshape(-1)
    if kind == "F16":
        return b.contiguous().view(torch.float16).float().reshape(-1)
    if kind == "BF16":
        return b.contiguous().view(torch.bfloat16).float().reshape(-1)
    if kind == "Q8_0":
        return (b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])[:, None]).reshape(-1)
    if kind == "Q6_K":
        return _q6_k(b).reshape(-1)
    if kind == "Q4_0":
        q, scale, _ = _q4_0(b)
        return ((q.float() - 8) * scale[:, None]).reshape(-1)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])      # Q4_K, in the reference's order of operations
    sc, m = _q4_k_scales(b[:, 4:16])
    q = torch.stack([b[:, 16:144].reshape(-1, 4, 32) & 0xF, b[:, 16:144].reshape(-1, 4, 32) >> 4], 2)
    q = q.reshape(-1, 8, 32).float()
    return ((d[:, None] * sc)[:, :, None] * q - (dmin[:, None] * m)[:, :, None]).reshape(-1)


class QuantWeight:
    """A linear weight [out, in] held packed for one of torch's CPU kernels (`scheme` int4 or int8).

    int4: `packed` (the kernel's layout of [out, in] nibbles), `scales` [in / 32, out, 2] bfloat16 (scale, zero).
    The kernel's layout groups output rows in ISA-dependent blocks (32 on AVX2, 64 on AVX-512), so packed
    tensors do not concatenate: until first used (or `pack()`), an int4 weight holds `nibbles` instead, the
    same values as uint8 [out, in / 2] (low nibble: the even input), which `concat` stacks before packing once.
    int8: `packed` int8 [out, in], `scales` [out] bfloat16.
    Both kernels run on bfloat16 inputs (their vectorized path): a float32 activation is rounded to bfloat16 on
    the way in and the output cast back."""

    def __init__(self, scheme: Scheme, packed: torch.Tensor | None, out_features: int, in_features: int,
                 scales: torch.Tensor, source: str, requant_error: float = 0.0, nibbles: torch.Tensor | None = None):
        self.scheme, self._packed, self.scales, self.nibbles = scheme, packed, scales, nibbles
        self.out_features, self.in_features = out_features, in_features
        self.source = source                  # what it was made from ("Q4_K", "float32", ...)
        self.requant_error = requant_error    # largest |change| of a weight made by repacking (0: exact)

    @property
    def packed(self) -> torch.Tensor:
        """The kernel's tensor (an int4 weight still in `nibbles` is packed now)."""
        if self._packed is None:
            self.pack()
        return cast(torch.Tensor, self._packed)

    def pack(self) -> None:
        """Pack an int4 weight's `nibbles` into the kernel's layout (loaders call it once the parts are merged)."""
        if self._packed is None and self.nibbles is not None:
            n = self.nibbles
            q = torch.stack([n & 0xF, n >> 4], -1).reshape(self.out_features, self.in_features)
            self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
            self.nibbles = None

    @property
    def nbytes(self) -> int:
        held = self.nibbles if self._packed is None else self._packed
        assert held is not None
        return held.numel() * held.element_size() + self.scales.numel() * self.scales.element_size()

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_blocks(cls, kind: str, data: torch.Tensor, rows: int, cols: int) -> QuantWeight:
        """A weight from raw GGUF bytes of a [rows, cols] tensor: Q4_0/Q4_K → int4, Q8_0/Q6_K → int8."""
        b = _blocks(data, kind)
        if kind in ("Q4_0", "Q4_K") and rows % INT4_N_MULTIPLE == 0:
            q, scale, zero = _q4_0(b) if kind == "Q4_0" else _q4_k(b)
            return cls._int4(q.reshape(rows, cols), scale.reshape(rows, -1), zero.reshape(rows, -1), kind)
        if kind in ("Q8_0", "Q6_K", "Q4_0", "Q4_K"):
            return cls._int8(dequantize(kind, b).reshape(rows, cols), kind)
        raise ValueError(f"GGUF type {kind} is not a quantized type this runtime packs")

    @classmethod
    def from_float(cls, w: torch.Tensor, scheme: Scheme) -> QuantWeight:
        """`--quantize`: int8 with one scale per output row, or int4 with a scale and zero per 32 inputs."""
        w = w.detach().float()
        rows, cols = w.shape
        if scheme == "int8":
            return cls._int8(w, "float")
        if cols % INT4_GROUP or rows % INT4_N_MULTIPLE:
            raise ValueError(f"int4 needs inputs in groups of {INT4_GROUP} and outputs in sixteens, "
                             f"not a [{rows}, {cols}] weight")
        g = w.reshape(rows, cols // INT4_GROUP, INT4_GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-12)
        q = ((g - lo[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.uint8)
        return cls._int4(q.reshape(rows, cols), scale, lo + 8 * scale, "float")

    @classmethod
    def _int4(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, source: str) -> QuantWeight:
        """q [rows, cols] in 0..15, scale and zero [rows, cols / 32]; held as nibbles until packed."""
        rows, cols = q.shape
        q = q.to(torch.uint8).reshape(rows, cols // 2, 2)
        nibbles = (q[..., 0] | (q[..., 1] << 4)).contiguous()
        scales_zeros = torch.stack([scale.t(), zero.t()], -1).to(torch.bfloat16).contiguous()
        return cls("int4", None, rows, cols, scales_zeros, source, nibbles=nibbles)

    @classmethod
    def _int8(cls, w: torch.Tensor, source: str) -> QuantWeight:
        """Symmetric per-row int8 of float32 values w [rows, cols]."""
        scale = (w.abs().amax(1) / 127).clamp_min(1e-12)
        q = (w / scale[:, None]).round_().clamp_(-127, 127)
        error = float((q * scale[:, None] - w).abs().max()) if w.numel() else 0.0
        return cls("int8", q.to(torch.int8).contiguous(), w.shape[0], w.shape[1], scale.to(torch.bfloat16).contiguous(),
                   source, error)

    @classmethod
    def concat(cls, parts: list[QuantWeight]) -> QuantWeight:
        """Parts of one scheme stacked by output rows (q, k, v; gate, up): int8 rows concatenate; int4 parts
        concatenate as nibbles and are packed once (their packed layouts group rows in blocks, so packed parts
        would not concatenate: parts already packed stay separate, a `QuantStack`)."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        if any(p.scheme != first.scheme or p.in_features != first.in_features for p in parts):
            raise ValueError("only weights of one scheme and input width stack")
        int4 = first.scheme == "int4"
        if int4 and any(p.nibbles is None for p in parts):
            return QuantStack(parts)
        held = torch.cat([cast(torch.Tensor, p.nibbles if int4 else p.packed) for p in parts])
        scales = torch.cat([p.scales for p in parts], 1 if int4 else 0)
        source = "+".join(dict.fromkeys(p.source for p in parts))
        return cls(first.scheme, None if int4 else held, sum(p.out_features for p in parts), first.in_features,
                   scales.contiguous(), source, max(p.requant_error for p in parts), held if int4 else None)

    # ---- use -----------------------------------------------------------------------------------
    def mm(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] @ W^T (+ bias) → [..., out], reading the packed weight."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        dtype = x2.dtype
        if dtype != torch.bfloat16:      # the kernels' fast (vectorized) path; float32 inputs run 5-30x slower
            x2 = x2.to(torch.bfloat16)
        if self.scheme == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, INT4_GROUP, self.scales)
        else:
            y = torch._weight_int8pack_mm(x2, self.packed, self.scales)
        y = y.to(dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] the kernel multiplies by (tests; never called when serving)."""
        if self.scheme == "int8":
            return self.packed.float() * self.scales.float()[:, None]
        eye = torch.eye(self.in_features)
        return self.mm(eye).t().contiguous()


class QuantStack(QuantWeight):
    """Quantized parts of different schemes stacked by output rows (a Q4_K_M file's Q4_K q/k beside its Q6_K
    v): one kernel call per part, outputs concatenated."""

    def __init__(self, parts: list[QuantWeight]):
        first = parts[0]
        super().__init__(first.scheme, None, sum(p.out_features for p in parts), first.in_features,
                         first.scales, "+".join(dict.fromkeys(p.source for p in parts)),
                         max(p.requant_error for p in parts))
        self.parts = parts

    @property
    def packed(self) -> torch.Tensor:
        raise AttributeError("a QuantStack's parts hold its packed tensors")

    def pack(self) -> None:
        for p in self.parts:
            p.pack()

    @classmethod
    def of(cls, parts: list[QuantWeight]) -> QuantWeight:
        """Consecutive parts of one scheme concatenated; a stack only where schemes differ."""
        runs: list[list[QuantWeight]] = []
        for p in parts:
            if runs and runs[-1][0].scheme == p.scheme:
                runs[-1].append(p)
            else:
                runs.append([p])
        merged = [QuantWeight.concat(r) for r in runs]
        return merged[0] if len(merged) == 1 else cls(merged)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def mm(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.cat([p.mm(x) for p in self.parts], -1)
        return y if bias is None else y + bias

    def dequantized(self) -> torch.Tensor:
        return torch.cat([p.dequantized() for p in self.parts])
