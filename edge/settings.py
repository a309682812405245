"""`EdgeSettings`: every setting of an edge node, written once (flag, type, default, help).

Life cycle: `edgecore edge` adds one flag per field (`shared/settings.add_arguments`, edge/cli.py) and builds
an `EdgeSettings` from the parsed flags; `run_edge` checks it and turns it into the runtime `EdgeConfig`
(files read, addresses parsed, TLS context made). What starts an edge renders one with
`shared/settings.to_argv`: the frontend for its engine process, `edgecore up` (deploy/launcher.py) and the
Kubernetes manifests (deploy/k8s_workloads.py), both through deploy/node_settings.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from edgecore.shared.node import node_settings as common
from edgecore.shared.node.node_settings import Dtype, Quantize
from edgecore.shared.node.settings import setting


@dataclass(frozen=True, kw_only=True)
class EdgeSettings:
    model: str | None = common.model()
    dtype: Dtype = common.dtype()
    device: str | None = common.device()
    compile: bool = common.compile_decode()
    quantize: Quantize | None = common.quantize()
    speculative_config: str | None = common.speculative_config()
    draft_model: str | None = common.draft_model()
    core: tuple[str, ...] = setting((), metavar="HOST:PORT",
                                    help="a core's protocol address (repeatable); none: prefill locally")
    core_dns: tuple[str, ...] = setting((), metavar="NAME:PORT", help="a DNS name whose addresses are cores (e.g. "
                                        "a headless Service), re-resolved periodically")
    peer: tuple[str, ...] = setting((), metavar="HOST:PORT", help="a peer edge's --peer-listen address (repeatable): "
                                    "a prompt whose cached prefix it holds pulls that KV from it when predicted "
                                    "faster than computing it")
    peer_listen: str | None = setting(None, metavar="HOST:PORT", help="serve this edge's cached KV to peer edges "
                                      "here (same authentication as the link to cores; default: not served)")
    listen: str = setting("127.0.0.1:8000", metavar="HOST:PORT", help="HTTP address")
    api_key_file: str | None = setting(None, help="API keys, one per line (or EDGECORE_API_KEYS)")
    tenants: str | None = setting(None, metavar="FILE", help="tenants (TOML, shared/node/tenants.py): each tenant's API "
                                  "key digests, rate and concurrency limits, engine weight, priority band and "
                                  "models; other keys get a 401 (those of --api-key-file stay valid, unlimited); "
                                  "re-read when it changes")
    secret_file: str | None = setting(None, help="cluster secret file (or EDGECORE_SECRET)")
    credential: str | None = common.credential()
    authority: str | None = common.authority()
    revocations: str | None = common.revocations()
    served_model_name: str | None = setting(None, help="model id in the API (default: directory name)")
    lora: tuple[str, ...] = common.lora()
    max_lora_rank: int = common.max_lora_rank()
    admin_key_file: str | None = common.admin_key_file()
    name: str = setting("edge")
    codec: tuple[str, ...] | None = setting(None, metavar="NAME", help="allowed KV codec(s), in preference order "
                                            "(default lossless); lossy codecs (fp8, int8, int4, q4e, q3e, q2e) "
                                            "only when listed")
    adaptive: bool = setting(False, help="pick the codec per request from link bandwidth")
    ttft_target_ms: float | None = setting(None)
    kv_quality_budget: float | None = setting(
        None, metavar="PPL", help="with --adaptive: the largest relative perplexity increase a codec may cost, "
        "read from the rate-distortion curve (default 0.01, i.e. 1%%; 0 allows only codecs measured lossless)")
    kv_curve: str | None = setting(None, metavar="FILE", help="with --adaptive: this model's rate-distortion curve, "
                                   "a bench/kv_rd.py result (default: the bundled model's, shipped in "
                                   "edge/codec_policy.py)")
    layer0_budget_macs: float = setting(
        1e9, metavar="N", aliases=("--first-layer-macs",), help="lossy codecs: compute layer 0's KV here (it depends on the prompt's tokens alone) "
        "instead of receiving it, when that costs at most N multiply-adds (default 1e9; 0: always receive)")
    core_routing: Literal["predicted", "rtt"] = setting(
        "predicted", help="how a core is picked for a prefill: 'predicted' (default), the least predicted time to "
        "first token for the prompt (round trip, the core's prefill queue and the prompt tokens its prefix cache "
        "lacks, from the digests it sends); 'rtt', round trip and requests in flight only")
    local_prefill_below: str = setting(
        "32", metavar="N|auto", help="prompts (or uncached suffixes) shorter than N tokens prefill at the edge; "
        "'auto' uses the crossover measured from this edge's own and the cores' prefill times")
    max_concurrent: int = setting(256, help="sequences (prompts × n, all requests together) in flight before 503 "
                                            "(default 256)")
    max_seqs_per_request: int = setting(64, help="sequences (prompts × n) one request may ask for; more get a 400 "
                                                 "(default 64)")
    max_connections: int = common.max_connections()
    header_timeout: float = common.header_timeout()
    body_timeout: float = common.body_timeout()
    keepalive_timeout: float = common.keepalive_timeout()
    drain_timeout: float = common.drain_timeout()
    otlp_endpoint: str | None = common.otlp_endpoint()
    transfer_timeout: float = setting(30.0, help="seconds without KV progress before giving up on a core (then "
                                                 "retry or prefill locally)")
    handover_max_tokens: int = setting(64, help="decode handover: tokens after the first a core may decode and "
                                                "stream while the KV travels, before this edge takes over (0: wait "
                                                "for the KV, the old mode)")
    max_body_mb: float = setting(8.0, help="request body limit")
    kv_cache_memory: str = common.kv_cache_memory()
    kv_blocks: int | None = common.kv_blocks()
    kv_cache_dtype: Literal["auto", "int8", "fp8"] = setting(
        "auto", help="the KV pool's values: 'auto' the model's dtype; 'int8' or 'fp8' (e4m3) one byte each with a "
        "scale per token and head, about twice the tokens per GiB of a bf16 pool (four times float32); "
        "attention reads them dequantized; not for MLA models, and --compile then serves eagerly")
    kv_resident_memory: str | None = common.kv_resident_memory()
    kv_tier_dir: str | None = common.kv_tier_dir()
    kv_tier_size: str = common.kv_tier_size()
    kv_tier_codec: str = common.kv_tier_codec()
    model_from: str | None = setting(None, metavar="CORE_URL", help="fetch the packed model from a core's control "
                                     "port (e.g. http://core:7101), resuming and verifying, then serve it")
    model_from_key_file: str | None = setting(None, help="API key file for --model-from's core (first key; "
                                              "default: the first of --api-key-file)")
    model_cache: str | None = setting(None, help="where fetched models are kept (default ~/.cache/edgecore/models)")
    tls_cert: str | None = setting(None, metavar="PEM", help="serve the API over HTTPS with this certificate "
                                   "(chain); re-read when it changes")
    tls_key: str | None = setting(None, metavar="PEM", help="the HTTPS certificate's private key")
    link_tls_ca: str | None = setting(None, help="CA for the cores' certificates: TLS around the (already "
                                      "encrypted) link to cores")
    link_tls_cert: str | None = setting(None, help="client certificate for mutual TLS on the link")
    link_tls_key: str | None = setting(None)
    engine_in_process: bool = setting(False, help="run the engine inside the HTTP process instead of a process of "
                                                  "its own (simpler to debug; slower under load, as HTTP and the "
                                                  "engine then share one GIL)")
