"""`edgecore deploy render`: a topology → a kustomize base plus one overlay per region.

Layout written under OUT:
  base/           kustomization, ConfigMap (the topology), NetworkPolicies
  overlays/REGION kustomization (base + the region's nodes) and, per node:
                  core: headless Service + StatefulSet (accelerator requests, region node selector,
                        probes on /health and /ready, cluster secret mounted)
                  edge: Deployment + Service + HorizontalPodAutoscaler + PodDisruptionBudget
Secrets are referenced (Secret `secrets.kubernetes_secret` with keys `cluster-secret` and
`api-keys`), never rendered. Edges find cores through the cores' headless Services (DNS), nearest
region first.
"""

from __future__ import annotations

from pathlib import Path

from edgecore.deploy.topology import CoreNode, EdgeNode, Topology
from edgecore.deploy.yaml_out import dump

APP = "edgecore"
NAMESPACE = "edgecore"
MODEL_MOUNT = "/models"
SECRET_MOUNT = "/etc/edgecore"


def labels(component: str, node: str, region: str) -> dict:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": component,
            "edgecore.dev/node": node, "edgecore.dev/region": region}


def selector(component: str, node: str) -> dict:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": component, "edgecore.dev/node": node}


def _probe(path: str, port: str, period: int = 10) -> dict:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "timeoutSeconds": 3,
            "failureThreshold": 3}


def _secret_volume(topo: Topology) -> dict:
    return {"name": "secrets", "secret": {"secretName": topo.secret_name, "defaultMode": 0o400,
                                          "items": [{"key": "cluster-secret", "path": "cluster-secret"},
                                                    {"key": "api-keys", "path": "api-keys"}],
                                          "optional": False}}


def core_manifests(topo: Topology, core: CoreNode) -> list[dict]:
    name = f"core-{core.name}" if not core.name.startswith("core") else core.name
    lab, sel = labels("core", core.name, core.region), selector("core", core.name)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": lab},
               "spec": {"clusterIP": "None", "selector": sel, "publishNotReadyAddresses": False,
                        "ports": [{"name": "kv", "port": core.port, "targetPort": "kv"},
                                  {"name": "http", "port": core.http_port, "targetPort": "http"}]}}
    gpus = core.tp * core.pp
    resources = {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "16Gi"}}
    if core.device == "cuda":
        resources["requests"]["nvidia.com/gpu"] = str(gpus)
        resources["limits"]["nvidia.com/gpu"] = str(gpus)
    args = ["core", "--model", f"{MODEL_MOUNT}/{topo.model_name}", "--listen", f"0.0.0.0:{core.port}",
            "--http", f"0.0.0.0:{core.http_port}", "--secret-file", f"{SECRET_MOUNT}/cluster-secret",
            "--name", core.name, "--device", core.device, "--data-dir", "/data",
            "--api-key-file", f"{SECRET_MOUNT}/api-keys"]      # the control port listens beyond loopback
    if core.tp * core.pp > 1:    # the Service exposes one KV port, so rank 0 sends every rank's KV
        args += ["--tp", str(core.tp), "--pp", str(core.pp), "--gather-kv"]
    statefulset = {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": name, "labels": lab},
        "spec": {"serviceName": name, "replicas": core.replicas, "selector": {"matchLabels": sel},
                 "template": {"metadata": {"labels": lab}, "spec": {
                     "nodeSelector": {"topology.kubernetes.io/region": core.region},
                     "containers": [{"name": "core", "image": topo.image, "args": args,
                                     "ports": [{"name": "kv", "containerPort": core.port},
                                               {"name": "http", "containerPort": core.http_port}],
                                     "readinessProbe": _probe("/ready", "http", 5),
                                     "livenessProbe": _probe("/health", "http"),
                                     "resources": resources,
                                     "volumeMounts": [{"name": "secrets", "mountPath": SECRET_MOUNT, "readOnly": True},
                                                      {"name": "models", "mountPath": MODEL_MOUNT, "readOnly": True},
                                                      {"name": "data", "mountPath": "/data"}]}],
                     "volumes": [_secret_volume(topo),
                                 {"name": "models", "persistentVolumeClaim": {"claimName": "edgecore-models",
                                                                              "readOnly": True}}]}},
                 "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": {
                     "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Gi"}}}}]}}
    return [service, statefulset]


