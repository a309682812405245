"""Topology files: regions, their core and edge nodes, links between regions, model, secrets, Kubernetes.

Life cycle: `load_topology(path)` parses TOML (tomllib), converts it into the
schema below (msgspec Structs with constraints: types, ranges, names, known
keys), checks what spans tables (unique node names, links between known
regions), and returns a frozen `Topology`. Any problem raises `TopologyError`
naming the key and its line in the file (`schema_errors` explains msgspec's
error path, `toml_lines` finds the line). deploy/topology.toml documents
every key.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, NoReturn

import msgspec
from msgspec import Meta

from edgecore.deploy.schema_errors import explain
from edgecore.deploy.toml_lines import TomlLines
from edgecore.shared.errors import ConfigError

NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?\Z"     # \Z: `$` would let a final newline in
NAME_WORDS = "a valid name (lowercase letters, digits, '-'; at most 32, no '-' at either end)"
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?\Z"
RELATIVE_PATTERN = r"^(?!/)(?!.*\.\.)[A-Za-z0-9._/-]+\Z"
CORE_DNS_PATTERN = r"\{service\}"
IMAGE_PATTERN = r"^[a-z0-9][A-Za-z0-9._/:@-]*\Z"     # an image reference: no spaces, not empty
LABEL_PATTERN = r"^([a-z0-9.-]{1,253}/)?[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?\Z"
_WORDS = {NAME_PATTERN: NAME_WORDS,
          QUANTITY_PATTERN: "a Kubernetes quantity (e.g. 500m, 2, 8Gi)",
          RELATIVE_PATTERN: "a relative path without '..'",
          LABEL_PATTERN: "a Kubernetes label key",
          CORE_DNS_PATTERN: "a DNS name template containing {service}",
          IMAGE_PATTERN: "an image reference (e.g. registry.example.com/edgecore:0.1.0)"}

Name = Annotated[str, Meta(pattern=NAME_PATTERN)]
Port = Annotated[int, Meta(ge=1, le=65535)]
Count = Annotated[int, Meta(ge=1, le=2 ** 31 - 1)]     # Kubernetes counts are int32
Quantity = Annotated[str, Meta(pattern=QUANTITY_PATTERN)]
Labels = dict[Annotated[str, Meta(pattern=LABEL_PATTERN)], str]
Image = Annotated[str, Meta(pattern=IMAGE_PATTERN)]
Codec = Literal["raw", "lossless", "fp8", "int8", "int4"]
OtlpUrl = Annotated[str, Meta(pattern=r"^https?://[^\s/]+(/\S*)?$", max_length=2048)]   # `--otlp-endpoint`


class TopologyError(ConfigError):
    pass


class _Spec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Every table: unknown keys are errors, values are checked, nothing is coerced from strings."""


class Resources(_Spec, frozen=True):
    cpu: Quantity = "2"                         # requested CPU
    memory: Quantity = "8Gi"                    # requested memory
    memory_limit: Quantity | None = None        # limit (default: twice the request's number)
    gpu: Annotated[int, Meta(ge=0)] | None = None   # nvidia.com/gpu; cores: default tp*pp when device = cuda


class CoreSpec(_Spec, frozen=True):
    name: Name | None = None
    device: Literal["cpu", "cuda"] = "cpu"
    tp: Count = 1
    pp: Count = 1
    port: Port = 7100
    http_port: Port = 7101
    replicas: Count = 1
    drain_timeout: Annotated[float, Meta(ge=0, le=86400)] = 30.0     # `--drain-timeout`: SIGTERM finishes in-flight work
    otlp_endpoint: OtlpUrl | None = None     # `--otlp-endpoint`: OpenTelemetry traces to this collector
    resources: Resources = msgspec.field(default_factory=Resources)


class EdgeSpec(_Spec, frozen=True):
    name: Name | None = None
    port: Port = 8000
    replicas: Count = 1
    max_replicas: Count = 4
    codecs: tuple[Codec, ...] = ("lossless",)
    transfer_timeout: Annotated[float, Meta(ge=0.1, le=86400)] = 30.0   # seconds without KV progress before giving up
    compile: bool = False           # `edgecore edge --compile`: the decode step through torch.compile
    drain_timeout: Annotated[float, Meta(ge=0, le=86400)] = 30.0     # `--drain-timeout`: SIGTERM lets streams finish
    otlp_endpoint: OtlpUrl | None = None     # `--otlp-endpoint`: OpenTelemetry traces to this collector
    peer_port: Port | None = None   # `--peer-listen`: serve cached KV here to the edges of this and linked regions,
                                    # which pull from it (`--peer`); `edgecore up` only (not rendered for Kubernetes)
    resources: Resources = msgspec.field(default_factory=lambda: Resources(memory="4Gi"))


