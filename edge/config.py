"""`EdgeConfig`: what an `EdgeNode` (edge/node.py) runs with, built by `run_edge` (edge/cli.py) from the flags.

Life cycle: made once at start; the node and the parts it builds read it, nothing changes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from ssl import SSLContext

from edgecore.edge.codec_policy import DEFAULT_QUALITY_BUDGET
from edgecore.protocol.credentials import NodeIdentity, Trust
from edgecore.protocol.transport import Timeouts
from edgecore.shared.models.config import CacheConfig, EngineConfig
from edgecore.shared.models.lora_files import MAX_LORA_RANK


@dataclass
class EdgeConfig:
    model_dir: str
    cores: list[tuple[str, int]] = field(default_factory=list)
    core_dns: list[tuple[str, int]] = field(default_factory=list)   # names resolved to cores (headless Service)
    peers: list[tuple[str, int]] = field(default_factory=list)      # peer edges to pull cached KV from (--peer)
    peer_listen: tuple[str, int] | None = None                      # serve cached KV to peer edges here
    secret: bytes | None = None
    identity: NodeIdentity | None = None      # this edge's credential and whom it trusts (per-node credentials)
    trust: Trust | None = None
    dtype: str = "auto"
    device: str = "cpu"
    codecs: list[str] = field(default_factory=lambda: ["lossless"])   # allowed; lossy only if listed
    adaptive: bool = False
    ttft_target_ms: float | None = None
    kv_quality_budget: float = DEFAULT_QUALITY_BUDGET   # adaptive: max perplexity increase (edge/codec_policy.py)
    kv_curve: dict | None = None                        # adaptive: the model's curve (None: the bundled model's)
    local_prefill_below: int | None = 32   # None: measured crossover (fixed 32 until measured)
    core_routing: str = "predicted"        # "rtt": cores ranked by round trip and load, their digests unread
    transfer_timeout: float = 30.0
    max_core_attempts: int = 2
    handover_tokens: int = 64          # tokens after the first a core may decode while the KV travels; 0: off
    layer0_budget_macs: float = 1e9     # lossy transfers: most multiply-adds spent computing layer 0's KV here
                                      # instead of receiving it (0: always receive; shared/kv/transfer.py)
    cache: CacheConfig = field(default_factory=CacheConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    engine_threads: int | None = None   # intra-op threads of the engine thread (None: leave as they are)
    timeouts: Timeouts = field(default_factory=Timeouts)
    name: str = "edge"
    ssl: SSLContext | None = None
    served_model_name: str = ""       # the `model_name` label of the metrics (default: the directory's name)
    loras: list[tuple[str, str]] = field(default_factory=list)     # LoRA adapters loaded at start: (name, dir)
    max_lora_rank: int = MAX_LORA_RANK