def edge_manifests(topo: Topology, edge: EdgeNode) -> list[dict]:
    name = f"edge-{edge.name}" if not edge.name.startswith("edge") else edge.name
    lab, sel = labels("edge", edge.name, edge.region), selector("edge", edge.name)
    args = ["edge", "--listen", f"0.0.0.0:{edge.port}", "--name", edge.name, "--served-model-name", topo.model_name,
            "--secret-file", f"{SECRET_MOUNT}/cluster-secret", "--api-key-file", f"{SECRET_MOUNT}/api-keys"]
    cores = topo.cores_for(edge.region)
    if cores:   # the nearest core serves the packed model; every reachable core is a prefill target
        first = cores[0]
        args += ["--model-from", f"http://{_core_name(first)}:{first.http_port}", "--model-cache", "/cache"]
        for core in cores:
            args += ["--core-dns", f"{_core_name(core)}:{core.port}"]
    else:
        args += ["--model", f"{MODEL_MOUNT}/{topo.model_name}"]
    for codec in edge.codecs:
        args += ["--codec", codec]
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": lab},
        "spec": {"replicas": edge.replicas, "selector": {"matchLabels": sel},
                 "template": {"metadata": {"labels": lab}, "spec": {
                     "nodeSelector": {"topology.kubernetes.io/region": edge.region},
                     "containers": [{"name": "edge", "image": topo.image, "args": args,
                                     "ports": [{"name": "http", "containerPort": edge.port}],
                                     "readinessProbe": _probe("/ready", "http", 5),
                                     "livenessProbe": _probe("/health", "http"),
                                     "resources": {"requests": {"cpu": "2", "memory": "4Gi"},
                                                   "limits": {"memory": "8Gi"}},
                                     "volumeMounts": [{"name": "secrets", "mountPath": SECRET_MOUNT, "readOnly": True},
                                                      {"name": "cache", "mountPath": "/cache"}]}],
                     "volumes": [_secret_volume(topo), {"name": "cache", "emptyDir": {}}]}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": lab},
               "spec": {"type": "ClusterIP", "selector": sel,
                        "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}}
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": name, "labels": lab},
           "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                    "minReplicas": edge.replicas, "maxReplicas": edge.max_replicas,
                    "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {
                        "type": "Utilization", "averageUtilization": 70}}}]}}
    pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": name, "labels": lab},
           "spec": {"minAvailable": 1, "selector": {"matchLabels": sel}}}
    return [deployment, service, hpa, pdb]


def _core_name(core: CoreNode) -> str:
    return f"core-{core.name}" if not core.name.startswith("core") else core.name


def network_policies(topo: Topology) -> list[dict]:
    core_ports = sorted({p for c in topo.cores for p in (c.port, c.http_port)})
    edge_ports = sorted({e.port for e in topo.edges})
    base = {"app.kubernetes.io/name": APP}
    return [
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "edgecore-core-ingress"},
         "spec": {"podSelector": {"matchLabels": {**base, "app.kubernetes.io/component": "core"}},
                  "policyTypes": ["Ingress"],
                  "ingress": [{"from": [{"podSelector": {"matchLabels": {**base, "app.kubernetes.io/component": "edge"}},
                                         "namespaceSelector": {}}],
                               "ports": [{"protocol": "TCP", "port": p} for p in core_ports]}]}},
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "edgecore-edge-ingress"},
         "spec": {"podSelector": {"matchLabels": {**base, "app.kubernetes.io/component": "edge"}},
                  "policyTypes": ["Ingress"],
                  "ingress": [{"ports": [{"protocol": "TCP", "port": p} for p in edge_ports]}]}},
    ]


def render(topo: Topology, out: str | Path) -> list[Path]:
    out = Path(out)
    written: list[Path] = []

    def write(path: Path, docs) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        docs = docs if isinstance(docs, list) else [docs]
        path.write_text("---\n".join(dump(d) for d in docs))
        written.append(path)

    topology_text = Path(topo.path).read_text() if Path(topo.path).is_file() else ""
    write(out / "base" / "configmap.yaml", {"apiVersion": "v1", "kind": "ConfigMap",
                                            "metadata": {"name": "edgecore-config"},
                                            "data": {"topology.toml": topology_text, "model": topo.model_name}})
    write(out / "base" / "networkpolicy.yaml", network_policies(topo))
    write(out / "base" / "kustomization.yaml", {"apiVersion": "kustomize.config.k8s.io/v1beta1",
                                                "kind": "Kustomization", "namespace": NAMESPACE,
                                                "resources": ["configmap.yaml", "networkpolicy.yaml"]})
    for region in topo.regions:
        files = []
        for core in (c for c in topo.cores if c.region == region):
            write(out / "overlays" / region / f"core-{core.name}.yaml", core_manifests(topo, core))
            files.append(f"core-{core.name}.yaml")
        for edge in (e for e in topo.edges if e.region == region):
            write(out / "overlays" / region / f"edge-{edge.name}.yaml", edge_manifests(topo, edge))
            files.append(f"edge-{edge.name}.yaml")
        write(out / "overlays" / region / "kustomization.yaml", {
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": NAMESPACE,
            "resources": ["../../base", *files],
            "labels": [{"pairs": {"edgecore.dev/region": region}, "includeSelectors": False}]})
    return written