class TopologyCore(CoreSpec, frozen=True, kw_only=True):
    name: Name
    region: Name

    @property
    def gpus(self) -> int:
        """GPUs the core's pod requests: the topology's value, else one per rank on cuda."""
        if self.resources.gpu is not None:
            return self.resources.gpu
        return self.tp * self.pp if self.device == "cuda" else 0


class TopologyEdge(EdgeSpec, frozen=True, kw_only=True):
    name: Name
    region: Name


class Link(_Spec, frozen=True):
    a: Name = msgspec.field(name="from")
    b: Name = msgspec.field(name="to")
    delay_ms: Annotated[float, Meta(ge=0, le=60000)] = 0.0        # (bounds: no inf, nothing tc refuses)
    jitter_ms: Annotated[float, Meta(ge=0, le=60000)] = 0.0
    bandwidth_mbit: Annotated[float, Meta(ge=0.001, le=1e6)] | None = None
    loss_pct: Annotated[float, Meta(ge=0, lt=100)] = 0.0


class ModelSpec(_Spec, frozen=True):
    path: str | None = None                     # default: the bundled model
    name: str | None = None                     # model id in the API (default: the directory name)
    image: Image = "edgecore:latest"            # image of edges and CPU cores (`make image`)
    cuda_image: Image = "edgecore:latest-cuda"  # image of cores with device = cuda


class SecretsSpec(_Spec, frozen=True):
    cluster_secret_file: str | None = None
    api_keys_file: str | None = None
    kubernetes_secret: Name = "edgecore-secrets"


class RegionSpec(_Spec, frozen=True):
    cores: list[CoreSpec] = []
    edges: list[EdgeSpec] = []


class SecretFiles(_Spec, frozen=True):
    """Files the kustomize secretGenerator reads, relative to the rendered base/ directory."""
    cluster_secret: Annotated[str, Meta(pattern=RELATIVE_PATTERN)] = "secrets/cluster-secret"
    api_keys: Annotated[str, Meta(pattern=RELATIVE_PATTERN)] = "secrets/api-keys"


class Prometheus(_Spec, frozen=True):
    namespace: Name = "monitoring"
    pod_labels: Annotated[Labels, Meta(min_length=1)] = msgspec.field(
        default_factory=lambda: {"app.kubernetes.io/name": "prometheus"})
    url: str = "http://prometheus-operated.monitoring.svc:9090"      # for KEDA's prometheus trigger
    service_monitor_labels: Labels = {}         # labels your Prometheus' serviceMonitorSelector wants


class Autoscaling(_Spec, frozen=True):
    mode: Literal["keda", "hpa"] = "keda"       # hpa: autoscaling/v2 Pods metric (prometheus-adapter)
    queue_target: Annotated[float, Meta(gt=0, le=1e6)] = 4.0   # edgecore:num_requests_waiting per edge replica


class BatchClient(_Spec, frozen=True, kw_only=True):
    name: Name
    namespace: Name | None = None               # default: edgecore's own namespace
    pod_labels: Annotated[Labels, Meta(min_length=1)]


class Kubernetes(_Spec, frozen=True):
    namespace: Name = "edgecore"
    models_pvc_size: Quantity = "20Gi"          # per region with cores, when the model is not the bundled one
    models_access_mode: Literal["ReadWriteMany", "ReadOnlyMany", "ReadWriteOnce"] = "ReadWriteMany"
    data_pvc_size: Quantity = "10Gi"            # per core replica: batch files and jobs
    storage_class: str | None = None            # default storage class when unset
    startup_seconds: Annotated[int, Meta(ge=10, le=86400)] = 600      # model loading before liveness counts
    core_dns: Annotated[str, Meta(pattern=CORE_DNS_PATTERN)] = "{service}"
    tls: bool = False           # HTTPS on the HTTP ports from a kubernetes.io/tls Secret per node (docs/deploy.md)
    secret_files: SecretFiles = msgspec.field(default_factory=SecretFiles)
    prometheus: Prometheus = msgspec.field(default_factory=Prometheus)
    autoscaling: Autoscaling = msgspec.field(default_factory=Autoscaling)
    batch_clients: list[BatchClient] = []


