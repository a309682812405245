"""Batch API throughput: a 500-request batch through the core's Files + Batches API vs the engine offline.

Both on the bundled model with the same requests (held-out prompts of 32–128
tokens, 64 new tokens, greedy, ignore_eos) and the same torch thread count:
(1) a real `edgecore core` process runs the batch (upload, create, poll until
completed; time from create to completed); (2) the engine generates the same
requests in this process, once before and once after (1), since this shared
machine's speed drifts; the mean is the baseline. Reports tokens/s and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

from common import ROOT, emit, engine_tokens_per_s, progress

from edgecore.core.batch_cli import Api  # noqa: E402
from tests.e2e.procs import start_core  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from edgecore.shared.text.tokenizer import Tokenizer
    model = ROOT / "models" / "pydoc-llama"
    tok = Tokenizer.from_dir(model)
    ids = tok.encode((model / "heldout.txt").read_text())
    rng = random.Random(0)
    prompts = []
    for _ in range(args.requests):
        n = rng.randint(32, 128)
        start = rng.randint(0, len(ids) - n)
        prompts.append(ids[start:start + n])
    rows = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": p, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}}
            for i, p in enumerate(prompts)]
    import torch
    torch.set_num_threads(args.threads)
    before = engine_tokens_per_s(prompts, args.max_tokens, max_num_seqs=128)     # the machine drifts: measure on both sides
    progress(f"engine offline (before): {before:.0f} tok/s")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "in.jsonl")
        with open(src, "w") as f:
            f.write("\n".join(json.dumps(r) for r in rows) + "\n")
        secret = os.path.join(tmp, "secret")
        with open(secret, "w") as f:
            f.write("bench")
        os.environ["EDGECORE_THREADS"] = str(args.threads)
        node, _, http = start_core(secret, "--kv-blocks", "8192", data_dir=os.path.join(tmp, "data"))
        try:
            api = Api(f"http://127.0.0.1:{http}", None)
            upload = api.upload(__import__("pathlib").Path(src))
            t = time.perf_counter()
            batch = api.json("POST", "/v1/batches", {"input_file_id": upload["id"], "endpoint": "/v1/completions",
                                                     "completion_window": "24h"})
            while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
                time.sleep(0.1)
                batch = api.json("GET", f"/v1/batches/{batch['id']}")
            elapsed = time.perf_counter() - t
            out = api.call("GET", f"/v1/files/{batch['output_file_id']}/content").decode().splitlines()
            tokens = sum(json.loads(x)["response"]["body"]["usage"]["completion_tokens"] for x in out)
        finally:
            node.stop()
    api_tps = tokens / elapsed
    progress(f"batch API: {len(out)} requests, {tokens} tokens in {elapsed:.2f} s = {api_tps:.0f} tok/s")
    engine_tps = (before + engine_tokens_per_s(prompts, args.max_tokens, max_num_seqs=128)) / 2
    progress(f"engine offline (mean of the runs before and after): {engine_tps:.0f} tok/s")
    emit("batch", "api_vs_engine_tokens_per_s", round(api_tps / engine_tps, 3), target=0.9,
         requests=args.requests, api_tokens_per_s=round(api_tps, 1), engine_tokens_per_s=round(engine_tps, 1),
         api_seconds=round(elapsed, 2), threads=args.threads)


if __name__ == "__main__":
    main()
