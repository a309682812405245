"""Per-node credentials in the rendered manifests: one Secret per node (generated in its region's overlay from
secrets/NODE.cred), the authority and the revocation list beside the shared keys, every pod mounting its own
node's credential and no other's and running with --credential/--authority/--revocations into those mounts;
the cluster secret only when the topology names one. With kubectl at hand, kustomize builds the overlays
from credentials made by `edgecore keys` as docs/deploy.md says."""

import base64
import shutil
import subprocess

import pytest

from edgecore.deploy.cli import build_parser, main
from edgecore.deploy.k8s import render
from edgecore.deploy.k8s_check import check
from edgecore.deploy.k8s_refs import gather
from edgecore.deploy.topology import load_topology
from tests.deploy.conftest import ROOT

yaml = pytest.importorskip("yaml")
DOCS = (ROOT / "docs" / "deploy.md").read_text()


def overlays(out):
    return sorted(p for p in (out / "overlays").iterdir() if p.is_dir() and not p.name.endswith("-monitoring"))


def workloads(objects):
    """The object running each node's pods, as {kind, metadata, spec: {template}}: a parallel core's
    LeaderWorkerSet stands there with its leader's template (its workers run no node of their own)."""
    return [o if o["kind"] != "LeaderWorkerSet" else
            {**o, "spec": {"template": o["spec"]["leaderWorkerTemplate"]["leaderTemplate"]}}
            for o in objects if o["kind"] in ("Deployment", "StatefulSet", "LeaderWorkerSet")]


def node_of(workload):
    return workload["spec"]["template"]["metadata"]["labels"]["edgecore.dev/node"]


def mounted(workload):
    """The container's mounts as {mount path: (Secret name, its mounted keys)} (Secret volumes only)."""
    spec = workload["spec"]["template"]["spec"]
    volumes = {v["name"]: v["secret"] for v in spec["volumes"] if "secret" in v}
    container = spec["containers"][0]
    return {m["mountPath"]: (volumes[m["name"]]["secretName"], [i["path"] for i in volumes[m["name"]]["items"]])
            for m in container["volumeMounts"] if m["name"] in volumes and m["readOnly"]}


def in_mount(path, mounts):
    """The (Secret, key) a file path of the container reads, or None."""
    folder, _, name = path.rpartition("/")
    secret, keys = mounts.get(folder, (None, []))
    return (secret, name) if name in keys else None


def test_every_pod_mounts_its_own_credential_and_runs_with_it(rendered, three):
    for out, topo in ((rendered[0], load_topology(ROOT / "deploy" / "topology.toml")), (three[1], three[0])):
        nodes = {n.name for n in (*topo.cores, *topo.edges)}
        seen = set()
        for overlay in overlays(out):
            _, objects = gather(overlay, yaml)
            secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
            region_nodes = {n.name for n in (*topo.cores, *topo.edges) if n.region == overlay.name}
            # the overlay generates exactly its own nodes' credential Secrets, each from secrets/NODE.cred
            assert {s for s in secrets if s.startswith("edgecore-credential-")} == \
                {f"edgecore-credential-{n}" for n in region_nodes}
            kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
            assert sorted(g["files"] for g in kustomization["secretGenerator"]) == \
                sorted([f"credential=secrets/{n}.cred"] for n in region_nodes)
            assert (overlay / "secrets" / ".gitignore").is_file()
            for w in workloads(objects):
                node = node_of(w)
                seen.add(node)
                mounts = mounted(w)
                credentials = [s for s, _ in mounts.values() if s.startswith("edgecore-credential-")]
                assert credentials == [f"edgecore-credential-{node}"], (node, credentials)
                args = build_parser().parse_args(w["spec"]["template"]["spec"]["containers"][0]["args"])
                assert in_mount(args.credential, mounts) == (f"edgecore-credential-{node}", "credential")
                assert in_mount(args.authority, mounts) == (topo.secret_name, "authority.pub")
                assert in_mount(args.revocations, mounts) == (f"{topo.secret_name}-revocations", "revoked.txt")
                assert args.secret_file is None          # no cluster secret unless the topology names one
                for secret, keys in mounts.values():
                    assert set(keys) <= set(secrets[secret]["data"])
                mount_paths = sorted(m["mountPath"] for m in w["spec"]["template"]["spec"]["containers"][0]
                                     ["volumeMounts"])
                for a, b in zip(mount_paths, mount_paths[1:]):       # no mount inside a (read-only) Secret volume
                    assert not b.startswith(a + "/"), (a, b)
        assert seen == nodes


