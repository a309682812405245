"""The cheap decode step's shortcuts give what the general path gives: a single decode row whose blocks are
consecutive reads its K/V as views of the cache (no gather), and only such a row; a packed linear layer
keeps an input-major copy of a small weight for few-row inputs (its parameter a view of that copy, a tied
table kept as it is) and uses the packed one from `PACKED_FROM_ROWS` rows on, while a large weight is held
once (packed only); a step of few tokens runs on one thread and restores
the caller's thread count."""

import pytest
import torch
import torch.nn.functional as F

from edgecore.shared.engine.step_plan import PlanItem
from edgecore.shared.models import layers, row_buckets
from edgecore.shared.models.attention import AttentionMetadata, paged_attention
from tests.conftest import make_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _decode_meta(caches, blocks: list[int], ctx: int, bs: int, span: bool) -> AttentionMetadata:
    meta = AttentionMetadata(slot_mapping=torch.tensor([blocks[(ctx - 1) // bs] * bs + (ctx - 1) % bs]),
                             kv_caches=caches, num_decode=1, decode_blocks=torch.tensor([blocks]),
                             block_size=bs, decode_len=ctx)
    meta.decode_span = blocks[0] * bs if span else None
    return meta


@pytest.mark.parametrize("ctx", [1, 7, 16, 37])
def test_a_consecutive_row_reads_views_with_the_gathered_result(ctx):
    gen = torch.Generator().manual_seed(ctx)
    bs, hq, hkv, d = 4, 6, 2, 8
    blocks = list(range(5, 5 + -(-ctx // bs)))
    outs = []
    for span in (False, True):
        caches = [(torch.randn(64 * bs, hkv, d, generator=torch.Generator().manual_seed(1)),
                   torch.randn(64 * bs, hkv, d, generator=torch.Generator().manual_seed(2)))]
        q, k, v = (torch.randn(1, h, d, generator=gen) for h in (hq, hkv, hkv))
        gen.manual_seed(ctx)
        outs.append(paged_attention(q, k, v, 0, _decode_meta(caches, blocks, ctx, bs, span), d ** -0.5))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
    assert not torch.equal(outs[0], torch.zeros_like(outs[0]))


def test_the_runner_takes_views_only_for_one_consecutive_row():
    runner = make_engine(block_size=4).runner
    bs = runner.block_size

    def span(*rows):
        items = [(PlanItem(ctx - 1, 1, ctx, [3], blocks), 1) for ctx, blocks in rows]
        return runner.prepare(items)[3].decode_span

    assert span((10, [7, 8, 9])) == 7 * bs
    assert span((10, [7, 9, 8])) is None                    # not consecutive
    assert span((10, [-1, 8, 9])) is None                   # a released leading block
    assert span((10, [7, 8, 9]), (6, [1, 2])) is None       # two rows: gathered
    assert span((8, [7, 8, 20])) == 7 * bs                  # only the blocks the context covers count


@pytest.fixture
def pack_sizes(monkeypatch):
    def set_limit(nbytes):
        monkeypatch.setattr(layers, "KEEP_PLAIN_BYTES", nbytes)
    return set_limit


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
@pytest.mark.parametrize("keep_bytes", [1 << 20, 0])
def test_packed_linear_picks_its_weight_by_rows(pack_sizes, keep_bytes):
    pack_sizes(keep_bytes)
    lin = layers.ColumnParallelLinear(64, 96)
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    lin.weight.data.copy_(w)
    lin.pack()
    assert lin.packed is not None
    assert lin.weight.numel() == (w.numel() if keep_bytes else 0)        # a large weight is held once
    assert lin.plain_below == (layers.PACKED_FROM_ROWS if keep_bytes else 0)
    if keep_bytes:       # the few-row copy is input-major, and the parameter reads it: one plain copy
        assert lin.transposed.shape == (64, 96) and lin.transposed.is_contiguous()
        assert lin.weight.data_ptr() == lin.transposed.data_ptr() and torch.equal(lin.weight, w)
    for rows in (1, 3, layers.PACKED_FROM_ROWS - 1, layers.PACKED_FROM_ROWS, 40):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        with torch.inference_mode():
            torch.testing.assert_close(lin(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_few_rows_with_a_bias_and_leading_dims_match_linear():
    lin = layers.ColumnParallelLinear(64, 96, bias=True)
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    lin.weight.data.copy_(w)
    lin.bias.data.copy_(b)
    lin.pack()
    for shape in ((1, 64), (2, 64), (1, 3, 64)):
        x = torch.randn(*shape, generator=gen)
        with torch.inference_mode():
            torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_a_tied_table_stays_the_shared_parameter():
    table = layers.VocabParallelEmbedding(128, 64)
    table.weight.data.normal_(generator=torch.Generator().manual_seed(4))
    head = layers.ParallelLMHead(128, 64)
    head.weight = table.weight
    head.pack(keep_plain=True)
    assert head.weight is table.weight and head.transposed is not None
    assert head.packed_bytes == 2 * table.weight.numel() * 4     # the packed and the transposed copy
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        torch.testing.assert_close(head.forward(x), F.linear(x, table.weight), rtol=1e-5, atol=1e-5)


def small_packed_model(pack_sizes):
    pack_sizes(1 << 20)
    model = torch.nn.Sequential(layers.ColumnParallelLinear(64, 96), layers.RowParallelLinear(96, 64),
                                layers.ColumnParallelLinear(64, 96))
    for m in model:
        m.weight.data.normal_(generator=torch.Generator().manual_seed(1))
    assert layers.pack_for_cpu(model) == 3
    return model


@pytest.fixture
def timed(monkeypatch):
    """Calibration as in production: not pinned, nothing cached."""
    monkeypatch.delenv("EDGECORE_PACKED_FROM_ROWS", raising=False)
    monkeypatch.setattr(layers, "_calibrated", {})


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_calibration_switches_layout_where_the_timings_cross(pack_sizes, monkeypatch, timed):
    model = small_packed_model(pack_sizes)
    calls = []

    def fake_times(x, plain, packed, reps):    # input-major costs 10 a row, packed 35 flat: they cross at 4
        calls.append((x.shape[0], torch.get_num_threads(), sum(n for _, _, n in plain), sum(n for _, _, n in packed)))
        return 10.0 * x.shape[0], 35.0

    monkeypatch.setattr(layers, "_layout_times", fake_times)
    torch.set_num_threads(2)
    assert layers.calibrate_plain_rows(model, 1) == 4
    assert [m.plain_below for m in model] == [4, 4, 4]
    assert torch.get_num_threads() == 2                      # timed on one thread, restored after
    assert {c[1] for c in calls} == {1}
    assert {c[2:] for c in calls} == {(3, 3)}         # the two 64->96 weights share a shape and weigh twice
    calls.clear()
    assert layers.calibrate_plain_rows(model, 1) == 4 and not calls     # timed once per process

    # One noisy win does not move it: packed must win at two row counts in a row.
    monkeypatch.setattr(layers, "_layout_times", lambda x, p, q, reps: (1.0, 0.5 if x.shape[0] in (3, 6, 7) else 2.0))
    assert layers.calibrate_plain_rows(model, 2) == 6
    monkeypatch.setattr(layers, "_layout_times", lambda x, p, q, reps: (1.0, 2.0))
    assert layers.calibrate_plain_rows(model, 3) == layers.CALIBRATE_MAX_ROWS     # packed never wins

    def failing(x, plain, packed, reps):
        raise RuntimeError("timing failed")

    monkeypatch.setattr(layers, "_layout_times", failing)
    with pytest.raises(RuntimeError):
        layers.calibrate_plain_rows(model, 4)
    assert torch.get_num_threads() == 2


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_calibration_on_real_timings_and_pinned(pack_sizes, monkeypatch, timed):
    model = small_packed_model(pack_sizes)
    rows = layers.calibrate_plain_rows(model, 1)
    assert 2 <= rows <= layers.CALIBRATE_MAX_ROWS and all(m.plain_below == rows for m in model)
    with torch.inference_mode():        # both layouts, each side of the switch, compute the product
        for r in (rows - 1, rows):
            x = torch.randn(r, 64)
            torch.testing.assert_close(model[0](x), F.linear(x, model[0].weight), rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("EDGECORE_PACKED_FROM_ROWS", "5")
    monkeypatch.setattr(layers, "_layout_times", None)       # pinned: nothing is timed (nor read from the cache)
    monkeypatch.setattr(layers, "_calibrated", {})
    assert layers.calibrate_plain_rows(model, 1) == 5 and [m.plain_below for m in model] == [5, 5, 5]
    pack_sizes(0)                       # a large weight is held packed only: nothing to choose
    large = layers.ColumnParallelLinear(64, 96)
    large.pack()
    assert layers.calibrate_plain_rows(torch.nn.Sequential(large), 1) == 0 and large.plain_below == 0
    from edgecore.shared.errors import ConfigError
    monkeypatch.setenv("EDGECORE_PACKED_FROM_ROWS", "many")
    with pytest.raises(ConfigError, match="EDGECORE_PACKED_FROM_ROWS"):
        layers.calibrate_plain_rows(model, 1)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="needs oneDNN with bf16")
def test_a_small_bf16_weight_stays_packed_only():
    lin = layers.ColumnParallelLinear(64, 96).to(torch.bfloat16)
    lin.weight.data.normal_()
    lin.pack()
    assert lin.weight.numel() == 0 and lin.plain_below == 0


def test_small_steps_run_on_one_thread_and_restore_the_count(monkeypatch):
    from edgecore.shared.engine import model_runner
    from edgecore.shared.engine.sampling_params import SamplingParams
    engine = make_engine()
    seen = []
    forward = engine.runner.model.forward

    def recording(ids, *args, **kwargs):
        seen.append((ids.shape[0], torch.get_num_threads()))
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(engine.runner.model, "forward", recording)
    flat_forward = engine.runner.flat.forward      # decode steps of the bundled model run flat

    def recording_flat(ids, *args):
        seen.append((ids.shape[0], torch.get_num_threads()))
        return flat_forward(ids, *args)

    monkeypatch.setattr(engine.runner.flat, "forward", recording_flat)
    torch.set_num_threads(2)
    engine.generate([list(range(5, 5 + model_runner.SINGLE_THREAD_BELOW))],
                    SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert torch.get_num_threads() == 2
    assert seen == [(model_runner.SINGLE_THREAD_BELOW, 2), (1, 1), (1, 1)]
    engine.runner.step_threads.below = 0           # what a model above SINGLE_THREAD_MAX_WEIGHTS gets
    seen.clear()
    engine.generate([list(range(5, 9))], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert seen == [(4, 2), (1, 2)]


def test_only_small_models_step_on_one_thread(monkeypatch):
    from edgecore.shared.engine import model_runner
    assert make_engine().runner.step_threads.below == model_runner.SINGLE_THREAD_BELOW     # ~16 MB of weights
    monkeypatch.setattr(model_runner, "SINGLE_THREAD_MAX_WEIGHTS", 1 << 20)
    assert make_engine().runner.step_threads.below == 0


def test_packed_matmuls_run_at_few_row_counts():
    seen = {row_buckets.padded_rows(m) for m in range(1, 2049)}
    assert len(seen) == 80                       # 32 exact, then 8 per power of two up to 2048
    for m in range(1, 4097):
        p = row_buckets.padded_rows(m)
        assert p == m if m <= row_buckets.EXACT_ROWS else m <= p <= m * 9 / 8
        assert row_buckets.padded_rows(p) == p        # a padded count is its own bucket


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
@pytest.mark.parametrize("rows", [33, 37, 100, 513])
def test_padded_packed_matmul_is_the_product(rows):
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(2))
    b = torch.randn(96, generator=torch.Generator().manual_seed(3))
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        y = row_buckets.packed_linear(x, packed, b)
        assert y.shape == (rows, 96) and y.is_contiguous()
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        y3 = row_buckets.packed_linear(x.view(1, rows, 64), packed, None)     # leading dimensions kept
        assert y3.shape == (1, rows, 96)
        torch.testing.assert_close(y3[0], F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_the_model_meets_only_padded_row_counts(model_dir, monkeypatch):
    """Prefill and decode, through the module tree and flat: every packed matmul runs at a bucket's rows."""
    from edgecore.shared.engine.sampling_params import SamplingParams
    engine = make_engine(model_dir)
    rows_seen = []
    real = torch.ops.mkldnn._linear_pointwise

    def spy(x, *args):
        rows_seen.append(x.numel() // x.shape[-1])
        return real(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    prompts = [list(range(5 + i, 5 + i + 37 + i % 5)) for i in range(40)]       # prefill of 1,500+ rows
    engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))   # 40-row decode
    assert max(rows_seen) > 1000 and 40 in rows_seen
    assert all(row_buckets.padded_rows(r) == r for r in rows_seen)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_padding_a_strided_input():
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(2))
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    x = torch.randn(64, 50, generator=torch.Generator().manual_seed(5)).t()        # [50, 64], not contiguous
    with torch.inference_mode():
        torch.testing.assert_close(row_buckets.packed_linear(x, packed, None), F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bounded_matmuls_pad_only_where_onednn_serves_them(monkeypatch, dtype):
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(6)).to(dtype)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(7)).to(dtype)
    a = torch.randn(3, 37, 64, generator=torch.Generator().manual_seed(8)).to(dtype)
    b = torch.randn(3, 64, 16, generator=torch.Generator().manual_seed(9)).to(dtype)
    expected = F.linear(x, w), torch.bmm(a, b)
    rows = []
    real_linear, real_bmm = F.linear, torch.bmm
    monkeypatch.setattr(F, "linear", lambda x, w, bias=None: rows.append(x.shape[0]) or real_linear(x, w, bias))
    monkeypatch.setattr(torch, "bmm", lambda a, b: rows.append(a.shape[1]) or real_bmm(a, b))
    y, z = row_buckets.bounded_linear(x, w), row_buckets.bounded_bmm(a, b)
    assert y.shape == (37, 48) and z.shape == (3, 37, 16)
    assert rows == ([40, 40] if dtype == torch.bfloat16 else [37, 37])     # bf16 on CPU: oneDNN, padded
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y, expected[0], rtol=tol, atol=tol)
    torch.testing.assert_close(z, expected[1], rtol=tol, atol=tol)


def test_the_pinned_layout_switch_reaches_every_packed_weight(monkeypatch):
    """EDGECORE_PACKED_FROM_ROWS is read where a weight is packed, so models too large for start-up timing
    (which only calibrates small ones) get it too."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("needs oneDNN")
    monkeypatch.setenv("EDGECORE_PACKED_FROM_ROWS", "3")
    lin = layers.ColumnParallelLinear(64, 96)
    lin.pack()
    assert lin.plain_below == 3


@pytest.mark.parametrize("which", ["projection", "router"])
def test_unpacked_bf16_projections_and_routers_pad_their_rows(monkeypatch, which):
    """A bf16 projection left unpacked (EDGECORE_CPU_PACK=0) and an MoE router go through oneDNN per row
    count too: both run at bucketed row counts."""
    rows = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, bias=None: rows.append(x.shape[0]) or real(x, w, bias))
    x = torch.randn(37, 64).to(torch.bfloat16)
    if which == "projection":
        lin = layers.ColumnParallelLinear(64, 96).to(torch.bfloat16)
        assert lin.packed is None and lin.transposed is None
        lin.matmul(x)
    else:
        from edgecore.shared.models.mixtral import SparseMoE
        moe = SparseMoE(64, 4, 32, 2, True).to(torch.bfloat16)
        moe.forward(x)              # the router's is the first linear; the experts' follow (padded alike)
    assert rows and rows[0] == row_buckets.padded_rows(37) == 40


def test_layout_timing_gives_each_layout_three_interleaved_passes(monkeypatch):
    order = []
    monkeypatch.setattr(layers.torch, "mm", lambda x, w: order.append("plain"))
    monkeypatch.setattr(layers, "packed_linear", lambda x, w: order.append("packed"))
    layers._layout_times(torch.zeros(1, 4), [(None, 4, 1)], [(None, 4, 1)], 1)
    assert order == ["plain", "packed"] * 3
