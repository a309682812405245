"""Kubernetes objects of one node: a core's StatefulSet and headless Service, an edge's Deployment and
Service, a PodDisruptionBudget for each, and a region's model volume claim. A parallel core (tp × pp > 1)
is a LeaderWorkerSet instead of a StatefulSet: per replica a group of one pod per rank, the leader running
the core (rank 0, `--external-workers`, the Service and PDB select it alone), each worker `edgecore
core-worker` (`_leader_worker_set`).

Life cycle: pure functions from the topology (`Topology`, `TopologyCore`,
`TopologyEdge`) to manifest dicts; `k8s.render` writes them into the region's
overlay. Pods run as the image's non-root user and mount three Secrets read-only: the shared one
(`api-keys`, `authority.pub`, and `cluster-secret` only when the topology names a cluster secret), their
own node's credential (`edgecore-credential-NODE`, key `credential`; no other node's) and the revocation
list (`revoked.txt`, a Secret without a hash suffix, so that an update reaches running pods, which re-read
it). They mount the region's model claim read-only unless the model is the one bundled in the image, and
are probed on /health (startup, sized for model loading; liveness) and /ready.
Drains and rolling updates: each pod's `terminationGracePeriodSeconds` is its node's drain timeout plus a
margin (and an edge's preStop pause), so SIGTERM's graceful drain (shared/node/service.py) finishes before the
kubelet's SIGKILL; an edge first pauses `PRESTOP_SECONDS` in preStop (still serving) while it leaves the
Service's endpoints, then drains. Edge Deployments roll with maxUnavailable 0 / maxSurge 1 (a new pod is
Ready before an old one stops); core StatefulSets roll one pod at a time, the next only after the last
replacement has been Ready for `MIN_READY_SECONDS` (edges have reconnected); every pod is spread across
zones (`topologySpreadConstraints`, best effort: a region may have one zone); the PodDisruptionBudgets keep
one replica up through voluntary evictions when there are two or more.
With `[kubernetes] tls`, each pod also mounts its own node's `kubernetes.io/tls` Secret
(`edgecore-tls-NODE`) and serves its HTTP port over HTTPS from it (`--tls-cert`/`--tls-key`; probes
use HTTPS); edges that fetch the model from a core also mount the CA Secret and trust it for that
download (SSL_CERT_FILE).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

from edgecore.deploy.node_settings import core_settings, edge_settings, node_argv
from edgecore.deploy.topology import TopologyCore, TopologyEdge, Resources, Topology, kube_name

APP = "edgecore"
MODEL_MOUNT = "/models"
SECRET_MOUNT = "/etc/edgecore"                  # the shared Secret
CREDENTIAL_MOUNT = "/etc/edgecore-node"         # the node's own credential (mounts do not nest: volumes
REVOCATIONS_MOUNT = "/etc/edgecore-revocations"  # of Secrets are read-only, no mount point can be made in one)
CLUSTER_SECRET_KEY, API_KEYS_KEY, AUTHORITY_KEY = "cluster-secret", "api-keys", "authority.pub"
CREDENTIAL_KEY, REVOCATIONS_KEY = "credential", "revoked.txt"
# what every node runs with: --credential, --authority, --revocations (and --secret-file, `_cluster_secret`)
CREDENTIAL_FILE = f"{CREDENTIAL_MOUNT}/{CREDENTIAL_KEY}"
AUTHORITY_FILE = f"{SECRET_MOUNT}/{AUTHORITY_KEY}"
REVOCATIONS_FILE = f"{REVOCATIONS_MOUNT}/{REVOCATIONS_KEY}"
# `[kubernetes] tls`: the node's certificate and key (a kubernetes.io/tls Secret's keys), and the CA edges trust
TLS_MOUNT, TLS_CA_MOUNT = "/etc/edgecore-tls", "/etc/edgecore-tls-ca"
TLS_CERT_KEY, TLS_KEY_KEY, TLS_CA_KEY = "tls.crt", "tls.key", "ca.crt"
TLS_CERT_FILE, TLS_KEY_FILE = f"{TLS_MOUNT}/{TLS_CERT_KEY}", f"{TLS_MOUNT}/{TLS_KEY_KEY}"
TLS_CA_FILE = f"{TLS_CA_MOUNT}/{TLS_CA_KEY}"
RUN_AS = 10001          # the image's user (deploy/docker/Dockerfile)
STARTUP_PERIOD = 10
PRESTOP_SECONDS = 5     # an edge keeps serving this long after it is marked terminating (endpoints update)
GRACE_MARGIN = 10       # seconds beyond the drain (and preStop) before the kubelet's SIGKILL
MIN_READY_SECONDS = 10  # a replaced core is Ready this long before the next core pod is stopped
ZONE_KEY = "topology.kubernetes.io/zone"
RENDEZVOUS_PORT = 29500  # a parallel core's leader: where its worker pods join (torch.distributed's TCP store)
LWS_API = "leaderworkerset.x-k8s.io/v1"


def labels(component: str, node: str, region: str) -> dict:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": component,
            "edgecore.dev/node": node, "edgecore.dev/region": region}


def selector(component: str, node: str) -> dict:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": component, "edgecore.dev/node": node}


# Kubernetes pulls a `:latest` image on every start by default, so an image loaded into kind or minikube (what
# `make image` tags) would never start; a registry's pinned tag is pulled once either way.
PULL_POLICY = "IfNotPresent"


def core_name(core: TopologyCore) -> str:
    return kube_name("core", core.name)


def edge_name(edge: TopologyEdge) -> str:
    return kube_name("edge", edge.name)


def models_claim(region: str) -> str:
    return f"edgecore-models-{region}"


def needs_model_volume(topo: Topology, region: str) -> bool:
    """A region's pods read the model from a volume: cores, and edges with no core to fetch it from."""
    if topo.bundled_model:
        return False
    return any(c.region == region for c in topo.cores) or \
        any(e.region == region and not topo.cores_for(e.region) for e in topo.edges)


