"""Turns a scheduled batch into tensors, runs the model and samples.

Life cycle per step: `prepare(batch)` orders the batch (decode rows first,
then prefill chunks), builds token ids, positions, the slot of every new
token and the attention metadata; `run(batch)` executes the model under
`torch.inference_mode`, computes logits only for the rows that reach the end
of their known tokens, and samples them. The scheduler never sees a tensor;
this is the only place where sequences meet tensors.

Attention forms: the model's config says which positions each layer sees
(`ModelConfig.layer_attention`); besides the full-attention masks, `prepare`
builds, per sliding-window or chunked form, the prefill masks (only where they
differ from full attention) and the decode rows' window blocks (`DecodeWindow`:
a windowed layer's decode reads only the blocks holding its window). Leading
blocks that no layer can see any more may have been released
(`BlockManager.release_before`, id -1): a full-attention read takes them as
block 0, masked out; a windowed decode never reads them.

Threads: a step of fewer than `SINGLE_THREAD_BELOW` tokens (batch-1 and small-batch decode) may run on
one thread, then the caller's count is restored; `StepThreads` (step_threads.py) decides per row count by
timing the steps both ways. Few of such a step's ops have enough work to split, while every OpenMP region
pays a fork and a barrier: on one 2-core machine two threads made the typical step 2-5x slower when busy
(the barrier waits for a descheduled worker), and batch 8 and 16 steps 2.5x slower in the same run (6.6
against 16.3 ms, 8.5 against 21.9 ms, other jobs running); on another, batch 4-8 decode ran 1.1-1.2x
faster on two. Only for small models (`SINGLE_THREAD_MAX_WEIGHTS`): a step of a large one is matmuls over
megabytes of weights, which split well over threads even at one token.

Compiled decode (`compile_decode`, `edgecore edge --compile`): small pure decode steps of a model that has one
run through `CompiledDecoder` (compiled_decode.py) on all threads, every other step as above; if a compiled
step fails (one that would need a new graph), the runner drops it and serves eagerly from then on.

LoRA adapters (shared/models/lora.py): the engine sets its `LoraRegistry` (`lora`); a step whose rows include an
adapter's runs through the module tree on all threads (`lora.begin` sets the rows' slots, the layers add their
deltas); the fast decode paths (`FlatDecoder`, `CompiledDecoder`) bypass the modules, so they serve only steps
of base rows. An edge's own layer 0 (`write_first_layer_kv`) applies the request's adapter too.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, cast
from collections.abc import Callable

import torch
from torch import nn

from edgecore.shared.models.config import FULL, LayerAttention
from edgecore.shared.engine import prompt_logprobs
from edgecore.shared.engine.sampler import SampleResult, sample
from edgecore.shared.engine.scheduler import ScheduledBatch
from edgecore.shared.engine.sequence import Sequence
from edgecore.shared.engine.speculative import verify
from edgecore.shared.engine.step_threads import StepThreads
from edgecore.shared.node.env import cpu_pack_enabled
from edgecore.shared.errors import first_line
from edgecore.shared.kv.pool import KVPool
from edgecore.shared.node.malloc import retain_freed_memory
from edgecore.shared.models.attention import AttentionMetadata, DecodeWindow, PrefillChunk
from edgecore.shared.models.flat_decode import FlatDecoder
from edgecore.shared.models.layers import calibrate_plain_rows, pack_for_cpu, quantized_numel, weight_bytes

if TYPE_CHECKING:
    from typing import TypeVar

    from edgecore.shared.engine.step_plan import PlanItem
    from edgecore.shared.kv.transfer import DirectRoute
    from edgecore.shared.models.lora import LoraRegistry
    from edgecore.shared.models.compiled_decode import CompiledDecoder
    from edgecore.shared.models.llama import LlamaForCausalLM

    # What a step's items hold: the driver's sequences, or a parallel worker's stand-ins (step_plan.py).
    StepSeq = TypeVar("StepSeq", bound=Sequence | PlanItem)

log = logging.getLogger("edgecore.engine")

SINGLE_THREAD_BELOW = 16    # tokens: smaller steps may run on one thread (0: never) ...
SINGLE_THREAD_MAX_WEIGHTS = 64 << 20    # ... of a model with at most these weight bytes (a larger model's
                                        # matmuls at batch 1 read enough memory for two threads to pay)
FIRST_LAYER_PIECE = 2048   # tokens per call of write_first_layer_kv (bounds its activations)


def sampling_rows(ordered: list[tuple[StepSeq, int]]) -> tuple[list[int], list[StepSeq]]:
    """Rows of the flattened batch whose sequence reaches its last known token (they sample), and those
    sequences."""
    rows: list[int] = []
    samplers: list[StepSeq] = []
    end = 0
    for seq, n in ordered:
        end += n
        if seq.num_computed_tokens + n == seq.num_tokens:
            rows.append(end - 1)
            samplers.append(seq)
    return rows, samplers


def first_visible(form: LayerAttention, pos: torch.Tensor) -> torch.Tensor:
    """The first position each query position in `pos` sees under `form`."""
    if form.kind == "sliding":
        return (pos - form.size + 1).clamp(min=0)
    if form.kind == "chunked":
        return pos - pos % form.size
    return torch.zeros_like(pos)


class ModelRunner:
    lora: LoraRegistry | None = None   # the engine's LoRA adapters (shared/models/lora.py)
    compiled: CompiledDecoder | None = None
    compile_pending = False        # `compile_decode` asked for and not done yet
    compiled_steps = 0             # steps the compiled step ran

    def __init__(self, model: LlamaForCausalLM, pool: KVPool, sliding_window: int | None = None,
                 compile_decode: bool = False) -> None:
        """`sliding_window` is not used any more: each layer's attention form comes from `model.config`.
        `compile_decode`: serve small pure decode steps through `CompiledDecoder`, compiled by the first
        `compile_decode()` or step: on the thread, and at the thread count, that steps run on."""
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.block_size = pool.block_size
        self.forms = sorted({f for f in model.config.layer_attention if f != FULL}, key=lambda f: (f.kind, f.size))
        # Multiply-adds per token of computing layer 0's K/V here (its attention's weights: the projections
        # run whole); 0 where this process does not hold layer 0.
        layer0 = cast(nn.Module, model.model.layers[0].self_attn) if model.model.layer_ids[0] == 0 else None
        self.layer0_macs_per_token = sum(p.numel() for p in layer0.parameters() if p.dim() == 2) if layer0 else 0
        if layer0 is not None:      # quantized projections (quant.py) hold placeholders: count their weights
            self.layer0_macs_per_token += quantized_numel(layer0)
        packed = self.device == "cpu" and cpu_pack_enabled()
        if self.device == "cpu":
            retain_freed_memory()      # activations reuse heap pages instead of faulting in new ones
            if packed:
                pack_for_cpu(model)    # weights are final from here on
        # Steps under SINGLE_THREAD_BELOW tokens of a small model may run on one thread (step_threads.py).
        self.step_threads = StepThreads(SINGLE_THREAD_BELOW if weight_bytes(model) <= SINGLE_THREAD_MAX_WEIGHTS else 0)
        if packed and self.step_threads.below:
            # Timed here, before the engine thread exists, on one thread, although StepThreads may run a
            # few-row step on all (on the EPYC the crossover was 4 rows on one thread, 3 on two: one row
            # off costs little); a larger model keeps PACKED_FROM_ROWS. Ranks of a parallel run
            # (parallel_runner.py) step through StageRunner, which runs every step on all threads.
            calibrate_plain_rows(model, 1)
        # Pure decode steps of a plain Llama-family model skip its module tree (flat_decode.py).
        self.flat = FlatDecoder.for_model(model) if self.device == "cpu" else None
        self.compile_pending = compile_decode

    def compile_decode(self) -> None:
        if self.compile_pending:
            from edgecore.shared.models.compiled_decode import CompiledDecoder   # torch's compiler: only if asked
            self.compile_pending = False
            self.compiled = CompiledDecoder.build(self.flat, self.pool.layers, self.block_size)

    def prepare(self, items: list[tuple[StepSeq, int]], on_layer: Callable[[int], None] | None = None
                ) -> tuple[list[tuple[StepSeq, int]], torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        decode = [(s, n) for s, n in items if n == 1]
        prefill = [(s, n) for s, n in items if n > 1]
        ordered = decode + prefill
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for seq, n in ordered:
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start:start + n])
            blocks = seq.table.blocks
            if n == 1:                 # a decode row: no inner loop
                positions.append(start)
                slots.append(blocks[start // bs] * bs + start % bs)
                continue
            for p in range(start, start + n):
                positions.append(p)
                slots.append(blocks[p // bs] * bs + p % bs)
        dev, t = self.device, len(ids)
        flat = torch.tensor(ids + positions + slots, dtype=torch.long, device=dev)   # one tensor, three views
        meta = AttentionMetadata(slot_mapping=flat[2 * t:], kv_caches=self.pool.layers, on_layer=on_layer)
        if decode:
            self._decode_meta(meta, [s for s, _ in decode])
        offset = len(decode)
        for seq, n in prefill:
            meta.prefills.append(self._prefill_chunk(seq, n, offset))
            offset += n
        return ordered, flat[:t], flat[t:2 * t], meta

    def _decode_meta(self, meta: AttentionMetadata, seqs: list[StepSeq]) -> None:
        """The decode rows' block table, context length, padding mask and window blocks; for a single row
        whose blocks are consecutive, the first slot of that run (`decode_span`: attention reads a view)."""
        bs = self.block_size
        ctx = [s.num_computed_tokens + 1 for s in seqs]
        longest = max(ctx)
        width = -(-longest // bs)
        rows = [s.table.blocks[:width] for s in seqs]
        table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long,
                             device=self.device).clamp_(min=0)
        meta.num_decode = len(seqs)
        meta.decode_blocks = table
        meta.block_size = bs
        meta.decode_len = longest
        if len(rows) == 1 and len(rows[0]) == width and rows[0][0] >= 0 \
                and rows[0] == list(range(rows[0][0], rows[0][0] + width)):
            meta.decode_span = rows[0][0] * bs
        if min(ctx) == longest and not self.forms:
            return                     # every row attends to all `longest` positions
        ctx_t = torch.tensor(ctx, device=self.device).unsqueeze(1)
        if min(ctx) < longest:
            pos = torch.arange(longest, device=self.device).unsqueeze(0)
            meta.decode_mask = (pos < ctx_t)[:, None, None, :]
        for form in self.forms:
            window = self._decode_window(form, table, ctx_t)
            if window is not None:
                meta.decode_windows[form] = window

    def _decode_window(self, form: LayerAttention, table: torch.Tensor, ctx: torch.Tensor) -> DecodeWindow | None:
        """The blocks each decode row (context lengths `ctx` [B, 1], blocks `table` [B, W]) reads under a
        windowed `form`: from the block of its first visible position to its last. None when every row sees
        its whole context."""
        bs = self.block_size
        first = first_visible(form, ctx - 1)                        # [B, 1]
        if first.max() == 0:
            return None
        start = first // bs                                         # first block read by each row
        width = int((-(-ctx // bs) - start).max())
        cols = (start + torch.arange(width, device=table.device)).clamp_(max=table.shape[1] - 1)
        blocks = table.gather(1, cols)                              # [B, width]
        length = int((ctx - start * bs).max())
        pos = start * bs + torch.arange(length, device=table.device)   # [B, length] positions read
        seen = (pos >= first) & (pos < ctx)
        return DecodeWindow(blocks, length, None if bool(seen.all()) else seen[:, None, None, :])

    def _prefill_chunk(self, seq: Sequence | PlanItem, n: int, offset: int) -> PrefillChunk:
        dev = self.device
        start = seq.num_computed_tokens
        ctx = start + n
        chunk_slots, mask = None, None
        q_pos = torch.arange(start, ctx, device=dev).unsqueeze(1)
        k_pos = torch.arange(0, ctx, device=dev).unsqueeze(0)
        if start > 0:
            chunk_slots = self.pool.slots([max(b, 0) for b in seq.table.blocks], 0, ctx)
            mask = k_pos <= q_pos
        chunk = PrefillChunk(offset, n, ctx, chunk_slots, mask)
        for form in self.forms:
            first = first_visible(form, q_pos)
            if first[-1].item() > 0:
                chunk.masks[form] = (k_pos <= q_pos) & (k_pos >= first)
        return chunk

    @torch.inference_mode()
    def write_first_layer_kv(self, seq: Sequence, start: int, end: int) -> None:
        """Layer 0's K/V of `seq`'s tokens [start, end), computed here in pieces of `FIRST_LAYER_PIECE` tokens
        (an edge's own first layer: shared/kv/transfer.py `EDGE_LAYERS`)."""
        for lo in range(start, end, FIRST_LAYER_PIECE):
            hi = min(end, lo + FIRST_LAYER_PIECE)
            ids = torch.tensor(seq.token_ids[lo:hi], dtype=torch.long, device=self.device)
            slots = self.pool.slots(seq.table.blocks, lo, hi)
            positions = torch.arange(lo, hi, device=self.device)
            adapted = self.lora is not None and self.lora.begin([(seq, hi - lo)])
            try:
                self.model.write_first_layer_kv(ids, positions, AttentionMetadata(slot_mapping=slots,
                                                                                  kv_caches=self.pool.layers))
            finally:
                if adapted and self.lora is not None:
                    self.lora.end()

    # ---- ranks: a parallel runner (parallel_runner.py) overrides these; one process has none ----
    def add_route(self, stream_id: str, route: DirectRoute) -> None:
        raise NotImplementedError("stream routes need a parallel core")

    def drop_route(self, stream_id: str) -> None:
        pass

    def rank_stats(self) -> list[dict]:
        return []

    def shutdown(self) -> None:
        pass

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, on_layer: Callable[[int, list], None] | None = None
            ) -> tuple[list[Sequence], SampleResult | None]:
        """Compute the batch; return the sequences that sampled and their samples. `on_layer(layer, items)`
        runs after each layer has written its K/V."""
        if self.compile_pending:
            self.compile_decode()
        hook = (lambda layer: on_layer(layer, batch.items)) if on_layer is not None else None
        ordered, ids, positions, meta = self.prepare(batch.items, hook)
        if self.lora is not None and self.lora.begin(ordered):     # adapter rows: the module tree only
            try:
                return self._compute(ordered, ids, positions, meta, fast=False)
            finally:
                self.lora.end()
        compiled = self.compiled
        if compiled is not None and compiled.takes(meta, ids.shape[0]) and not prompt_logprobs.wanted(ordered):
            try:        # every row's logits first: the step writes the K/V of rows that do not sample too
                logits = compiled.logits(ids, positions, meta)
            except Exception as exc:    # e.g. a step that would recompile: from here on, eager (the same K/V)
                log.warning("compiled decode step failed (%s); serving eagerly from now on", first_line(exc))
                self.compiled = None
            else:
                self.compiled_steps += 1
                return self._sample(ordered, lambda rows: logits)
        threads, chooser = torch.get_num_threads(), self.step_threads
        kind = (ids.shape[0], not meta.prefills)      # pure decode steps and steps with prefill timed apart
        small = threads > 1 and chooser.one_thread(kind)
        timed = threads > 1 and chooser.timing(kind)
        if small:
            torch.set_num_threads(1)
        start = time.perf_counter()
        try:
            result = self._compute(ordered, ids, positions, meta)
        finally:
            if small:
                torch.set_num_threads(threads)
        if timed:
            chooser.record(kind, small, time.perf_counter() - start)
        return result

    def _compute(self, ordered: list[tuple[Sequence, int]], ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata, fast: bool = True) -> tuple[list[Sequence], SampleResult | None]:
        flat = self.flat
        if fast and flat is not None and flat.takes(meta, ids.shape[0]):
            hidden = flat.forward(ids, positions, meta)
        else:
            hidden = self.model(ids, positions, meta)
        if prompt_logprobs.wanted(ordered):
            prompt_logprobs.record(self.model, hidden, ordered)
        # A pure decode step samples every row: no copy of `hidden`.
        return self._sample(ordered, lambda rows: self.model.compute_logits(
            hidden if len(rows) == hidden.shape[0] else hidden[rows]))

    @staticmethod
    def _sample(ordered: list[tuple[Sequence, int]], logits_of: Callable[[list[int]], torch.Tensor]
                ) -> tuple[list[Sequence], SampleResult | None]:
        """Sample the rows that reach their last known token, from `logits_of(rows)`: those rows' logits (the
        compiled step gives every row's: a pure decode step samples every row)."""
        rows, samplers = sampling_rows(ordered)
        if not samplers:
            return [], None
        drafted = [(i, len(s.draft)) for i, s in enumerate(samplers) if isinstance(s, Sequence) and s.draft]
        if not drafted:
            logits = logits_of(rows)
            return samplers, sample(logits if logits.shape[0] == len(rows) else logits[rows], samplers)
        wanted = sorted(rows + [r for i, k in drafted for r in range(rows[i] - k, rows[i])])  # the drafts' too
        logits = logits_of(wanted)      # (in row order: all rows may come back whole)
        logits = logits if logits.shape[0] == len(wanted) else logits[wanted]
        at = {row: j for j, row in enumerate(wanted)}
        result = sample(logits[[at[r] for r in rows]], samplers)
        for i, k in drafted:        # rows of the last known token and the drafts, in position order
            seq = samplers[i]
            assert isinstance(seq, Sequence)
            result.drafted[i] = verify(logits[[at[r] for r in range(rows[i] - k, rows[i] + 1)]], seq.draft, seq)
        return samplers, result
