"""Codec contract and the float bit helpers every codec shares.

A codec turns one plane (all K, or all V, of a chunk) into bytes and back.
Planes are numpy arrays of raw bits shaped [layers, tokens, heads, head_dim]:
uint16 for bfloat16/float16, uint32 for float32 (numpy has no bfloat16), so
`protocol/` never needs torch. `decode` returns bits of the same dtype, so
a lossy codec's output is already in the model's dtype.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import zstandard

from edgecore.protocol.errors import CodecError

BITS_DTYPES = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32}


@dataclass(frozen=True)
class PlaneInfo:
    dtype: str                      # "bfloat16" | "float16" | "float32"
    shape: tuple[int, int, int, int]  # layers, tokens, heads, head_dim
    kind: str = "k"                 # "k" or "v"
    token_start: int = 0            # position of the chunk's first token in the prompt
    total_tokens: int = 0           # prompt length (0: unknown, treat the chunk as the whole prompt)
    layer_start: int = 0            # model layer of the plane's first layer (encoders may tune per layer)
    # The model's RoPE inverse frequencies (head_dim/2 of them, rotate-half layout), when both ends know
    # them: codecs may then code keys with the rotation removed (see equant.py). None: not known.
    rope: tuple[float, ...] | None = None
    # Encoder hint, the model's bit allocation: step multipliers of this plane's kind per model layer (layer i;
    # 1.0 beyond). Steps travel in the payload, so decoders never need it (bench/kv_rd.py --allocate).
    step_scales: tuple[float, ...] = ()
    # Encoder hint, the model's per-channel importance: for model layer i, step multipliers of this plane's
    # heads × head_dim channels (flat, heads of the plane only), from reverse water-filling on the channel's
    # weight in the attention output (bench/kv_alloc.py). () or a layer beyond the tuple: 1.0.
    channel_scales: tuple[tuple[float, ...], ...] = ()
    # Encoder hint: the decoding peer reads compact parameters (capability "kv-compact-params"); False: the
    # entropy-coded levels send float16 parameters, as a decoder that predates them expects.
    compact_params: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in BITS_DTYPES:
            raise CodecError(f"unknown KV dtype '{self.dtype}'")
        if len(self.shape) != 4 or any(int(s) < 0 for s in self.shape):
            raise CodecError(f"bad KV plane shape {self.shape}")

    @property
    def count(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def raw_bytes(self) -> int:
        return self.count * np.dtype(BITS_DTYPES[self.dtype]).itemsize


class Codec:
    name = ""
    codec_id = 0
    lossless = False

    def encode(self, bits: np.ndarray, info: PlaneInfo) -> bytes | memoryview:
        raise NotImplementedError

    def decode(self, data: bytes | memoryview, info: PlaneInfo) -> np.ndarray:
        raise NotImplementedError


def to_float32(bits: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    if dtype == "float16":
        return bits.view(np.float16).astype(np.float32)
    return bits.view(np.float32)


def from_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    values = np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "bfloat16":
        u = values.view(np.uint32)
        return ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)   # round to nearest even
    if dtype == "float16":
        return values.astype(np.float16).view(np.uint16)
    return values.view(np.uint32).copy()


def bits_to_f32(bits: np.ndarray, dtype: str, out: np.ndarray) -> np.ndarray:
    """to_float32 into `out` (float32, bits' shape; a scratch array, say): bfloat16 widens in place, then one
    shift, with no temporary."""
    if dtype == "bfloat16":
        wide = out.view(np.uint32)
        np.copyto(wide, bits, casting="unsafe")
        wide <<= 16
    else:
        np.copyto(out, bits.view(np.float16 if dtype == "float16" else np.float32))
    return out


FLOAT16_MAX = 65504.0      # a float16 reconstruction past it (a group's centre plus its largest offset) is clamped


def store_f32(x: np.ndarray, dtype: str, dst: np.ndarray) -> None:
    """Lossy codecs' from_float32 into `dst` (a view of the output plane); x (float32, a scratch array) is
    clobbered. float16 is clamped to its finite range (values near 65504 would round to infinity; bfloat16 and
    float32 reach theirs only near 3e38, with no pass spent on it); bfloat16 rounds half away from zero (ties are
    not worth a pass in a lossy codec)."""
    if dtype == "float16":
        np.clip(x, -FLOAT16_MAX, FLOAT16_MAX, out=x)
    if dtype != "bfloat16":
        dst[...] = from_float32(x, dtype)
        return
    u = x.view(np.uint32)
    u += 0x8000
    u >>= 16
    np.copyto(dst, u, casting="unsafe")


def safe_inverse(step: np.ndarray) -> np.ndarray:
    """1/step in float32; 0 where step is 0 or so small (subnormal) that 1/step overflows: those groups
    code every value as the centre (or min), off by at most their tiny range."""
    with np.errstate(divide="ignore", over="ignore"):
        inv = (1.0 / step).astype(np.float32)
    inv[~np.isfinite(inv)] = 0.0
    return inv


_local = threading.local()
_VIEWS = 256       # cached scratch views per thread (shapes vary with chunk sizes)


def scratch(name: str, shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray:
    """A per-thread work array of `shape` and `dtype`, reused by every call that asks for `name` on this thread
    (contents undefined). Codec temporaries live here: a fresh 100 KB+ numpy array is a fresh mmap whose page
    faults cost more than the arithmetic on it (measured: q*e decode spent half its time in the kernel). A
    caller must not return a scratch array, nor hold it past its own call. The view of each (name, shape,
    dtype) is kept too: building it is several numpy calls, and an encode asks for a dozen."""
    views = getattr(_local, "views", None)
    if views is None:
        views = _local.views = {}
    key = (name, shape, dtype)
    view = views.get(key)
    if view is not None:
        return view
    dtype = np.dtype(dtype)
    n = 1
    for s in shape:
        n *= int(s)
    bufs = getattr(_local, "scratch", None)
    if bufs is None:
        bufs = _local.scratch = {}
    buf = bufs.get(name)
    if buf is None or buf.nbytes < n * dtype.itemsize:
        buf = bufs[name] = np.empty(max(n * dtype.itemsize, 1 << 16), dtype=np.uint8)
        for old in [k for k in views if k[0] == name]:      # views of the old buffer
            del views[old]
    view = buf[:n * dtype.itemsize].view(dtype).reshape(shape)
    if len(views) >= _VIEWS:
        views.clear()
    views[key] = view
    return view


def zstd_compress(data: bytes | memoryview | np.ndarray, level: int = 1) -> bytes:
    cache = getattr(_local, "c", None)
    if cache is None:
        cache = _local.c = {}
    comp = cache.get(level)
    if comp is None:
        comp = cache[level] = zstandard.ZstdCompressor(level=level)
    return comp.compress(data)    # type: ignore[arg-type]  # zstandard's stubs omit other buffers (numpy arrays)


def zstd_frame_fits(data: bytes | memoryview, size: int) -> None:
    """Raise zstandard.ZstdError unless the frame's header declares `size` bytes of content or none:
    python-zstandard allocates a declared size before `max_output_size` applies (a forged header
    declaring 50 GB raised MemoryError)."""
    declared = zstandard.frame_content_size(data)
    if declared not in (-1, size):
        raise zstandard.ZstdError(f"frame declares {declared} bytes, expected {size}")


def zstd_decompress(data: bytes | memoryview, size: int) -> bytes:
    dec = getattr(_local, "d", None)
    if dec is None:
        dec = _local.d = zstandard.ZstdDecompressor()
    try:
        zstd_frame_fits(data, size)
        out = dec.decompress(data, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise CodecError(f"corrupt entropy-coded section: {exc}") from None
    if len(out) != size:
        raise CodecError(f"entropy-coded section decodes to {len(out)} bytes, expected {size}")
    return out


def check_bits(bits: np.ndarray, info: PlaneInfo) -> None:
    if bits.dtype != BITS_DTYPES[info.dtype] or tuple(bits.shape) != tuple(info.shape):
        raise CodecError(f"plane is {bits.dtype}{tuple(bits.shape)}, expected "
                         f"{np.dtype(BITS_DTYPES[info.dtype])}{tuple(info.shape)}")
