"""`bench/decode.py --arch moe`: decode throughput of a random-weight Mixtral-shaped MoE (~200 MB in
float32: 4 layers, hidden 512, 8 experts of intermediate 768, top-2) against transformers `generate`
in the same run, at batch 1, 8 and 32 (greedy, token ids out); then the MoE layer alone: our grouped
computation (tokens sorted by expert, one pair of matmuls per expert) against a per-token loop and
against a dense MLP with the same active parameters (intermediate = top_k × 768: the same FLOPs).
"""

from __future__ import annotations

import statistics
import tempfile
import time

from common import emit, median_time, progress

import torch
import torch.nn.functional as F

from edgecore.shared.models.config import CacheConfig, EngineConfig
from edgecore.shared.engine.engine import LLMEngine

SHAPE = dict(vocab_size=8192, hidden_size=512, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, num_local_experts=8, num_experts_per_tok=2,
             max_position_embeddings=4096, sliding_window=None, bos_token_id=0, eos_token_id=1)


def random_moe(path: str):
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(**SHAPE)).eval()
    with torch.no_grad():          # routers with spread-out logits, so tokens use all experts
        for name, p in hf.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 1 / SHAPE["hidden_size"] ** 0.5)
    hf.save_pretrained(path)
    return hf


def per_token(moe, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The reference form: each token through each of its experts, one at a time."""
    e, out = moe, torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            i = int(ids[t, slot])
            h = F.linear(x[t:t + 1], e.w13[i])
            y = F.linear(F.silu(h[:, :e.shard]) * h[:, e.shard:], e.w2[i])
            out[t] += weights[t, slot] * y[0]
    return out


def layer_rows(engine, tokens_list=(1, 8, 32, 256)) -> list[dict]:
    moe = engine.model.model.layers[0].mlp
    experts, k = moe.experts, moe.top_k
    hidden, inter = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    dense_up = torch.randn(2 * k * inter, hidden) / hidden ** 0.5
    dense_down = torch.randn(hidden, k * inter) / (k * inter) ** 0.5
    rows = []
    with torch.inference_mode():
        for t in tokens_list:
            x = torch.randn(t, hidden)
            weights, ids = torch.softmax(moe.gate(x), -1).topk(k, -1)
            experts(x, ids, weights), per_token(experts, x, ids, weights)       # warm-up
            grouped = median_time(lambda x=x, ids=ids, weights=weights: experts(x, ids, weights), 5)
            loop = median_time(lambda x=x, ids=ids, weights=weights: per_token(experts, x, ids, weights), 3)

            def dense(x=x):
                h = F.linear(x, dense_up)
                g, u = h.chunk(2, -1)
                return F.linear(F.silu(g) * u, dense_down)
            dense()
            same_flops = median_time(dense, 5)
            rows.append({"tokens": t, "grouped_ms": round(grouped * 1e3, 3), "per_token_ms": round(loop * 1e3, 3),
                         "dense_same_flops_ms": round(same_flops * 1e3, 3),
                         "speedup_vs_per_token": round(loop / grouped, 2),
                         "time_vs_dense_same_flops": round(grouped / same_flops, 2)})
            progress(f"MoE layer, {t} tokens: grouped {grouped * 1e3:.2f} ms, per-token {loop * 1e3:.2f} ms, "
                     f"dense same FLOPs {same_flops * 1e3:.2f} ms")
    return rows


def run(batches: list[int], prompt_len: int, new_tokens: int, repeats: int, engine_tps, hf_tps) -> None:
    with tempfile.TemporaryDirectory() as path:
        hf = random_moe(path)
        engine = LLMEngine.from_dir(path, "fp32", "cpu", CacheConfig(num_blocks=2048),
                                    EngineConfig(max_num_batched_tokens=4096, max_num_seqs=256))
    weight_mb = sum(p.numel() * p.element_size() for p in hf.parameters()) / 2**20
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in batches:
        prompts = torch.randint(3, SHAPE["vocab_size"], (b, prompt_len), generator=gen).tolist()
        engine_tps(engine, prompts[:1], 4)     # warm-up
        ours = statistics.median(engine_tps(engine, prompts, new_tokens) for _ in range(repeats))
        theirs = statistics.median(hf_tps(hf, prompts, new_tokens) for _ in range(repeats))
        rows.append({"batch": b, "edgecore_tok_s": round(ours, 1), "transformers_tok_s": round(theirs, 1),
                     "ratio": round(ours / theirs, 2)})
        progress(f"moe batch {b}: edgecore {ours:.0f} tok/s, transformers {theirs:.0f} tok/s, {ours / theirs:.2f}x")
    layer = layer_rows(engine)
    at_32 = next((r["ratio"] for r in rows if r["batch"] == 32), rows[-1]["ratio"])
    emit("decode_moe", "ratio_vs_transformers_at_32", at_32, dtype="fp32", weight_mb=round(weight_mb),
         shape=SHAPE, rows=rows, moe_layer=layer, prompt_tokens=prompt_len, new_tokens=new_tokens,
         threads=torch.get_num_threads(), measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
