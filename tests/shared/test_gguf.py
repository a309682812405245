"""GGUF checkpoints and quantized weights: each block format's dequantization against the `gguf` package's
reference, the packed kernels against the values they stand for, tiny random Llama / Qwen2 models written as
GGUF (F32 and F16 greedy-identical to transformers; Q8_0 and Q4_0 close), `--quantize`, the tokenizer from a
file's metadata, bad files as one-line errors, and an HTTP request served from a .gguf file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from edgecore.shared.errors import ConfigError, ModelLoadError
from edgecore.shared.models.quant import BLOCKS, QuantWeight, dequantize
from tests.conftest import MODEL_DIR
from tests.shared.gguf_checkpoints import hf_model, write_gguf

gguf = pytest.importorskip("gguf")
pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = [[5, 17, 42, 99, 3, 7], [200, 1, 2, 3], [64, 65, 66, 67, 68, 69, 70, 71], [9, 250, 9, 250, 9]]
STEPS = 10


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """Random bytes of a [rows, cols] tensor of `kind`, with its float16 scales set to small finite values."""
    per, nbytes = BLOCKS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // per, nbytes), dtype=np.uint8)
    scale_at = {"Q8_0": [0], "Q4_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}.get(kind, [])
    for at in scale_at:
        raw[..., at:at + 2] = ((rng.random((rows, cols // per)) + 0.1) * scale).astype(np.float16)[..., None].view(
            np.uint8)
    if kind in ("F16", "BF16", "F32"):
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        if kind == "F16":
            return values.astype(np.float16).view(np.uint8).reshape(rows, -1)
        if kind == "BF16":
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
        return values.view(np.uint8).reshape(rows, -1)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_dequantize_matches_the_gguf_package(kind):
    raw = random_blocks(kind, 32, 512)
    reference = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    ours = dequantize(kind, torch.from_numpy(raw)).reshape(reference.shape).numpy()
    np.testing.assert_array_equal(ours, reference)


@pytest.mark.parametrize("kind,scheme", [("Q4_0", "int4"), ("Q4_K", "int4"), ("Q8_0", "int8"), ("Q6_K", "int8")])
def test_packed_kernels_multiply_by_the_block_values(kind, scheme):
    raw = torch.from_numpy(random_blocks(kind, 64, 512, seed=1))
    w = dequantize(kind, raw).reshape(64, 512)
    q = QuantWeight.from_blocks(kind, raw, 64, 512)
    assert q.scheme == scheme and q.packed.dtype in (torch.uint8, torch.int8)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0))
    got, want = q.mm(x), x @ w.t()
    # bfloat16 activations, scales and zeros: about 2^-8 relative each
    bf16 = 2 ** -7 * float((x.abs() @ w.abs().t()).max())
    if scheme == "int4":        # the nibbles exactly
        assert q.requant_error == 0
        assert float((got - want).abs().max()) <= bf16
        assert float((q.dequantized() - w).abs().max()) <= 2 ** -7 * float(w.abs().max())
    else:                       # requantized per row: each weight moved by at most `requant_error`
        assert 0 < q.requant_error <= float(w.abs().amax(1).max()) / 254 * 1.01
        assert float((got - want).abs().max()) <= q.requant_error * float(x.abs().sum(1).max()) + bf16
        assert float((q.dequantized() - w).abs().max()) <= q.requant_error + 2 ** -7 * float(w.abs().max())


def test_quantize_float_weights_int8_and_int4():
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(2))
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(3))
    for scheme, rel in (("int8", 0.02), ("int4", 0.2)):
        q = QuantWeight.from_float(w, scheme)
        assert q.scheme == scheme
        err = (q.mm(x) - x @ w.t()).norm() / (x @ w.t()).norm()
        assert err < rel, (scheme, float(err))
    with pytest.raises(ValueError, match="int4 needs"):
        QuantWeight.from_float(torch.randn(48, 40), "int4")


@pytest.mark.parametrize("rows", [(16, 64), (48, 16), (32, 16, 48)])
def test_int4_parts_of_uneven_sizes_merge_exactly(rows):
    """q+k+v / gate+up merged (`QuantStack.of`): the int4 kernel's layout groups output rows in blocks of 32
    (AVX2) or 64 (AVX-512), so parts are concatenated as nibbles and packed once, never as packed tensors."""
    from edgecore.shared.models.quant import QuantStack
    g = torch.Generator().manual_seed(4)
    weights = [torch.randn(n, 128, generator=g) for n in rows]
    x = torch.randn(3, 128, generator=g)
    separate = torch.cat([QuantWeight.from_float(w, "int4").mm(x) for w in weights], -1)
    merged = QuantStack.of([QuantWeight.from_float(w, "int4") for w in weights])
    merged.pack()
    assert not isinstance(merged, QuantStack) and merged.out_features == sum(rows)
    torch.testing.assert_close(merged.mm(x), separate, rtol=1e-3, atol=1e-3)
    packed = [QuantWeight.from_float(w, "int4") for w in weights]
    for p in packed:
        p.pack()                    # already in the kernel's layout: kept apart, still right
    torch.testing.assert_close(QuantStack.of(packed).mm(x), separate, rtol=1e-3, atol=1e-3)
    raw = [torch.from_numpy(random_blocks("Q4_0", n, 128, seed=n)) for n in rows]
    blocks = torch.cat([QuantWeight.from_blocks("Q4_0", r, n, 128).mm(x) for r, n in zip(raw, rows)], -1)
    torch.testing.assert_close(QuantStack.of([QuantWeight.from_blocks("Q4_0", r, n, 128) for r, n in zip(raw, rows)])
                               .mm(x), blocks, rtol=1e-3, atol=1e-3)


def test_quantize_refuses_a_model_off_the_cpu():
    from edgecore.shared.models.config import ModelConfig
    from edgecore.shared.models.loader import build_model
    from edgecore.shared.models.quant_loader import quantize_model
    model = build_model(ModelConfig.from_dir(MODEL_DIR), torch.float32, "meta")
    with pytest.raises(ConfigError, match="--quantize runs on CPU.*'meta'"):
        quantize_model(model, "int4")


# ---- tiny models written as GGUF ----------------------------------------------------------------

@pytest.fixture(scope="module")
def models():
    return {arch: hf_model(arch) for arch in ("llama", "qwen2")}


@torch.no_grad()
def greedy_hf(hf, prompt: list[int], steps: int = STEPS) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def next_logits_hf(hf, prompt: list[int]) -> torch.Tensor:
    return hf(torch.tensor([prompt])).logits[0, -1]


def engine_for(path, quantize=None):
    from edgecore.shared.models.config import CacheConfig, EngineConfig
    from edgecore.shared.engine.engine import LLMEngine
    return LLMEngine.from_dir(path, "fp32", "cpu", CacheConfig(num_blocks=64),
                              EngineConfig(quantize=quantize))


def greedy(engine, prompts=PROMPTS, steps=STEPS) -> list[list[int]]:
    from edgecore.shared.engine.sampling_params import SamplingParams
    return [o["token_ids"] for o in engine.generate(prompts, SamplingParams(max_tokens=steps, temperature=0,
                                                                             ignore_eos=True))]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["F32", "F16"])
def test_float_gguf_is_greedy_identical_to_transformers(models, tmp_path, arch, kind):
    hf = models[arch]
    if kind == "F16":          # the reference holds the same float16-rounded weights
        hf = hf_model(arch)
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if p.dim() == 2 and "embed" not in name:
                    p.copy_(p.half().float())
    path = write_gguf(hf, tmp_path / f"{arch}-{kind}.gguf", kind, arch=arch)
    from edgecore.shared.models.config import ModelConfig
    config = ModelConfig.from_dir(path)
    assert (config.architecture, config.num_key_value_heads, config.head_dim) == (
        {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch], 2, 16)
    assert greedy(engine_for(path)) == [greedy_hf(hf, p) for p in PROMPTS]


@pytest.mark.parametrize("kind,scheme,agree", [("Q8_0", "int8", 1.0), ("Q4_0", "int4", 0.75)])
def test_quantized_gguf_stays_packed_and_close(models, tmp_path, kind, scheme, agree):
    from edgecore.shared.models.layers import _Matmul, weight_bytes
    hf = models["llama"]
    path = write_gguf(hf, tmp_path / f"llama-{kind}.gguf", kind)
    engine = engine_for(path)
    model = engine.model
    projections = [m for m in model.modules() if isinstance(m, _Matmul)]
    assert projections and all(m.quant is not None and m.quant.scheme == scheme and m.weight.numel() == 0
                               for m in projections)
    assert engine.runner.flat is None           # the float fast path does not take quantized weights
    assert engine.runner.layer0_macs_per_token == sum(p.numel() for p in hf.model.layers[0].self_attn.parameters()
                                                 if p.dim() == 2)      # what placement weighs layer 0 by
    floats = sum(p.numel() for n, p in hf.named_parameters() if p.dim() == 2 and "embed" not in n) * 4
    quantized = sum(m.quant.nbytes for m in projections)
    assert quantized < floats * (0.3 if scheme == "int8" else 0.2)
    assert weight_bytes(model) < floats
    # next-token logits close to the float model's; the greedy choice the same on (nearly) every prompt
    from edgecore.shared.engine.sampling_params import SamplingParams
    prompts = [[(7 * i + j * 13) % 256 for j in range(6 + i % 5)] for i in range(16)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=1))
    same = sum(o["token_ids"][0] == int(next_logits_hf(hf, p).argmax()) for o, p in zip(outs, prompts))
    assert same / len(prompts) >= agree
    first = greedy(engine, PROMPTS[:1], 1)[0][0]
    assert first == greedy_hf(hf, PROMPTS[0], 1)[0]


def test_fingerprint_tells_files_apart(models, tmp_path):
    from edgecore.shared.models.fingerprint import model_fingerprint
    a = write_gguf(models["llama"], tmp_path / "a.gguf", "Q8_0")
    b = write_gguf(models["llama"], tmp_path / "b.gguf", "Q4_0")
    assert model_fingerprint(a) == model_fingerprint(a) != model_fingerprint(b)


def test_mixed_block_formats_in_one_projection(models, tmp_path):
    """A Q4_K_M-like mix: Q4_0 q/k beside a Q8_0 v (one kernel call per scheme), a Q8_0 down projection."""
    hf = models["llama"]
    kinds = {f"blk.{i}.{n}.weight": "Q8_0" for i in range(2) for n in ("attn_v", "ffn_down")}
    path = write_gguf(hf, tmp_path / "mixed.gguf", "Q4_0", kinds=kinds)
    model = engine_for(path).model
    qkv = model.model.layers[0].self_attn.qkv_proj.quant
    assert qkv is not None and [p.scheme for p in qkv.parts] == ["int4", "int8"]
    assert model.model.layers[0].mlp.down_proj.quant.scheme == "int8"
    assert greedy(engine_for(path), PROMPTS[:1], 1)[0][0] == greedy_hf(hf, PROMPTS[0], 1)[0]


def test_quantized_tied_embedding_stays_in_blocks(tmp_path):
    """A tied model whose embedding table is Q8_0: lookups decode its rows, the LM head multiplies by its blocks."""
    hf = hf_model("llama", tie_word_embeddings=True)
    with torch.no_grad():       # the reference holds the table's Q8_0 values
        table = hf.model.embed_tokens.weight
        q8 = gguf.quants.quantize(table.numpy(), gguf.GGMLQuantizationType.Q8_0)
        table.copy_(torch.from_numpy(gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)))
    path = write_gguf(hf, tmp_path / "tied.gguf", "F32", kinds={"token_embd.weight": "Q8_0"})
    engine = engine_for(path)
    embed, head = engine.model.model.embed_tokens, engine.model.lm_head
    assert embed.quant_rows is not None and embed.weight.numel() == 0 and head.weight.numel() == 0
    assert head.quant.source == "Q8_0" and head.quant.scheme == "int8"
    ids = torch.tensor([3, 200, 3])
    torch.testing.assert_close(embed.forward(ids), table[ids], rtol=0, atol=0)
    first = [g[0] for g in greedy(engine, steps=1)]
    assert sum(a == greedy_hf(hf, p, 1)[0] for a, p in zip(first, PROMPTS)) >= 3


def test_k_quant_file_matches_its_dequantized_weights(tmp_path):
    """A Q4_K_M-like file (Q4_K q/k/o/gate/up, Q6_K v/down/LM head) of random blocks, against transformers
    holding the blocks' float values: next-token choices and logits agree up to bfloat16 activations."""
    from tests.shared.gguf_checkpoints import unpermute
    hf = hf_model("llama", hidden_size=256, intermediate_size=256, head_dim=64, num_hidden_layers=1)
    c = hf.config
    raw = {}
    for i, (name, p) in enumerate(hf.named_parameters()):
        if p.dim() != 2 or "embed" in name:
            continue
        from tests.shared.gguf_checkpoints import gguf_name
        g = gguf_name(name)
        kind = "Q6_K" if any(k in g for k in ("attn_v", "ffn_down", "output")) else "Q4_K"
        blocks = random_blocks(kind, p.shape[0], p.shape[1], seed=10 + i, scale=3e-4 if kind == "Q4_K" else 1e-4)
        values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]).reshape(p.shape)
        if "attn_q" in g or "attn_k" in g:
            values = unpermute(values, c.num_attention_heads if "attn_q" in g else c.num_key_value_heads)
        with torch.no_grad():
            p.copy_(torch.from_numpy(values.copy()))
        raw[g] = (kind, blocks)
    path = write_gguf(hf, tmp_path / "k.gguf", "F32", raw=raw)
    engine = engine_for(path)
    layer = engine.model.model.layers[0]
    assert [q.source for q in layer.self_attn.qkv_proj.quant.parts] == ["Q4_K", "Q6_K"]
    assert layer.mlp.gate_up_proj.quant.scheme == "int4" and engine.model.lm_head.quant.source == "Q6_K"
    from edgecore.shared.engine.sampling_params import SamplingParams
    prompts = [[(11 * i + 5 * j) % 256 for j in range(5 + i % 4)] for i in range(12)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    same = sum(o["token_ids"][0] == int(next_logits_hf(hf, p).argmax()) for o, p in zip(outs, prompts))
    assert same >= len(prompts) - 1


def test_quantize_flag_on_a_hugging_face_checkpoint(models, tmp_path):
    from edgecore.shared.models.layers import _Matmul
    hf = models["llama"]
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    reference = [greedy_hf(hf, p, 1)[0] for p in PROMPTS]
    for scheme in ("int8", "int4"):
        engine = engine_for(tmp_path / "hf", scheme)
        assert all(m.quant is not None and m.quant.scheme == scheme
                   for m in engine.model.modules() if isinstance(m, _Matmul))
        got = [g[0] for g in greedy(engine, steps=1)]
        assert sum(a == b for a, b in zip(got, reference)) >= (4 if scheme == "int8" else 3)


# ---- the tokenizer ------------------------------------------------------------------------------

def bundled_gguf(path: Path, kind: str = "F32") -> Path:
    """The bundled pydoc-llama as a GGUF file with its tokenizer in the metadata (no tokenizer.json beside)."""
    import transformers

    from edgecore.shared.text.gguf_tokenizer import tokenizer_metadata
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()
    tok = tokenizer_metadata(MODEL_DIR / "tokenizer.json")
    tok["chat_template"] = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())["chat_template"]
    return write_gguf(hf, path, kind, tokenizer=tok)


