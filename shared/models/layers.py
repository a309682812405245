"""Linear and embedding layers that shard themselves across tensor-parallel ranks.

Life cycle: a layer is built with its full (logical) sizes, allocates only its
rank's shard, and fills it through `weight_loader(param, source, shard_id)`
where `source` is a lazy safetensors slice: each rank reads only its own rows
or columns, never the full tensor. With one rank every layer is a plain
`nn.Linear`/`nn.Embedding` and no communication happens.

Column-parallel layers split the output dimension (no communication);
row-parallel layers split the input dimension and all-reduce their output, so a
column→row pair (QKV→O, gate_up→down) costs one all-reduce.

On CPU, once weights are loaded, `pack_for_cpu(model)` reorders every linear
weight into oneDNN's blocked layout: with tens of rows, matmuls run up to 2x
faster that way than through the default GEMM path, but one to a few rows
(batch-1 and small-batch decode) pay 25-50 us per call for oneDNN's setup.
Few rows are fastest against the weight stored input-major ([in, out],
`torch.mm(x, W^T)`): the 17 matmuls of a bundled-model decode step at one row
take 0.30 ms that way on one thread against 0.5-1.5 ms through `F.linear` on the
[out, in] weight and 1.15 ms through oneDNN. So a small float32 weight (up to
`KEEP_PLAIN_BYTES`) keeps that transposed copy too (`transposed`; the parameter
becomes a view of it, no third copy; a larger tied LM head uses its shared
embedding table) and `matmul` picks by row count
(`plain_below`); a larger one, or a bf16 one, keeps the packed layout only
(weights are never held twice for big models: at one row a 1 GB model's
matmuls take the same time packed as transposed on two threads).
`weight_bytes(model)` counts packed and transposed copies too.

Where the two layouts cross depends on the CPU: 8 rows on the machine that
first measured it, 4 on an AMD EPYC (one thread, the bundled model: 4 rows
340 us input-major against 260 us packed; 3 on two threads). So `calibrate_plain_rows(model, threads)`
times the model's own weights both ways at 2, 3, ... rows, once at start-up
(about 0.1 s for the bundled model, more for larger weights), and sets the row
count from which the packed layout is used (EDGECORE_PACKED_FROM_ROWS pins it
instead). The two layouts round differently, so logits can differ in their last
bits between machines or start-ups that choose differently, as they already do
between batch sizes.

Packed matmuls run at a few row counts only: see row_buckets.py.

A projection may instead hold a quantized weight (`set_quant`, quant.py: GGUF blocks or `--quantize`): its
float parameter becomes an empty placeholder, `matmul` runs the quantized kernel, and `pack_for_cpu` passes
it by.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from edgecore.shared.kv.heads import kv_head_start
from edgecore.shared.node.env import packed_from_rows
from edgecore.shared.models.row_buckets import bounded_linear, packed_linear
from edgecore.shared.models.parallel import all_gather_last_dim, all_reduce, tensor_parallel

if TYPE_CHECKING:
    from typing import TypeAlias

    from edgecore.shared.models.quant import QuantWeight
    from edgecore.shared.models.weights import WeightSlice

    # What the weight loaders read: a tensor, or a checkpoint tensor not read yet (what `iter_weights` yields).
    WeightSource: TypeAlias = torch.Tensor | WeightSlice


def _read(source: WeightSource, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
    """Read a (sub)tensor from a safetensors slice or a plain tensor."""
    if rows is None and cols is None:
        return source[:] if not isinstance(source, torch.Tensor) else source
    rows = rows or slice(None)
    if cols is None:
        return source[rows]
    return source[rows, cols]


def _shape(source: WeightSource) -> tuple[int, ...]:
    return tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())


KEEP_PLAIN_BYTES = 4 << 20    # a packed weight up to this size keeps its plain copy for few-row matmuls
PACKED_FROM_ROWS = 8          # rows from which the packed weight is used, until `calibrate_plain_rows`
CALIBRATE_MAX_ROWS = 16       # the calibration's last row count: from there on the packed layout is taken


class _Matmul(nn.Module):
    """The x @ W^T (+ b) of a linear layer: plain, or through a oneDNN-packed weight after `pack()`, and
    for inputs of fewer than `plain_below` rows through the input-major copy when one was kept."""

    packed: torch.Tensor | None = None
    packed_bytes = 0
    plain_below = 0      # rows under which `transposed` is used although packed (0: packed only)
    transposed: torch.Tensor | None = None   # W^T contiguous [in, out] for few-row inputs
    weight: nn.Parameter                     # [out, in], set by each layer
    quant: QuantWeight | None = None         # a quantized weight (quant.py): then every matmul reads it

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.mm(x, bias)
        if self.packed is not None and x.numel() >= self.plain_below * x.shape[-1]:
            return packed_linear(x, self.packed, bias)
        wt = self.transposed
        if wt is None:              # unpacked (bf16 without oneDNN packing, EDGECORE_CPU_PACK=0): bucketed rows
            return bounded_linear(x, self.weight, bias)
        if x.dim() == 2:
            return torch.mm(x, wt) if bias is None else torch.addmm(bias, x, wt)
        y = torch.matmul(x, wt)
        return y if bias is None else y + bias

    def set_quant(self, quant: QuantWeight, keep_plain: bool = False) -> None:
        """Multiply by `quant` from now on; the float weight is dropped (an empty placeholder keeps dtype and
        device visible) unless `keep_plain` (a tied LM head's table, which the embedding still reads)."""
        if (quant.out_features, quant.in_features) != tuple(self.weight.shape) and self.weight.dim() == 2:
            raise ValueError(f"quantized weight [{quant.out_features}, {quant.in_features}] for a "
                             f"{list(self.weight.shape)} projection")
        self.quant = quant
        self.packed, self.transposed, self.plain_below, self.packed_bytes = None, None, 0, 0
        if not keep_plain:
            self.weight = nn.Parameter(self.weight.detach().new_empty(0), requires_grad=False)

    def pack(self, keep_plain: bool = False) -> None:
        """`keep_plain`: the [out, in] weight is shared (a tied embedding table) and stays; few rows use an
        input-major copy of it if that is small, else the table itself."""
        w = self.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w)
        self.packed_bytes = nbytes = w.numel() * w.element_size()
        if w.dtype == torch.float32 and (keep_plain or nbytes <= KEEP_PLAIN_BYTES):
            # measured for float32 only: bf16 stays on oneDNN; EDGECORE_PACKED_FROM_ROWS pins it for every model
            self.plain_below = packed_from_rows() or PACKED_FROM_ROWS
            if nbytes <= KEEP_PLAIN_BYTES:
                self.transposed = w.t().contiguous()
                if keep_plain:
                    self.packed_bytes += nbytes     # the shared table, its packed and its transposed copy
                else:                               # the parameter reads the transposed copy: one copy
                    self.weight = nn.Parameter(self.transposed.t(), requires_grad=False)
        elif not keep_plain:     # an empty placeholder keeps dtype and device visible
            self.weight = nn.Parameter(w.new_empty(0), requires_grad=False)


