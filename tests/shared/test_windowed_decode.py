"""Windowed decode reads only the blocks that hold each row's window: the per-form `DecodeWindow` the runner
builds (sizes independent of the context), and a decode whose every block outside the window holds NaN
still gives the reference tokens (a read of the whole block table, masked, would turn them into NaN)."""

import pytest
import torch

from edgecore.shared.models.config import LayerAttention
from edgecore.shared.engine.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.shared.moe_checkpoints import build

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return build(tmp_path_factory.mktemp("mixtral"), "mixtral-sliding")[0]


@pytest.mark.parametrize("form, first_block, width, length, row1", [
    (LayerAttention("sliding", 8), [248, 0], 3, 11, list(range(3, 11))),   # row 0: 992..999; row 1: 3..10
    (LayerAttention("chunked", 8), [248, 2], 2, 8, [8, 9, 10]),            # row 0: 992..999; row 1: 8..10
])
def test_the_window_view_is_as_small_as_the_window(mixtral, form, first_block, width, length, row1):
    runner = make_engine(mixtral, block_size=4).runner
    ctx = torch.tensor([[1000], [11]])                # context lengths: queries at 999 and 10
    table = torch.arange(250).repeat(2, 1) + torch.tensor([[0], [1000]])     # row 1: block ids 1000..
    view = runner._decode_window(form, table, ctx)
    assert view.blocks.shape == (2, width) and view.length == length
    assert view.blocks[:, 0].tolist() == [first_block[0], 1000 + first_block[1]]
    seen = view.mask[:, 0, 0]
    positions = [(first_block[i] * 4 + torch.nonzero(seen[i])[:, 0]).tolist() for i in range(2)]
    assert positions == [list(range(992, 1000)), row1]


def test_a_context_inside_the_first_window_needs_no_view(mixtral):
    runner = make_engine(mixtral, block_size=4).runner
    assert runner._decode_window(LayerAttention("sliding", 8), torch.zeros(1, 2, dtype=torch.long),
                                 torch.tensor([[8]])) is None


def test_decode_never_reads_blocks_outside_the_window(mixtral):
    ids = torch.randint(2, 257, (43,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ref = make_engine(mixtral, block_size=4).generate([ids], params)[0]["token_ids"]
    engine = make_engine(mixtral, block_size=4, num_blocks=64, prefix_caching=False)
    seq = engine.add_request("r", ids, params)
    window = engine.config.attention_of(0)
    assert all(engine.config.attention_of(i) == window for i in range(engine.config.num_hidden_layers))
    tokens, poisoned = [], 0
    while engine.has_unfinished():
        if seq.num_computed_tokens >= len(ids):        # decoding: poison every block outside the window
            first = window.first_visible(seq.num_computed_tokens) // 4
            keep = torch.tensor([b for b in seq.table.blocks[first:] if b >= 0])
            outside = torch.ones(64, dtype=torch.bool)
            outside[keep] = False
            for t in engine.pool.k + engine.pool.v:
                t.view(64, 4, *t.shape[1:])[outside] = float("nan")
            poisoned += 1
        for out in engine.step():
            tokens += out.new_token_ids
    assert poisoned >= 15 and tokens == ref
