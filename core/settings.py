"""`CoreSettings`: every setting of a core node, written once (flag, type, default, help).

Life cycle: `edgecore core` adds one flag per field (`shared/settings.add_arguments`, core/cli.py) and builds
a `CoreSettings` from the parsed flags; `run_core` checks it and turns it into the runtime `CoreConfig`
(files read, addresses parsed, TLS context made). What starts a core renders one with
`shared/settings.to_argv`: `edgecore up` (deploy/launcher.py) and the Kubernetes manifests
(deploy/k8s_workloads.py), both through deploy/node_settings.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgecore.shared.node import node_settings as common
from edgecore.shared.node.node_settings import Dtype, Quantize
from edgecore.shared.node.settings import setting


@dataclass(frozen=True, kw_only=True)
class CoreSettings:
    model: str | None = common.model()
    dtype: Dtype = common.dtype()
    device: str | None = common.device()
    quantize: Quantize | None = common.quantize()
    lora: tuple[str, ...] = common.lora()
    max_lora_rank: int = common.max_lora_rank()
    listen: str = setting("127.0.0.1:7100", metavar="HOST:PORT", help="protocol address")
    http: str = setting("127.0.0.1:7101", metavar="HOST:PORT", help="control port address")
    secret_file: str | None = setting(None, help="cluster secret file (or EDGECORE_SECRET)")
    credential: str | None = common.credential()
    authority: str | None = common.authority()
    revocations: str | None = common.revocations()
    name: str = setting("core", help="node name shown to peers and in logs")
    lease: float = setting(30.0, help="seconds a finished prefill's KV waits for the edge's Ack (default 30)")
    drain_timeout: float = common.drain_timeout()
    otlp_endpoint: str | None = common.otlp_endpoint()
    max_batched_tokens: int = setting(2048, help="prefill token budget per step")
    kv_cache_memory: str = common.kv_cache_memory()
    kv_blocks: int | None = common.kv_blocks()
    kv_resident_memory: str | None = common.kv_resident_memory()
    kv_tier_dir: str | None = common.kv_tier_dir()
    kv_tier_size: str = common.kv_tier_size()
    kv_tier_codec: str = common.kv_tier_codec()
    tls_cert: str | None = setting(None, metavar="PEM", help="serve the control port over HTTPS with this "
                                   "certificate (chain); re-read when it changes")
    tls_key: str | None = setting(None, metavar="PEM", help="the HTTPS certificate's private key")
    link_tls_cert: str | None = setting(None, help="TLS around the (already encrypted) protocol port: its "
                                        "certificate")
    link_tls_key: str | None = setting(None)
    link_tls_ca: str | None = setting(None, help="CA to verify edge certificates on the link (mutual TLS)")
    data_dir: str | None = setting(None, help="batch API storage (default: ./edgecore-data/NAME)")
    api_key_file: str | None = setting(None, help="API keys for the control port's /v1/ routes (batch API, "
                                       "contexts, model downloads) and /stats; required when --http is not a "
                                       "loopback address")
    push_edge: tuple[str, ...] = setting((), metavar="NAME=URL", help="an edge contexts may be pushed to (POST "
                                         "/v1/contexts/ID/push {\"edges\": [NAME]}), by its API base URL "
                                         "(repeatable); pushes go nowhere else")
    push_api_key_file: str | None = setting(None, help="the API key the core presents to --push-edge edges (first "
                                            "line of the file)")
    max_connections: int = common.max_connections()
    header_timeout: float = common.header_timeout()
    body_timeout: float = common.body_timeout()
    keepalive_timeout: float = common.keepalive_timeout()
    max_file_mb: float = setting(200.0, help="upload limit of /v1/files")
    tp: int = setting(1, help="tensor-parallel ranks (one process each)")
    pp: int = setting(1, help="pipeline stages (one process per stage and TP rank)")
    pp_split: str | None = setting(None, metavar="N,N,...", help="layers per pipeline stage")
    pp_micro_batches: int = setting(0, help="micro-batches per step so pipeline stages overlap (default: one per "
                                            "stage)")
    kv_after_prefill: bool = setting(False, help="send a request's KV only once its prefill has finished (the "
                                                 "baseline that layer-wise streaming is measured against)")
    rendezvous: str = setting("127.0.0.1:0", metavar="HOST:PORT", help="parallel core: where the ranks' rendezvous "
                              "(TCP store) listens; gloo's own sockets use the same host's interface (default "
                              "127.0.0.1, any free port)")
    external_workers: bool = setting(False, help="parallel core: the worker ranks are started elsewhere (`edgecore "
                                     "core-worker --master HOST:PORT --rank R`, e.g. the worker pods of a "
                                     "LeaderWorkerSet) and join at --rendezvous (give it a port); this process "
                                     "starts none and sends every rank's KV itself")
    gather_kv: bool = setting(False, help="parallel core: rank 0 gathers every rank's KV after the prefill and "
                                          "sends it, instead of each rank streaming its own on its own port (when "
                                          "edges can reach only --listen)")
    handover_max_tokens: int = setting(64, help="decode handover: tokens after the first this core decodes and "
                                                "streams for an edge while its KV travels (the edge then takes "
                                                "over); 0 turns core decoding off")
    handover_max_seconds: float = setting(10.0, help="decode handover: seconds after the first token this core "
                                                     "decodes for an edge at most")
    handover_refuse_waiting: int = setting(8, help="decode handover: refuse to decode for edges while this many "
                                                   "requests wait here (prefill pressure); the edge then waits for "
                                                   "the KV")
    max_inflight_per_connection: int = setting(64, help="requests one edge connection may have in flight; beyond "
                                                        "it a request gets Error OVERLOADED (the edge goes elsewhere)")
    max_running_per_connection: int | None = setting(None, help="requests of one edge connection in the engine at "
                                                                "once, the rest waiting here (default: half the "
                                                                "engine's sequences, at most the in-flight cap)")
    outbox_mb: float = setting(64.0, help="KV one edge connection may have copied and queued for sending; beyond "
                                          "it the KV stays in the pool until the connection drains")
