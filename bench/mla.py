"""MLA latent KV: bytes per token against the dense model of the same hidden size, and each codec's
ratio, speed, per-plane error and greedy agreement on a DeepSeek-style model's latent KV.

Rows:
- `bytes_per_token`: DeepSeek-V3 / Kimi K2 shapes (analytic) and the measured pools of a random-weight
  MLA model and a dense Llama of the same hidden size, layers and heads (the pools' bytes per slot).
- `codecs`: prefills windows on the MLA model, takes each request's per-layer latent and rope planes
  (bf16 bits, as a core sends them), and per codec measures ratio (raw / encoded), single-thread
  encode and decode MB/s, relative RMS error per plane, and for int8/int4 the error of both groupings
  (per channel "k", per token "v") of each plane: which part needs care.
- `agreement`: greedy tokens after the latent went through the codec into another engine, against
  the tokens decoded from the uncompressed bf16 latent (`raw`; `raw` itself against the fp32 single-node
  run); fraction of identical tokens (up to the first difference per prompt) and of prompts identical
  throughout.
- `channels`: per plane and layer, how unevenly the trained model's latent KV spreads over its channels
  (RMS of the largest channel over the median channel's, channels above 4x the median, energy share of the
  top 5% channels): which channels need care when quantizing.
Bytes per token are measured on random-weight models of realistic shapes; codecs, channels and agreement on
the trained `models/pystd-mla` (`--model`), over windows of its held-out text.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import ROOT, emit, progress

import numpy as np
import torch

from edgecore.protocol.codecs import CODECS, PlaneInfo
from edgecore.protocol.kv import decode_chunk, encode_chunk
from edgecore.shared.models.config import CacheConfig, EngineConfig, ModelConfig
from edgecore.shared.engine.engine import LLMEngine
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.kv.transfer import KVSlice
from edgecore.shared.kv.wire import from_bits, to_bits
from edgecore.shared.models.loader import build_model

HIDDEN, LAYERS, HEADS = 1024, 4, 8
MLA = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=2048, hidden_size=HIDDEN, intermediate_size=2048,
           num_hidden_layers=LAYERS, num_attention_heads=HEADS, max_position_embeddings=4096, kv_lora_rank=256,
           q_lora_rank=384, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=16,
           n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=256, first_k_dense_replace=1,
           n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, rope_theta=10000.0,
           rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "mscale": 1.0,
                         "mscale_all_dim": 1.0})
DENSE = dict(architectures=["LlamaForCausalLM"], vocab_size=2048, hidden_size=HIDDEN, intermediate_size=2048,
             num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
             max_position_embeddings=4096)


def real_shapes() -> dict:
    """Bytes per token (bf16) of DeepSeek-V3 / Kimi K2 (61 layers, latent 512 + 64) and of dense models with
    their hidden size 7168 (56 heads of 128: MHA, and GQA with 8 KV heads)."""
    mla = 61 * (512 + 64) * 2
    mha, gqa = 2 * 61 * 56 * 128 * 2, 2 * 61 * 8 * 128 * 2
    return {"deepseek_v3_latent": mla, "dense_mha_same_hidden": mha, "dense_gqa8_same_hidden": gqa,
            "ratio_mha": round(mha / mla, 2), "ratio_gqa8": round(gqa / mla, 2)}


def random_engine(raw: dict, blocks: int) -> LLMEngine:
    config = ModelConfig.from_dict(raw)
    model = build_model(config, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("gate.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(1.2 / p.shape[-1] ** 0.5 * torch.randn(p.shape, generator=g))
    return LLMEngine(model, config, None, CacheConfig(block_size=16, num_blocks=blocks),
                     EngineConfig(max_num_batched_tokens=4096))


def prefill(engine: LLMEngine, rid: str, ids: list[int]) -> int:
    engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0), prefill_only=True)
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            first = out.new_token_ids[0]
    return first


def planes_of(engine: LLMEngine, rid: str) -> tuple[np.ndarray, np.ndarray]:
    """bf16 bits [layers, tokens, 1, width] of the latent and rope planes of a prefilled request."""
    parts = [engine.read_kv(rid, layer) for layer in range(engine.config.num_hidden_layers)]
    lat = torch.stack([p[0] for p in parts]).to(torch.bfloat16)
    rope = torch.stack([p[1] for p in parts]).to(torch.bfloat16)
    return to_bits(lat), to_bits(rope)


def rel_err(bits: np.ndarray, decoded: np.ndarray) -> float:
    a = from_bits(bits, "bfloat16").float()
    b = from_bits(decoded, "bfloat16").float()
    return float(((a - b).pow(2).mean() / a.pow(2).mean()).sqrt())


def channel_stats(samples) -> dict:
    """Per plane, per layer: max/median channel RMS over the windows' tokens, channels above 4x the median,
    the share of the plane's energy in its top 5% channels; plus the plane's RMS."""
    out = {}
    for i, plane in enumerate(("latent", "rope")):
        x = torch.cat([from_bits(s[i], "bfloat16").float() for s in samples], dim=1)[:, :, 0]   # [L, T, width]
        rms = x.pow(2).mean(dim=1).sqrt()                                                      # [L, width]
        med = rms.median(dim=1).values
        energy = rms.pow(2)
        top = max(1, round(0.05 * rms.shape[1]))
        out[plane] = {"width": rms.shape[1], "rms": [round(v, 4) for v in x.pow(2).mean(dim=(1, 2)).sqrt().tolist()],
                      "max_over_median_channel_rms": [round(v, 2) for v in (rms.max(dim=1).values / med).tolist()],
                      "channels_over_4x_median": (rms > 4 * med[:, None]).sum(dim=1).tolist(),
                      "top5pct_channel_energy_share": [round(v, 3) for v in
                                                       (energy.topk(top, dim=1).values.sum(1) / energy.sum(1)).tolist()]}
    return out


def heldout_windows(engine: LLMEngine, model: Path, count: int, length: int) -> list[list[int]]:
    ids = engine.tokenizer.encode((model / "heldout.txt").read_text())
    stride = max(length, (len(ids) - length) // max(1, count))
    return [ids[i * stride: i * stride + length] for i in range(count) if i * stride + length <= len(ids)]


def codec_rows(samples, repeats: int) -> dict:
    rows = {}
    for name, codec in CODECS.items():
        raw = enc_bytes = 0
        enc_t = dec_t = 0.0
        errs = {"latent": [], "rope": []}
        grouping = {f"{plane}_{kind}": [] for plane in ("latent", "rope") for kind in ("k", "v")}
        for lat, rope in samples:
            for plane, bits, kind in (("latent", lat, "k"), ("rope", rope, "v")):
                info = PlaneInfo("bfloat16", bits.shape, kind, 0, bits.shape[1])
                t = time.perf_counter()
                for _ in range(repeats):
                    data = codec.encode(bits, info)
                enc_t += (time.perf_counter() - t) / repeats
                t = time.perf_counter()
                for _ in range(repeats):
                    out = codec.decode(data, info)
                dec_t += (time.perf_counter() - t) / repeats
                raw += bits.nbytes
                enc_bytes += len(data)
                errs[plane].append(rel_err(bits, out))
                if name in ("int8", "int4"):
                    for k2 in ("k", "v"):
                        i2 = PlaneInfo("bfloat16", bits.shape, k2, 0, bits.shape[1])
                        grouping[f"{plane}_{k2}"].append(rel_err(bits, codec.decode(codec.encode(bits, i2), i2)))
        rows[name] = {"ratio": round(raw / enc_bytes, 3), "encode_MBps": round(raw / enc_t / 1e6, 1),
                      "decode_MBps": round(raw / dec_t / 1e6, 1),
                      "rel_rms_err": {p: float(f"{np.mean(e):.3g}") for p, e in errs.items()}}
        if name in ("int8", "int4"):
            rows[name]["rel_rms_err_by_grouping"] = {k: float(f"{np.mean(e):.3g}") for k, e in grouping.items()}
    return rows


def agreement(core: LLMEngine, edge: LLMEngine, prompts, tokens: int) -> dict:
    """Per codec, against the tokens decoded from the bf16 latent itself (`raw`): what the codec changes.
    `raw` against the fp32 single-node run shows what bf16 on the wire alone changes."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    single = [r["token_ids"] for r in edge.generate(prompts, params)]
    out, ref = {}, None
    for name in CODECS:
        same = whole = 0
        got_all = []
        for i, ids in enumerate(prompts):
            rid = f"{name}-{i}"
            first = prefill(core, rid, ids)
            lat, rope = planes_of(core, rid)
            core.release(rid)
            k, v = decode_chunk(encode_chunk(rid, lat, rope, layer_start=0, token_start=0, dtype="bfloat16",
                                             codec=name, total_tokens=len(ids)))
            kt, vt = from_bits(k, "bfloat16").float(), from_bits(v, "bfloat16").float()
            edge.reserve(rid, ids, params)
            edge.write_kv(rid, KVSlice(0, 0, len(ids), 0, kt, vt))
            edge.activate(rid, first)
            got = []
            while edge.has_unfinished():
                for o in edge.step():
                    got += o.new_token_ids
            got_all.append(got)
        ref = ref or got_all
        for got, want in zip(got_all, ref if name != "raw" else single):
            n = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
            same += n
            whole += n == len(want)
        key = name if name != "raw" else "raw_bf16_vs_fp32_single_node"
        out[key] = {"token_agreement": round(same / (len(prompts) * tokens), 3),
                    "prompts_identical": f"{whole}/{len(prompts)}"}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "pystd-mla"))
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    measured = {name: e.pool.bytes // e.pool.num_slots // 2 for name, e in       # fp32 pools, bf16 on the wire
                (("mla", random_engine(MLA, 64)), ("dense_same_hidden", random_engine(DENSE, 64)))}
    measured["ratio"] = round(measured["dense_same_hidden"] / measured["mla"], 2)
    per_token = {"real_shapes_bf16": real_shapes(), "measured_bf16": measured}
    progress(f"bytes per token: {per_token}")
    model = Path(args.model)
    cache = CacheConfig(block_size=16, num_blocks=512)
    core = LLMEngine.from_dir(model, "fp32", "cpu", cache, EngineConfig(max_num_batched_tokens=4096))
    samples = []
    for w, ids in enumerate(heldout_windows(core, model, args.windows, args.length)):
        prefill(core, f"w{w}", ids)
        samples.append(planes_of(core, f"w{w}"))
        core.release(f"w{w}")
    channels = channel_stats(samples)
    progress(f"channels: {channels}")
    codecs = codec_rows(samples, args.repeats)
    progress(f"codecs: {codecs}")
    edge = LLMEngine.from_dir(model, "fp32", "cpu", cache, EngineConfig(max_num_batched_tokens=4096))
    lengths = (17, 64, 130, 256, 400, 600)[:args.prompts]
    prompts = [w[:n] for w, n in zip(heldout_windows(core, model, len(lengths), 600), lengths)]
    agree = agreement(core, edge, prompts, args.tokens)
    progress(f"agreement: {agree}")
    emit("mla", "kv_bytes_per_token_ratio_dense_over_mla", measured["ratio"], bytes_per_token=per_token,
         channels=channels, codecs=codecs, agreement=agree, model=model.name,
         random_model={k: v for k, v in MLA.items() if k != "architectures"},
         note="codecs, channels and agreement on the trained model (fp32 compute, latent sent as bf16); "
              "bytes per token on random-weight models of the shapes in random_model")


if __name__ == "__main__":
    main()
