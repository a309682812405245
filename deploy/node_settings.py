"""What a topology's node runs with: its keys as `CoreSettings` / `EdgeSettings`, and the node's command line.

Life cycle: `core_settings` / `edge_settings` map a node's topology keys onto its settings (the one place that
mapping is written); the launcher (deploy/launcher.py) and the Kubernetes manifests (deploy/k8s_workloads.py)
add where the node runs (addresses, files, the model's path) with `dataclasses.replace`, and `node_argv`
renders the result with `shared/settings.to_argv`, the one renderer, as `edgecore` arguments.
"""

from __future__ import annotations

from edgecore.core.settings import CoreSettings
from edgecore.deploy.topology import TopologyCore, TopologyEdge, Topology
from edgecore.edge.settings import EdgeSettings
from edgecore.shared.node.settings import to_argv


def core_settings(core: TopologyCore) -> CoreSettings:
    """A core's own keys: name, device, parallel layout, drain timeout, traces."""
    return CoreSettings(name=core.name, device=core.device, tp=core.tp, pp=core.pp, drain_timeout=core.drain_timeout,
                        otlp_endpoint=core.otlp_endpoint)


def edge_settings(topo: Topology, edge: TopologyEdge) -> EdgeSettings:
    """An edge's own keys (name, codecs, transfer timeout, compile, drain timeout, traces) and the topology's model
    name."""
    return EdgeSettings(name=edge.name, served_model_name=topo.model_name, codec=edge.codecs,
                        transfer_timeout=edge.transfer_timeout, compile=edge.compile,
                        drain_timeout=edge.drain_timeout, otlp_endpoint=edge.otlp_endpoint)


def node_argv(settings: CoreSettings | EdgeSettings) -> list[str]:
    """The `edgecore` arguments that run a node with these settings."""
    return ["core" if isinstance(settings, CoreSettings) else "edge", *to_argv(settings)]
