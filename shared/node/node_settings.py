"""The settings both node kinds take, written once: model, dtype, device, `--compile`, the KV cache's size and
the HTTP server's limits.

Life cycle: each function returns a fresh `setting` field (`shared/node/settings.py`) that `EdgeSettings` and
`CoreSettings` declare under the same name and type; from there they are flags, parsed values and rendered
argv like every other setting of the node.
"""

from __future__ import annotations

from typing import Any, Literal

from edgecore.shared.node.http_server import ServerLimits
from edgecore.shared.kv.budget import DEFAULT_KV_CACHE_MEMORY
from edgecore.shared.node.settings import setting

Dtype = Literal["auto", "bf16", "fp16", "fp32"]
Quantize = Literal["int8", "int4"]
_LIMITS = ServerLimits()


def model() -> Any:
    """model: str | None"""
    return setting(None, metavar="DIR", help="Hugging Face model directory, or a .gguf file (F32, F16, BF16, Q8_0, "
                                             "Q4_0, Q4_K, Q6_K tensors; default: the bundled pydoc-llama)")


def dtype() -> Any:
    """dtype: Dtype"""
    return setting("auto", help="weight and KV dtype (auto: fp32 on CPU, bf16 on CUDA)")


def device() -> Any:
    """device: str | None"""
    return setting(None, help="cpu or cuda (default: cuda when available)")


def compile_decode() -> Any:
    """compile: bool"""
    return setting(False, help="compile the decode step with torch.compile (CPU, small float32 Llama-family "
                               "models: about 1.3-1.9x faster steps at 1-64 sequences; a minute of start-up the "
                               "first time, cached after; needs a C++ compiler)")


def speculative_config() -> Any:
    """speculative_config: str | None"""
    return setting(None, metavar="JSON", help="speculative decoding by prompt lookup, as vLLM's flag: e.g. "
                   "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
                   "\"prompt_lookup_min\": 2}', or a draft model: '{\"method\": \"draft_model\", \"model\": DIR}' "
                   "(greedy and seeded output unchanged; requests with logprobs, "
                   "penalties, biases or a grammar decode plainly; default: off)")


def draft_model() -> Any:
    """draft_model: str | None"""
    return setting(None, metavar="DIR", help="speculative decoding with this small model drafting (same tokenizer "
                   "as --model; the same as --speculative-config with method draft_model; it computes its own KV of "
                   "each prompt, none crosses a link; default: none)")


def quantize() -> Any:
    """quantize: Quantize | None"""
    return setting(None, help="quantize the float weights at load, weight-only (CPU): int8 with a scale per "
                              "output row, or int4 with a scale and zero per 32 inputs; matmuls read them packed "
                              "(default: keep the checkpoint's weights)")


def kv_cache_memory() -> Any:
    """kv_cache_memory: str"""
    return setting(DEFAULT_KV_CACHE_MEMORY, metavar="SIZE",
                   help="memory for the KV cache, e.g. 512MiB or 4GiB: the pool holds as many 16-token blocks as "
                        f"fit (default {DEFAULT_KV_CACHE_MEMORY}); on CPU it becomes resident only as it fills")


def kv_resident_memory() -> Any:
    """kv_resident_memory: str | None"""
    return setting(None, metavar="SIZE",
                   help="resident bound for the KV cache, e.g. 256MiB: once the pool has touched this much "
                        "memory, cached prefixes are evicted (least recently used first) before a new page is "
                        "touched, so resident KV levels off here under unique traffic (fewer prefixes stay cached); "
                        "live sequences may still take the whole --kv-cache-memory (default: the whole "
                        "--kv-cache-memory, i.e. no bound)")


DEFAULT_KV_TIER_SIZE = "8GiB"


def kv_tier_dir() -> Any:
    """kv_tier_dir: str | None"""
    return setting(None, metavar="DIR",
                   help="disk KV tier: full KV blocks evicted from the prefix cache are kept in this directory "
                        "(created if missing), compressed, and read back instead of recomputed, also after a "
                        "restart; one node per directory (default: none)")


def kv_tier_size() -> Any:
    """kv_tier_size: str"""
    return setting(DEFAULT_KV_TIER_SIZE, metavar="SIZE",
                   help="with --kv-tier-dir: the most bytes its files may take, e.g. 500M or 20GiB (K/M/G are "
                        "powers of 1000, KiB/MiB/GiB of 1024); least recently used blocks are deleted first "
                        f"(default {DEFAULT_KV_TIER_SIZE})")