def pack_for_cpu(model: nn.Module) -> int:
    """Pack every linear weight of a CPU model for oneDNN (fp32/bf16); returns how many were packed.

    Call after the weights are loaded: the plain copies of large weights are released, so a packed
    model can no longer load weights. A no-op on other devices, dtypes, or builds without oneDNN; bf16 weights
    stay plain on CPUs without oneDNN's bf16 support (e.g. AVX2-only)."""
    if not torch.backends.mkldnn.is_available():
        return 0
    dtypes = (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)
    embeddings = {id(m.weight) for m in model.modules() if type(m) is VocabParallelEmbedding}
    count = 0
    for module in model.modules():
        if not isinstance(module, _Matmul) or module.packed is not None or module.quant is not None:
            continue
        w = module.weight
        if w.device.type != "cpu" or w.dtype not in dtypes or w.dim() != 2:
            continue
        module.pack(keep_plain=id(w) in embeddings)   # a tied LM head shares the embedding table
        count += 1
    return count


def _layout_times(x: torch.Tensor, plain: list[tuple], packed: list[tuple], reps: int) -> tuple[float, float]:
    """Seconds per pass over the weights, input-major and packed, each the best of three passes of `reps`
    interleaved with the other's; a weight is (tensor, input width, how many the model holds)."""
    inputs = [[(x[:, :width].contiguous(), w, count) for w, width, count in ws] for ws in (plain, packed)]
    best = [float("inf"), float("inf")]
    for i in range(6):
        kind = i % 2            # alternating, three passes each: input-major first, then packed first
        fn = torch.mm if kind == 0 else packed_linear   # what `matmul` runs for each layout
        t = time.perf_counter()
        for _ in range(reps):
            for xi, w, count in inputs[kind]:
                for _ in range(count):
                    fn(xi, w)
        best[kind] = min(best[kind], time.perf_counter() - t)
    return best[0] / reps, best[1] / reps