def model_volume_claim(topo: Topology, region: str) -> dict:
    spec: dict = {"accessModes": [topo.kube.models_access_mode],
                  "resources": {"requests": {"storage": topo.kube.models_pvc_size}}}
    if topo.kube.storage_class:
        spec["storageClassName"] = topo.kube.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": models_claim(region), "labels": {"app.kubernetes.io/name": APP,
                                                                   "edgecore.dev/region": region}},
            "spec": spec}


def _model_path(topo: Topology) -> str | None:
    """The bundled model is the image's default; any other is read from the mounted claim."""
    return None if topo.bundled_model else f"{MODEL_MOUNT}/{Path(topo.model).name}"


def _doubled(quantity: str) -> str:
    parsed = re.match(r"^([0-9.]+)(.*)$", quantity)      # the topology's pattern guarantees a number first
    if parsed is None:
        return quantity
    number, unit = parsed.groups()
    value = float(number) * 2
    return f"{int(value) if value.is_integer() else value}{unit}"


def _resources(res: Resources, gpus: int) -> dict:
    out = {"requests": {"cpu": res.cpu, "memory": res.memory},
           "limits": {"memory": res.memory_limit or _doubled(res.memory)}}
    if gpus:
        out["requests"]["nvidia.com/gpu"] = str(gpus)
        out["limits"]["nvidia.com/gpu"] = str(gpus)
    return out


def _probes(topo: Topology) -> dict:
    get = {"scheme": "HTTPS"} if topo.kube.tls else {}      # (the kubelet does not verify the certificate)

    def probe(path: str, period: int, failures: int) -> dict:
        return {"httpGet": {"path": path, "port": "http", **get}, "periodSeconds": period, "timeoutSeconds": 3,
                "failureThreshold": failures}
    return {"startupProbe": probe("/health", STARTUP_PERIOD, math.ceil(topo.kube.startup_seconds / STARTUP_PERIOD)),
            "readinessProbe": probe("/ready", 5, 3), "livenessProbe": probe("/health", 10, 3)}


