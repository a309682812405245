"""The model's KV bit allocation for the entropy-coded levels: per-layer and per-channel step multipliers
(kv_allocation.json) steer the encoder only, load with clear errors, and are calibrated (bench/kv_alloc.py)
as transformers' own projections say."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgecore.protocol.codecs import LEVELS, PlaneInfo, from_float32, get_codec, to_float32
from edgecore.protocol.codecs.equant import groups, token_spans
from edgecore.protocol.errors import CodecError
from tests.conftest import make_engine
from tests.protocol.test_codecs import random_plane


def test_step_scales_steer_the_encoder_only():
    """The model's bit allocation (per kind and layer step multipliers) changes what the encoder spends where;
    the decoder needs none of it. Through encode_chunk, as a core passes it."""
    from edgecore.protocol.kv import decode_chunk, encode_chunk
    rng = np.random.default_rng(4)
    k, v = random_plane(rng, "bfloat16", (2, 300, 2, 16)), random_plane(rng, "bfloat16", (2, 300, 2, 16))

    def chunk(scales):
        data = encode_chunk("r", k, v, layer_start=1, token_start=0, dtype="bfloat16", codec="q2e",
                            total_tokens=300, step_scales=scales)
        k2, v2 = decode_chunk(data)
        errs = [np.abs(to_float32(a, "bfloat16") - to_float32(b, "bfloat16"))[i].mean()
                for a, b in ((k2, k), (v2, v)) for i in range(2)]
        return data.chunk.k_bytes, len(data.payload) - data.chunk.k_bytes, errs

    k_bytes, v_bytes, errs = chunk(None)
    # Model layer 1 = the chunk's first layer: its keys finer, layer 2's values coarser; the rest as before.
    k2_bytes, v2_bytes, errs2 = chunk({"k": (1.0, 0.5), "v": (1.0, 1.0, 2.0)})
    assert k2_bytes > k_bytes and v2_bytes < v_bytes
    assert errs2[0] < 0.7 * errs[0] and errs2[1] == pytest.approx(errs[1])
    assert errs2[2] == pytest.approx(errs[2]) and errs2[3] > 1.4 * errs[3]


def test_model_allocation_file(tmp_path):
    from edgecore.shared.errors import ConfigError
    from edgecore.shared.kv.wire import ALLOCATION_FILE, codec_step_scales
    from tests.conftest import MODEL_DIR
    assert codec_step_scales(tmp_path) == {}
    shipped = codec_step_scales(MODEL_DIR)       # the bundled model's, measured by bench/kv_rd.py --allocate
    assert {"k", "v"} <= set(shipped) and all(len(shipped[kind]) == 4 and all(0.25 <= x <= 4 for x in shipped[kind])
                                              for kind in "kv")
    (tmp_path / ALLOCATION_FILE).write_text('{"step_scales": {"k": [1.0, 0.5], "v": [2]}}')
    assert codec_step_scales(tmp_path) == {"k": (1.0, 0.5), "v": (2.0,)}
    for bad in ('{"step_scales": {"q": [1]}}', '{"step_scales": {"k": [0]}}', '{"step_scales": []}', "{"):
        (tmp_path / ALLOCATION_FILE).write_text(bad)
        with pytest.raises(ConfigError, match=ALLOCATION_FILE):
            codec_step_scales(tmp_path)


def test_channel_scales_steer_the_encoder_only():
    """Per-channel importance scales (kv_allocation.json's channel_scales) reach the encoder through
    encode_chunk, sliced to the chunk's heads; the decoder needs none of them; scales of 1.0 change no byte."""
    from edgecore.protocol.kv import decode_chunk, encode_chunk
    rng = np.random.default_rng(5)
    shape = (1, 300, 2, 16)
    k, v = random_plane(rng, "bfloat16", shape), random_plane(rng, "bfloat16", shape)
    layer = {"k": (1.0,), "v": (1.0,)}

    def chunk(channels, head_start=0):
        data = encode_chunk("r", k, v, layer_start=0, token_start=0, head_start=head_start, dtype="bfloat16",
                            codec="q2e", total_tokens=300, step_scales={**layer, **channels})
        k2, v2 = decode_chunk(data)
        err = [np.abs(to_float32(a, "bfloat16") - to_float32(b, "bfloat16"))[0, 4:].mean(axis=0)
               for a, b in ((k2, k), (v2, v))]
        return bytes(data.payload), err

    plain, err = chunk({})
    ones, _ = chunk({"k_channels": ((1.0,) * 96,), "v_channels": ((1.0,) * 96,)})
    assert ones == plain
    # The model has 6 KV heads; the chunk holds heads 2-3: head 2 channel 0's values twice as fine, head 3
    # channel 5's keys four times as coarse (its guard, max deviation / 7.5, sets a floor on fine steps only).
    vc, kc = [1.0] * 96, [1.0] * 96
    vc[2 * 16] = 0.5
    kc[3 * 16 + 5] = 4.0
    _, err2 = chunk({"k_channels": (tuple(kc),), "v_channels": (tuple(vc),)}, head_start=2)
    assert err2[1][0, 0] < 0.8 * err[1][0, 0] and err2[0][1, 5] > 2 * err[0][1, 5]
    assert np.allclose(np.delete(err2[1].reshape(-1), 0), np.delete(err[1].reshape(-1), 0))
    with pytest.raises(CodecError, match="channel scales"):
        chunk({"k_channels": ((1.0,) * 20,)})


def test_model_allocation_file_channels(tmp_path):
    from edgecore.shared.errors import ConfigError
    from edgecore.shared.kv.wire import ALLOCATION_FILE, codec_step_scales
    (tmp_path / ALLOCATION_FILE).write_text(
        '{"step_scales": {"k": [1.0], "v": [2]}, "channel_scales": {"k": [[0.5, 2.0], [1, 1]]}}')
    assert codec_step_scales(tmp_path) == {"k": (1.0,), "v": (2.0,), "k_channels": ((0.5, 2.0), (1.0, 1.0))}
    for bad in ('{"q": [[1]]}', '{"k": [[0]]}', '{"k": [[1, 1], [1]]}', '{"k": [1]}'):
        (tmp_path / ALLOCATION_FILE).write_text(f'{{"step_scales": {{"k": [1]}}, "channel_scales": {bad}}}')
        with pytest.raises(ConfigError, match=ALLOCATION_FILE):
            codec_step_scales(tmp_path)


def test_channel_weights_match_transformers(heldout):
    """bench/kv_alloc.py's calibration against transformers on the same windows: value weights are o_proj's
    column norms summed over each KV head's query heads; key weights E[q_c² + q_partner²] of the pre-RoPE
    queries (q_proj's output) summed likewise; key stds those of k_proj's output (the RoPE undone)."""
    import sys
    from transformers import AutoModelForCausalLM

    from tests.conftest import MODEL_DIR, ROOT
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from kv_alloc import channel_scales, channel_weights
        from kv_rd import Run
    finally:
        sys.path.remove(str(ROOT / "bench"))
    from edgecore.shared.kv.wire import codec_rope
    engine = make_engine(dtype="fp32")
    ids = engine.tokenizer.encode(heldout)
    windows = [ids[:96], ids[500:596]]
    rope = codec_rope(engine.config)
    weights, stds = channel_weights(engine, lambda w: Run(engine, w, 1), windows, rope)

    ref = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    cfg = ref.config
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    group, half = heads // kv_heads, d // 2
    q_sq, k_out = {}, {}
    hooks = []
    for i, layer in enumerate(ref.model.layers):
        attn = layer.self_attn
        hooks.append(attn.q_proj.register_forward_hook(
            lambda m, a, out, i=i: q_sq.__setitem__(i, q_sq.get(i, 0) + out[0].double().square().sum(0))))
        hooks.append(attn.k_proj.register_forward_hook(
            lambda m, a, out, i=i: k_out.setdefault(i, []).append(out[0].double())))
    with torch.no_grad():
        for w in windows:
            ref(torch.tensor([w]))
    for h in hooks:
        h.remove()
    count = sum(len(w) for w in windows)
    for i, layer in enumerate(ref.model.layers):
        eq = (q_sq[i] / count).reshape(kv_heads, group, d).sum(1).numpy()
        w_k = eq + np.roll(eq, half, axis=-1)
        w_v = layer.self_attn.o_proj.weight.detach().double().square().sum(0).reshape(kv_heads, group, d).sum(1).numpy()
        std_k = torch.cat(k_out[i]).std(0, unbiased=False).reshape(kv_heads, d).numpy()
        assert np.allclose(weights["k"][i], w_k, rtol=1e-3), i
        assert np.allclose(weights["v"][i], w_v, rtol=1e-6), i
        assert np.allclose(stds["k"][i], std_k, rtol=0.02, atol=1e-3), i     # ours: bf16-rounded keys
    scales = channel_scales(weights, stds, 0.0, 0.5)
    for kind in "kv":
        m = np.array(scales[f"{kind}_channels"])
        assert m.shape == (cfg.num_hidden_layers, kv_heads * d) and (m >= 0.25).all() and (m <= 4).all()
        assert np.allclose(np.log(m).mean(axis=1), 0, atol=0.05)   # geometric mean 1 per layer (clipping aside)
        # inside the bounds, step = factor · std · m ∝ w^-1/2: w·(std·m)² is constant within a layer
        wm = weights[kind].reshape(len(m), -1) * (stds[kind].reshape(len(m), -1) * m) ** 2
        inside = (m > 0.26) & (m < 3.9)
        for row, ok in zip(wm, inside):
            assert np.allclose(row[ok], row[ok][0], rtol=2e-3)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), level=st.sampled_from(list(LEVELS)), kind=st.sampled_from("kv"),
       tokens=st.integers(5, 300), layers=st.integers(1, 3))
