"""`edgecore deploy render`: a topology -> a kustomize base, one overlay per region, and an optional
monitoring overlay per region; `kubectl apply -k overlays/REGION` runs that region as is.

Life cycle: `render(topo, out)` builds every object (k8s_workloads, k8s_policy,
k8s_monitoring) and writes this layout under OUT, returning the files written:
  base/                    Namespace, ConfigMap (the topology), NetworkPolicies, and kustomize
                           secretGenerators reading base/secrets/* (files the user creates; nothing
                           secret is written here; secrets/.gitignore keeps them out of git): the
                           shared Secret (api-keys, authority.pub, cluster-secret only when the
                           topology names one) and the revocation list (revoked.txt; no hash suffix,
                           so `kubectl apply` updates it in place and running nodes re-read it)
  overlays/REGION/         base + the region's nodes: per core a headless Service, StatefulSet
                           (data claim per replica) and PDB, a parallel core's StatefulSet being a
                           LeaderWorkerSet (a group of one pod per rank per replica) and its ranks'
                           NetworkPolicy; per edge a Deployment, Service and PDB;
                           the region's model claim unless the model is bundled in the image; a
                           secretGenerator per node, `edgecore-credential-NODE` from
                           overlays/REGION/secrets/NODE.cred (kustomize reads files only under the
                           kustomization's own folder, and a region's overlay carries only its own
                           nodes' keys); with `[kubernetes] tls` also `edgecore-tls-NODE`
                           (kubernetes.io/tls) from secrets/NODE.crt and NODE.key, and in base/ the CA
                           the nodes' certificates chain to (secrets/tls-ca.crt), both without hash suffix
  overlays/REGION-monitoring/  REGION + ServiceMonitor + queue-depth autoscaler per edge
Edges find cores through the cores' headless Services (DNS), nearest region first.
`k8s_check.check(out)` validates what was written (`render --check`).
"""

from __future__ import annotations

from pathlib import Path

from edgecore.deploy.k8s_monitoring import monitoring_manifests, replica_patch
from edgecore.deploy.k8s_policy import network_policies
from edgecore.deploy.k8s_workloads import (API_KEYS_KEY, APP, AUTHORITY_KEY, CLUSTER_SECRET_KEY, CREDENTIAL_KEY,
                                           REVOCATIONS_KEY, TLS_CA_KEY, TLS_CERT_KEY, TLS_KEY_KEY, core_manifests,
                                           credential_secret, edge_manifests, model_volume_claim, needs_model_volume,
                                           revocations_secret, tls_ca_secret, tls_secret)
from edgecore.deploy.topology import TopologyCore, TopologyEdge, Topology
from edgecore.deploy.yaml_out import dump

KUSTOMIZE = "kustomize.config.k8s.io/v1beta1"
# Pod security: the pods run non-root without privileges, so the namespace can enforce `restricted`.
POD_SECURITY = {"pod-security.kubernetes.io/enforce": "restricted"}
# Input files of the base's generators beyond those `[kubernetes.secret_files]` names (relative to base/)
AUTHORITY_FILE, REVOCATIONS_FILE = "secrets/authority.pub", "secrets/revoked.txt"
TLS_CA_FILE = "secrets/tls-ca.crt"      # `[kubernetes] tls` only
# Secrets updated in place: no hash suffix, so `kubectl apply` keeps the name and running pods re-read the files
IN_PLACE = {"disableNameSuffixHash": True}
GITIGNORE = "# the secretGenerator's input files: never commit them\n*\n!.gitignore\n"


def namespace(topo: Topology) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": topo.kube.namespace, "labels": {"app.kubernetes.io/name": APP, **POD_SECURITY}}}


def base_kustomization(topo: Topology) -> dict:
    files = topo.kube.secret_files
    shared = [f"{API_KEYS_KEY}={files.api_keys}", f"{AUTHORITY_KEY}={AUTHORITY_FILE}"]
    if topo.secret_file:        # the topology names a cluster secret: it applies beside the credentials
        shared.append(f"{CLUSTER_SECRET_KEY}={files.cluster_secret}")
    generators = [{"name": topo.secret_name, "type": "Opaque", "files": shared},
                  {"name": revocations_secret(topo), "type": "Opaque",
                   "files": [f"{REVOCATIONS_KEY}={REVOCATIONS_FILE}"], "options": IN_PLACE}]
    if topo.kube.tls:           # the CA edges (model downloads) and Prometheus verify the nodes' certificates with
        generators.append({"name": tls_ca_secret(topo), "type": "Opaque", "files": [f"{TLS_CA_KEY}={TLS_CA_FILE}"],
                           "options": IN_PLACE})
    return {"apiVersion": KUSTOMIZE, "kind": "Kustomization", "namespace": topo.kube.namespace,
            "resources": ["namespace.yaml", "configmap.yaml", "networkpolicy.yaml"], "secretGenerator": generators}


