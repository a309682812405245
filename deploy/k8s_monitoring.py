"""The optional monitoring overlay of a region: a ServiceMonitor and queue-depth autoscaling for its edges.

Life cycle: `monitoring_manifests(topo, region)` returns the objects of
overlays/REGION-monitoring (which builds on overlays/REGION): a Prometheus
Operator `ServiceMonitor` over the region's Services (port `http`, /metrics),
and per edge either a KEDA `ScaledObject` (default) or an autoscaling/v2
HPA on a Pods metric (served by prometheus-adapter), both on
`edgecore:num_requests_waiting` (edge/metrics.py) per replica. `replica_patch`
removes the Deployments' fixed replica count so the autoscaler owns it. With `[kubernetes] tls` the
scrape is HTTPS, verified against the CA Secret: one ServiceMonitor per node then, as each names the
node's Service as the certificate's server name (Prometheus scrapes pod addresses).
"""

from __future__ import annotations

from edgecore.deploy.k8s_workloads import APP, TLS_CA_KEY, edge_name, tls_ca_secret, tls_names
from edgecore.deploy.topology import TopologyCore, TopologyEdge, Topology

QUEUE_METRIC = "edgecore:num_requests_waiting"
ADAPTER_METRIC = "edgecore_num_requests_waiting"     # the name prometheus-adapter serves it under (docs/deploy.md)


def service_monitor(topo: Topology, region: str, node: TopologyCore | TopologyEdge | None = None) -> dict:
    """The region's Services (`node`: that node's Service only, scraped over HTTPS)."""
    endpoint: dict = {"port": "http", "path": "/metrics", "interval": "15s"}
    match = {"app.kubernetes.io/name": APP, "edgecore.dev/region": region}
    name = f"edgecore-{region}"
    if node is not None:
        names = tls_names(topo, node)                   # [Service, ..., Service.NAMESPACE.svc]
        ca = {"secret": {"name": tls_ca_secret(topo), "key": TLS_CA_KEY}}
        endpoint |= {"scheme": "https", "tlsConfig": {"ca": ca, "serverName": names[-1], "insecureSkipVerify": False}}
        match["edgecore.dev/node"] = node.name
        name = f"edgecore-{names[0]}"
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": {"name": name,
                         "labels": {"app.kubernetes.io/name": APP, **topo.kube.prometheus.service_monitor_labels}},
            "spec": {"selector": {"matchLabels": match},
                     "namespaceSelector": {"matchNames": [topo.kube.namespace]},
                     "endpoints": [endpoint]}}


def queue_query(topo: Topology, edge: TopologyEdge) -> str:
    """Waiting requests summed over the edge's pods (the Service's scrape target labels)."""
    return f'sum({QUEUE_METRIC}{{namespace="{topo.kube.namespace}",service="{edge_name(edge)}"}})'


def autoscaler(topo: Topology, edge: TopologyEdge) -> dict:
    name, target = edge_name(edge), topo.kube.autoscaling.queue_target
    meta = {"name": name, "labels": {"app.kubernetes.io/name": APP, "edgecore.dev/node": edge.name}}
    if topo.kube.autoscaling.mode == "keda":
        return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": meta,
                "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                         "minReplicaCount": edge.replicas, "maxReplicaCount": edge.max_replicas,
                         "pollingInterval": 15, "cooldownPeriod": 300,
                         "triggers": [{"type": "prometheus", "metricType": "AverageValue", "metadata": {
                             "serverAddress": topo.kube.prometheus.url, "query": queue_query(topo, edge),
                             "threshold": f"{target:g}"}}]}}
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": meta,
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                     "minReplicas": edge.replicas, "maxReplicas": edge.max_replicas,
                     "metrics": [{"type": "Pods", "pods": {"metric": {"name": ADAPTER_METRIC},
                                                           "target": {"type": "AverageValue",
                                                                      "averageValue": f"{target:g}"}}}]}}


def replica_patch() -> dict:
    """A kustomize patch: edge Deployments leave `replicas` to the autoscaler (else each apply resets it)."""
    return {"target": {"kind": "Deployment", "labelSelector": "app.kubernetes.io/component=edge"},
            "patch": "- op: remove\n  path: /spec/replicas\n"}


def monitoring_manifests(topo: Topology, region: str) -> list[dict]:
    everyone: tuple[TopologyCore | TopologyEdge, ...] = (*topo.cores, *topo.edges)
    nodes = [n for n in everyone if n.region == region]
    monitors = [service_monitor(topo, region, n) for n in nodes] if topo.kube.tls and nodes \
        else [service_monitor(topo, region)]
    return [*monitors, *(autoscaler(topo, e) for e in topo.edges if e.region == region)]