def test_channel_scaled_steps_bound_every_error(seed, level, kind, tokens, layers):
    """Whatever the channel scales (0.25-4), a quantized value is off by at most half its step, the step being
    max(factor · scale · std, max deviation / 7.5) of its group, rounded up to a log-coded step (≤ 2^(1/8) more;
    the fine span's deviation from the main span's centre, which it shares), + float16 parameters and bf16
    output rounding: scales move error between channels, they never clip."""
    rng = np.random.default_rng(seed)
    heads, dim = 2, 8
    x = (rng.standard_normal((layers, tokens, heads, dim)) * rng.uniform(0.01, 5, (1, 1, heads, dim))
         + rng.standard_normal((1, 1, heads, dim))).astype(np.float32)
    bits = from_float32(x, "bfloat16")
    x = to_float32(bits, "bfloat16").astype(np.float64)
    scales = rng.uniform(0.25, 4, (layers, heads * dim))
    info = PlaneInfo("bfloat16", bits.shape, kind, 0, tokens, 0,
                     channel_scales=tuple(tuple(float(v) for v in row) for row in scales))
    codec = get_codec(level)
    got = to_float32(codec.decode(codec.encode(bits, info), info), "bfloat16").astype(np.float64)
    lv = LEVELS[level]
    a, b, c = token_spans(info, lv)
    assert np.array_equal(got[:, :a], x[:, :a]) and np.array_equal(got[:, c:], x[:, c:])     # exact tokens
    base = lv.key_factor if kind == "k" else lv.value_factor
    centre = None
    for s, e in groups(b - a, c - b, lv.group if kind == "v" else lv.rotated_key_group):   # no RoPE given
        span = x[:, a + s:a + e].reshape(layers, e - s, -1)
        fine = s >= b - a
        factor = base * (lv.fine_factor if fine else 1.0) * scales
        if not (fine and lv.compact and b > a):
            centre = span.mean(axis=1, keepdims=True).astype(np.float16).astype(np.float64)
        dev = np.abs(span - centre).max(axis=1)
        step = np.maximum(factor * span.std(axis=1), dev / 7.5) * (2 ** (1 / 8) if lv.compact else 1.0)
        err = np.abs(got[:, a + s:a + e].reshape(span.shape) - span)
        assert (err <= 0.5 * step[:, None] * 1.01 + 2 ** -8 * np.abs(span) + 1e-6).all()
