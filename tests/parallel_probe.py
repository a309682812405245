"""Driver side of the parallel-correctness tests: run as `python -m tests.parallel_probe`.

Starts a TP×PP core's ranks (the real `start_parallel_engine`), computes the
logits after a prefill of `--prefill` tokens and after each following decode
step (teacher forcing), and greedy generations, and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json

import torch

from edgecore.core.ranks import start_parallel_engine
from edgecore.shared.models.config import CacheConfig, EngineConfig
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.engine.sequence import Sequence
from edgecore.shared.engine.step_plan import encode_step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ids", required=True, help="JSON list of token ids")
    ap.add_argument("--prefill", type=int, required=True)
    ap.add_argument("--prompts", required=True, help="JSON list of prompts (token id lists) to generate from")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    engine, workers, _ = start_parallel_engine(args.model, args.tp, args.pp, "fp32", "cpu", CacheConfig(num_blocks=256),
                                            EngineConfig())
    ids = json.loads(args.ids)
    seq = Sequence("probe", ids[:args.prefill], SamplingParams())
    engine.block_manager.allocate_prompt(seq.table, ids, len(ids))
    rows = []
    for n in [args.prefill] + [1] * (len(ids) - args.prefill):
        seq.token_ids = ids[:seq.num_computed_tokens + n]
        engine.runner._broadcast(encode_step([(seq, n)]))
        _, logits = engine.runner.execute([(seq, n)])
        rows.append(logits[-1].tolist())
        seq.num_computed_tokens += n
    engine.block_manager.free_table(seq.table)
    prompts = json.loads(args.prompts)
    greedy = [r["token_ids"] for r in engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0,
                                                                           ignore_eos=True))]
    with open(args.out, "w") as f:
        json.dump({"logits": rows, "greedy": greedy, "ranks": engine.runner.rank_stats()}, f)
    engine.runner.shutdown()
    for w in workers:
        w.wait(30)


if __name__ == "__main__":
    main()
