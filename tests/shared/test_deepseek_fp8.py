"""Published fp8 DeepSeek-V3 / Kimi K2 checkpoints: float8_e4m3fn linear weights with block `weight_scale_inv`
dequantized at load as transformers dequantizes them (and as DeepSeek's formula does over partial edge blocks);
a tiny checkpoint quantized here gives transformers' logits (on the same dequantized weights) within 1e-4;
multi-token-prediction layers are skipped with a logged note."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from edgecore.shared.errors import ModelLoadError
from edgecore.shared.models.fp8 import dequantize_block, dequantized
from tests.conftest import make_engine
from tests.helpers import stepwise_logits
from tests.shared.deepseek_checkpoints import deepseek_checkpoint

transformers = pytest.importorskip("transformers")
fp8_mod = pytest.importorskip("transformers.integrations.finegrained_fp8")
BLOCK = (8, 8)


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block absmax scaling into e4m3 (max 448): the fp8 weight and its scale_inv grid."""
    rows, cols = w.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale = torch.empty(grid)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
    full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (w / full).to(torch.float8_e4m3fn), scale


def transformers_dequant(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return fp8_mod.Fp8Dequantize(None)._dequantize_one(w, scale_inv, output_dtype=torch.float32)


def test_dequantize_matches_transformers_on_whole_blocks():
    w = torch.randn(48, 64) * 0.05
    q, s = quantize(w, (16, 32))
    ours = dequantize_block(q, s, (16, 32))
    assert torch.equal(ours, transformers_dequant(q, s))
    assert (ours - w).abs().max().item() <= 0.07 * w.abs().max().item()      # e4m3: 3 mantissa bits


def test_dequantize_partial_edge_blocks_by_the_published_formula():
    """V3's kv_a_proj_with_mqa is 576 x 7168 in 128 x 128 blocks: its last row block holds 64 rows."""
    w = torch.randn(40, 20)
    q, s = quantize(w, (16, 16))
    assert s.shape == (3, 2)
    ours = dequantize_block(q, s, (16, 16))
    expect = torch.empty(40, 20)
    for i in range(40):
        for j in range(20):
            expect[i, j] = q[i, j].float() * s[i // 16, j // 16]
    assert torch.equal(ours, expect)
    with pytest.raises(ValueError, match="w_scale_inv.*expected shape \\(3, 2\\)"):
        dequantize_block(q, s[:2], (16, 16), "w")


def test_stream_pairs_weights_with_scales_in_either_order():
    q, s = quantize(torch.randn(16, 16), BLOCK)
    norm = torch.ones(16)
    out = dict(dequantized([("a.weight_scale_inv", s), ("a.weight", q), ("n.weight", norm),
                            ("b.weight", q), ("b.weight_scale_inv", s)], BLOCK))
    assert set(out) == {"a.weight", "b.weight", "n.weight"} and out["n.weight"] is norm
    assert torch.equal(out["a.weight"], out["b.weight"])
    with pytest.raises(ValueError, match="'c.weight' has no '_scale_inv'"):
        dict(dequantized([("c.weight", q)], BLOCK))
    with pytest.raises(ValueError, match="'d.weight_scale_inv' scales no fp8 weight"):
        dict(dequantized([("d.weight_scale_inv", s)], BLOCK))


def _is_quantized(name: str, t: torch.Tensor) -> bool:
    """As the published checkpoints: every linear weight but the embeddings, the head and the router."""
    return t.dim() == 2 and name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight")


def fp8_checkpoint(path):
    """The tiny V3 checkpoint with its linear weights in fp8 (8x8 blocks), one MTP layer appended; returns the
    path, transformers' model carrying the dequantized weights (transformers' own dequantization) and the
    unquantized original."""
    path, hf = deepseek_checkpoint(path / "fp8", "v3-qlora-yarn-grouped")
    tensors = load_file(path / "model.safetensors")
    out, reference = {}, dict(tensors)
    for name, t in tensors.items():
        if _is_quantized(name, t):
            q, s = quantize(t.float(), BLOCK)
            out[name], out[name + "_scale_inv"] = q, s
            reference[name] = transformers_dequant(q, s)
        else:
            out[name] = t
    layers = hf.config.num_hidden_layers
    for name, t in tensors.items():                  # an MTP layer: the last layer's tensors under index `layers`
        if name.startswith(f"model.layers.{layers - 1}."):
            out[name.replace(f".{layers - 1}.", f".{layers}.", 1)] = torch.randn_like(t.float()).to(t.dtype)
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": list(BLOCK)}
    raw["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(raw))
    assert sum(name.endswith("_scale_inv") for name in out) > 20
    ref_dir = path.parent / "dequantized"                # transformers reads its expert layout from here
    hf.save_pretrained(ref_dir)
    save_file(reference, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    return path, transformers.DeepseekV3ForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval(), hf


def test_fp8_checkpoint_logits_match_transformers(tmp_path, caplog):
    path, hf, unquantized = fp8_checkpoint(tmp_path)
    with caplog.at_level(logging.INFO, logger="edgecore.models"):
        engine = make_engine(path, block_size=16, num_blocks=32)
    assert "multi-token-prediction layer(s) 3" in caplog.text
    assert "match nothing" not in caplog.text           # the scales are read with their weights
    ids = torch.randint(2, 257, (64,), generator=torch.Generator().manual_seed(5)).tolist()
    ours = stepwise_logits(engine, ids, 40)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, 39:]
    assert (ours - ref).abs().max().item() <= 1e-4
    with torch.no_grad():
        before = unquantized(torch.tensor([ids])).logits[0, 39:]
    assert (before - ref).abs().max().item() > 1e-2          # the fp8 rounding is visible: the check can fail


def test_fp8_weights_without_quantization_config_are_refused(tmp_path):
    path, _, _ = fp8_checkpoint(tmp_path)
    raw = json.loads((path / "config.json").read_text())
    del raw["quantization_config"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="_scale_inv.*quantization_config"):
        make_engine(path, block_size=16, num_blocks=32)
