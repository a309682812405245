"""Row buckets: matmuls served by oneDNN run at a few row counts, not at every count they meet.

Life cycle: stateless functions. `_Matmul.matmul` and `FlatDecoder` call `packed_linear` for every matmul
through a oneDNN-packed weight; the MoE experts and MLA call `bounded_linear` / `bounded_bmm` where plain
torch would call `F.linear` / `torch.bmm`. Each pads its row dimension with zeros up to `padded_rows`
(itself up to `EXACT_ROWS`, then 8 steps per power of two: at most 1/8 more rows) and returns a view of
the rows asked for; each output row depends on its own input row only.

Why: oneDNN builds a kernel for each row count a packed weight meets and keeps it:
about 0.4 MB of heap each, never returned, so a server whose prefill steps
meet every row count from 1 to 2048 grew by 55 MB per 10 s of HTTP load on
the bundled model (1,300 requests), to 400 MB over its idle size. So
`packed_linear` runs more than `EXACT_ROWS` rows at one of 8 row counts per
power of two (`padded_rows`, at most 1/8 more rows): at most 80 kernels
per weight shape up to 2048 rows. bf16 `F.linear` and `bmm` on CPU go through
oneDNN too and grow the same way up to its 1024-primitive cache (230 -> 790
MB over 1,000 row counts); `bounded_linear` and `bounded_bmm` pad those
(MoE experts, MLA); float32 ones go to MKL's GEMM, which keeps nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EXACT_ROWS = 32               # up to this many rows, a matmul runs at its own row count


def padded_rows(rows: int) -> int:
    """The row count a packed matmul of `rows` rows runs at: itself up to `EXACT_ROWS`, else rounded up to
    one of 8 steps per power of two (at most 1/8 more rows)."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def _pad_rows(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    """x with its dimension `dim` grown to `padded_rows` by zeros (x itself when no growth); and the size
    it had."""
    rows = x.shape[dim]
    padded = padded_rows(rows)
    if padded == rows:
        return x, rows
    shape = list(x.shape)
    shape[dim] = padded
    xp = x.new_empty(shape)
    xp.narrow(dim, rows, padded - rows).zero_()     # no garbage (denormals, NaN) through the kernel
    xp.narrow(dim, 0, rows).copy_(x)                # one copy, whatever x's strides
    return xp, rows


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T (+ bias) through a oneDNN-packed weight, at `padded_rows` rows: the rows added are zeros
    and their outputs dropped (each output row depends on its own input row only); the result is a view
    of the first rows."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    xp, rows = _pad_rows(x2, 0)
    y = torch.ops.mkldnn._linear_pointwise(xp, packed, bias, "none", [], "")
    if xp is not x2:
        y = y[:rows]
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


def _via_onednn(x: torch.Tensor) -> bool:
    """Whether torch serves a CPU matmul of x through oneDNN (kernels per row count): not float32, which
    goes to MKL's GEMM and keeps nothing per shape."""
    return x.device.type == "cpu" and x.dtype != torch.float32


def bounded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear of a 2-D x, at `padded_rows` rows where oneDNN serves it (bf16 on CPU: MoE experts and routers,
    MLA's up-projection, unpacked projections), so that varying row counts do not each leave a kernel behind."""
    if not _via_onednn(x) or x.dim() != 2:
        return F.linear(x, weight, bias)
    xp, rows = _pad_rows(x, 0)
    y = F.linear(xp, weight, bias)
    return y if xp is x else y[:rows]


def bounded_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm(a [H, B, k], b [H, k, n]) with B at `padded_rows` where oneDNN serves it."""
    if not _via_onednn(a):
        return torch.bmm(a, b)
    ap, rows = _pad_rows(a, 1)
    y = torch.bmm(ap, b)
    return y if ap is a else y[:, :rows]
