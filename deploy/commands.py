"""`edgecore up`, `edgecore deploy render` and the WAN relay helper."""

from __future__ import annotations

import argparse
import os


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="run a topology (default: one core + one edge) on this machine",
                       description="Start every core and edge of a topology as local processes, wait until "
                                   "they are ready, print the edge URLs; Ctrl-C or SIGTERM stops them all.")
    p.add_argument("--topology", default=None,
                   help="topology TOML, or 'example' for the bundled three-region example "
                        "(default: one core and one edge, bundled model)")
    p.add_argument("--model", default=None, help="model directory when no topology is given")
    p.add_argument("--emulate-wan", action="store_true",
                   help="run each region in its own network namespace with the links' delay, jitter, "
                        "bandwidth and loss (needs root)")
    p.add_argument("--data-dir", default=None, help="where cores keep batch data (default: temporary)")
    p.add_argument("--tls", action="store_true",
                   help="HTTPS on every node's HTTP port, with certificates from a local CA made for this run "
                        "(clients trust its ca.pem, printed with the URLs)")
    p.add_argument("--shared-secret", action="store_true",
                   help="shared-secret mode, for a quick local run: every node authenticates with one cluster "
                        "secret (the topology's cluster_secret_file, or one generated for the run) instead of "
                        "the default per-node credentials (an authority and one credential per node, made for "
                        "the run)")
    p.set_defaults(func=run_up)

    d = sub.add_parser("deploy", help="render Kubernetes manifests from a topology",
                       description="Deployment tooling.")
    dsub = d.add_subparsers(dest="deploy_command", metavar="ACTION")
    dsub.required = True
    r = dsub.add_parser("render", help="write a kustomize base and one overlay per region",
                        description="Write Kubernetes manifests (kustomize base + per-region overlays).")
    r.add_argument("--topology", default="example",
                   help="topology TOML (default: 'example', the bundled three-region example)")
    r.add_argument("--out", required=True)
    r.add_argument("--check", action="store_true",
                   help="validate what was written: kubernetes-validate --strict for built-in kinds, a schema "
                        "for the CRD kinds and kustomizations (needs the 'deploy' extra)")
    r.set_defaults(func=run_render)

    w = sub.add_parser("wan-relay", help="(internal) a TCP relay adding delay and jitter between regions",
                       description="Relay TCP connections with one-way delay and jitter (used by --emulate-wan).")
    w.add_argument("--listen", required=True)
    w.add_argument("--target", required=True)
    w.add_argument("--delay-ms", type=float, default=0.0)
    w.add_argument("--jitter-ms", type=float, default=0.0)
    w.set_defaults(func=run_relay)


def run_up(args: argparse.Namespace) -> int:
    from edgecore.deploy.launcher import Launcher
    from edgecore.deploy.topology import default_topology, load_topology
    from edgecore.shared.node.env import default_model
    from edgecore.shared.errors import ConfigError
    if args.emulate_wan and os.geteuid() != 0:
        raise ConfigError("--emulate-wan needs root (network namespaces, tc and nftables)")
    topo = load_topology(args.topology) if args.topology else default_topology(args.model or default_model())
    return Launcher(topo, args.emulate_wan, args.data_dir, tls=args.tls, shared_secret=args.shared_secret).run()


def run_render(args: argparse.Namespace) -> int:
    from edgecore.deploy.k8s import render
    from edgecore.deploy.topology import load_topology
    files = render(load_topology(args.topology), args.out)
    print(f"wrote {len(files)} files under {args.out}")
    if args.check:
        import sys

        from edgecore.deploy.k8s_check import check
        from edgecore.shared.errors import ConfigError
        problems = check(args.out)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            raise ConfigError(f"{len(problems)} problems in the manifests under {args.out} (listed above)")
        print(f"checked: every manifest under {args.out} validates")
    return 0


def run_relay(args: argparse.Namespace) -> int:

    from edgecore.deploy.wan_relay import LinkSpec, WanRelay
    from edgecore.shared.node.secrets import parse_hostport
    from edgecore.shared.node.service import run_service
    relay = WanRelay(LinkSpec(args.delay_ms, args.jitter_ms))

    async def start() -> None:
        await relay.start(parse_hostport(args.listen), parse_hostport(args.target))
        print(f"relay ready: {args.listen} -> {args.target}", flush=True)

    return run_service(start, relay.stop)
