"""The KV layout a model caches and ships: described once, used by the pool, the wire and the codecs.

Life cycle: `KVLayout.of(config, kv_heads)` is derived from the model config when an engine builds its
pool; the pool allocates from it, the KV sender/receiver and `shared/kv/wire.py` read plane shapes from
it, and it names the two planes a KV chunk carries (`plane_names`), which is how codecs see them.

- `heads` (dense, GQA, MQA): per layer and token, K and V of each KV head — planes
  "k" and "v", both [tokens, kv_heads, head_dim].
- `latent` (MLA: DeepSeek-V2/V3, Kimi K2): per layer and token, one latent vector shared by every
  query head — plane "latent" (the compressed KV after its RMSNorm, kv_lora_rank values) and plane
  "rope" (the shared rotary key after RoPE, qk_rope_head_dim values), each [tokens, 1, width].
  The pool stores them side by side, cat(latent, rope), in one tensor per layer. They sit in the
  K and V positions of the pool's read/write calls and of a KV chunk (plane 0, plane 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgecore.shared.models.config import ModelConfig


@dataclass(frozen=True)
class KVLayout:
    kind: str              # "heads" | "latent"
    heads: int             # KV heads this process caches (1 for latent)
    k_dim: int             # width of plane 0 (head_dim, or kv_lora_rank)
    v_dim: int             # width of plane 1 (head_dim, or qk_rope_head_dim)

    @classmethod
    def of(cls, config: ModelConfig, kv_heads: int | None = None) -> KVLayout:
        if config.mla is not None:
            return cls("latent", 1, config.mla.kv_lora_rank, config.mla.qk_rope_head_dim)
        return cls("heads", kv_heads or config.num_key_value_heads, config.head_dim, config.head_dim)

    @property
    def latent(self) -> bool:
        return self.kind == "latent"

    @property
    def plane_names(self) -> tuple[str, str]:
        return ("latent", "rope") if self.latent else ("k", "v")

    @property
    def values_per_token(self) -> int:
        """Values cached per token per layer (this process's heads)."""
        return self.heads * (self.k_dim + self.v_dim)

    def bytes_per_token(self, layers: int, value_bytes: int = 2) -> int:
        return layers * self.values_per_token * value_bytes
