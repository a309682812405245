"""Attention over the paged KV cache.

Life cycle per step: the model runner builds one `AttentionMetadata` for the
whole batch (where each new token's K/V goes, which cache slots each sequence
reads, masks), then every layer calls `paged_attention`, which
1. writes the step's new K/V into that layer's cache slots,
2. runs the decode group (one query token per sequence) as one batched call,
3. runs each prefill chunk on its own (fresh K/V when nothing precedes it,
   otherwise the cached context gathered through its slots),
4. calls `on_layer(layer_index)` so a KV sender can ship that layer at once.

Attention forms: a layer says which positions it sees (`LayerAttention`: full, sliding window,
chunked); the runner builds one mask per form present in the model (`PrefillChunk.masks`; absent
where the form sees what full attention sees). Decode rows of a windowed layer read only the blocks
that hold their window (`DecodeWindow`: each row's block table from the block of its first visible
position), so a decode step costs O(window) per sequence, not O(context). Learned attention
sinks (gpt-oss) are one more logit per head that takes probability mass and contributes no value:
an extra zero key/value column whose additive mask entry is the sink.

Token order in the flattened batch: all decode tokens first, then prefill
chunks back to back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable

import torch
import torch.nn.functional as F

from edgecore.shared.models.config import FULL, LayerAttention
from edgecore.shared.kv.quant_cache import Cache, gather, gather_blocks, span, write


@dataclass
class PrefillChunk:
    q_start: int               # offset of the chunk in the flattened batch
    q_len: int                 # tokens computed in this step
    ctx_len: int               # tokens attended to (cached + new)
    slots: torch.Tensor | None  # [ctx_len] cache slots, None when ctx_len == q_len
    mask: torch.Tensor | None   # [q_len, ctx_len] bool, None for plain causal
    masks: dict[LayerAttention, torch.Tensor] = field(default_factory=dict)   # other attention forms


@dataclass
class DecodeWindow:
    """What the decode rows of one windowed attention form read: row i's blocks from the one holding its first
    visible position on; column j of row i is position (first block of row i) * block_size + j."""
    blocks: torch.Tensor                # [B, W] cache blocks (padding: block 0, masked)
    length: int                         # positions read per row (≤ W * block_size)
    mask: torch.Tensor | None           # [B, 1, 1, length] True where attended; None: everything


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor          # [T] cache slot of each new token
    num_decode: int = 0                 # decode tokens at the front of the batch
    decode_blocks: torch.Tensor | None = None  # [B, W] cache blocks read by each decode sequence
    block_size: int = 16
    decode_len: int = 0                        # longest decode context (L ≤ W * block_size)
    decode_mask: torch.Tensor | None = None   # [B, 1, 1, L] True where attended; None: everything
    decode_span: int | None = None      # one decode row whose blocks are consecutive: its first cache slot
    decode_windows: dict[LayerAttention, DecodeWindow] = field(default_factory=dict)   # windowed forms
    prefills: list[PrefillChunk] = field(default_factory=list)
    kv_caches: list[tuple[Cache, Cache | None]] = field(default_factory=list)  # per layer [slots, H, D] (MLA: latent, None)
    on_layer: Callable[[int], None] | None = None


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[H_kv, L, D] -> [H_kv * groups, L, D] (each KV head serves `groups` query heads)."""
    if groups == 1:
        return x
    h, length, d = x.shape
    return x[:, None].expand(h, groups, length, d).reshape(h * groups, length, d)


