"""A small NetworkPolicy evaluator: may this pod reach that pod on that port, given the policies?

Life cycle: `Cluster(objects, namespaces)` takes rendered objects (the pods
come from Deployment/StatefulSet/LeaderWorkerSet templates, with the kustomization's
namespace) and namespace labels; `allowed(source, target, port)` answers for
ingress as Kubernetes does: a target no Ingress policy selects accepts
everything; otherwise some selecting policy must have a rule whose peers
match the source (podSelector in the policy's namespace, namespaceSelector,
both: pods matching in matching namespaces; no `from`: anyone) and whose
ports match (number, named container port, or range; no `ports`: all).
Egress and ipBlock peers are not modelled (edgecore renders neither).
Used by the tests to check that the policies mean what docs/deploy.md says.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edgecore.deploy.k8s_refs import WORKLOADS, pod_templates


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: dict[str, str]
    ports: dict[str, int] = field(default_factory=dict)     # named container ports


def matches(selector: dict | None, labels: dict[str, str]) -> bool:
    """A LabelSelector: matchLabels and matchExpressions all hold ({} selects everything)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


class Cluster:
    def __init__(self, objects: list[tuple[str, dict]], namespaces: dict[str, dict[str, str]] | None = None):
        """`objects`: (namespace, object) pairs; `namespaces`: extra labels per namespace."""
        self.policies = [(ns, o) for ns, o in objects if o.get("kind") == "NetworkPolicy"]
        self.pods: dict[str, Pod] = {}
        self.namespaces = {ns: {"kubernetes.io/metadata.name": ns} for ns, _ in objects}
        for ns, labels in (namespaces or {}).items():
            self.namespaces[ns] = {"kubernetes.io/metadata.name": ns, **labels}
        for ns, o in objects:
            if o.get("kind") not in WORKLOADS:
                continue
            for template, _ in pod_templates(o):      # a LeaderWorkerSet's worker pods: NAME-worker
                name = o["metadata"]["name"] + ("-worker" if template is o["spec"].get("leaderWorkerTemplate", {})
                                                .get("workerTemplate") else "")
                ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"]
                         for p in c.get("ports", []) if "name" in p}
                self.pods[name] = Pod(name, ns, template["metadata"]["labels"], ports)

    def pod(self, name: str) -> Pod:
        return self.pods[name]

    def _peer(self, peer: dict, policy_ns: str, source: Pod) -> bool:
        if "ipBlock" in peer:
            return False
        ns_labels = self.namespaces.get(source.namespace, {"kubernetes.io/metadata.name": source.namespace})
        if "namespaceSelector" in peer:
            if not matches(peer["namespaceSelector"], ns_labels):
                return False
        elif source.namespace != policy_ns:
            return False
        return matches(peer.get("podSelector"), source.labels)

    @staticmethod
    def _port(rule_port: dict, target: Pod, port: int, protocol: str) -> bool:
        if rule_port.get("protocol", "TCP") != protocol:
            return False
        want = rule_port.get("port")
        if want is None:
            return True
        if isinstance(want, str):
            return target.ports.get(want) == port
        return want <= port <= rule_port.get("endPort", want)

    def allowed(self, source: Pod, target: Pod, port: int, protocol: str = "TCP") -> bool:
        selecting = [(ns, p) for ns, p in self.policies if ns == target.namespace
                     and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                     and matches(p["spec"].get("podSelector"), target.labels)]
        if not selecting:
            return True
        for ns, policy in selecting:
            for rule in policy["spec"].get("ingress") or []:
                peers_ok = not rule.get("from") or any(self._peer(p, ns, source) for p in rule["from"])
                ports_ok = not rule.get("ports") or any(self._port(p, target, port, protocol) for p in rule["ports"])
                if peers_ok and ports_ok:
                    return True
        return False
