"""NetworkPolicies of a topology: deny all ingress in the namespace, then allow exactly what edgecore uses.

Life cycle: `network_policies(topo)` returns the policies `k8s.render` writes
into the base (one per core, one for all edges, one default deny). Allowed:
  users (anywhere)      -> every edge's HTTP port (the OpenAI API; /metrics is on it too)
  edges (same namespace)-> every core's protocol port and control port (model fetch)
  Prometheus (its namespace and pod labels, from the topology) -> every core's control port
  named batch clients (namespace + pod labels)                  -> every core's control port
  the pods of a parallel core's group (leader and workers)      -> each other, any port (rendezvous, gloo)
Everything else into the namespace is denied (egress is not restricted).
`netpol.Cluster` answers reachability questions over the rendered objects.
"""

from __future__ import annotations

from edgecore.deploy.k8s_workloads import APP, core_name, selector
from edgecore.deploy.topology import Topology

API = "networking.k8s.io/v1"
NAMESPACE_LABEL = "kubernetes.io/metadata.name"     # set by Kubernetes on every namespace


def _tcp(*ports: int) -> list[dict]:
    return [{"protocol": "TCP", "port": p} for p in sorted(set(ports))]


def _in_namespace(namespace: str, pod_labels: dict) -> dict:
    return {"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: namespace}},
            "podSelector": {"matchLabels": dict(pod_labels)}}


def _policy(name: str, pods: dict, ingress: list[dict]) -> dict:
    return {"apiVersion": API, "kind": "NetworkPolicy",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/name": APP}},
            "spec": {"podSelector": pods, "policyTypes": ["Ingress"], "ingress": ingress}}


def network_policies(topo: Topology) -> list[dict]:
    kube = topo.kube
    edges = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": "edge"}}}
    prometheus = _in_namespace(kube.prometheus.namespace, kube.prometheus.pod_labels)
    clients = [_in_namespace(c.namespace or kube.namespace, c.pod_labels) for c in kube.batch_clients]
    policies = [_policy("edgecore-default-deny", {}, [])]
    if topo.edges:
        policies.append(_policy("edgecore-edge-api", {"matchLabels": {"app.kubernetes.io/name": APP,
                                                                     "app.kubernetes.io/component": "edge"}},
                                [{"ports": _tcp(*(e.port for e in topo.edges))}]))
    for core in topo.cores:
        rules = [{"from": [edges], "ports": _tcp(core.port, core.http_port)},
                 {"from": [prometheus, *clients], "ports": _tcp(core.http_port)}]
        policies.append(_policy(f"edgecore-{core_name(core)}", {"matchLabels": selector("core", core.name)}, rules))
        if core.tp * core.pp > 1:     # a LeaderWorkerSet group: its ranks reach each other on any port (gloo/NCCL)
            group = {"matchLabels": {"app.kubernetes.io/name": APP, "edgecore.dev/node": core.name}}
            policies.append(_policy(f"edgecore-{core_name(core)}-ranks", group, [{"from": [{"podSelector": group}]}]))
    return policies
