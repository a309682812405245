"""The `edgecore` command: one argparse parser, subcommands registered by each package.

Life cycle: `main()` builds the parser (each package's `cli.register` adds
its subcommands), runs the chosen one, and turns user errors into one line
on stderr and a non-zero exit (no traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
from types import ModuleType

# Before anything imports numpy: its BLAS (OpenBLAS) sums the KV codecs' columns in worker threads beside
# torch's, and a BLAS thread pool of its own on the same cores slowed a core's prefill (bench/ttft.py, q3e, 8k
# tokens on 2 cores: TTFT 3.8 s, lossless 2.1 s; with one BLAS thread 2.1 s). shared/node/env.py lists it.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from edgecore.shared.node import cli as shared_cli  # noqa: E402
from edgecore.shared.errors import EdgecoreError  # noqa: E402

EXIT_USER_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgecore",
        description="Edge-plus-core LLM inference: prefill at the core, compressed KV over the WAN, "
                    "decode at the edge.")
    parser.add_argument("--version", action="version", version=f"edgecore {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in _modules():
        module.register(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("edgecore")
    except PackageNotFoundError:      # running from a checkout that was never installed
        return "unknown (not installed)"


def _modules() -> list[ModuleType]:
    mods = [shared_cli]
    for name in ("edgecore.core.cli", "edgecore.core.batch_cli", "edgecore.edge.cli", "edgecore.deploy.commands",
                 "edgecore.deploy.keys", "edgecore.deploy.plan_cli"):
        try:
            mods.append(__import__(name, fromlist=["register"]))
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
    return mods


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)     # e.g. to start a helper process alike
    try:
        from edgecore.shared.node.env import apply_threads
        apply_threads()
        return args.func(args) or 0
    except EdgecoreError as exc:
        print(f"edgecore: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except (FileNotFoundError, PermissionError, IsADirectoryError) as exc:
        print(f"edgecore: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
