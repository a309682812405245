"""Long chaos run: `bench/chaos.py --trials 10000` (or `--seed N` to replay one trial).

Starts a core and an edge with a fault-injecting relay between them (edgecore.deploy.chaos) and
reports trials, faults injected by kind, silent differences (must be 0), leaked blocks (must be 0),
clean errors, and the longest time from a fault to the affected request's answer.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from pathlib import Path

from common import ROOT, emit, progress

from edgecore.deploy.chaos import ChaosCluster
from edgecore.shared.text.tokenizer import Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=None, help="replay one trial")
    ap.add_argument("--model", default=str(ROOT / "models" / "pydoc-llama"))
    args = ap.parse_args()
    tok = Tokenizer.from_dir(args.model)
    held = Path(args.model, "heldout.txt")
    ids = tok.encode(held.read_text() if held.is_file() else "The quick brown fox " * 200)
    prompts = [ids[i * 97: i * 97 + n] for i, n in enumerate([40, 64, 90, 128, 170, 220, 300, 64, 100, 150])]
    seeds = [args.seed] if args.seed is not None else range(args.trials)
    with tempfile.TemporaryDirectory(prefix="edgecore-chaos-") as work:
        cluster = ChaosCluster(args.model, Path(work))
        cluster.reference(prompts)
        cluster.start()
        results, t0 = [], time.monotonic()
        try:
            for i, seed in enumerate(seeds):
                results.append(cluster.run_trial(seed))
                if results[-1].silent_differences or results[-1].leaked:
                    progress(f"seed {seed}: {results[-1]}")
                if i % 10 == 9:
                    progress(f"{i + 1}/{len(seeds)} trials, {time.monotonic() - t0:.0f} s")
        finally:
            left = cluster.stop()
    kinds = Counter(r.fault.split(":")[0] for r in results)
    emit("chaos", "silent_differences", sum(r.silent_differences for r in results), **{
        "trials": len(results), "faults_by_kind": dict(kinds),
        "leaked_trials": sum(1 for r in results if r.leaked),
        "identical": sum(r.identical for r in results), "clean_errors": sum(r.clean_errors for r in results),
        "longest_detect_s": round(max((r.detect_s or 0.0) for r in results), 3) if results else None,
        "processes_left": len(left)})


if __name__ == "__main__":
    main()