class Slo(_Spec, frozen=True):
    ttft_ms: Annotated[float, Meta(gt=0, le=1e7)] | None = None     # time to first token at `percentile`
    tpot_ms: Annotated[float, Meta(gt=0, le=1e7)] | None = None     # time per output token at `percentile`
    percentile: Literal["p50", "p90", "p99"] = "p99"


class Failure(_Spec, frozen=True, kw_only=True):
    node: Name                                  # a core or edge removed (all its replicas)
    at_s: Annotated[float, Meta(ge=0, le=1e9)]  # seconds from the trace's start


class PlanSpec(_Spec, frozen=True):
    """`edgecore plan` only (docs/plan.md): costs, SLOs and failures of the simulated fleet."""
    core_cost: Annotated[float, Meta(ge=0, le=1e12)] = 1.0      # per core replica (any unit, e.g. per hour)
    edge_cost: Annotated[float, Meta(ge=0, le=1e12)] = 0.25     # per edge replica
    slo: Slo = msgspec.field(default_factory=Slo)               # every region's SLO (`--search`)
    region_slo: dict[Name, Slo] = {}                            # per-region SLOs, instead of `slo`
    max_replicas: Count = 16                                    # `--search`: most replicas of one node
    failures: list[Failure] = []


class TopologyFile(_Spec, frozen=True, kw_only=True):
    model: ModelSpec = msgspec.field(default_factory=ModelSpec)
    secrets: SecretsSpec = msgspec.field(default_factory=SecretsSpec)
    regions: Annotated[dict[Name, RegionSpec], Meta(min_length=1)]
    links: list[Link] = []
    kubernetes: Kubernetes = msgspec.field(default_factory=Kubernetes)
    plan: PlanSpec = msgspec.field(default_factory=PlanSpec)


@dataclass(frozen=True)
class Topology:
    path: str
    model: str
    model_name: str
    image: str
    secret_file: str | None
    secret_name: str
    api_keys_file: str | None
    regions: tuple[str, ...]
    cores: tuple[TopologyCore, ...]
    edges: tuple[TopologyEdge, ...]
    links: tuple[Link, ...] = ()
    cuda_image: str = "edgecore:latest-cuda"
    kube: Kubernetes = field(default_factory=Kubernetes)
    plan: PlanSpec = field(default_factory=PlanSpec)

    def link(self, a: str, b: str) -> Link | None:
        for link in self.links:
            if {link.a, link.b} == {a, b}:
                return link
        return None

    def cores_for(self, region: str) -> list[TopologyCore]:
        """Cores an edge in `region` may use, nearest (by configured delay) first."""
        def delay(core: TopologyCore) -> float:
            if core.region == region:
                return 0.0
            link = self.link(region, core.region)
            return link.delay_ms if link else float("inf")
        return sorted((c for c in self.cores if delay(c) != float("inf")), key=delay)

    def peers_for(self, edge: TopologyEdge) -> list[TopologyEdge]:
        """The other edges serving cached KV (`peer_port`) that `edge` may pull from: in its region or a linked one,
        nearest first."""
        def delay(peer: TopologyEdge) -> float:
            link = self.link(edge.region, peer.region)
            return 0.0 if peer.region == edge.region else link.delay_ms if link else float("inf")
        return sorted((p for p in self.edges if p is not edge and p.peer_port is not None and delay(p) != float("inf")),
                      key=delay)

    @property
    def bundled_model(self) -> bool:
        """The model is the one inside the image (no model volume needed)."""
        from edgecore.models import bundled_model_dir
        ours, bundled = Path(self.model) / "config.json", bundled_model_dir() / "config.json"
        return ours.is_file() and ours.resolve() == bundled.resolve()   # files: editable installs link files


EXAMPLE = "example"      # `--topology example`: the documented topology.toml shipped in the package


def example_topology_path() -> Path:
    """The bundled example topology (package data beside this module)."""
    from importlib import resources
    return Path(str(resources.files("edgecore.deploy").joinpath("topology.toml")))