def region_kustomization(topo: Topology, region: str, resources: list[str]) -> dict:
    """The region's overlay: base, its objects, and one Secret per node from secrets/NODE.cred."""
    everyone: tuple[TopologyCore | TopologyEdge, ...] = (*topo.cores, *topo.edges)
    nodes = [n for n in everyone if n.region == region]
    out: dict[str, object] = {"apiVersion": KUSTOMIZE, "kind": "Kustomization", "namespace": topo.kube.namespace,
                              "resources": ["../../base", *resources]}
    generators: list[dict] = [{"name": credential_secret(n), "type": "Opaque",
                               "files": [f"{CREDENTIAL_KEY}=secrets/{n.name}.cred"]} for n in nodes]
    if topo.kube.tls:       # a renewed certificate is applied in place: nodes re-read it, no restart
        generators += [{"name": tls_secret(n), "type": "kubernetes.io/tls",
                        "files": [f"{TLS_CERT_KEY}=secrets/{n.name}.crt", f"{TLS_KEY_KEY}=secrets/{n.name}.key"],
                        "options": IN_PLACE} for n in nodes]
    if generators:
        out["secretGenerator"] = generators
    return out


def region_objects(topo: Topology, region: str) -> dict[str, list[dict]]:
    """File name -> objects, for one region's overlay."""
    files: dict[str, list[dict]] = {}
    if needs_model_volume(topo, region):
        files["models-pvc.yaml"] = [model_volume_claim(topo, region)]
    for core in (c for c in topo.cores if c.region == region):
        files[f"core-{core.name}.yaml"] = core_manifests(topo, core)
    for edge in (e for e in topo.edges if e.region == region):
        files[f"edge-{edge.name}.yaml"] = edge_manifests(topo, edge)
    return files


def render(topo: Topology, out: str | Path) -> list[Path]:
    out = Path(out)
    written: list[Path] = []

    def write(path: Path, docs: dict | list[dict] | str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(docs, str):
            path.write_text(docs)
        else:
            path.write_text("---\n".join(dump(d) for d in (docs if isinstance(docs, list) else [docs])))
        written.append(path)

    topology_text = Path(topo.path).read_text() if Path(topo.path).is_file() else ""
    write(out / "base" / "namespace.yaml", namespace(topo))
    write(out / "base" / "configmap.yaml", {"apiVersion": "v1", "kind": "ConfigMap",
                                            "metadata": {"name": "edgecore-config"},
                                            "data": {"topology.toml": topology_text, "model": topo.model_name}})
    write(out / "base" / "networkpolicy.yaml", network_policies(topo))
    write(out / "base" / "kustomization.yaml", base_kustomization(topo))
    if not (out / "base" / "secrets" / ".gitignore").exists():
        write(out / "base" / "secrets" / ".gitignore", GITIGNORE)
    for region in topo.regions:
        overlay = out / "overlays" / region
        files = region_objects(topo, region)
        for name, docs in files.items():
            write(overlay / name, docs)
        write(overlay / "kustomization.yaml", region_kustomization(topo, region, list(files)))
        if not (overlay / "secrets" / ".gitignore").exists():
            write(overlay / "secrets" / ".gitignore", GITIGNORE)
        monitoring = out / "overlays" / f"{region}-monitoring"
        write(monitoring / "monitoring.yaml", monitoring_manifests(topo, region))
        kustomization: dict[str, object] = {"apiVersion": KUSTOMIZE, "kind": "Kustomization", "namespace": topo.kube.namespace,
                         "resources": [f"../{region}", "monitoring.yaml"]}
        if any(e.region == region for e in topo.edges):
            kustomization["patches"] = [replica_patch()]
        write(monitoring / "kustomization.yaml", kustomization)
    return written