_calibrated: dict[tuple, int] = {}      # (weight shapes and counts, threads) -> rows: a process times once


def calibrate_plain_rows(model: nn.Module, threads: int) -> int:
    """Set, for every packed weight that kept an input-major copy, the row count from which its packed
    layout is used: the fewest rows r ≥ 2 at which the model's own weights (one of each shape, weighted by
    how many the model holds) multiply no slower packed than input-major at r and at r + 1 (one noisy
    timing does not move it), timed on `threads` threads. Returns it (0: no weight has both layouts; a
    large tied LM head, which has no input-major copy, keeps `PACKED_FROM_ROWS`). EDGECORE_PACKED_FROM_ROWS
    sets it without timing; a process times the same shapes on the same thread count once."""
    modules = [m for m in model.modules() if isinstance(m, _Matmul) and m.plain_below and m.transposed is not None]
    if not modules:
        return 0
    shapes: dict[tuple[int, ...], list] = {}
    for m in modules:
        assert m.transposed is not None     # `modules` holds only those
        entry = shapes.setdefault(tuple(m.transposed.shape), [m, 0])
        entry[1] += 1
    key = (tuple((shape, n) for shape, (_, n) in shapes.items()), threads)
    rows = packed_from_rows() or _calibrated.get(key)
    if rows is None:
        plain = [(m.transposed, m.transposed.shape[0], n) for m, n in shapes.values()]
        packed = [(m.packed, m.transposed.shape[0], n) for m, n in shapes.values()]
        widest = max(width for _, width, _ in plain)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with torch.inference_mode():
                x = torch.randn(CALIBRATE_MAX_ROWS, widest)
                one = _layout_times(x[:1], plain, packed, 1)[0]
                reps = max(1, min(50, int(1e-3 / max(one, 1e-6))))     # ~1 ms a pass
                rows, won = CALIBRATE_MAX_ROWS, False
                for r in range(2, CALIBRATE_MAX_ROWS + 1):
                    t_plain, t_packed = _layout_times(x[:r], plain, packed, reps)
                    if t_packed <= t_plain and won:
                        rows = r - 1
                        break
                    won = t_packed <= t_plain
        finally:
            torch.set_num_threads(before)
        _calibrated[key] = rows
    for m in modules:
        m.plain_below = rows
    return rows



def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights a process holds: parameters (each counted once) plus packed copies (a tied LM head
    keeps both its plain table, shared with the embedding, and a packed copy)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())     # shared ones once
    total += sum(m.quant.nbytes for m in model.modules() if isinstance(m, _Matmul) and m.quant is not None)
    total += sum(m.quant_rows[1].numel() for m in model.modules()
                 if isinstance(m, VocabParallelEmbedding) and m.quant_rows is not None)
    return total + sum(m.packed_bytes for m in model.modules() if isinstance(m, _Matmul) and m.packed is not None)


def quantized_numel(module: nn.Module) -> int:
    """Weights held by the quantized projections under `module` (their parameters are empty placeholders)."""
    return sum(m.quant.out_features * m.quant.in_features for m in module.modules()
               if isinstance(m, _Matmul) and m.quant is not None)


def _copy_checked(param: torch.Tensor, value: torch.Tensor, what: str) -> None:
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"{what}: expected shape {tuple(param.shape)}, got {tuple(value.shape)}")
    param.data.copy_(value)


