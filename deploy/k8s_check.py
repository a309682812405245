"""`edgecore deploy render --check`: validate rendered manifests offline.

Life cycle: `check(out)` reads every YAML file under OUT and returns the
problems found (empty when all is well): built-in kinds against
kubernetes-validate's strict schemas (unknown fields fail), the CRD kinds of
the monitoring overlay and kustomizations against `k8s_schemas`, every
kustomization's `resources` must exist, and each overlay's pods may name
only objects of its own build (`k8s_refs`). kubernetes-validate (and the PyYAML
and jsonschema it brings) is the `deploy` extra; without it `check` raises a
ConfigError saying what to install.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from edgecore.deploy.k8s_refs import gather
from edgecore.deploy.k8s_refs import problems as references
from edgecore.deploy.k8s_schemas import CRDS, KUSTOMIZATION, LWS_POD_TEMPLATES
from edgecore.shared.errors import ConfigError

if TYPE_CHECKING:
    from jsonschema.protocols import Validator

KUBERNETES_VERSION = "1.30"      # the oldest release the manifests are checked against (all fields are GA there)


def _libraries() -> tuple[ModuleType, ModuleType, ModuleType]:
    try:
        import jsonschema
        import kubernetes_validate
        import yaml
    except ImportError as exc:
        raise ConfigError(f"--check needs {exc.name}: pip install 'edgecore[deploy]'") from None
    return jsonschema, kubernetes_validate, yaml


def _schema_problems(jsonschema: ModuleType, schema: dict, doc: dict) -> list[str]:
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '(top)'}: {e.message}"
            for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]


def check_document(doc: dict) -> list[str]:
    """Problems of one manifest (built-in kind: strict Kubernetes schema; CRD kind: k8s_schemas)."""
    jsonschema, _, _ = _libraries()
    if not isinstance(doc, dict) or "kind" not in doc or "apiVersion" not in doc:
        return ["not a Kubernetes object (no apiVersion/kind)"]
    schema = CRDS.get((doc["apiVersion"], doc["kind"]))
    if schema is not None:
        found = _schema_problems(jsonschema, schema, doc)
        if doc["kind"] == "LeaderWorkerSet" and not found:
            found = _leader_worker_set_templates(doc)
        return found
    validator = _strict_validator(doc["apiVersion"], doc["kind"])
    if validator is None:
        return [f"no schema for {doc['kind']} ({doc['apiVersion']}) in Kubernetes {KUBERNETES_VERSION}"]
    error = next(iter(sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))), None)
    return [] if error is None else [f"{'.'.join(str(p) for p in error.absolute_path) or '(top)'}: {error.message}"]


def _leader_worker_set_templates(doc: dict) -> list[str]:
    """A LeaderWorkerSet's pod and claim templates against Kubernetes' strict Pod and PersistentVolumeClaim."""
    found = []
    group = doc["spec"]["leaderWorkerTemplate"]
    embedded = [(f"spec.leaderWorkerTemplate.{key}", "Pod", group[key]) for key in LWS_POD_TEMPLATES if key in group]
    embedded += [(f"spec.leaderWorkerTemplate.volumeClaimTemplates.{i}", "PersistentVolumeClaim", claim)
                 for i, claim in enumerate(group.get("volumeClaimTemplates", []))]
    for where, kind, template in embedded:
        as_object = {"apiVersion": "v1", "kind": kind, **template}
        found += [f"{where}: {p}" for p in check_document(as_object)]
    return found


@functools.cache
def _strict_validator(api_version: str, kind: str) -> Validator | None:
    """kubernetes-validate's strict schema for a kind, as `kubernetes_validate.validate(strict=True)` finds
    it, built once (the library re-reads its definitions file on every call: ~0.2 s per object)."""
    jsonschema, kv, _ = _libraries()
    from kubernetes_validate import utils
    from referencing import Registry, Resource
    version = [v for v in utils.all_versions() if utils.major_minor(v) <= KUBERNETES_VERSION][-1]
    folder = f"kubernetes-json-schema/v{version}-local-strict"
    api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    try:
        schema = utils.schema_contents(f"{folder}/{kind.lower()}-{api}.json", version)
    except FileNotFoundError:
        return None
    definitions = utils.schema_contents(f"{folder}/_definitions.json", version)
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def check(out: str | Path) -> list[str]:
    """Every problem under `out`, each as 'FILE: KIND/NAME: where: what'."""
    jsonschema, _, yaml = _libraries()
    out = Path(out)
    problems: list[str] = []
    files = sorted(out.rglob("*.yaml"))
    if not files:
        return [f"{out}: no manifests"]
    for path in files:
        shown = path.relative_to(out)
        try:
            docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        except yaml.YAMLError as exc:
            problems.append(f"{shown}: not YAML: {exc}")
            continue
        for doc in docs:
            if path.name == "kustomization.yaml":
                found = _schema_problems(jsonschema, KUSTOMIZATION, doc)
                found += [f"resources: {r} does not exist" for r in doc.get("resources", [])
                          if not (path.parent / r).exists()]
                problems += [f"{shown}: {p}" for p in found]
                continue
            name = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}" if isinstance(doc, dict) else "?"
            problems += [f"{shown}: {name}: {p}" for p in check_document(doc)]
    overlays = sorted(p for p in (out / "overlays").glob("*") if (p / "kustomization.yaml").is_file())
    everything = [o for overlay in overlays for o in gather(overlay, yaml)[1]]
    for overlay in overlays:
        problems += [f"{overlay.relative_to(out)}: {p}" for p in references(overlay, yaml, everything)]
    return problems