def shared_secret_keys(topo: Topology) -> tuple[str, ...]:
    """Keys of the shared Secret: the cluster secret only when the topology names one (per-node
    credentials are the default; with both, both apply)."""
    return (API_KEYS_KEY, AUTHORITY_KEY, *((CLUSTER_SECRET_KEY,) if topo.secret_file else ()))


def credential_secret(node: TopologyCore | TopologyEdge) -> str:
    """The Secret holding one node's credential (node names are unique across the topology)."""
    return f"edgecore-credential-{node.name}"


def revocations_secret(topo: Topology) -> str:
    return f"{topo.secret_name}-revocations"


def tls_secret(node: TopologyCore | TopologyEdge) -> str:
    """`[kubernetes] tls`: the kubernetes.io/tls Secret of one node (`tls.crt`, `tls.key`)."""
    return f"edgecore-tls-{node.name}"


def tls_ca_secret(topo: Topology) -> str:
    """`[kubernetes] tls`: the CA (`ca.crt`) edges trust for the cores' control ports, as Prometheus does."""
    return f"{topo.secret_name}-tls-ca"


def tls_names(topo: Topology, node: TopologyCore | TopologyEdge) -> list[str]:
    """DNS names a node's certificate must hold: its Service's (as Prometheus scrapes it: the last), and
    for a core the address edges use (`core_dns`)."""
    name = core_name(node) if isinstance(node, TopologyCore) else edge_name(node)
    extra = [core_address(topo, node)] if isinstance(node, TopologyCore) else []
    return list(dict.fromkeys([name, *extra, f"{name}.{topo.kube.namespace}.svc"]))


def _secret(volume: str, name: str, keys: tuple[str, ...]) -> dict:
    return {"name": volume, "secret": {"secretName": name, "defaultMode": 0o440,
                                       "items": [{"key": k, "path": k} for k in keys]}}


def _cluster_secret(topo: Topology) -> str | None:
    return f"{SECRET_MOUNT}/{CLUSTER_SECRET_KEY}" if topo.secret_file else None