@pytest.fixture(scope="module")
def bundled(tmp_path_factory):
    return bundled_gguf(tmp_path_factory.mktemp("gguf") / "pydoc-Q8_0.gguf", "Q8_0")


def test_tokenizer_from_gpt2_metadata_matches_tokenizer_json(bundled, tokenizer, heldout, caplog):
    from edgecore.shared.text.tokenizer import Tokenizer
    with caplog.at_level("INFO", "edgecore.models"):
        ours = Tokenizer.from_dir(bundled)
    assert "tokenizer from the file's metadata" in caplog.text
    for text in (heldout[:3000], "def f(x):\n    return x  # é ✓ 😀", "<|bos|>hi<|eos|>"):
        assert ours.encode(text) == tokenizer.encode(text)
        assert ours.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
        assert ours.decode(tokenizer.encode(text)) == tokenizer.decode(tokenizer.encode(text))
    assert (ours.bos_token_id, ours.eos_token_id) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    messages = [{"role": "user", "content": "hello"}]
    assert ours.encode_chat(messages) == tokenizer.encode_chat(messages)


def test_tokenizer_json_beside_the_file_is_preferred(tmp_path, caplog):
    import shutil
    path = write_gguf(hf_model("llama", vocab_size=2048), tmp_path / "m.gguf", "F32")
    shutil.copy(MODEL_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    from edgecore.shared.text.tokenizer import Tokenizer
    with caplog.at_level("INFO", "edgecore.models"):
        tok = Tokenizer.from_dir(path)
    assert f"tokenizer from {tmp_path / 'tokenizer.json'}" in caplog.text and tok.vocab_size == 2048


def test_sentencepiece_metadata(tmp_path):
    """A "llama" (SentencePiece) vocabulary: merges by score, "▁" for spaces, byte fallback, BOS prepended."""
    from edgecore.shared.text.tokenizer import Tokenizer
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + \
        ["▁", "h", "e", "l", "o", "▁h", "ll", "▁he", "llo", "▁hello", "w", "r", "d"]
    scores = [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0, -9.0, -1.5, -10.0, -11.0, -12.0]
    types = [2, 3, 3] + [6] * 256 + [1] * 13
    model = hf_model("llama", vocab_size=len(pieces) + (16 - len(pieces) % 16) % 16, bos_token_id=1, eos_token_id=2)
    path = write_gguf(model, tmp_path / "spm.gguf", "F32", tokenizer={
        "model": "llama", "tokens": pieces + [f"<pad{i}>" for i in range(model.config.vocab_size - len(pieces))],
        "scores": scores + [0.0] * (model.config.vocab_size - len(pieces)),
        "types": types + [4] * (model.config.vocab_size - len(pieces))})
    tok = Tokenizer.from_dir(path)
    ids = tok.encode("hello hello")
    assert [tok.backend.id_to_token(i) for i in ids] == ["<s>", "▁hello", "▁hello"]
    ids = tok.encode("hi", add_special_tokens=False)      # 'i' is no piece: its byte
    assert [tok.backend.id_to_token(i) for i in ids] == ["▁h", "<0x69>"]
    assert tok.decode(tok.encode("hello hi", add_special_tokens=False)) == "hello hi"


# ---- bad files ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good(models, tmp_path_factory):
    return write_gguf(models["llama"], tmp_path_factory.mktemp("bad") / "good.gguf", "Q8_0")


def load(path):
    from edgecore.shared.models.loader import load_model
    return load_model(path, "fp32", "cpu")


def test_truncated_file_names_the_tensor(good, tmp_path):
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 5000])
    with pytest.raises(ModelLoadError, match=r"tensor '[\w.]+' needs \d+ bytes .* \(truncated\?\)"):
        load(cut)
    cut.write_bytes(data[:100])                   # inside the metadata
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load(cut)


