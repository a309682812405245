"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache; the base the MoE and MLA
families (Mixtral, Qwen3-MoE, gpt-oss, Llama 4, DeepSeek) extend by replacing the MLP, the attention or both.

Life cycle: `LlamaForCausalLM(config)` allocates this rank's weight shards,
`load_weights` fills them from (name, lazy slice) pairs named as in the
Hugging Face checkpoint, then each engine step calls
`forward(input_ids [T], positions [T], meta)` → hidden [T, hidden] and
`compute_logits(hidden [S, hidden])` → [S, vocab] for the rows that sample.
RoPE and the inverse-frequency schedule are pure functions (`rope.py`).
A subclass changes a layer through `make_mlp(config, layer)` / `make_attention`, and loads
checkpoint tensors no plain parameter matches through `load_special` (with `special_names`
listing the checkpoint names it expects).

The per-token path calls submodules' `forward` directly: `nn.Module.__call__` costs ~1.7 us a call on
a small CPU (hook checks), about forty calls a step, while this model registers no hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from edgecore.shared.models.config import ModelConfig
from edgecore.shared.models.activation import ACTIVATIONS
from edgecore.shared.models.attention import AttentionMetadata, paged_attention
from edgecore.shared.models.rope import apply_rope, rope_cos_sin
from edgecore.shared.models.layers import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                                  RowParallelLinear, VocabParallelEmbedding)
from edgecore.shared.models.parallel import tensor_parallel

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor

    from edgecore.shared.models.lora import LayerLora
    from edgecore.shared.models.layers import WeightSource