def kv_tier_codec() -> Any:
    """kv_tier_codec: str"""
    return setting("lossless", metavar="CODEC",
                   help="with --kv-tier-dir: the KV codec its blocks are stored with (default lossless: "
                        "bit-exact; a lossy one, e.g. fp8 or q4e, stores more blocks in the same size but "
                        "changes what is read back)")


def kv_blocks() -> Any:
    """kv_blocks: int | None"""
    return setting(None, metavar="N", help="KV cache blocks of 16 tokens, instead of sizing the cache from "
                                           "--kv-cache-memory")


def max_connections() -> Any:
    """max_connections: int"""
    return setting(_LIMITS.max_connections, help="open HTTP connections; more get a 503 and are closed "
                                                 f"(default {_LIMITS.max_connections})")


def header_timeout() -> Any:
    """header_timeout: float"""
    return setting(_LIMITS.header_timeout, help="seconds a client has to send complete request headers "
                                                f"(default {_LIMITS.header_timeout:g})")


def body_timeout() -> Any:
    """body_timeout: float"""
    return setting(_LIMITS.body_timeout, help="seconds a client has to send a JSON request body "
                                              f"(default {_LIMITS.body_timeout:g})")


def keepalive_timeout() -> Any:
    """keepalive_timeout: float"""
    return setting(_LIMITS.keepalive_timeout, help="seconds an idle kept-alive connection stays open "
                                                   f"(default {_LIMITS.keepalive_timeout:g})")


def credential() -> Any:
    """credential: str | None"""
    return setting(None, metavar="FILE", help="this node's credential (edgecore keys issue): it proves who the "
                                              "node is on the link, with or without a cluster secret")


def authority() -> Any:
    """authority: str | None"""
    return setting(None, metavar="FILE", help="the cluster authorities peers' credentials must be issued by "
                                              "(authority.pub; several lines during a rollover)")


def revocations() -> Any:
    """revocations: str | None"""
    return setting(None, metavar="FILE", help="revoked credential serials, one per line; re-read when it changes "
                                              "(a revoked peer's connections close within seconds)")


def lora() -> Any:
    """lora: tuple[str, ...]"""
    return setting((), metavar="NAME=DIR",
                   help="serve a LoRA adapter (PEFT: adapter_config.json + adapter_model.safetensors; q/k/v/o and "
                        "gate/up/down projections) as model NAME, parent the base model (repeatable); one that does "
                        "not fit the model stops the start with one line")


def max_lora_rank() -> Any:
    """max_lora_rank: int"""
    return setting(64, metavar="R", help="largest LoRA rank an adapter may have (default 64)")


def admin_key_file() -> Any:
    """admin_key_file: str | None"""
    return setting(None, metavar="FILE", help="the admin key (first line), which alone may POST "
                                              "/v1/load_lora_adapter and /v1/unload_lora_adapter; without it those "
                                              "routes answer 404 (as vLLM's without runtime LoRA updating)")


def otlp_endpoint() -> Any:
    """otlp_endpoint: str | None"""
    return setting(None, metavar="URL", help="send OpenTelemetry traces (OTLP over HTTP, protobuf) to this collector, "
                                             "e.g. http://otel-collector:4318: one trace per request across edge and "
                                             "core, W3C traceparent honoured; needs edgecore[otel] (default: off)")


DRAIN_TIMEOUT = 30.0


def drain_timeout() -> Any:
    """drain_timeout: float"""
    return setting(DRAIN_TIMEOUT, metavar="SECONDS",
                   help="on SIGTERM, stop taking new work and finish what is in flight for at most this long, then "
                        f"exit 0; a second SIGTERM exits at once; 0: exit at once (default {DRAIN_TIMEOUT:g})")


def check_drain_timeout(seconds: float) -> None:
    """--drain-timeout in range (one-line ConfigError otherwise)."""
    from edgecore.shared.errors import ConfigError
    if not 0 <= seconds <= 86400:      # NaN too
        raise ConfigError(f"--drain-timeout must be between 0 and 86400 seconds, not {seconds:g}")
