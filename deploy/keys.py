"""`edgecore keys`: the cluster authority and the per-node credentials it issues (protocol/credentials.py).

Life cycle of a fleet's credentials, all files in one folder (`--dir`, default ./edgecore-keys):
`keys init` makes the authority (authority.key: keep it offline; authority.pub: give it to every node as
`--authority`); `keys issue NAME --role core|edge [--region R] [--days N]` writes NAME.cred (the node's
signed credential and private key: its `--credential`, one Kubernetes Secret per node) and logs the serial
in issued.txt; `keys revoke NAME|SERIAL` appends the serials to revoked.txt (every node's `--revocations`:
re-read when it changes, so a revoked node is refused at its next handshake and its live connections close
within seconds). Rolling the authority over: `keys init --dir NEW`, append NEW/authority.pub's line to the
authority.pub the nodes read (both are trusted during the overlap), re-issue every node from NEW, then drop
the old line. Every command prints one line per file it wrote.
"""

from __future__ import annotations

import argparse
import base64
import os
import time
from pathlib import Path

from edgecore.protocol.credentials import ROLES, Authority, NodeIdentity
from edgecore.shared.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    k = sub.add_parser("keys", help="the cluster authority and per-node credentials for the core-edge link",
                       description="Make a cluster authority, issue a credential per node, revoke them.")
    ksub = k.add_subparsers(dest="keys_command", metavar="ACTION")
    ksub.required = True
    i = ksub.add_parser("init", help="make a cluster authority (authority.key, authority.pub)")
    i.add_argument("--dir", default="edgecore-keys", help="where the authority and credentials live")
    i.set_defaults(func=run_init)
    s = ksub.add_parser("issue", help="issue one node's credential (NAME.cred)")
    s.add_argument("name")
    s.add_argument("--role", required=True, choices=ROLES)
    s.add_argument("--region", default="")
    s.add_argument("--days", type=float, default=90.0, help="validity (default 90)")
    s.add_argument("--dir", default="edgecore-keys")
    s.set_defaults(func=run_issue)
    r = ksub.add_parser("revoke", help="revoke a node's credentials (by name, or one serial)")
    r.add_argument("name_or_serial")
    r.add_argument("--dir", default="edgecore-keys")
    r.set_defaults(func=run_revoke)


def _private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _authority(folder: Path) -> Authority:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    path = folder / "authority.key"
    if not path.exists():
        raise ConfigError(f"no authority in {folder}: run `edgecore keys init --dir {folder}` first")
    raw = base64.b64decode(path.read_text().split()[-1])
    return Authority(Ed25519PrivateKey.from_private_bytes(raw))


def run_init(args: argparse.Namespace) -> int:
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / "authority.key").exists():
        raise ConfigError(f"{folder / 'authority.key'} exists already: an authority is made once (see --help)")
    auth = Authority.generate()
    _private(folder / "authority.key", f"authority-key {base64.b64encode(auth.private.private_bytes_raw()).decode()}\n")
    (folder / "authority.pub").write_text(f"authority {base64.b64encode(auth.public).decode()}\n")
    print(f"wrote {folder / 'authority.key'} (keep it offline) and {folder / 'authority.pub'} (every node's "
          f"--authority); authority {auth.id}")
    return 0


def run_issue(args: argparse.Namespace) -> int:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    folder = Path(args.dir)
    if not args.name or "/" in args.name or args.name.startswith("."):
        raise ConfigError(f"bad node name {args.name!r}")
    if args.days <= 0:
        raise ConfigError("--days must be positive")
    key = Ed25519PrivateKey.generate()
    node = NodeIdentity(_authority(folder).issue(args.name, args.role, args.region, key, args.days), key)
    path = folder / f"{args.name}.cred"
    _private(path, node.dumps())
    c = node.credential
    with open(folder / "issued.txt", "a") as log:
        log.write(f"{c.serial} {c.name} {c.role} {c.region or '-'} until {time.strftime('%Y-%m-%d', time.gmtime(c.not_after))}\n")
    print(f"wrote {path}: {c.role} credential for {c.name}, serial {c.serial}, valid {args.days:g} days")
    return 0


def run_revoke(args: argparse.Namespace) -> int:
    folder = Path(args.dir)
    issued = [line.split() for line in (folder / "issued.txt").read_text().splitlines() if line.strip()] \
        if (folder / "issued.txt").exists() else []
    serials = [f[0] for f in issued if args.name_or_serial in (f[0], f[1])]
    if not serials:
        raise ConfigError(f"no credential named or numbered {args.name_or_serial!r} in {folder / 'issued.txt'}")
    with open(folder / "revoked.txt", "a") as out:
        for serial in serials:
            out.write(f"{serial} {args.name_or_serial} revoked {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
    print(f"revoked {len(serials)} credential(s) of {args.name_or_serial} in {folder / 'revoked.txt'} "
          f"(nodes reading it close their connections within seconds)")
    return 0