ROPE_TABLE_START = 1 << 15      # positions of the first RoPE tables; they grow on demand


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HF's arithmetic: normalize in float32, cast back, then scale. For float32 spelled out in place:
        # bit-identical to F.rms_norm, which on CPU is a composite of the same kernels plus dtype checks
        # and casts (about a third slower at one row).
        if x.dtype == torch.float32:
            return (x * x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()).mul_(self.weight)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class Attention(nn.Module):
    """`layer` indexes this process's KV cache, `global_layer` the model's layers (its attention form)."""

    def __init__(self, config: ModelConfig, layer: int, global_layer: int | None = None):
        super().__init__()
        self.layer = layer
        self.form = config.attention_of(layer if global_layer is None else global_layer)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.qkv_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, config.hidden_size,
                                        bias=config.o_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        if config.qk_norm:       # Qwen3: per-head RMSNorm of q and k before RoPE
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.sinks: torch.Tensor | None = None

    lora: LayerLora | None = None       # LoRA adapters' stacks (shared/models/lora.py), installed with the first adapter

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...], meta: AttentionMetadata) -> torch.Tensor:
        """`rope`: the (cos, sin) rows of this step's positions (what `rope_inputs` gave)."""
        cos, sin = rope[0], rope[1]
        t, d = x.shape[0], self.head_dim
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj.forward(x)
        if self.lora is not None:
            qkv = self.lora.apply("qkv_proj", x, qkv)
        qkv = qkv.view(t, heads + 2 * kv_heads, d)
        if hasattr(self, "q_norm"):
            qk = torch.cat([self.q_norm.forward(qkv[:, :heads]),
                            self.k_norm.forward(qkv[:, heads:heads + kv_heads])], 1)
        else:
            qk = qkv[:, :heads + kv_heads]
        qk = apply_rope(qk, cos, sin)     # one rotation for q and k together
        o = paged_attention(qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:], self.layer, meta, self.scale,
                            self.form, self.sinks)
        o = o.reshape(t, self.num_heads * d)
        if self.lora is not None:
            return self.lora.apply("o_proj", o, self.o_proj.forward(o))
        return self.o_proj.forward(o)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate: int | None = None):
        super().__init__()
        inter = intermediate or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=config.mlp_bias)
        self.act = ACTIVATIONS[config.hidden_act]

    lora: LayerLora | None = None       # as Attention.lora

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora = self.lora
        if lora is None:
            gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
            return self.down_proj.forward(self.act(gate) * up)
        gate, up = lora.apply("gate_up_proj", x, self.gate_up_proj.forward(x)).chunk(2, dim=-1)
        h = self.act(gate) * up
        return lora.apply("down_proj", h, self.down_proj.forward(h))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...], meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), rope, meta)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, layers: range | None,
                 make_layer: Callable[[ModelConfig, int, int], nn.Module]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # Layers this process owns (all of them unless pipeline-parallel).
        self.layer_ids = list(layers if layers is not None else range(config.num_hidden_layers))
        # Each layer addresses its KV cache by its index in this process (pipeline stages own a slice).
        self.layers = nn.ModuleList(make_layer(config, local, gid) for local, gid in enumerate(self.layer_ids))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # Checkpoint projection name → (packed parameter, shard id).
    packed: dict[str, tuple[str, int | str]] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    rope_cos: torch.Tensor      # [positions, D] float32 buffers (`rope_inputs`)
    rope_sin: torch.Tensor

    def __init__(self, config: ModelConfig, layers: range | None = None):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, layers, self.make_layer)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = self.rope_tables(config, min(config.max_position_embeddings, ROPE_TABLE_START))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    # ---- what a family changes ----------------------------------------------------------
    renames: tuple[tuple[str, str], ...] = ()    # checkpoint → module name parts (e.g. Llama 4's feed_forward)

    def rope_tables(self, config: ModelConfig, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(config, positions)

    def rope_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """What every attention layer gets about this step's positions: cos, sin [T, 1, D]. The tables start
        at `ROPE_TABLE_START` positions (Llama 4 declares 10M: 10 GB of tables) and double when needed."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self.rope_cos.shape[0]:
            size = min(max(need, 2 * self.rope_cos.shape[0]), max(need, self.config.max_position_embeddings))
            cos, sin = self.rope_tables(self.config, size)
            self.rope_cos, self.rope_sin = cos.to(self.rope_cos.device), sin.to(self.rope_sin.device)
        cos, sin = self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)
        return (cos, sin) if cos.dtype == dtype else (cos.to(dtype), sin.to(dtype))

    def make_layer(self, config: ModelConfig, local: int, layer: int) -> DecoderLayer:
        return DecoderLayer(config, self.make_attention(config, local, layer), self.make_mlp(config, layer))

    def make_attention(self, config: ModelConfig, local: int, layer: int) -> nn.Module:
        return Attention(config, local, layer)

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return MLP(config)

    def load_special(self, name: str, local_name: str, source: WeightSource) -> bool:
        """Load a checkpoint tensor that no parameter matches by name (stacked experts ...); `local_name` has
        this process's layer index. Returns whether it was used."""
        return False

    def special_names(self, param_name: str) -> list[str] | None:
        """Checkpoint names that fill a parameter `load_special` loads (None: the parameter's own name)."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Embed (unless `hidden` comes from a previous pipeline stage) and run this process's layers."""
        x = self.model.embed_tokens.forward(input_ids) if hidden is None else hidden
        rope = self.rope_inputs(positions, x.dtype)
        for layer in self.model.layers:
            x = layer.forward(x, rope, meta)
        return x

    def write_first_layer_kv(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Layer 0's K/V of these tokens into its cache slots (`meta.slot_mapping`), attending to nothing: a
        layer's K/V depend on its input rows alone, and layer 0's are the tokens' embeddings. `meta` has no
        decode rows or prefill chunks, so the attention only writes the cache (its output, zeros, is dropped)."""
        if self.model.layer_ids[0] != 0 or meta.prefills or meta.num_decode:
            raise ValueError("write_first_layer_kv needs the model's layer 0 and a write-only AttentionMetadata")
        x = self.model.embed_tokens.forward(input_ids)
        layer = cast(DecoderLayer, self.model.layers[0])     # what `make_layer` builds
        layer.self_attn.forward(layer.input_layernorm.forward(x), self.rope_inputs(positions, x.dtype), meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.forward(self.model.norm.forward(hidden))
        return logits if logits.dtype == torch.float32 else logits.float()

    def expected_weights(self) -> set[str]:
        """Checkpoint tensor names this process needs."""
        names = set()
        for name, _ in self.named_parameters(remove_duplicate=False):
            names.update(self._checkpoint_names(name))
        if self.config.tie_word_embeddings:
            names.discard("lm_head.weight")
        return names

    def _checkpoint_names(self, name: str) -> list[str]:
        special = self.special_names(name)
        name = self._to_checkpoint_layer(name)
        names = [self._to_checkpoint_layer(n) for n in special] if special is not None else None
        if names is None:
            names = self._packed_names(name)
        for ckpt, ours in self.renames:
            names = [n.replace(ours, ckpt) for n in names]
        return names

    def _packed_names(self, name: str) -> list[str]:
        for packed, _ in self.packed.values():
            if f".{packed}." in name:
                return [name.replace(packed, c) for c, (p, _) in self.packed.items() if p == packed]
        return [name]

    def _to_checkpoint_layer(self, name: str) -> str:
        # Local layer index → global index (differs under pipeline parallelism).
        parts = name.split(".")
        if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers":
            parts[2] = str(self.model.layer_ids[int(parts[2])])
        return ".".join(parts)

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]], threads: int = 0) -> set[str]:
        """Fill parameters from (checkpoint name, tensor or lazy slice). Returns the names used.

        With `threads`, sources that can decode themselves (`decode_jobs`, packed checkpoints) are
        decoded chunk by chunk straight into their parameters on a thread pool. The garbage collector
        is paused meanwhile: queueing a thousand jobs otherwise sets off full collections of a freshly
        imported process's heap, which hold the GIL while the decoding threads wait."""
        import gc
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(threads) if threads else None
        jobs: list[Future[None]] = []
        if pool is None:
            return self._load_weights(weights, pool, jobs)
        collecting = gc.isenabled()
        gc.disable()
        try:
            used = self._load_weights(weights, pool, jobs)
            for job in jobs:
                job.result()              # re-raises the first failure
            return used
        finally:                          # never leave decode jobs running behind an error
            pool.shutdown(wait=True, cancel_futures=True)
            if collecting:
                gc.enable()

    def _load_one(self, name: str, param: nn.Parameter, source: WeightSource, loader: Callable[..., None] | None,
                  shard: int | str | None) -> None:
        """Fill one parameter (or one shard of a packed parameter) from a tensor or lazy slice."""
        try:
            if loader is None:
                value = source if isinstance(source, torch.Tensor) else source[:]
                if tuple(value.shape) != tuple(param.shape):
                    raise ValueError(f"expected shape {tuple(param.shape)}, got {tuple(value.shape)}")
                param.data.copy_(value)
            elif shard is None:
                loader(param, source)
            else:
                loader(param, source, shard)
        except ValueError as exc:
            raise ValueError(f"tensor '{name}': {exc}") from None

    def skips(self, name: str) -> bool:
        """Checkpoint tensors this process passes over by design (the loader reports any other it does not
        use): RoPE buffers, a tied LM head's copy, layers it does not own (another pipeline stage's, or
        beyond the decoder)."""
        if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
            return True
        parts = name.split(".", 3)
        return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and \
            int(parts[2]) not in self.model.layer_ids

    def _load_weights(self, weights: Iterable[tuple[str, WeightSource]], pool: ThreadPoolExecutor | None,
                      jobs: list[Future[None]]) -> set[str]:
        params = dict(self.named_parameters(remove_duplicate=False))
        local = {gid: i for i, gid in enumerate(self.model.layer_ids)}
        used: set[str] = set()
        for name, source in weights:
            local_name = name
            for ckpt, ours in self.renames:
                local_name = local_name.replace(ckpt, ours)
            if self.skips(name):
                continue
            parts = local_name.split(".")
            if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers":
                parts[2] = str(local[int(parts[2])])
            target, shard = ".".join(parts), None
            for ckpt, (packed, shard_id) in self.packed.items():
                if f".{ckpt}." in target:
                    target, shard = target.replace(ckpt, packed), shard_id
                    break
            param = params.get(target)
            if param is None:
                if self.load_special(name, ".".join(parts), source):
                    used.add(name)
                continue
            owner = self.get_submodule(target.rsplit(".", 1)[0])
            loader = getattr(owner, "weight_loader", None)
            if pool is not None and hasattr(source, "decode_jobs"):
                dest = _whole_block(param, owner, loader, shard)
                decoders = source.decode_jobs(dest) if dest is not None else None
                if decoders is not None:    # straight into the parameter, chunks spread over the pool
                    jobs += [pool.submit(job) for job in decoders]
                else:
                    jobs.append(pool.submit(self._load_one, name, param, source, loader, shard))
            else:
                self._load_one(name, param, source, loader, shard)
            used.add(name)
        return used


def _whole_block(param: torch.Tensor, owner: nn.Module, loader: Callable[..., None] | None,
                 shard: int | str | None) -> torch.Tensor | None:
    """The contiguous part of `param` that one checkpoint tensor fills whole, if there is one: the
    parameter itself, or one shard's rows of a merged projection, when a single rank holds them all."""
    if loader is None or (tensor_parallel().size == 1 and shard is None):
        return param.data
    shard_rows = getattr(owner, "shard_rows", None)    # a merged projection's, taking its own kind of shard id
    if tensor_parallel().size != 1 or shard_rows is None:
        return None
    _, offset, size = shard_rows(shard)
    return param.data[offset:offset + size]