def with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k, v [..., L, D] plus one zero row; a float mask [..., H, n, L+1]: 0 / -inf from `mask` (None:
    causal, queries at the end), then the sink of each query row: `sinks` broadcasts to q.shape[-3:-1]."""
    n, length = q.shape[-2], k.shape[-2]
    if mask is None:
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    shape = (*torch.broadcast_shapes(bias.shape[:-2], q.shape[:-2]), n)
    bias = torch.cat([bias.expand(*shape, length), sinks.to(q.dtype)[..., None].expand(*shape, 1)], -1)
    zero = k.new_zeros(*k.shape[:-2], 1, k.shape[-1])
    return torch.cat([k, zero], -2), torch.cat([v, zero], -2), bias


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            sinks: torch.Tensor | None, gqa: bool = False) -> torch.Tensor:
    if sinks is not None:
        k, v, mask = with_sinks(q, k, v, mask, sinks)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                          enable_gqa=gqa)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                    meta: AttentionMetadata, scale: float, form: LayerAttention = FULL,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] for the new tokens; `form` the positions this layer sees; `sinks`
    [Hq] learned sink logits. Returns [T, Hq, D]."""
    k_cache, v_cache = meta.kv_caches[layer]
    assert v_cache is not None          # only MLA's latent caches have none
    write(k_cache, meta.slot_mapping, k)
    write(v_cache, meta.slot_mapping, v)
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    groups = hq // hkv
    b = meta.num_decode
    # Rows neither decoding nor in a prefill chunk (a write-only step: an edge's own layer-0 KV) read zeros.
    out = (torch.empty_like(q) if meta.prefills else torch.zeros_like(q)) if b < q.shape[0] else None
    if b:
        # float32 on CPU: one query per head, K/V shared by head groups inside SDPA ([B, Hq, 1, D]),
        # 1.15-2x faster than the other form. Otherwise the query heads of one KV head act as a short
        # query sequence ([B, Hkv, G, D]): for bf16 on CPU SDPA's GQA path is 2.5-6x slower.
        gqa = q.dtype == torch.float32 and q.device.type == "cpu" and groups > 1
        qd = q[:b].view(b, hq, 1, d) if gqa else q[:b].view(b, hkv, groups, d)
        # Gather whole blocks (contiguous runs of block_size slots), not single slots: far fewer,
        # larger copies. Attention reads the first L positions; a shorter sequence's tail is masked.
        # A windowed layer reads its rows' window blocks only (`DecodeWindow`).
        window = meta.decode_windows.get(form)
        blocks, length, mask = (meta.decode_blocks, meta.decode_len, meta.decode_mask) if window is None else \
            (window.blocks, window.length, window.mask)
        if window is None and meta.decode_span is not None:     # one row, consecutive blocks: views, no copy
            start = meta.decode_span
            kd = span(k_cache, start, length).unsqueeze(0).transpose(1, 2)
            vd = span(v_cache, start, length).unsqueeze(0).transpose(1, 2)
        else:
            assert blocks is not None       # decode rows come with their block table
            bs, flat = meta.block_size, blocks.view(-1)
            width = blocks.shape[1] * bs
            kd = gather_blocks(k_cache, flat, bs).view(b, width, hkv, d)[:, :length].transpose(1, 2)
            vd = gather_blocks(v_cache, flat, bs).view(b, width, hkv, d)[:, :length].transpose(1, 2)
        if sinks is None:
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale, enable_gqa=gqa)
        else:
            if mask is None:
                mask = torch.ones(b, 1, 1, length, dtype=torch.bool, device=q.device)
            od = _attend(qd, kd, vd, mask, scale, sinks.view(qd.shape[1], qd.shape[2]), gqa)
        if b == q.shape[0]:             # a decode-only step: no copy into `out`
            out = od.view(b, hq, d)
        else:
            assert out is not None          # made above: rows other than the decode ones
            out[:b] = od.reshape(b, hq, d)
    for chunk in meta.prefills:
        assert out is not None              # made above: prefill rows follow the decode ones
        s, n = chunk.q_start, chunk.q_len
        qp = q[s:s + n].transpose(0, 1)                  # [Hq, n, D]
        if chunk.slots is None:
            kp, vp = k[s:s + n].transpose(0, 1), v[s:s + n].transpose(0, 1)
        else:
            kp = gather(k_cache, chunk.slots).transpose(0, 1)
            vp = gather(v_cache, chunk.slots).transpose(0, 1)
        kp, vp = repeat_kv(kp, groups), repeat_kv(vp, groups)
        # 4-D ([1, H, n, D]): with 3-D inputs SDPA takes its unfused math path on CPU, 2-2.5x slower.
        mask = chunk.masks.get(form, chunk.mask)
        op = _attend(qp[None], kp[None], vp[None], mask, scale, None if sinks is None else sinks.view(-1, 1))
        out[s:s + n] = op[0].transpose(0, 1)
    if meta.on_layer is not None:
        meta.on_layer(layer)
    assert out is not None                  # a step of no rows has no attention
    return out
