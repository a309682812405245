"""Layer 0 computed at the edge (`edge_layers` = 1), in one process: the core's `LayerSender` sends no layer-0
KV, the edge's `KVReceiver` completes without it, the edge computes it into a pool filled with NaN and decodes
as a single node does (tests/e2e/test_core_streaming.py: the same over a socket, and the refusal of more)."""

import pytest
import torch

from edgecore.core.kv_sender import LayerSender
from edgecore.core.transfer import Transfer
from edgecore.protocol.kv_receiver import KVReceiver
from edgecore.protocol import messages as m
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.kv.transfer import EDGE_LAYERS, needed_from
from edgecore.shared.kv.wire import codec_rope
from tests.conftest import MODEL_DIR, make_engine
from tests.core.test_windowed_transfer import decode_at_edge
from tests.shared.deepseek_checkpoints import deepseek_checkpoint
from tests.shared.moe_checkpoints import build

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def engine(path):
    return make_engine(path, block_size=4, num_blocks=256)


def model_dir(name, tmp_path):
    if name == "deepseek-mla":
        return deepseek_checkpoint(tmp_path, "v3-qlora-yarn-grouped")[0]
    return MODEL_DIR if name == "pydoc-llama" else build(tmp_path, name)[0]


@pytest.mark.parametrize("codec", ["lossless", "int8"])
@pytest.mark.parametrize("name", ["pydoc-llama", "mixtral-sliding", "gpt_oss", "deepseek-mla"])
def test_core_sends_no_layer0_and_the_edge_decodes_like_one_node(name, codec, tmp_path):
    path = model_dir(name, tmp_path)
    ids = torch.randint(2, 250, (43,), generator=torch.Generator().manual_seed(5)).tolist()
    ref = engine(path).generate([ids], GREEDY)[0]["token_ids"]
    core = engine(path)
    streamer = LayerSender(core.pool, core.runner.model, loop=None, mode="hold")
    transfer = Transfer("s/c", "c", None, codec, len(ids), 0, EDGE_LAYERS)
    streamer.remote["c"] = transfer
    core.add_request("c", ids, SamplingParams(max_tokens=1, temperature=0), prefill_only=True)
    first = [out.new_token_ids[0] for out in core.step(streamer.on_layer) if out.finished][0]
    pieces = [item.piece for item in transfer.held]
    assert pieces and all(p.layer > 0 for p in pieces)

    tokens = decode_at_edge(engine(path), ids, pieces, first, codec, edge_layers=EDGE_LAYERS,
                            rope=codec_rope(core.config))
    if codec == "lossless":      # layers 1.. exact: all of it is single node's
        assert tokens == ref
    else:                       # lossy layers 1..: it starts as single node's (q4e: tests/e2e/test_codec_live.py)
        assert tokens[:6] == ref[:6], (tokens, ref)


def test_receiver_needs_no_layer0_chunk_but_accepts_one():
    """An older core that ignores `edge_layers` still sends layer 0: accepted, counted for nothing."""
    receiver = KVReceiver("r", 2, 1, 10, needed_from=[10, 0])
    receiver.on_chunk(m.KVChunk("r", 1, 2, 0, 10, 0, 1, 4, "bfloat16", "q4e", 0, 160), 50, 0.0)
    assert receiver.covered
    receiver.on_chunk(m.KVChunk("r", 0, 1, 0, 10, 0, 1, 4, "bfloat16", "q4e", 0, 160), 50, 0.0)
    receiver.on_done(m.PrefillDone("r", 3, num_tokens=10))
    assert receiver.complete


def test_needed_from_with_edge_layers():
    cfg = make_engine().config
    assert needed_from(cfg, 30) == [0] * cfg.num_hidden_layers
    assert needed_from(cfg, 30, EDGE_LAYERS) == [30] + [0] * (cfg.num_hidden_layers - 1)
