"""`CompiledDecoder`: a pure decode step of a plain Llama-family model, compiled whole by `torch.compile`.

Life cycle: `ModelRunner` builds one when asked to (`EngineConfig.compile_decode`, the nodes' `--compile`)
and the model has a `FlatDecoder` (flat_decode.py: one rank, base attention and MLP, small float32
weights), every layer attends fully and has no sinks. `build` compiles the step at start-up, from
dummy steps of one row and of two rows (torch specializes a size of 1, so those are two graphs; from
two rows on the row count is symbolic), and a second module of the same step, for steps of WIDE_FROM
rows or more, from a dummy of WIDE_DUMMY rows x blocks (inductor tunes its kernels to its inputs' sizes:
`build`). The dummies write into the first cache blocks, whose contents it puts back. The graphs are
cached on disk by torch (`TORCHINDUCTOR_CACHE_DIR`, default under /tmp), so a second start compiles
much faster. Then `takes(meta, rows)` says whether a step is one it serves: pure decode, at most
`MAX_ROWS` rows and `MAX_CONTEXT` positions of block table, no layer hook, the thread count it was
compiled for (a different count would recompile mid-serving). `logits(ids, positions, meta)` returns the float32 logits of every row;
the runner samples them as it does the eager path's. A call that would need a new graph raises rather than
compile while serving; the runner then drops the compiled step and serves eagerly.

What the graph holds: embedding, per layer RMSNorm, QKV (+ bias, + Qwen3's per-head norms), RoPE from
the model's own tables (`rope_inputs`, run eagerly: the tables grow on demand), the step's K/V written
into the paged cache, attention over the rows' block tables, the output projection, the MLP; then the
final norm and the LM head (unless the head kept no plain copy: then the model's packed head, eagerly).
Attention is written as sums of products, not SDPA: inductor fuses the block-table gather into the
reductions, where SDPA would need the gathered K/V materialized (with SDPA the step was 1.15x slower at
8 rows and 1.2x at 32). Past a few rows a step's attention reads more bytes of K/V than of weights, so its
loops matter: they run block by block, the rotated queries are computed once into a buffer, and the
softmax divides once per output (forward's comments). Weights
are frozen into the graph (inductor's `freezing`) and the matmuls take inductor's C++ GEMM template
where its autotuning finds it faster than oneDNN (`max_autotune`, backends CPP and ATEN).

Why: at a few rows a small model's step is less arithmetic than dispatch: about 45 eager operator
calls per layer at 1.3-2 us each (bench/decode.py --breakdown). The compiled step runs a handful of
generated C++ kernels per layer. Results are the eager path's to float32 rounding, not bit for bit
(reductions are ordered differently): tests/shared/test_compiled_decode.py checks logits within 1e-4
and greedy tokens equal.

Costs: start-up time (tens of seconds for the first compile on a 2-core machine; a few with torch's
cache warm), about 160 MB more resident memory for the bundled model (torch's compiler stack, its kernels
and the weights frozen into each graph: three copies; oneDNN's kernels for the matmuls autotuning gives it,
one per row count, at most 8 + 14 of them: `DecodeGraph.linear`), and a C++ compiler on the machine. If
compiling fails, `build` logs why and returns None: the node serves with the eager path.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import TYPE_CHECKING, cast

import torch
import torch._dynamo.config as dynamo_config
import torch._inductor.config as inductor_config
import torch.fx.experimental._config as shape_config
import torch.nn.functional as F
from torch import nn

from edgecore.shared.models.config import FULL
from edgecore.shared.errors import first_line
from edgecore.shared.models.attention import AttentionMetadata
from edgecore.shared.models.flat_decode import FlatDecoder, rms_norm
from edgecore.shared.models.rope import apply_rope
from edgecore.shared.models.row_buckets import EXACT_ROWS

if TYPE_CHECKING:
    from collections.abc import Iterable

    from edgecore.shared.models.layers import _Matmul
    from edgecore.shared.models.llama import MLP, Attention, DecoderLayer

log = logging.getLogger("edgecore.engine")

MAX_ROWS = 2 * EXACT_ROWS   # larger steps run eagerly (their matmuls are work enough; oneDNN's kernels per
                            # row count stay bounded as in row_buckets.py; below, see DecodeGraph.linear)
WIDE_FROM = 9               # steps of this many rows or more take the graph compiled for many rows
WIDE_DUMMY = (16, 8)        # rows x blocks of the dummy step that compiles it
MAX_CONTEXT = 4096          # longer block tables run eagerly: the graphs' attention sums are guarded to at most
                            # this many positions (inductor switches to a cascaded float sum above it)
WIDE_ROW_MULTIPLE = 4       # its matmuls run at a multiple of this many rows (DecodeGraph.linear)
assert WIDE_FROM <= WIDE_DUMMY[0] <= MAX_ROWS      # the wide dummy compiles the wide module
INDUCTOR = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
            "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}   # nothing printed
DYNAMO = {"specialize_float": True}      # eps and scales are constants, not tensors made at every call


def _plain(matmul: _Matmul) -> torch.Tensor:
    """A projection's weight as [out, in]: a view of the input-major copy the eager path reads (no copy)."""
    return matmul.transposed.t() if matmul.transposed is not None else matmul.weight


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach(), requires_grad=False)