def _secret_mounts(topo: Topology, node: TopologyCore | TopologyEdge) -> tuple[list[dict], list[dict]]:
    """A node's Secrets: (its volume mounts, its volumes)."""
    mounts = [{"name": volume, "mountPath": path, "readOnly": True}
              for volume, path in (("secrets", SECRET_MOUNT), ("credential", CREDENTIAL_MOUNT),
                                   ("revocations", REVOCATIONS_MOUNT))]
    volumes = [_secret("secrets", topo.secret_name, shared_secret_keys(topo)),
               _secret("credential", credential_secret(node), (CREDENTIAL_KEY,)),
               _secret("revocations", revocations_secret(topo), (REVOCATIONS_KEY,))]
    if topo.kube.tls:
        mounts.append({"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True})
        volumes.append(_secret("tls", tls_secret(node), (TLS_CERT_KEY, TLS_KEY_KEY)))
    return mounts, volumes


def _tls(topo: Topology) -> tuple[str | None, str | None]:
    """(`tls_cert`, `tls_key`): HTTPS from the node's mounted tls Secret (None, None without `[kubernetes] tls`)."""
    return (TLS_CERT_FILE, TLS_KEY_FILE) if topo.kube.tls else (None, None)


def termination(drain_timeout: float, prestop: int = 0) -> tuple[dict, int]:
    """(the container's `lifecycle`, or {}; the pod's terminationGracePeriodSeconds) for a node's drain timeout:
    the kubelet waits for preStop, then SIGTERM starts the drain; SIGKILL only after both and a margin."""
    lifecycle = {"lifecycle": {"preStop": {"sleep": {"seconds": prestop}}}} if prestop else {}
    return lifecycle, prestop + math.ceil(drain_timeout) + GRACE_MARGIN


def _spread(sel: dict) -> list[dict]:
    """Replicas spread over the region's zones, best effort (a region with one zone still schedules)."""
    return [{"maxSkew": 1, "topologyKey": ZONE_KEY, "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": {"matchLabels": sel}}]


def _pod(topo: Topology, lab: dict, region: str, port: int, container: dict, volumes: list[dict],
         sel: dict, drain_timeout: float, prestop: int = 0) -> dict:
    """A pod template: non-root, no service-account token, scraped on `port`'s /metrics; spread over zones, and
    given the time its drain needs."""
    lifecycle, grace = termination(drain_timeout, prestop)
    container = {**container, **_probes(topo), **lifecycle,
                 "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}
    scrape = {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics",
              **({"prometheus.io/scheme": "https"} if topo.kube.tls else {})}
    return {"metadata": {"labels": lab, "annotations": scrape},
            "spec": {"nodeSelector": {"topology.kubernetes.io/region": region},
                     "terminationGracePeriodSeconds": grace,
                     "topologySpreadConstraints": _spread(sel),
                     "automountServiceAccountToken": False,
                     "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS,
                                         "fsGroup": RUN_AS, "seccompProfile": {"type": "RuntimeDefault"}},
                     "containers": [container], "volumes": volumes}}


def _disruption_budget(name: str, lab: dict, sel: dict, replicas: int) -> dict:
    """Two or more replicas keep one up during drains; a single replica may be evicted (else drains hang)."""
    spec = {"minAvailable": 1} if replicas > 1 else {"maxUnavailable": 1}
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": name, "labels": lab},
            "spec": {**spec, "selector": {"matchLabels": sel}}}


def core_manifests(topo: Topology, core: TopologyCore) -> list[dict]:
    name = core_name(core)
    lab, sel = labels("core", core.name, core.region), selector("core", core.name)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": lab},
               "spec": {"clusterIP": "None", "selector": sel, "publishNotReadyAddresses": False,
                        "ports": [{"name": "kv", "port": core.port, "targetPort": "kv"},
                                  {"name": "http", "port": core.http_port, "targetPort": "http"}]}}
    mounts, volumes = _secret_mounts(topo, core)
    settings = replace(core_settings(core), model=_model_path(topo), listen=f"0.0.0.0:{core.port}",
                       http=f"0.0.0.0:{core.http_port}", secret_file=_cluster_secret(topo),
                       credential=CREDENTIAL_FILE, authority=AUTHORITY_FILE, revocations=REVOCATIONS_FILE,
                       data_dir="/data", api_key_file=f"{SECRET_MOUNT}/{API_KEYS_KEY}",  # control port beyond loopback
                       # the Service exposes one KV port, so rank 0 sends every rank's KV
                       gather_kv=core.tp * core.pp > 1)
    if core.tp * core.pp > 1:    # the worker ranks are the group's other pods: they join the leader's rendezvous
        settings = replace(settings, external_workers=True, rendezvous=f"0.0.0.0:{RENDEZVOUS_PORT}")
    cert, key = _tls(topo)
    settings = replace(settings, tls_cert=cert, tls_key=key)
    mounts.append({"name": "data", "mountPath": "/data"})
    if needs_model_volume(topo, core.region):
        mounts.append({"name": "models", "mountPath": MODEL_MOUNT, "readOnly": True})
        volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": models_claim(core.region),
                                                                    "readOnly": True}})
    world = core.tp * core.pp
    container = {"name": "core", "image": topo.cuda_image if core.device == "cuda" else topo.image,
                 "imagePullPolicy": PULL_POLICY, "args": node_argv(settings),
                 "ports": [{"name": "kv", "containerPort": core.port},
                           {"name": "http", "containerPort": core.http_port},
                           *([{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT}] if world > 1 else [])],
                 "resources": _resources(core.resources, -(-core.gpus // world)), "volumeMounts": mounts}
    data = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": topo.kube.data_pvc_size}}}
    if topo.kube.storage_class:
        data["storageClassName"] = topo.kube.storage_class
    if world > 1:     # the budget covers every pod of the core: evicting a worker recreates its whole group
        group = {"app.kubernetes.io/name": APP, "edgecore.dev/node": core.name}
        return [service, _leader_worker_set(topo, core, container, volumes, data),
                _disruption_budget(name, lab, group, core.replicas)]
    statefulset = {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": name, "labels": lab},
        "spec": {"serviceName": name, "replicas": core.replicas, "selector": {"matchLabels": sel},
                 # one pod at a time, the next once its replacement has been Ready a while (edges reconnected)
                 "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}},
                 "minReadySeconds": MIN_READY_SECONDS,
                 "template": _pod(topo, lab, core.region, core.http_port, container, volumes, sel,
                                  core.drain_timeout),
                 "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": data}]}}
    return [service, statefulset, _disruption_budget(name, lab, sel, core.replicas)]


def _leader_worker_set(topo: Topology, core: TopologyCore, leader: dict, volumes: list[dict], data: dict) -> dict:
    """A parallel core as LeaderWorkerSet groups, one per replica: the leader pod runs rank 0 (the core, with
    --external-workers: its protocol, control and rendezvous ports), each worker pod one more rank (`edgecore
    core-worker`, its rank from LWS_WORKER_INDEX, the leader from LWS_LEADER_ADDRESS, both set by the
    controller). A pod of a group that fails or restarts recreates the group (ranks join together or not at
    all); a rolling update replaces one group at a time, and with one replica surges a new group first."""
    name, world = core_name(core), core.tp * core.pp
    lab, sel = labels("core", core.name, core.region), selector("core", core.name)
    worker_lab, worker_sel = labels("core-worker", core.name, core.region), selector("core-worker", core.name)
    args = ["core-worker", "--rank", "$(LWS_WORKER_INDEX)", "--tp", str(core.tp), "--pp", str(core.pp),
            "--master", f"$(LWS_LEADER_ADDRESS):{RENDEZVOUS_PORT}", "--device", core.device,
            "--join-timeout", str(topo.kube.startup_seconds), "--pool-from-driver"]
    model = _model_path(topo)
    mounts, worker_volumes = [], []
    if model is not None:
        args += ["--model", model]
    if needs_model_volume(topo, core.region):
        mounts.append({"name": "models", "mountPath": MODEL_MOUNT, "readOnly": True})
        worker_volumes = [v for v in volumes if v["name"] == "models"]
    worker = {"name": "core-worker", "image": leader["image"], "imagePullPolicy": PULL_POLICY, "args": args,
              "resources": leader["resources"], "volumeMounts": mounts,
              "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}
    leader_pod = _pod(topo, lab, core.region, core.http_port, leader, volumes, sel, core.drain_timeout)
    worker_pod = _pod(topo, worker_lab, core.region, core.http_port, worker, worker_volumes, worker_sel,
                      core.drain_timeout)
    for key in ("startupProbe", "readinessProbe", "livenessProbe"):    # a worker serves no HTTP
        worker_pod["spec"]["containers"][0].pop(key)
    del worker_pod["spec"]["topologySpreadConstraints"]    # a group's ranks stay together (no zone spreading)
    del worker_pod["metadata"]["annotations"]                              # nor metrics
    rolling = {"maxUnavailable": 1, "maxSurge": 0} if core.replicas > 1 else {"maxUnavailable": 0, "maxSurge": 1}
    # Its own name: the LWS controller makes a headless Service of that name (publishing pods not yet Ready) and
    # LWS_LEADER_ADDRESS names the leader through it; edgecore's Service `name` publishes Ready leaders only.
    return {"apiVersion": LWS_API, "kind": "LeaderWorkerSet", "metadata": {"name": f"{name}-ranks", "labels": lab},
            "spec": {"replicas": core.replicas, "startupPolicy": "LeaderCreated",
                     "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": rolling},
                     "leaderWorkerTemplate": {
                         "size": world, "restartPolicy": "RecreateGroupOnPodRestart",
                         "leaderTemplate": leader_pod, "workerTemplate": worker_pod,
                         "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": data}]}}}