def test_shared_secrets_in_the_base(rendered):
    out = rendered[0]
    k = yaml.safe_load((out / "base" / "kustomization.yaml").read_text())
    generators = {g["name"]: g for g in k["secretGenerator"]}
    assert generators["edgecore-secrets"]["files"] == ["api-keys=secrets/api-keys",
                                                       "authority.pub=secrets/authority.pub"]
    revocations = generators["edgecore-secrets-revocations"]
    # no hash suffix: an update keeps the name, so kubelet refreshes the mounted file in running pods
    assert revocations["files"] == ["revoked.txt=secrets/revoked.txt"]
    assert revocations["options"] == {"disableNameSuffixHash": True}
    for needle in ("edgecore keys init", "edgecore keys issue", "edgecore keys revoke", "overlays/dc-east/secrets/",
                   "base/secrets/authority.pub", "base/secrets/revoked.txt", "edgecore-credential-"):
        assert needle in DOCS, needle


def test_a_named_cluster_secret_applies_beside_the_credentials(tmp_path):
    text = (ROOT / "deploy" / "topology.toml").read_text().replace(
        '# cluster_secret_file = "/etc/edgecore/cluster.secret"', 'cluster_secret_file = "/etc/edgecore/cluster.secret"')
    assert 'cluster_secret_file = "/etc' in text
    (tmp_path / "topology.toml").write_text(text)
    render(load_topology(tmp_path / "topology.toml"), tmp_path / "out")
    assert check(tmp_path / "out") == []
    k = yaml.safe_load((tmp_path / "out" / "base" / "kustomization.yaml").read_text())
    assert "cluster-secret=secrets/cluster-secret" in k["secretGenerator"][0]["files"]
    for overlay in overlays(tmp_path / "out"):
        for w in workloads(gather(overlay, yaml)[1]):
            args = build_parser().parse_args(w["spec"]["template"]["spec"]["containers"][0]["args"])
            assert in_mount(args.secret_file, mounted(w)) == ("edgecore-secrets", "cluster-secret")
            assert args.credential and args.authority and args.revocations


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (its built-in kustomize)")
def test_kustomize_builds_each_pod_with_its_own_credential(tmp_path, rendered, capsys):
    """The steps of docs/deploy.md: keys init, keys issue per node, the files where the render expects them;
    `kubectl kustomize` then gives every pod the hashed Secret holding its own node's credential."""
    from edgecore.protocol.credentials import NodeIdentity, load_authorities
    out, keys = tmp_path / "k8s", tmp_path / "edgecore-keys"
    shutil.copytree(rendered[0], out)
    topo = load_topology(ROOT / "deploy" / "topology.toml")
    assert main(["keys", "init", "--dir", str(keys)]) == 0
    for node in (*topo.cores, *topo.edges):
        role = "core" if node in topo.cores else "edge"
        assert main(["keys", "issue", node.name, "--role", role, "--region", node.region, "--dir", str(keys)]) == 0
        shutil.copy(keys / f"{node.name}.cred", out / "overlays" / node.region / "secrets" / f"{node.name}.cred")
    (keys / "revoked.txt").touch()
    shutil.copy(keys / "authority.pub", out / "base" / "secrets" / "authority.pub")
    shutil.copy(keys / "revoked.txt", out / "base" / "secrets" / "revoked.txt")
    (out / "base" / "secrets" / "api-keys").write_text("key\n")
    capsys.readouterr()
    for overlay in overlays(out):
        built = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
        assert built.returncode == 0, built.stderr
        objects = [d for d in yaml.safe_load_all(built.stdout) if d]
        secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
        assert "edgecore-secrets-revocations" in secrets            # the name the nodes' mounts keep
        for w in workloads(objects):
            node = node_of(w)
            volumes = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
            data = secrets[volumes["credential"]["secret"]["secretName"]]["data"]
            (tmp_path / "node.cred").write_bytes(base64.b64decode(data["credential"]))
            identity = NodeIdentity.load(tmp_path / "node.cred")
            assert identity.credential.name == node
            authority = base64.b64decode(secrets[volumes["secrets"]["secret"]["secretName"]]["data"]["authority.pub"])
            (tmp_path / "authority.pub").write_bytes(authority)
            assert identity.credential.authority in load_authorities(tmp_path / "authority.pub")
            assert volumes["revocations"]["secret"]["secretName"] == "edgecore-secrets-revocations"
