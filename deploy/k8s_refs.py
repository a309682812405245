"""Cross-references of a rendered overlay: every name a Pod uses is an object of the same build.

Life cycle: `gather(directory)` collects what `kubectl apply -k DIRECTORY`
would apply (resources followed recursively; a secretGenerator becomes a
Secret with its keys, not its contents); `problems(directory)` then checks
each workload's pods: mounted Secrets exist with the keys mounted, claims
exist (or come from the workload's claim templates), volume mounts name
volumes, files the node reads from Secrets (`SECRET_FILE_FLAGS`: credential,
keys, certificate) are keys of a mounted Secret, `--core-dns NAME:PORT` names
a headless Service with that port (in this overlay or another region's,
applied to the same cluster), selectors of Services and PodDisruptionBudgets
match a workload's pods, and the Secret a ServiceMonitor verifies
certificates with (`tlsConfig.ca`) exists with that key.
Images, the default ServiceAccount, StorageClasses and node labels are
outside the build (docs/deploy.md lists them).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

# arguments naming a file the node reads from a mounted Secret
SECRET_FILE_FLAGS = ("--credential", "--authority", "--revocations", "--secret-file", "--api-key-file",
                     "--model-from-key-file", "--tls-cert", "--tls-key")


def gather(directory: Path, yaml: ModuleType) -> tuple[str | None, list[dict]]:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects: list[dict] = []
    for res in k.get("resources", []):
        path = directory / res
        if path.is_dir():
            objects += gather(path, yaml)[1]
        elif path.is_file():
            objects += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for gen in k.get("secretGenerator", []):
        keys = {f.split("=", 1)[0] for f in gen.get("files", [])}
        objects.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": gen["name"]},
                        "data": dict.fromkeys(sorted(keys), "")})
    return k.get("namespace"), objects


def _selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


WORKLOADS = ("Deployment", "StatefulSet", "LeaderWorkerSet")


def pod_templates(workload: dict) -> list[tuple[dict, list[dict]]]:
    """A workload's pod templates, each with the claim templates its pods may mount: a Deployment's or
    StatefulSet's one, a LeaderWorkerSet's leader and worker templates."""
    spec = workload["spec"]
    if workload["kind"] == "LeaderWorkerSet":
        group = spec["leaderWorkerTemplate"]
        claims = group.get("volumeClaimTemplates", [])
        return [(group[key], claims) for key in ("leaderTemplate", "workerTemplate") if key in group]
    return [(spec["template"], spec.get("volumeClaimTemplates", []))]


def _pod_problems(template: dict, claims: list[dict], by_kind: dict[str, dict[str, dict]],
                  services: dict[str, dict]) -> list[str]:
    spec = template["spec"]
    templates = {t["metadata"]["name"] for t in claims}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    found = []
    for volume in volumes.values():
        if "secret" in volume:
            secret = by_kind.get("Secret", {}).get(volume["secret"]["secretName"])
            if secret is None:
                found.append(f"Secret {volume['secret']['secretName']} is not generated")
            else:
                found += [f"Secret {volume['secret']['secretName']} has no key {i['key']}"
                          for i in volume["secret"].get("items", []) if i["key"] not in secret.get("data", {})]
        elif "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            if claim not in by_kind.get("PersistentVolumeClaim", {}):
                found.append(f"PersistentVolumeClaim {claim} is not generated")
    for container in spec["containers"]:
        found += [f"volumeMount {m['name']} names no volume" for m in container.get("volumeMounts", [])
                  if m["name"] not in volumes and m["name"] not in templates]
        files = {f"{m['mountPath']}/{i['path']}" for m in container.get("volumeMounts", [])
                 if "secret" in volumes.get(m["name"], {}) for i in volumes[m["name"]]["secret"].get("items", [])}
        args = container.get("args", [])
        for flag, value in zip(args, args[1:]):
            if flag in SECRET_FILE_FLAGS and value not in files:
                found.append(f"{flag} {value} is no key of a mounted Secret")
            if flag == "--core-dns":
                name, port = value.split(":")[0].split(".")[0], int(value.rsplit(":", 1)[1])
                svc = services.get(name)
                if svc is None or svc["spec"].get("clusterIP") != "None" or \
                        port not in [p["port"] for p in svc["spec"]["ports"]]:
                    found.append(f"--core-dns {value} names no headless Service with that port")
    return found


def problems(directory: Path, yaml: ModuleType, elsewhere: Sequence[dict] = ()) -> list[str]:
    """`elsewhere`: objects of the other overlays (an edge's cores may be another region's)."""
    _, objects = gather(directory, yaml)
    by_kind: dict[str, dict[str, dict]] = {}
    for o in objects:
        by_kind.setdefault(o["kind"], {})[o["metadata"]["name"]] = o
    workloads = [o for o in objects if o["kind"] in WORKLOADS]
    found = []
    services = {o["metadata"]["name"]: o for o in [*elsewhere, *objects] if o["kind"] == "Service"}
    for w in workloads:
        for template, claims in pod_templates(w):
            found += [f"{w['kind']}/{w['metadata']['name']}: {p}"
                      for p in _pod_problems(template, claims, by_kind, services)]
    for name, monitor in by_kind.get("ServiceMonitor", {}).items():
        for endpoint in monitor["spec"].get("endpoints", []):
            ref = endpoint.get("tlsConfig", {}).get("ca", {}).get("secret")
            if ref and ref["key"] not in by_kind.get("Secret", {}).get(ref.get("name"), {}).get("data", {}):
                found.append(f"ServiceMonitor/{name}: tlsConfig.ca: Secret {ref.get('name')} with key {ref['key']} "
                             "is not generated")
    for kind, key in (("Service", ("spec", "selector")), ("PodDisruptionBudget", ("spec", "selector", "matchLabels"))):
        for name, o in by_kind.get(kind, {}).items():
            selector = o
            for part in key:
                selector = selector.get(part, {})
            if not any(_selects(selector, t["metadata"]["labels"]) for w in workloads for t, _ in pod_templates(w)):
                found.append(f"{kind}/{name}: selects no pod of this overlay")
    return found
