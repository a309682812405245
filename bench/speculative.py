"""Speculative decoding by prompt lookup against plain decoding, batch 1, on an edit-like workload.

Each prompt is a passage of the bundled model's held-out text followed by its first sentences again, so the
answer can repeat much of the prompt (what an edit or a quote asks for). One engine per configuration, the
same prompts, greedy, `--max-tokens` new tokens each; configurations alternate over `--rounds` rounds and the
ratio is of medians (tokens per second over the whole generation, prefill included, as a user sees it):
- `plain`: plain decoding (the baseline);
- `ngram`: `--speculative-config '{"method": "ngram", "num_speculative_tokens": K}'`;
- `oracle`: the same machinery fed drafts that are always right (the plain run's own continuation): the most
  speculation could give at this K on this machine, not a workload result.
With `--compile` the plain and ngram rows use the compiled decode step (steps with drafts run eagerly).
Every configuration's tokens are checked equal to plain decoding's. Writes bench/results/speculative.json
(speculative_compiled.json with `--compile`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("EDGECORE_SMALL_STEP_THREADS", "one")

from common import ROOT, emit, progress  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()

    import torch
    sys.path.insert(0, str(ROOT))
    from edgecore.shared.engine import speculative
    from edgecore.shared.engine.engine import LLMEngine
    from edgecore.shared.engine.sampling_params import SamplingParams
    from edgecore.shared.models.config import CacheConfig, EngineConfig, SpeculativeConfig

    torch.set_num_threads(args.threads)
    model = ROOT / "models" / "pydoc-llama"
    text = (model / "heldout.txt").read_text()
    passages = [text[i:i + 900] for i in range(0, 900 * args.prompts, 900)]
    prompts = [p + "\n\n" + p[:240] for p in passages]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    spec = SpeculativeConfig(num_speculative_tokens=args.k)

    def engine(speculate: bool) -> LLMEngine:
        return LLMEngine.from_dir(model, "fp32", "cpu", CacheConfig(num_blocks=2048),
                                  EngineConfig(compile_decode=args.compile, speculative=spec if speculate else None))

    engines = {"plain": engine(False), "ngram": engine(True), "oracle": engine(True)}
    reference = {}
    for p in prompts:
        ids = engines["plain"].tokenizer.encode(p)
        reference[tuple(ids)] = engines["plain"].generate([ids], params)[0]["token_ids"]
    real_lookup = speculative.lookup

    def oracle(tokens, k, n_max, n_min):
        for prompt, out in reference.items():
            n = len(prompt)
            if len(tokens) >= n and tuple(tokens[:n].tolist()) == prompt:
                return list(out[len(tokens) - n:len(tokens) - n + k])
        return []

    rates: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(-1, args.rounds):       # round -1 warms each engine up (oneDNN kernels per row count), untimed
        for name, eng in engines.items():
            speculative.lookup = oracle if name == "oracle" else real_lookup
            start, tokens = time.perf_counter(), 0
            for ids, want in reference.items():
                got = eng.generate([list(ids)], params)[0]["token_ids"]
                if got != want:
                    raise SystemExit(f"{name}: tokens differ from plain decoding")
                tokens += len(got)
            if r >= 0:
                rates[name].append(tokens / (time.perf_counter() - start))
                progress(f"round {r + 1}/{args.rounds} {name}: {rates[name][-1]:.0f} tokens/s")
    speculative.lookup = real_lookup
    median = {name: statistics.median(v) for name, v in rates.items()}
    counts = {name: eng.stats() for name, eng in engines.items() if name != "plain"}    # (warm-up included)
    emit("speculative_compiled" if args.compile else "speculative", "ngram_over_plain_tokens_per_s", round(median["ngram"] / median["plain"], 3),
         oracle_over_plain=round(median["oracle"] / median["plain"], 3),
         tokens_per_s={name: round(v, 1) for name, v in median.items()},
         acceptance={name: round(s.spec_accepted_tokens / max(1, s.spec_draft_tokens), 3) for name, s in counts.items()},
         tokens_per_verify_step={name: round(1 + s.spec_accepted_tokens / max(1, s.spec_drafts), 2)
                                 for name, s in counts.items()},
         drafted_steps={name: s.spec_drafts for name, s in counts.items()},
         k=args.k, prompts=args.prompts, max_tokens=args.max_tokens, rounds=args.rounds, threads=args.threads,
         compiled=args.compile, identical_to_plain=True, model="pydoc-llama (bundled), float32, CPU")


if __name__ == "__main__":
    main()
