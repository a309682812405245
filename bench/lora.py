"""Multi-LoRA decode throughput: a batch of requests spread over 8 adapters against the same batch on the base
model alone (issue 40's row: 8 adapters mixed in one batch of 32 at ≥ 0.8× the base model's tokens/s).

One process, an in-process `LLMEngine` on CPU (`--threads` torch threads) over the bundled model (4 layers,
192 wide: a rank-16 adapter adds ~20% to its multiply-adds), a random Llama of more realistic proportions built
here (`--model synthetic`: 6 layers, 768 wide, ~5%), or `--model DIR`. `--adapters` random PEFT adapters (rank `--rank`, every q/k/v/o and gate/up/down projection,
non-zero B) are written to a temporary directory and loaded; then, alternating `--repeats` times, the engine
generates `--tokens` tokens (greedy, ignore_eos) for `--batch` prompts of `--prompt` tokens: once with every
request on the base model, once with request i on adapter i mod `--adapters`. Each run's prompts differ (no
prefix-cache hits). Reported: generated tokens/s of each (median), their ratio (adapters / base), and the
configuration, as one JSON line and in bench/results/lora.json (lora_synthetic.json for `--model synthetic`).
Both runs share the engine: base-only steps take the fast decode path (flat_decode.py), steps
with adapter rows the module tree plus the gathered LoRA products (shared/models/lora.py).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common import ROOT, emit, progress

from edgecore.shared.models.config import CacheConfig, EngineConfig, ModelConfig
from edgecore.shared.engine.engine import LLMEngine
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.models.loader import build_model

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: Path, config: ModelConfig, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter for `config`'s every target projection (B non-zero, unlike peft's start)."""
    from safetensors.torch import save_file
    gen = torch.Generator().manual_seed(seed)
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    h, inter = config.hidden_size, config.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for proj, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if proj in TARGETS[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}))


def make_engine(model: str, batch: int) -> LLMEngine:
    cache, engine_config = CacheConfig(num_blocks=2048), EngineConfig(max_num_seqs=batch)
    if model != "synthetic":
        return LLMEngine.from_dir(ROOT / "models" / "pydoc-llama" if model == "bundled" else model, "fp32", "cpu",
                                  cache, engine_config)
    config = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 4096, "hidden_size": 768, "intermediate_size": 2048,
        "num_hidden_layers": 6, "num_attention_heads": 12, "num_key_value_heads": 4,
        "max_position_embeddings": 4096, "tie_word_embeddings": False})
    torch.manual_seed(0)
    weights = build_model(config, torch.float32, "cpu")
    with torch.no_grad():
        for p in weights.parameters():
            p.normal_(0, 0.02)
    return LLMEngine(weights, config, None, cache, engine_config)


def run(engine: LLMEngine, prompts: list[list[int]], adapters: list[str | None], tokens: int, tag: str) -> float:
    """Generated tokens per second of one batch, every request admitted at once."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        engine.add_request(f"{tag}-{i}", prompt, params, adapter=adapter)
    generated = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        generated += sum(len(out.new_token_ids) for out in engine.step())
    return generated / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bundled", help="bundled (pydoc-llama, the default), synthetic (a random "
                    "6-layer, 768-wide Llama built here) or a model directory")
    ap.add_argument("--adapters", type=int, default=8, help="adapters in the mixed batch (default 8)")
    ap.add_argument("--rank", type=int, default=16, help="rank of every adapter (default 16)")
    ap.add_argument("--batch", type=int, default=32, help="requests per batch (default 32)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (default 64)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each kind, alternating (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = make_engine(args.model, args.batch)
    config = engine.config
    rng = random.Random(0)
    names = [f"lora{i}" for i in range(args.adapters)]
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            write_adapter(Path(tmp) / name, config, args.rank, seed=i)
            engine.lora.load(name, str(Path(tmp) / name))
    mixed = [names[i % len(names)] for i in range(args.batch)]
    rates: dict[str, list[float]] = {"base": [], "adapters": []}
    for r in range(args.repeats + 1):             # the first pair warms up
        for kind, adapters in (("base", [None] * args.batch), ("adapters", mixed)):
            prompts = [[rng.randrange(2, config.vocab_size) for _ in range(args.prompt)] for _ in range(args.batch)]
            rate = run(engine, prompts, adapters, args.tokens, f"{kind}-{r}")
            if r:
                rates[kind].append(rate)
                progress(f"run {r} {kind}: {rate:.0f} tokens/s")
    base, mixed_rate = statistics.median(rates["base"]), statistics.median(rates["adapters"])
    emit("lora_synthetic" if args.model == "synthetic" else "lora", "tokens_per_s_ratio", round(mixed_rate / base, 3), base_tokens_per_s=round(base, 1),
         adapters_tokens_per_s=round(mixed_rate, 1), adapters=args.adapters, rank=args.rank, batch=args.batch,
         prompt_tokens=args.prompt, generated_tokens=args.tokens, threads=args.threads, repeats=args.repeats,
         model=Path(args.model).name, runs={k: [round(v, 1) for v in vs] for k, vs in rates.items()})


if __name__ == "__main__":
    main()