def core_address(topo: Topology, core: TopologyCore) -> str:
    """How an edge names a core's headless Service (`kubernetes.core_dns`, e.g. a multi-cluster domain)."""
    return topo.kube.core_dns.format(service=core_name(core), namespace=topo.kube.namespace)


def edge_manifests(topo: Topology, edge: TopologyEdge) -> list[dict]:
    name = edge_name(edge)
    lab, sel = labels("edge", edge.name, edge.region), selector("edge", edge.name)
    mounts, volumes = _secret_mounts(topo, edge)
    settings = replace(edge_settings(topo, edge), listen=f"0.0.0.0:{edge.port}", secret_file=_cluster_secret(topo),
                       credential=CREDENTIAL_FILE, authority=AUTHORITY_FILE, revocations=REVOCATIONS_FILE,
                       api_key_file=f"{SECRET_MOUNT}/{API_KEYS_KEY}")
    cert, key = _tls(topo)
    settings = replace(settings, tls_cert=cert, tls_key=key)
    mounts.append({"name": "cache", "mountPath": "/cache"})
    volumes.append({"name": "cache", "emptyDir": {}})
    env: list[dict] = []
    cores = topo.cores_for(edge.region)
    if cores:   # the nearest core serves the packed model; every reachable core is a prefill target
        first = cores[0]
        scheme = "https" if topo.kube.tls else "http"
        settings = replace(settings, model_from=f"{scheme}://{core_address(topo, first)}:{first.http_port}",
                           model_cache="/cache", model_from_key_file=f"{SECRET_MOUNT}/{API_KEYS_KEY}",
                           core_dns=tuple(f"{core_address(topo, core)}:{core.port}" for core in cores))
        if topo.kube.tls:   # the model download verifies the core's certificate against the CA (urllib's default)
            mounts.append({"name": "tls-ca", "mountPath": TLS_CA_MOUNT, "readOnly": True})
            volumes.append(_secret("tls-ca", tls_ca_secret(topo), (TLS_CA_KEY,)))
            env.append({"name": "SSL_CERT_FILE", "value": TLS_CA_FILE})
    else:
        settings = replace(settings, model=_model_path(topo))
        if needs_model_volume(topo, edge.region):
            mounts.append({"name": "models", "mountPath": MODEL_MOUNT, "readOnly": True})
            volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": models_claim(edge.region),
                                                                        "readOnly": True}})
    container = {"name": "edge", "image": topo.image, "imagePullPolicy": PULL_POLICY, "args": node_argv(settings),
                 "ports": [{"name": "http", "containerPort": edge.port}],
                 "resources": _resources(edge.resources, edge.resources.gpu or 0), "volumeMounts": mounts}
    if edge.compile:    # torch's compile cache on the pod's volume: a restarted container compiles from it
        # (about 15-25 s on a 2-core machine, against a minute or more from scratch)
        env.insert(0, {"name": "TORCHINDUCTOR_CACHE_DIR", "value": "/cache/torchinductor"})
    if env:
        container["env"] = env
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": lab},
                  "spec": {"replicas": edge.replicas, "selector": {"matchLabels": sel},
                           # a new pod is Ready before an old one stops: capacity never drops in an upgrade
                           "strategy": {"type": "RollingUpdate",
                                        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                           "template": _pod(topo, lab, edge.region, edge.port, container, volumes, sel,
                                            edge.drain_timeout, PRESTOP_SECONDS)}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": lab},
               "spec": {"type": "ClusterIP", "selector": sel,
                        "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}}
    return [deployment, service, _disruption_budget(name, lab, sel, edge.replicas)]
