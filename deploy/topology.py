"""Topology files: regions, their core and edge nodes, links between regions, model, secrets.

Life cycle: `load_topology(path)` parses TOML (tomllib), validates every key
and value, and returns a frozen `Topology`; a problem raises `TopologyError`
naming the key and the line of the file where it is (or where its table
starts). See deploy/topology.toml for a documented example of the schema.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from edgecore.shared.errors import ConfigError

NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$")


class TopologyError(ConfigError):
    pass


@dataclass(frozen=True)
class CoreNode:
    name: str
    region: str
    device: str = "cpu"
    tp: int = 1
    pp: int = 1
    port: int = 7100
    http_port: int = 7101
    replicas: int = 1


@dataclass(frozen=True)
class EdgeNode:
    name: str
    region: str
    port: int = 8000
    replicas: int = 1
    max_replicas: int = 4
    codecs: tuple[str, ...] = ("lossless",)
    transfer_timeout: float = 30.0      # seconds without KV progress before the edge gives up on a core


@dataclass(frozen=True)
class Link:
    a: str
    b: str
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    bandwidth_mbit: float | None = None
    loss_pct: float = 0.0


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
    cores: tuple[CoreNode, ...]
    edges: tuple[EdgeNode, ...]
    links: tuple[Link, ...] = field(default_factory=tuple)

    def link(self, a: str, b: str) -> Link | None:
        for link in self.links:
            if {link.a, link.b} == {a, b}:
                return link
        return None

    def cores_for(self, region: str) -> list[CoreNode]:
        """Cores an edge in `region` may use, nearest (by configured delay) first."""
        def delay(core: CoreNode) -> float:
            if core.region == region:
                return 0.0
            link = self.link(region, core.region)
            return link.delay_ms if link else float("inf")
        return sorted((c for c in self.cores if delay(c) != float("inf")), key=delay)


class _Locator:
    """Finds the line of a key in the TOML text (tables tracked by their headers)."""

    def __init__(self, text: str):
        self.lines = text.splitlines()

    def line(self, table: str, key: str | None = None, index: int | None = None) -> int:
        header = re.compile(r"^\s*\[\[?\s*" + re.escape(table) + r"\s*\]\]?\s*(#.*)?$")
        seen, start = -1, None
        for number, text in enumerate(self.lines, start=1):
            if header.match(text):
                seen += 1
                if index is None or seen == index:
                    start = number
                    break
        if start is None:
            return 1
        if key is None:
            return start
        key_re = re.compile(r"^\s*" + re.escape(key) + r"\s*=")
        for number in range(start, len(self.lines)):
            text = self.lines[number]
            if text.lstrip().startswith("["):
                break
            if key_re.match(text):
                return number + 1
        return start


EXAMPLE = "example"      # `--topology example`: the documented topology.toml shipped in the package


def example_topology_path() -> Path:
    """The bundled example topology (package data beside this module)."""
    from importlib import resources
    return Path(str(resources.files("edgecore.deploy").joinpath("topology.toml")))


def load_topology(path: str | Path) -> Topology:
    path = example_topology_path() if str(path) == EXAMPLE else Path(path)
    if not path.is_file():
        raise TopologyError(f"topology file {path} does not exist")
    text = path.read_text()
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TopologyError(f"{path}: {exc}") from None
    loc = _Locator(text)

    def fail(table: str, key: str | None, message: str, index: int | None = None):
        shown = f"{table}[{index}].{key}" if index is not None and key else (f"{table}.{key}" if key else table)
        raise TopologyError(f"{path}:{loc.line(table, key, index)}: '{shown}' {message}")

    def get(table: dict, tname: str, key: str, kind, default=None, index=None, lo=None):
        value = table.get(key, default)
        if value is None:
            return None
        ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            fail(tname, key, f"must be {kind.__name__}, got {value!r}", index)
        if lo is not None and value < lo:
            fail(tname, key, f"must be at least {lo}, got {value!r}", index)
        return value

    model = raw.get("model", {})
    if not isinstance(model, dict):
        fail("model", None, "must be a table")
    base = path.parent
    model_path = get(model, "model", "path", str, "models/pydoc-llama")
    resolved = Path(model_path) if Path(model_path).is_absolute() else (base / model_path)
    if not resolved.exists():
        resolved = Path(model_path)
    model_name = get(model, "model", "name", str, Path(model_path).name)
    image = get(model, "model", "image", str, "edgecore:latest")
    secrets = raw.get("secrets", {})
    secret_file = get(secrets, "secrets", "cluster_secret_file", str)
    secret_name = get(secrets, "secrets", "kubernetes_secret", str, "edgecore-secrets")
    api_keys_file = get(secrets, "secrets", "api_keys_file", str)
    regions_raw = raw.get("regions")
    if not isinstance(regions_raw, dict) or not regions_raw:
        raise TopologyError(f"{path}:1: 'regions' must define at least one region ([regions.NAME])")
    cores, edges, names = [], [], set()
    for region, spec in regions_raw.items():
        tname = f"regions.{region}"
        if not NAME.match(region):
            fail(tname, None, "is not a valid name (lowercase letters, digits, '-')")
        if not isinstance(spec, dict):
            fail(tname, None, "must be a table")
        unknown = set(spec) - {"cores", "edges"}
        if unknown:
            fail(tname, sorted(unknown)[0], "is not a known key (expected cores, edges)")
        for kind, items in (("cores", spec.get("cores", [])), ("edges", spec.get("edges", []))):
            if not isinstance(items, list):
                fail(f"{tname}.{kind}", None, "must be an array of tables ([[...]])")
            for i, node in enumerate(items):
                t = f"{tname}.{kind}"
                name = get(node, t, "name", str, f"{region}-{kind[:-1]}-{i}", i)
                if not NAME.match(name):
                    fail(t, "name", f"is not a valid name: {name!r}", i)
                if name in names:
                    fail(t, "name", f"repeats node name {name!r}", i)
                names.add(name)
                allowed = ({"name", "device", "tp", "pp", "port", "http_port", "replicas"} if kind == "cores"
                           else {"name", "port", "replicas", "max_replicas", "codecs", "transfer_timeout"})
                for key in node:
                    if key not in allowed:
                        fail(t, key, f"is not a known key of {kind} (expected {', '.join(sorted(allowed))})", i)
                if kind == "cores":
                    device = get(node, t, "device", str, "cpu", i)
                    if device not in ("cpu", "cuda"):
                        fail(t, "device", f"must be 'cpu' or 'cuda', got {device!r}", i)
                    cores.append(CoreNode(name, region, device, get(node, t, "tp", int, 1, i, 1),
                                          get(node, t, "pp", int, 1, i, 1), get(node, t, "port", int, 7100, i, 1),
                                          get(node, t, "http_port", int, 7101, i, 1),
                                          get(node, t, "replicas", int, 1, i, 1)))
                else:
                    codecs = node.get("codecs", ["lossless"])
                    if not isinstance(codecs, list) or not all(c in ("raw", "lossless", "fp8", "int8", "int4")
                                                               for c in codecs):
                        fail(t, "codecs", "must list codecs among raw, lossless, fp8, int8, int4", i)
                    replicas = get(node, t, "replicas", int, 1, i, 1)
                    edges.append(EdgeNode(name, region, get(node, t, "port", int, 8000, i, 1), replicas,
                                          max(replicas, get(node, t, "max_replicas", int, 4, i, 1)), tuple(codecs),
                                          get(node, t, "transfer_timeout", float, 30.0, i, 0.1)))
    if not cores and not edges:
        raise TopologyError(f"{path}:1: the topology has no nodes")
    links = []
    for i, spec in enumerate(raw.get("links", [])):
        a, b = get(spec, "links", "from", str, None, i), get(spec, "links", "to", str, None, i)
        for key, value in (("from", a), ("to", b)):
            if value not in regions_raw:
                fail("links", key, f"names unknown region {value!r}", i)
        loss = get(spec, "links", "loss_pct", float, 0.0, i, 0.0)
        if loss >= 100:
            fail("links", "loss_pct", "must be below 100", i)
        links.append(Link(a, b, get(spec, "links", "delay_ms", float, 0.0, i, 0.0),
                          get(spec, "links", "jitter_ms", float, 0.0, i, 0.0),
                          get(spec, "links", "bandwidth_mbit", float, None, i, 0.001), loss))
    return Topology(str(path), str(resolved), model_name, image, secret_file, secret_name, api_keys_file,
                    tuple(regions_raw), tuple(cores), tuple(edges), tuple(links))


def default_topology(model: str) -> Topology:
    """`edgecore up` with no file: one core and one edge, one region."""
    return Topology("(default)", model, Path(model).name, "edgecore:latest", None, "edgecore-secrets", None,
                    ("local",), (CoreNode("core", "local"),), (EdgeNode("edge", "local"),), ())
