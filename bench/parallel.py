"""Tensor and pipeline parallelism on CPU: per-rank parameter bytes, prefill tokens/s, all-reduce cost.

A random ~540 MB float32 Llama is written once; each layout (TP=1, TP=2,
PP=2 without and with micro-batching) runs in its own process group (`--layout` child processes), prefills
`--prompts` × `--tokens` tokens (max_tokens=1) and reports its ranks'
parameter bytes and the prefill rate; TP=2 also times one all-reduce of a
[tokens, hidden] activation. On 2 CPU cores the point is the scaling shape
and the overhead, not a speed-up: two ranks already share the two cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, emit, progress

CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 1024,
          "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8,
          "max_position_embeddings": 4096, "tie_word_embeddings": True}


def write_model(path: Path) -> None:
    import torch
    from safetensors.torch import save_file
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    g = torch.Generator().manual_seed(0)
    h, inter, kv = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["num_key_value_heads"] * 64
    tensors = {"model.embed_tokens.weight": torch.randn(CONFIG["vocab_size"], h, generator=g) * 0.02,
               "model.norm.weight": torch.ones(h)}
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (kv, h)), ("self_attn.v_proj", (kv, h)),
                            ("self_attn.o_proj", (h, h)), ("mlp.gate_proj", (inter, h)), ("mlp.up_proj", (inter, h)),
                            ("mlp.down_proj", (h, inter))):
            tensors[p + name + ".weight"] = torch.randn(*shape, generator=g) * 0.02
        tensors[p + "input_layernorm.weight"] = torch.ones(h)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h)
    save_file(tensors, str(path / "model.safetensors"))


def child(args) -> None:
    import torch
    from edgecore.core.ranks import start_parallel_engine
    from edgecore.shared.models.config import CacheConfig, EngineConfig
    from edgecore.shared.engine.sampling_params import SamplingParams
    tp, pp, *micro = map(int, args.layout.split("x"))
    torch.set_num_threads(max(1, 2 // (tp * pp)))
    engine, workers, _ = start_parallel_engine(args.model, tp, pp, "fp32", "cpu", CacheConfig(num_blocks=1024),
                                            EngineConfig(max_num_batched_tokens=args.tokens * args.prompts),
                                            micro_batches=micro[0] if micro else 0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 30000, (args.tokens,), generator=g).tolist() for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=1, temperature=0)
    engine.generate(prompts[:1], params)       # warm-up
    t = time.perf_counter()
    engine.generate(prompts, params)
    rate = args.prompts * args.tokens / (time.perf_counter() - t)
    ranks = engine.runner.rank_stats()
    engine.runner.shutdown()
    for w in workers:
        w.wait(60)
    print(json.dumps({"layout": args.layout, "prefill_tokens_per_s": round(rate, 1), "ranks": ranks}))


def allreduce_child(rank: int, master: str, tokens: int) -> None:
    """One of two gloo ranks timing the all-reduce a TP block does (a [tokens, hidden] fp32 activation)."""
    import datetime
    import statistics

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    times = []
    for size in (1, tokens):
        x = torch.randn(size, CONFIG["hidden_size"])
        for _ in range(5):
            dist.all_reduce(x)
        t0 = []
        for _ in range(30):
            t = time.perf_counter()
            dist.all_reduce(x)
            t0.append(time.perf_counter() - t)
        times.append(statistics.median(t0) * 1e6)
    if rank == 0:
        print(json.dumps({"decode_token_us": round(times[0], 1), f"prefill_{tokens}_tokens_us": round(times[1], 1)}))
    dist.destroy_process_group()


def allreduce_bench(tokens: int) -> dict:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master = f"127.0.0.1:{s.getsockname()[1]}"
    procs = [subprocess.Popen([sys.executable, __file__, "--allreduce", str(r), "--master", master, "--tokens",
                               str(tokens)], stdout=subprocess.PIPE, text=True, cwd=ROOT) for r in (0, 1)]
    out = procs[0].communicate(timeout=300)[0]
    procs[1].wait(60)
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layout", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--allreduce", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--master", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    if args.layout:
        return child(args)
    if args.allreduce is not None:
        return allreduce_child(args.allreduce, args.master, args.tokens)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "random-540mb"
        progress("writing a random ~540 MB float32 model")
        write_model(model)
        for layout in ("1x1", "2x1", "1x2x1", "1x2"):
            progress(f"layout TP×PP = {layout}")
            r = subprocess.run([sys.executable, __file__, "--layout", layout, "--model", str(model), "--prompts",
                                str(args.prompts), "--tokens", str(args.tokens)], capture_output=True, text=True,
                               cwd=ROOT, timeout=1200)
            if r.returncode != 0:
                raise SystemExit(f"layout {layout} failed: {r.stderr[-2000:]}")
            results.append(json.loads(r.stdout.strip().splitlines()[-1]))
            progress(json.dumps({k: v for k, v in results[-1].items() if k != "ranks"}))
    allreduce = allreduce_bench(args.tokens)
    progress(f"all-reduce: {allreduce}")
    by = {r["layout"]: r for r in results}
    full = by["1x1"]["ranks"][0]["parameter_bytes"]
    tp_share = [r["parameter_bytes"] / full for r in by["2x1"]["ranks"]]
    emit("parallel", "tp2_parameter_share_per_rank", round(max(tp_share), 3), full_parameter_bytes=full,
         tp2_shares=[round(s, 3) for s in tp_share],
         pp2_shares=[round(r["parameter_bytes"] / full, 3) for r in by["1x2"]["ranks"]],
         pp2_micro_batching_speedup=round(by["1x2"]["prefill_tokens_per_s"] / by["1x2x1"]["prefill_tokens_per_s"], 3),
         prefill_tokens_per_s={k: v["prefill_tokens_per_s"] for k, v in by.items()},
         allreduce_us=allreduce, allreduces_per_layer=2, ranks={k: v["ranks"] for k, v in by.items()}, cores=2)


if __name__ == "__main__":
    main()
