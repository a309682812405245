"""Speculative decoding by prompt lookup, edgecore against llama.cpp on the same GGUF file, batch 1.

The speculative rows of the llama.cpp comparison (bench/peer_llamacpp.py builds llama.cpp and converts the
bundled model to an f32 GGUF; this bench reuses both). Both engines load that one file and get the same
prompt token ids (edgecore's tokenizer), greedy, `--max-tokens` new tokens each, one request at a time:
- `edgecore_plain` / `edgecore_ngram`: `LLMEngine` in this process, plain and with
  `--speculative-config '{"method": "ngram", "num_speculative_tokens": K}'`; time = the wall time of
  `generate` (prefill included, as a user sees it);
- `llama_cpp_plain` / `llama_cpp_ngram` / `llama_cpp_ngram_k`: `llama-server -np 1` (one at a time, started
  afresh each round and warmed by one request), plain, with its own
  prompt lookup at its defaults (`--spec-type ngram-simple`: 12-token lookup, 48-token drafts), and with
  drafts of our K from a lookup of our longest n-gram (`--spec-ngram-simple-size-n/-size-m`); time = the
  server's own `prompt_ms + predicted_ms` (no HTTP in it), prompt cache off.
Rows alternate over `--rounds` rounds; tokens/s are medians over rounds; acceptance = accepted ÷ drafted.
Writes bench/results/speculative_llamacpp.json (speculative_llamacpp_compiled.json with `--compile`).

The workload is bench/speculative.py's edit-like one (a held-out passage, then its first sentences again).
What speculation can give depends on how much of its answer the model copies, and the bundled model is
too small to copy much (its drafts are accepted at about 16%: `acceptance`): that is the same for both
engines, so the ratios between them compare the machinery, not the model. `agreement`: the share of
prompts whose greedy tokens are the same in both engines (float32 on both; ties may break differently).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

os.environ.setdefault("EDGECORE_SMALL_STEP_THREADS", "one")

from common import ROOT, emit, progress  # noqa: E402
from peer_llamacpp import _wait_http, build, to_gguf  # noqa: E402

MODEL = ROOT / "models" / "pydoc-llama"


class LlamaServer:
    """One `llama-server` process (one slot) on a free loopback port."""

    def __init__(self, bin_dir, gguf, threads: int, ctx: int, extra: list[str]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
               "-c", str(ctx), "-np", "1", "--port", str(self.port), "--host", "127.0.0.1", "-fa", "off", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        _wait_http(self.port, "/health")

    def complete(self, ids: list[int], max_tokens: int) -> dict:
        body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True,
                "cache_prompt": False, "return_tokens": True, "stream": False}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        out = json.loads(urllib.request.urlopen(req, timeout=300).read())
        t = out["timings"]
        return {"tokens": out["tokens"], "seconds": (t["prompt_ms"] + t["predicted_ms"]) / 1e3,
                "drafted": t.get("draft_n", 0), "accepted": t.get("draft_n_accepted", 0)}

    def close(self) -> None:
        os.killpg(self.proc.pid, 15)
        self.proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (and llama.cpp's draft in ngram_k)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true",
                    help="edgecore on its compiled decode step (steps with drafts run eagerly)")
    args = ap.parse_args()

    import torch
    from edgecore.shared.engine.engine import LLMEngine
    from edgecore.shared.engine.sampling_params import SamplingParams
    from edgecore.shared.models.config import CacheConfig, EngineConfig, SpeculativeConfig

    torch.set_num_threads(args.threads)
    bin_dir = build()
    gguf = to_gguf(MODEL, "bundled")
    spec = SpeculativeConfig(num_speculative_tokens=args.k)
    engines = {name: LLMEngine.from_dir(gguf, "fp32", "cpu", CacheConfig(num_blocks=2048),
                                        EngineConfig(compile_decode=args.compile,
                                                     speculative=spec if name.endswith("ngram") else None))
               for name in ("edgecore_plain", "edgecore_ngram")}
    text = (MODEL / "heldout.txt").read_text()
    passages = [text[i:i + 900] for i in range(0, 900 * args.prompts, 900)]
    tokenizer = engines["edgecore_plain"].tokenizer
    prompts = [tokenizer.encode(p + "\n\n" + p[:240]) for p in passages]
    ctx = max(map(len, prompts)) + args.max_tokens + 64
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    flags = {"llama_cpp_plain": [], "llama_cpp_ngram": ["--spec-type", "ngram-simple"],
             "llama_cpp_ngram_k": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n",
                                   str(spec.prompt_lookup_max), "--spec-ngram-simple-size-m", str(args.k)]}
    rows = [*engines, *flags]
    rates: dict[str, list[float]] = {name: [] for name in rows}
    tokens: dict[str, list] = {}
    drafts = {name: [0, 0] for name in flags}
    for r in range(-1, args.rounds):            # round -1 warms the engines up, untimed
        for name in (rows if r % 2 else rows[::-1]):
            if name in flags and r < 0:
                continue
            # one llama-server at a time (an idle one's threads may still poll), started afresh each round and
            # warmed by one untimed request
            server = LlamaServer(bin_dir, gguf, args.threads, ctx, flags[name]) if name in flags else None
            try:
                if server is not None:
                    server.complete(prompts[0], 8)
                seconds, got, outs = 0.0, 0, []
                for ids in prompts:
                    if server is None:
                        start = time.perf_counter()
                        out = engines[name].generate([ids], params)[0]["token_ids"]
                        seconds += time.perf_counter() - start
                    else:
                        res = server.complete(ids, args.max_tokens)
                        out, seconds = res["tokens"], seconds + res["seconds"]
                        drafts[name][0] += res["drafted"]
                        drafts[name][1] += res["accepted"]
                    got += len(out)
                    outs.append(out)
            finally:
                if server is not None:
                    server.close()
            if tokens.setdefault(name, outs) != outs:
                raise SystemExit(f"{name}: greedy tokens changed between rounds")
            if r >= 0:
                rates[name].append(got / seconds)
                progress(f"round {r + 1}/{args.rounds} {name}: {rates[name][-1]:.0f} tokens/s")
    if tokens["edgecore_ngram"] != tokens["edgecore_plain"] or tokens["llama_cpp_ngram"] != tokens["llama_cpp_plain"]:
        raise SystemExit("speculative decoding changed an engine's greedy tokens")
    median = {name: statistics.median(v) for name, v in rates.items()}
    ours = engines["edgecore_ngram"].stats()                 # warm-up round included
    acceptance = {"edgecore_ngram": round(ours.spec_accepted_tokens / max(1, ours.spec_draft_tokens), 3),
                  **{name: round(a / max(1, d), 3) for name, (d, a) in drafts.items() if name != "llama_cpp_plain"}}
    best_theirs = max(median["llama_cpp_ngram"], median["llama_cpp_ngram_k"], median["llama_cpp_plain"])
    emit("speculative_llamacpp_compiled" if args.compile else "speculative_llamacpp", "edgecore_ngram_over_best_llama_cpp", round(median["edgecore_ngram"] / best_theirs, 3),
         edgecore_ngram_over_llama_cpp_ngram=round(median["edgecore_ngram"] / median["llama_cpp_ngram"], 3),
         edgecore_ngram_over_llama_cpp_ngram_k=round(median["edgecore_ngram"] / median["llama_cpp_ngram_k"], 3),
         edgecore_ngram_over_edgecore_plain=round(median["edgecore_ngram"] / median["edgecore_plain"], 3),
         llama_cpp_ngram_over_llama_cpp_plain=round(median["llama_cpp_ngram"] / median["llama_cpp_plain"], 3),
         edgecore_plain_over_llama_cpp_plain=round(median["edgecore_plain"] / median["llama_cpp_plain"], 3),
         tokens_per_s={name: round(v, 1) for name, v in median.items()}, acceptance=acceptance,
         agreement=round(sum(a == b for a, b in zip(tokens["edgecore_plain"], tokens["llama_cpp_plain"]))
                         / len(prompts), 3),
         k=args.k, prompts=args.prompts, max_tokens=args.max_tokens, rounds=args.rounds, threads=args.threads,
         compiled=args.compile, file=gguf.name, model="pydoc-llama (bundled) as f32 GGUF, CPU")


if __name__ == "__main__":
    sys.exit(main())