class ColumnParallelLinear(_Matmul):
    """y = x W^T + b with W split by output rows across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        tp = tensor_parallel()
        if out_features % tp.size:
            raise ValueError(f"output size {out_features} is not divisible by tensor-parallel size {tp.size}")
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = out_features // tp.size
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, source: WeightSource,
                      shard_id: Any = None) -> None:     # unused; each subclass has its own kind (int, str)
        rank = tensor_parallel().rank
        n = param.shape[0]
        _copy_checked(param, _read(source, slice(rank * n, (rank + 1) * n)), "column-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one matrix (gate and up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = output_sizes

    def shard_rows(self, shard_id: int) -> tuple[int, int, int]:
        """(first checkpoint row this rank reads, first parameter row it fills, row count) of a shard."""
        tp = tensor_parallel()
        size = self.output_sizes[shard_id] // tp.size
        return tp.rank * size, sum(self.output_sizes[:shard_id]) // tp.size, size

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: int = 0) -> None:
        start, offset, size = self.shard_rows(shard_id)
        _copy_checked(param.data[offset:offset + size], _read(source, slice(start, start + size)),
                      f"merged shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matrix; heads split across ranks.

    KV heads are split when there are at least as many as ranks, and
    replicated (each rank keeps the one its query heads use) otherwise.
    """

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = tensor_parallel()
        if num_heads % tp.size:
            raise ValueError(f"{num_heads} attention heads are not divisible by tensor-parallel size {tp.size}")
        if num_kv_heads >= tp.size and num_kv_heads % tp.size:
            raise ValueError(f"{num_kv_heads} KV heads are not divisible by tensor-parallel size {tp.size}")
        if num_kv_heads < tp.size and tp.size % num_kv_heads:
            raise ValueError(f"tensor-parallel size {tp.size} is not a multiple of {num_kv_heads} KV heads")
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        self.total_kv_heads = num_kv_heads
        nn.Module.__init__(self)
        self.in_features = hidden
        self.out_per_rank = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        self.out_features = self.out_per_rank * tp.size
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, hidden), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False) if bias else None

    def kv_head_start(self) -> int:
        """Index of this rank's first KV head in the full model."""
        tp = tensor_parallel()
        return kv_head_start(tp.rank, tp.size, self.total_kv_heads)

    def shard_rows(self, shard_id: str) -> tuple[int, int, int]:
        """(first checkpoint row this rank reads, first parameter row it fills, row count) of q, k or v."""
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            return tensor_parallel().rank * q_size, 0, q_size
        return self.kv_head_start() * d, q_size if shard_id == "k" else q_size + kv_size, kv_size

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: str = "q") -> None:
        start, offset, size = self.shard_rows(shard_id)
        _copy_checked(param.data[offset:offset + size], _read(source, slice(start, start + size)),
                      f"{shard_id} projection")


class RowParallelLinear(_Matmul):
    """y = x W^T + b with W split by input columns; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        tp = tensor_parallel()
        if in_features % tp.size:
            raise ValueError(f"input size {in_features} is not divisible by tensor-parallel size {tp.size}")
        self.in_per_rank = in_features // tp.size
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: object = None) -> None:
        if param.dim() == 1:  # bias: replicated, added once after the reduce
            _copy_checked(param, _read(source), "row-parallel bias")
            return
        rank, n = tensor_parallel().rank, param.shape[1]
        _copy_checked(param, _read(source, None, slice(rank * n, (rank + 1) * n)), "row-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(self.matmul(x))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; lookups outside a rank's range are zeroed, then summed."""

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        tp = tensor_parallel()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden), requires_grad=False)
        self.quant_rows: tuple[str, torch.Tensor] | None = None     # (GGUF type, [vocab, bytes]) instead of it

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: object = None) -> None:
        end = min(self.start + self.per_rank, _shape(source)[0])
        value = _read(source, slice(self.start, end))
        param.data.zero_()
        param.data[: end - self.start].copy_(value)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant_rows is not None:      # GGUF blocks, one row per token, decoded per lookup (one rank)
            from edgecore.shared.models.quant import dequantize
            kind, rows = self.quant_rows
            return dequantize(kind, rows[ids.reshape(-1)]).view(*ids.shape, -1).to(self.weight.dtype)
        if tensor_parallel().size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * inside.unsqueeze(-1)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding, _Matmul):
    """Output projection split by vocabulary; logits are gathered on every rank."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.matmul(hidden)
        logits = all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]
