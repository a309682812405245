"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) over a paged cache of latent vectors.

Life cycle per step (one `MLAttention` per layer, the batch's `AttentionMetadata` as for dense models):
1. project: queries (through the q LoRA when `q_lora_rank` is set) and the latent of every new token,
   c = RMSNorm(x W_dkv) [kv_lora_rank] plus the shared rotary key k_pe [qk_rope_head_dim];
2. rotate q_pe and k_pe (interleaved pairs or halves, as the config says; YaRN tables);
3. write cat(c, k_pe) — one vector per token, not per head — into the layer's latent cache slots;
4. decode rows attend in latent space: W_UK is absorbed into the query (q_lat = q_nope W_UK), all heads
   share the cached latent as one key/value head (MQA over `latent_dim` values), and W_UV is applied to
   the latent output afterwards; prefill chunks expand the latent into per-head K/V (kv_b_proj) instead;
5. `on_layer(layer)` so a KV sender can ship the layer's latent at once.

Tensor parallel: query heads (q_b/q_proj, kv_b_proj, o_proj) split across ranks; the latent
projections are replicated, so every rank caches the same latent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from edgecore.shared.models.config import ModelConfig
from edgecore.shared.models.attention import AttentionMetadata
from edgecore.shared.models.layers import ColumnParallelLinear, RowParallelLinear, _Matmul
from edgecore.shared.models.llama import RMSNorm
from edgecore.shared.models.mla_config import DeepseekConfig
from edgecore.shared.models.rope import apply_rope_split, default_inv_freq, yarn
from edgecore.shared.models.row_buckets import bounded_bmm, bounded_linear
from edgecore.shared.models.parallel import tensor_parallel

if TYPE_CHECKING:
    from edgecore.shared.models.layers import WeightSource


def rope_cos_sin(mla: DeepseekConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_positions, qk_rope_head_dim/2] (one angle per rotated pair), float32, YaRN-scaled
    when the config says so (the schedule of `rope.py`)."""
    rope, dim = mla.rope, mla.qk_rope_head_dim
    assert rope.rope_theta is not None          # `mla_config._rope` always sets it
    inv_freq, scale = default_inv_freq(dim, rope.rope_theta), 1.0
    if rope.rope_type == "yarn":
        inv_freq, scale = yarn(inv_freq, dim, rope.rope_theta, rope)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return freqs.cos() * scale, freqs.sin() * scale


class ReplicatedLinear(_Matmul):
    """y = x W^T (+ b), the whole weight on every rank (the latent projections every rank needs)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class KVUpProjection(nn.Module):
    """kv_b_proj: latent [r] -> per-head (k_nope, v), this rank's heads. Kept as a plain weight (never packed):
    decode uses its two halves W_UK [H, nope, r] and W_UV [H, v, r] directly."""

    def __init__(self, rank: int, heads: int, nope: int, v: int):
        super().__init__()
        self.heads, self.nope, self.v = heads, nope, v
        self.weight = nn.Parameter(torch.empty(heads * (nope + v), rank), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: object = None) -> None:
        rows = param.shape[0]
        start = tensor_parallel().rank * rows
        value = source[start:start + rows] if not isinstance(source, torch.Tensor) else source[start:start + rows]
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"kv_b_proj: expected shape {tuple(param.shape)}, got {tuple(value.shape)}")
        param.data.copy_(value)

    def split(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.weight.view(self.heads, self.nope + self.v, -1)
        return w[:, :self.nope], w[:, self.nope:]

    def forward(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c [L, r] -> k_nope [L, H, nope], v [L, H, v]."""
        kv = bounded_linear(c, self.weight).view(c.shape[0], self.heads, self.nope + self.v)
        return kv[..., :self.nope], kv[..., self.nope:]


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        mla: DeepseekConfig = config.mla
        self.layer, self.mla = layer, mla
        tp = tensor_parallel()
        if config.num_attention_heads % tp.size:
            raise ValueError(f"{config.num_attention_heads} attention heads do not split over {tp.size} ranks")
        self.num_heads = config.num_attention_heads // tp.size
        self.num_kv_heads = 1                          # one latent vector per token, shared by every head
        total_heads, qk, bias = config.num_attention_heads, mla.qk_head_dim, mla.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(config.hidden_size, total_heads * qk)
        else:
            self.q_a_proj = ReplicatedLinear(config.hidden_size, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, total_heads * qk)
        self.kv_a_proj_with_mqa = ReplicatedLinear(config.hidden_size, mla.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6)
        self.kv_b_proj = KVUpProjection(mla.kv_lora_rank, self.num_heads, mla.qk_nope_head_dim, mla.v_head_dim)
        self.o_proj = RowParallelLinear(total_heads * mla.v_head_dim, config.hidden_size, bias=bias)
        self.scale = mla.softmax_scale()

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...], meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden]; `rope`: cos, sin [T, 1, rope/2] (the model's `rope_inputs`). Returns [T, hidden]."""
        cos, sin = rope[0], rope[1]
        mla, t, heads = self.mla, x.shape[0], self.num_heads
        if mla.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, heads, mla.qk_head_dim)
        q_nope = q[..., :mla.qk_nope_head_dim]
        q_pe = apply_rope_split(q[..., mla.qk_nope_head_dim:], cos, sin, mla.rope_interleave)
        kv = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(kv[:, :mla.kv_lora_rank])
        k_pe = apply_rope_split(kv[:, mla.kv_lora_rank:], cos[:, 0], sin[:, 0], mla.rope_interleave)
        latent = torch.cat((c, k_pe), dim=-1)                                   # [T, latent_dim]
        whole = meta.kv_caches[self.layer][0]
        assert isinstance(whole, torch.Tensor)                                  # (no quantized latent pool)
        cache = whole.view(-1, mla.latent_dim)                                  # [slots, latent_dim]
        cache.index_copy_(0, meta.slot_mapping, latent.to(cache.dtype))
        out = x.new_empty(t, heads, mla.v_head_dim) if meta.prefills or meta.num_decode == t else \
            x.new_zeros(t, heads, mla.v_head_dim)       # a write-only step (an edge's own layer-0 KV)
        b = meta.num_decode
        if b:
            out[:b] = self._decode(q_nope[:b], q_pe[:b], cache, meta)
        for chunk in meta.prefills:
            s, n = chunk.q_start, chunk.q_len
            ctx = latent[s:s + n] if chunk.slots is None else cache.index_select(0, chunk.slots)
            out[s:s + n] = self._prefill(q_nope[s:s + n], q_pe[s:s + n], ctx, chunk.mask)
        if meta.on_layer is not None:
            meta.on_layer(self.layer)
        return self.o_proj(out.view(t, heads * mla.v_head_dim))

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata
                ) -> torch.Tensor:
        """Absorbed: q_lat = q_nope W_UK [B, H, r]; attention of the H query heads (as a query sequence) over
        the latent (key: all of it, value: its first r values); o = o_lat W_UV^T. Returns [B, H, v]."""
        mla, b, heads = self.mla, q_nope.shape[0], self.num_heads
        w_uk, w_uv = self.kv_b_proj.split()                                      # [H, nope, r], [H, v, r]
        q_lat = bounded_bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)       # [B, H, r]
        qd = torch.cat((q_lat, q_pe), dim=-1).view(b, 1, heads, mla.latent_dim)
        bs, length = meta.block_size, meta.decode_len
        assert meta.decode_blocks is not None       # decode rows come with their block table
        flat = meta.decode_blocks.view(-1)
        width = flat.numel() * bs // b
        kd = cache.view(-1, bs, mla.latent_dim).index_select(0, flat).view(b, width, mla.latent_dim)
        kd = kd[:, :length].unsqueeze(1)                                        # [B, 1, L, latent_dim]
        o_lat = F.scaled_dot_product_attention(qd, kd, kd[..., :mla.kv_lora_rank], attn_mask=meta.decode_mask,
                                               scale=self.scale)                # [B, 1, H, r]
        return bounded_bmm(o_lat.view(b, heads, -1).transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None
                 ) -> torch.Tensor:
        """Expanded: per-head K = cat(c W_UK, k_pe), V = c W_UV over the chunk's context. Returns [n, H, v]."""
        mla = self.mla
        k_nope, v = self.kv_b_proj(ctx[:, :mla.kv_lora_rank])                 # [L, H, nope], [L, H, v]
        k_pe = ctx[:, None, mla.kv_lora_rank:].expand(-1, self.num_heads, -1)
        q = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)                   # [H, n, qk]
        k = torch.cat((k_nope, k_pe), dim=-1).transpose(0, 1)                   # [H, L, qk]
        o = F.scaled_dot_product_attention(q[None], k[None], v.transpose(0, 1)[None], attn_mask=mask,
                                           is_causal=mask is None, scale=self.scale)
        return o[0].transpose(0, 1)