class DecodeGraph(nn.Module):
    """The step as one module: parameters are frozen into the compiled graph; the KV caches are a plain
    list (mutated in place: never frozen)."""

    def __init__(self, flat: FlatDecoder, caches: list, block_size: int, row_multiple: int = 1):
        super().__init__()
        model = flat.model
        self.block_size = block_size
        self.caches = caches
        self.embed = _param(flat.embed)
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        self.shapes: list[tuple] = []
        for layer in cast("Iterable[DecoderLayer]", model.model.layers):       # as `FlatDecoder.for_model` checked
            attn, mlp = cast("Attention", layer.self_attn), cast("MLP", layer.mlp)
            norms = hasattr(attn, "q_norm")
            for t in (layer.input_layernorm.weight, _plain(attn.qkv_proj), _plain(attn.o_proj),
                      layer.post_attention_layernorm.weight, _plain(mlp.gate_up_proj), _plain(mlp.down_proj),
                      attn.q_norm.weight if norms else torch.ones(1), attn.k_norm.weight if norms else torch.ones(1)):
                self.weights.append(_param(t))
            for b in (attn.qkv_proj.bias, attn.o_proj.bias, mlp.gate_up_proj.bias, mlp.down_proj.bias):
                self.biases.append(_param(b if b is not None else torch.zeros(0)))
            self.shapes.append((attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale, attn.layer,
                                layer.input_layernorm.eps, layer.post_attention_layernorm.eps,
                                attn.q_norm.eps if norms else None, mlp.act))
        self.final_norm = _param(model.model.norm.weight)
        self.final_eps = model.model.norm.eps
        # An LM head too large to keep a plain copy (untied, over KEEP_PLAIN_BYTES) stays out of the graph: the
        # graph returns the hidden states and the model's own packed head makes the logits.
        head = _plain(model.lm_head)
        self.lm_head = _param(head) if head.numel() else None
        self.vocab = model.lm_head.vocab_size
        attn = cast("Attention", model.model.layers[0].self_attn)
        # Each layer's rotated, scaled queries are written here (see forward); same shape in every layer
        # (FlatDecoder's models have uniform layers).
        self.queries = torch.zeros(MAX_ROWS, attn.num_heads, attn.head_dim)
        self.row_multiple = row_multiple

    def forward(self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        b, bs = ids.shape[0], self.block_size
        x = F.embedding(ids, self.embed)
        # Attention runs over [blocks, block size] rather than one flat context: the block-table lookup then
        # stays in the outer loop (17% faster at 32 rows than a flat gather, 9% at 8).
        # [B, 1, 1, blocks, bs]: True where attended (the rows' own positions so far; padding blocks masked)
        position = torch.arange(blocks.shape[1], device=ids.device)[:, None] * bs + \
            torch.arange(bs, device=ids.device)
        mask = (position <= positions[:, None, None])[:, None, None]
        w, bias = self.weights, self.biases
        for i, (heads, kvh, d, scale, index, eps1, eps2, qk_eps, act) in enumerate(self.shapes):
            n1, qkv_w, o_w, n2, gu_w, down_w, qn, kn = (w[8 * i + j] for j in range(8))
            qkv_b, o_b, gu_b, down_b = (bias[4 * i + j] if bias[4 * i + j].numel() else None for j in range(4))
            qkv = self.linear(rms_norm(x, n1, eps1), qkv_w, qkv_b).view(b, heads + 2 * kvh, d)
            qk = qkv[:, :heads + kvh]
            if qk_eps is not None:
                qk = torch.cat([rms_norm(qk[:, :heads], qn, qk_eps), rms_norm(qk[:, heads:], kn, qk_eps)], 1)
            qk = apply_rope(qk, cos, sin)
            k_cache, v_cache = self.caches[index]
            k_cache.index_copy_(0, slots, qk[:, heads:])
            v_cache.index_copy_(0, slots, qkv[:, heads + kvh:])
            self.queries[:b].copy_(qk[:, :heads] * scale)
            # [B, KV heads, 1, blocks, bs, d]
            kd = k_cache.view(-1, bs, kvh, d)[blocks].permute(0, 3, 1, 2, 4)[:, :, None]
            vd = v_cache.view(-1, bs, kvh, d)[blocks].permute(0, 3, 1, 2, 4)[:, :, None]
            q = self.queries[:b].reshape(b, kvh, heads // kvh, 1, 1, d)      # query heads grouped by KV head
            scores = (q * kd).sum(-1).masked_fill(~mask, float("-inf"))
            # Softmax with its division after the weighted sum: once per output, not per context position.
            e = (scores - scores.amax((-1, -2), keepdim=True)).exp()
            o = ((e[..., None] * vd).sum((-2, -3)) / e.sum((-1, -2))[..., None]).reshape(b, heads * d)
            y = self.linear(o, o_w)
            x = x + (y if o_b is None else y + o_b)
            gate, up = self.linear(rms_norm(x, n2, eps2), gu_w, gu_b).chunk(2, dim=-1)
            y = self.linear(act(gate) * up, down_w)
            x = x + (y if down_b is None else y + down_b)
        if self.lm_head is None:
            return x
        return self.linear(rms_norm(x, self.final_norm, self.final_eps), self.lm_head)[:, :self.vocab]

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear with the rows padded to a multiple of `row_multiple` (sliced off after): the matmuls that
        autotuning gives to oneDNN keep a kernel per row count, about 0.5 MB each, never freed; padded, the
        wide module's steps of 9-64 rows make 14 of them rather than 56 (measured: 8 MB of growth against 53;
        steps 1-4% slower)."""
        if self.row_multiple == 1:
            return F.linear(x, w, b)
        n = x.shape[0]
        return F.linear(F.pad(x, (0, 0, 0, (-n) % self.row_multiple)), w, b)[:n]


class CompiledDecoder:
    def __init__(self, flat: FlatDecoder, graph: DecodeGraph, wide: DecodeGraph, threads: int):
        """`graph` serves steps of fewer than WIDE_FROM rows, `wide` (the same step, another module so that
        it gets graphs of its own) the larger ones."""
        self.flat = flat
        self.graph = graph
        self.threads = threads
        for pair in graph.caches:          # fixed for the engine's life: no symbols (cheaper guards)
            for cache in pair:
                torch._dynamo.mark_static(cache)
        for g in (graph, wide):
            torch._dynamo.mark_static(g.queries)
        self.step = torch.compile(graph, dynamic=True, fullgraph=True)
        self.wide = torch.compile(wide, dynamic=True, fullgraph=True)
        # While serving, a call that would recompile (tens of seconds on the engine thread, and without the
        # settings below) raises instead; the runner then serves eagerly. Made once (a fresh one per call
        # costs ~5 us); making it sets the stance, so it is put back at once.
        self.no_recompile = torch.compiler.set_stance("fail_on_recompile")
        self.no_recompile.__exit__(None, None, None)

    @staticmethod
    def supports(flat: FlatDecoder | None) -> bool:
        from edgecore.shared.models.llama import LlamaForCausalLM
        if flat is None or type(flat.model).compute_logits is not LlamaForCausalLM.compute_logits:
            return False            # a family with its own logits (a scale, a soft cap): the model's path
        # base attention in every layer (`FlatDecoder.for_model` checked)
        attns = [cast("Attention", l.self_attn) for l in cast("Iterable[DecoderLayer]", flat.model.model.layers)]
        return all(a.form == FULL and a.sinks is None for a in attns) and \
            flat.model.lm_head.weight.dtype == torch.float32 and \
            len({(a.num_heads, a.head_dim) for a in attns}) == 1   # one `queries` buffer

    @classmethod
    def build(cls, flat: FlatDecoder | None, caches: list, block_size: int) -> CompiledDecoder | None:
        """Compile (one row, two rows, then WIDE_DUMMY for the wide module) or say why not and return None.

        The dummy steps' sizes are also the hints by which inductor decides which loops to split over threads
        and which matmul kernels its autotuning picks. Hints of 2 rows x 2 blocks keep the attention loops on
        one thread: best for a few rows, but a 32-row step ran 1.1-1.2x slower than with hints of 16 x 8, which
        in turn made 8-row steps 1.1x slower and noisier (more OpenMP barriers per step). Hence two modules
        compiled from different dummies, split at WIDE_FROM rows."""
        if any(not isinstance(k, torch.Tensor) for k, _ in caches):
            log.warning("--compile: the compiled step reads a float KV cache, not --kv-cache-dtype's; serving "
                        "eagerly")
            return None
        if not cls.supports(flat):
            log.warning("--compile: this model's decode step has no compiled form (a plain float32 Llama-family "
                        "model with full attention on one rank is needed); serving eagerly")
            return None
        assert flat is not None             # `supports` said so
        start = time.perf_counter()
        log.info("compiling the decode step (torch.compile; tens of seconds the first time, cached after)")
        # The dummy steps write blocks 0 to `width` - 1; what they held (a direct engine user may have written
        # KV before the first step compiles) is put back after.
        slots = next((c.shape[0] for pair in caches for c in pair if c is not None), 2 * block_size)
        wide_rows, width = WIDE_DUMMY[0], max(2, min(WIDE_DUMMY[1], slots // block_size))
        saved = [[None if c is None else c[:width * block_size].clone() for c in pair] for pair in caches]
        # Compiled graphs of every DecodeGraph (engines in one process) share one code object's cache entries.
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
        try:
            decoder = cls(flat, DecodeGraph(flat, caches, block_size),
                          DecodeGraph(flat, caches, block_size, WIDE_ROW_MULTIPLE), torch.get_num_threads())
            # No duck sizing: a dimension equal to another by chance (two blocks wide, two KV heads) would
            # share its symbol and be specialized with it.
            # Inductor's settings as a patch while compiling: torch.compile's `options` did not reach freezing.
            # (torch.fx.experimental._config gets `patch` at run time, from install_config_module: no stub has it)
            with (torch.inference_mode(), shape_config.patch(use_duck_shape=False),  # type: ignore[attr-defined]
                    inductor_config.patch(INDUCTOR), dynamo_config.patch(DYNAMO), warnings.catch_warnings()):
                warnings.filterwarnings("ignore", "TypedStorage is deprecated")     # torch's own autotuner
                for rows, blocks in ((1, 2), (2, 2), (wide_rows, width)):
                    decoder.logits(*decoder._dummy(rows, blocks), compiling=True)
        except Exception as exc:        # no compiler, an unsupported build: the eager path still serves
            log.warning("--compile: compiling the decode step failed (%s); serving eagerly", first_line(exc))
            return None
        finally:
            with torch.no_grad():
                for pair, kept in zip(caches, saved):
                    for cache, old in zip(pair, kept):
                        if cache is not None:
                            cache[:width * block_size].copy_(old)
        log.info("decode step compiled in %.1f s", time.perf_counter() - start)
        return decoder

    def _dummy(self, rows: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """A decode step of `rows` rows over blocks 0 to `blocks` - 1, at the first two positions of the last,
        built as `ModelRunner.prepare` builds one (ids, positions and slots are views of one tensor)."""
        bs = self.graph.block_size
        positions = [(blocks - 1) * bs + r % 2 for r in range(rows)]
        flat = torch.tensor([1] * rows + positions + positions, dtype=torch.long)
        meta = AttentionMetadata(slot_mapping=flat[2 * rows:], num_decode=rows,
                                 decode_blocks=torch.tensor([list(range(blocks))] * rows), block_size=bs)
        return flat[:rows], flat[rows:2 * rows], meta

    def takes(self, meta: AttentionMetadata, rows: int) -> bool:
        if meta.prefills or meta.num_decode != rows or not (self.flat.takes(meta, rows) and rows <= MAX_ROWS
                                                             and meta.on_layer is None):
            return False            # a pure decode step only (the flat decoder also takes small steps with chunks)
        assert meta.decode_blocks is not None       # a pure decode step has its block table
        return meta.decode_blocks.shape[1] * meta.block_size <= MAX_CONTEXT and \
            torch.get_num_threads() == self.threads       # (no windows: `supports` took full attention only)

    def logits(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               compiling: bool = False) -> torch.Tensor:
        """`compiling`: a warm-up step of `build`, which may compile."""
        cos, sin = self.flat.model.rope_inputs(positions, torch.float32)
        blocks = meta.decode_blocks
        assert blocks is not None           # a pure decode step (`takes`)
        if blocks.shape[1] == 1:        # at least two columns: one graph serves every context length
            blocks = F.pad(blocks, (0, 1))
        args = (ids, cos, sin, positions, meta.slot_mapping, blocks)
        step = self.wide if ids.shape[0] >= WIDE_FROM else self.step
        if compiling:
            out = step(*args)
        else:
            with self.no_recompile:
                out = step(*args)
        return out if self.graph.lm_head is not None else self.flat.model.compute_logits(out)