def test_corrupt_header_and_missing_file(good, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + good.read_bytes()[4:])
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load(bad)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load(tmp_path / "none.gguf")


def test_unsupported_type_architecture_and_shapes(models, tmp_path):
    hf = models["llama"]
    q5 = write_gguf(hf, tmp_path / "q5.gguf", "F32", kinds={"blk.1.ffn_up.weight": "Q5_0"})
    with pytest.raises(ModelLoadError, match=r"tensor 'blk.1.ffn_up.weight' has type Q5_0, which is not supported"):
        load(q5)
    arch = write_gguf(hf, tmp_path / "arch.gguf", "F32", arch="gpt2")
    with pytest.raises(ConfigError, match="general.architecture 'gpt2' is not supported"):
        from edgecore.shared.models.config import ModelConfig
        ModelConfig.from_dir(arch)
    shaped = write_gguf(hf_model("llama", intermediate_size=96), tmp_path / "shape.gguf", "F32")
    data = bytearray(shaped.read_bytes())       # metadata says 128: patch the feed-forward length in place
    key = b"llama.feed_forward_length"
    at = data.index(key) + len(key) + 4
    assert int.from_bytes(data[at:at + 4], "little") == 96
    data[at:at + 4] = (128).to_bytes(4, "little")
    shaped.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"tensor 'blk.0.ffn_gate.weight' has shape \[96, 64\], but the "
                                             r"metadata implies \[128, 64\]"):
        load(shaped)


@pytest.mark.slow
def test_cli_error_is_one_line(good, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-3000])
    r = subprocess.run([sys.executable, "-m", "edgecore", "generate", "--model", str(cut), "--prompt", "x"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgecore: error:") and "truncated" in lines[0], r.stderr


# ---- served over HTTP ---------------------------------------------------------------------------

@pytest.mark.slow
async def test_http_completion_from_a_gguf_file(bundled):
    from edgecore.shared.engine.sampling_params import SamplingParams
    from tests.edge.edge_api import edge_api
    engine = engine_for(bundled)
    prompt = "def parse_args("
    expected = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0]["text"]
    async with edge_api(bundled, engine, model_name="pydoc-q8") as s:
        async with s.post("/v1/completions", json={"model": "pydoc-q8", "prompt": prompt, "max_tokens": 8,
                                                   "temperature": 0}) as resp:
            assert resp.status == 200, await resp.text()
            body = await resp.json()
        async with s.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 4}) as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["usage"]["completion_tokens"] == 4
    assert body["choices"][0]["text"] == expected and body["usage"]["completion_tokens"] == 8