def _shown(path: tuple[str | int, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(path))


def load_topology(path: str | Path) -> Topology:
    path = example_topology_path() if str(path) == EXAMPLE else Path(path)
    if not path.is_file():
        raise TopologyError(f"topology file {path} " + ("is not a file" if path.exists() else "does not exist"))
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TopologyError(f"{path} cannot be read as UTF-8 text: {exc}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TopologyError(f"{path}: {exc}") from None

    def fail(where: tuple[str | int, ...], message: str) -> NoReturn:
        raise TopologyError(f"{path}:{TomlLines(text).line(where)}: '{_shown(where)}' {message}")

    try:
        spec = msgspec.convert(raw, TopologyFile, strict=True)
    except msgspec.ValidationError as exc:
        fail(*explain(exc, raw, TopologyFile, _WORDS))
    return _build(path, spec, fail)


def _build(path: Path, spec: TopologyFile, fail: Callable[[tuple[str | int, ...], str], NoReturn]) -> Topology:
    cores: list[TopologyCore] = []
    edges: list[TopologyEdge] = []
    seen: set[str] = set()
    kube_names: dict[str, str] = {}
    for region in spec.regions:
        if f"{region}-monitoring" in spec.regions:   # its overlay directory is that region's monitoring overlay
            fail(("regions", f"{region}-monitoring"), f"clashes with the monitoring overlay of region {region!r} "
                 f"(overlays/{region}-monitoring)")
    for region, table in spec.regions.items():
        nodes: list[tuple[str, Sequence[CoreSpec | EdgeSpec]]] = [("cores", table.cores), ("edges", table.edges)]
        for kind, items in nodes:
            for i, node in enumerate(items):
                name = node.name or f"{region}-{kind[:-1]}-{i}"
                if name in seen:
                    fail(("regions", region, kind, i, "name"), f"repeats node name {name!r}")
                seen.add(name)
                kube = kube_name(kind[:-1], name)
                if kube in kube_names:
                    fail(("regions", region, kind, i, "name"), f"is named {kube!r} in Kubernetes, as node "
                         f"{kube_names[kube]!r} is")
                kube_names[kube] = name
                if isinstance(node, CoreSpec) and node.port == node.http_port:
                    fail(("regions", region, kind, i, "http_port"), f"is the core's KV port too ({node.port})")
                fields = {**msgspec.structs.asdict(node), "name": name, "region": region}
                if isinstance(node, EdgeSpec):
                    fields["max_replicas"] = max(node.replicas, node.max_replicas)
                    edges.append(TopologyEdge(**fields))
                else:
                    cores.append(TopologyCore(**fields))
    if not cores and not edges:
        fail(("regions",), "defines no nodes (add [[regions.NAME.cores]] or [[regions.NAME.edges]])")
    for i, link in enumerate(spec.links):
        for key, value in (("from", link.a), ("to", link.b)):
            if value not in spec.regions:
                fail(("links", i, key), f"names unknown region {value!r}")
    for i, client in enumerate(spec.kubernetes.batch_clients):
        if client.name in seen:
            fail(("kubernetes", "batch_clients", i, "name"), f"repeats node name {client.name!r}")
    for i, failure in enumerate(spec.plan.failures):
        if failure.node not in seen:
            fail(("plan", "failures", i, "node"), f"names unknown node {failure.node!r}")
    for region in spec.plan.region_slo:
        if region not in spec.regions:
            fail(("plan", "region_slo", region), "is not a region of this topology")
    try:
        spec.kubernetes.core_dns.format(service="core", namespace="ns")
    except (KeyError, IndexError, ValueError):
        fail(("kubernetes", "core_dns"), "may use only {service} and {namespace}")
    model = _model_path(path, spec.model.path)
    return Topology(str(path), model, spec.model.name or Path(model).name, spec.model.image,
                    spec.secrets.cluster_secret_file, spec.secrets.kubernetes_secret, spec.secrets.api_keys_file,
                    tuple(spec.regions), tuple(cores), tuple(edges), tuple(spec.links), spec.model.cuda_image,
                    spec.kubernetes, spec.plan)


def kube_name(kind: str, name: str) -> str:
    """A node's Kubernetes name (Deployment, Service): `kind-name` unless the name starts with the kind."""
    return name if name.startswith(kind) else f"{kind}-{name}"


def _model_path(topology: Path, given: str | None) -> str:
    """Relative paths are relative to the topology file (else to the working directory)."""
    if given is None:
        from edgecore.models import bundled_model_dir
        return str(bundled_model_dir())
    resolved = Path(given) if Path(given).is_absolute() else topology.parent / given
    return str(resolved if resolved.exists() else Path(given))


def default_topology(model: str) -> Topology:
    """`edgecore up` with no file: one core and one edge, one region."""
    return Topology("(default)", model, Path(model).name, "edgecore:latest", None, "edgecore-secrets", None,
                    ("local",), (TopologyCore(name="core", region="local"),), (TopologyEdge(name="edge", region="local"),))
