"""The eager floor of a batch-1 decode step: the engine against the fewest torch operators that compute it.

`bench/decode.py --floor` runs the bundled model's batch-1 greedy decode two ways, interleaved over
rounds in one process with the same weights and thread count:
- engine: `LLMEngine.generate`, one request (scheduler, block tables, paged attention, sampler,
  detokenization off);
- floor: a hand-written step over the engine's own weight tensors — embedding row, per layer RMSNorm,
  merged QKV matmul, RoPE, a write into a dense per-layer KV tensor, SDPA over the filled prefix, output
  projection, RMSNorm, merged gate/up matmul, SiLU·up, down projection; final norm, LM head, argmax —
  with no scheduler, no metadata and no sampler: what any eager PyTorch engine must dispatch per token.
Both emit the same tokens (checked). Their ratio says how much of a step is the engine's own work; what
is left against llama.cpp (bench/peer_llamacpp.py) is the eager framework's per-operator cost on this CPU.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from common import ROOT, progress

from edgecore.shared.models.config import CacheConfig
from edgecore.shared.engine.engine import LLMEngine
from edgecore.shared.engine.sampling_params import SamplingParams

MODEL = ROOT / "models" / "pydoc-llama"


class FloorStep:
    """Greedy batch-1 decode of a Llama-family engine model in plain eager torch (float32)."""

    def __init__(self, model, max_len: int):
        cfg = model.config
        self.h, self.kvh, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        inter = cfg.intermediate_size

        def input_major(linear):
            return linear.weight.detach().t().contiguous()
        self.emb = model.model.embed_tokens.weight.detach()
        self.head = input_major(model.lm_head)
        self.norm = model.model.norm.weight.detach()
        self.layers = [(layer.input_layernorm.weight.detach(), input_major(layer.self_attn.qkv_proj),
                        input_major(layer.self_attn.o_proj), layer.post_attention_layernorm.weight.detach(),
                        input_major(layer.mlp.gate_up_proj), input_major(layer.mlp.down_proj))
                       for layer in model.model.layers]
        self.inter = inter
        self.cos, self.sin = model.rope_cos, model.rope_sin          # signed-sin halves layout [pos, D]
        self.k = torch.zeros(len(self.layers), max_len, self.kvh, self.d)
        self.v = torch.zeros_like(self.k)

    def _rms(self, x, w):
        return (x * x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()).mul_(w)

    def prefill(self, ids: list[int]) -> int:
        """Prompt through the same operators, one token at a time (the floor measures decode only)."""
        tok = 0
        for pos, t in enumerate(ids):
            tok = self.step(t, pos)
        return tok

    @torch.inference_mode()
    def step(self, tok: int, pos: int) -> int:
        h, kvh, d = self.h, self.kvh, self.d
        x = self.emb[tok:tok + 1]
        cos, sin = self.cos[pos], self.sin[pos]
        for i, (n1, qkv_w, o_w, n2, gu_w, down_w) in enumerate(self.layers):
            qkv = torch.mm(self._rms(x, n1), qkv_w).view(h + 2 * kvh, d)
            qk = qkv[:h + kvh]
            qk = qk * cos + qk.roll(d // 2, -1) * sin
            self.k[i, pos] = qk[h:]
            self.v[i, pos] = qkv[h + kvh:]
            a = F.scaled_dot_product_attention(qk[:h].view(1, h, 1, d), self.k[i, :pos + 1].transpose(0, 1)[None],
                                               self.v[i, :pos + 1].transpose(0, 1)[None], enable_gqa=h != kvh)
            x = x + torch.mm(a.view(1, h * d), o_w)
            gate, up = torch.mm(self._rms(x, n2), gu_w).chunk(2, dim=-1)
            x = x + torch.mm(F.silu(gate) * up, down_w)
        return int(torch.mm(self._rms(x, self.norm), self.head).argmax())


def run(prompt_len: int, new_tokens: int, rounds: int) -> dict:
    engine = LLMEngine.from_dir(MODEL, "fp32", "cpu", CacheConfig(num_blocks=512))
    prompt = torch.randint(3, engine.config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0))
    prompt = prompt.tolist()
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, detokenize=False)
    floor = FloorStep(engine.model, prompt_len + new_tokens)
    ms = {"engine": [], "floor": []}
    for r in range(rounds + 1):                 # round 0 warms both up and is not counted
        t = time.perf_counter()
        ours = engine.generate([prompt], params)[0]["token_ids"]
        engine_ms = (time.perf_counter() - t) * 1e3 / new_tokens
        tok = floor.prefill(prompt)
        got = []
        t = time.perf_counter()
        for pos in range(prompt_len, prompt_len + new_tokens):
            got.append(tok)
            tok = floor.step(tok, pos)
        floor_ms = (time.perf_counter() - t) * 1e3 / new_tokens
        assert got[0] == ours[0], "the floor's first token differs from the engine's"
        agree = sum(a == b for a, b in zip(got, ours)) / new_tokens     # float sums may differ in order
        assert agree >= 0.9, f"the floor's tokens agree with the engine's on only {agree:.0%}"
        if r:
            ms["engine"].append(engine_ms)
            ms["floor"].append(floor_ms)
            progress(f"round {r}/{rounds}: engine {engine_ms:.2f} ms/step, floor {floor_ms:.2f} ms/step")
    med = {k: statistics.median(v) for k, v in ms.items()}
    return {"engine_ms_per_step": round(med["engine"], 3), "floor_ms_per_step": round(med["floor"], 3),
            "engine_over_floor": round(med["engine"] / med["floor"], 3),
            "rounds": {k: [round(x, 3) for x in v] for k, v in ms.items()},
            "prompt_tokens": prompt_len, "new_tokens": new_tokens, "threads": torch.get_num_threads()}
