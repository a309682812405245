"""Sliding-window and chunked layers on the wire, in one process: the core's `LayerSender` cuts each
windowed layer to the window the edge's decode can still see; the slices travel through the codec
(encode/decode), the edge's `KVReceiver` counts per-layer coverage, and the edge engine writes them into
a pool filled with NaN (what uninitialised memory may hold) and decodes. The edge's output must equal a
single-node run; tokens a windowed layer did not receive must never reach attention; the edge's prefix
cache must not offer the partly filled blocks to a later prompt.

Families: Mixtral with `sliding_window` 8 (every layer windowed), gpt-oss (sliding and full layers
alternate: full layers stay complete) and Llama 4 (chunked RoPE layers of 8, full NoPE layers); prompts of
43 tokens, blocks of 4 (windows start inside blocks)."""

import pytest
import torch

from edgecore.core.kv_sender import LayerSender
from edgecore.core.transfer import Transfer
from edgecore.protocol.kv_receiver import KVReceiver, TransferFailed
from edgecore.protocol import messages as m
from edgecore.protocol.kv import decode_chunk, encode_chunk
from edgecore.shared.models.config import FULL
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.kv.transfer import KVSlice, cut_slice, needed_from
from edgecore.shared.kv.wire import DTYPE_NAMES, from_bits, to_bits
from tests.conftest import make_engine
from tests.shared.moe_checkpoints import build

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
FAMILIES = ["mixtral-sliding", "gpt_oss", "llama4"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(name, **overrides):
        key = (name, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = build(tmp_path_factory.mktemp(name), name, **overrides)[0]
        return made[key]
    return get


def prompt(n: int = 43, seed: int = 11) -> list[int]:
    return torch.randint(2, 257, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(path):
    return make_engine(path, block_size=4, num_blocks=128)


def prefill_at_core(core, ids: list[int], skip: int = 0) -> tuple[list[KVSlice], int]:
    """Prefill-only at the core with the streamer holding every slice it cuts; returns them and the first
    token."""
    streamer = LayerSender(core.pool, core.runner.model, loop=None, mode="hold")
    transfer = Transfer("s/c", "c", None, "lossless", len(ids), skip)
    streamer.remote["c"] = transfer
    core.add_request("c", ids, SamplingParams(max_tokens=1, temperature=0), prefill_only=True)
    first = None
    while core.has_unfinished():
        for out in core.step(streamer.on_layer):
            if out.finished:
                first = out.new_token_ids[0]
    core.release("c")
    return [item.piece for item in transfer.held], first


def decode_at_edge(edge, ids: list[int], pieces: list[KVSlice], first: int, codec: str = "lossless",
                   poison: bool = True, edge_layers: int = 0, rope=None) -> list[int]:
    """Reserve, poison the pool, (compute the first `edge_layers` layers here,) receive the slices through the
    codec (keys with `rope` removed when given), activate, decode to the end."""
    cfg = edge.config
    _, cached = edge.reserve("e", ids, GREEDY)
    if poison:
        for t in edge.pool.k + edge.pool.v:
            t.fill_(float("nan"))
    if edge_layers:
        edge.write_first_layer_kv("e")
    receiver = KVReceiver("e", cfg.num_hidden_layers, cfg.num_key_value_heads, len(ids), cached,
                          needed_from=needed_from(cfg, len(ids), edge_layers))
    dtype = DTYPE_NAMES[edge.pool.dtype]
    for piece in pieces:
        data = encode_chunk("e", to_bits(piece.k), to_bits(piece.v), layer_start=piece.layer,
                            token_start=piece.token_start, head_start=piece.head_start, dtype=dtype,
                            codec=codec, total_tokens=len(ids), rope=rope)
        receiver.on_chunk(data.chunk, len(data.payload), 0.0)
        k, v = decode_chunk(data, rope)
        c = data.chunk
        edge.write_kv("e", KVSlice(c.layer_start, c.token_start, c.token_end, c.head_start,
                                   from_bits(k, c.dtype), from_bits(v, c.dtype)))
    receiver.on_done(m.PrefillDone("e", first, num_tokens=len(ids)))
    assert receiver.complete
    edge.activate("e", first)
    tokens = []
    while edge.has_unfinished():
        for out in edge.step():
            tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize("name", FAMILIES)
def test_only_the_window_travels_and_the_edge_decodes_like_one_node(name, checkpoints):
    path = checkpoints(name)
    ids = prompt()
    ref = engine(path).generate([ids], GREEDY)[0]["token_ids"]
    core = engine(path)
    pieces, first = prefill_at_core(core, ids)
    cfg = core.config
    starts = needed_from(cfg, len(ids))
    sent = {}
    for p in pieces:
        sent.setdefault(p.layer, []).append((p.token_start, p.token_end))
    for layer in range(cfg.num_hidden_layers):
        form = cfg.attention_of(layer)
        want = [(form.first_visible(len(ids)), len(ids))] if form.first_visible(len(ids)) < len(ids) else []
        assert sent.get(layer, []) == want, (layer, form)
        if form == FULL:
            assert want == [(0, len(ids))]          # full layers stay complete
    assert any(s > 0 for s in starts)
    assert decode_at_edge(engine(path), ids, pieces, first) == ref


@pytest.mark.parametrize("name", ["mixtral-sliding", "gpt_oss"])
def test_partly_filled_blocks_never_become_a_cached_prefix(name, checkpoints):
    path = checkpoints(name)
    ids = prompt()
    pieces, first = prefill_at_core(engine(path), ids)
    edge = engine(path)
    decode_at_edge(edge, ids, pieces, first)
    longer = ids + prompt(9, seed=12)
    assert edge.cached_prefix(longer) == 0          # block 0 lacks sliding KV: the chain starts nowhere
    # A prompt that shares the prefix is computed here, right (a cached partial block would give zeros).
    assert edge.generate([longer], GREEDY)[0]["token_ids"] == \
        engine(path).generate([longer], GREEDY)[0]["token_ids"]


def test_a_window_wider_than_the_prompt_sends_everything_and_caches_it(checkpoints):
    """Control for the test above: with nothing cut, the edge caches the prompt's full blocks."""
    path = checkpoints("mixtral-sliding", sliding_window=64)
    ids = prompt()
    pieces, first = prefill_at_core(engine(path), ids)
    assert {(p.token_start, p.token_end) for p in pieces} == {(0, len(ids))}
    edge = engine(path)
    ref = engine(path).generate([ids], GREEDY)[0]["token_ids"]
    assert decode_at_edge(edge, ids, pieces, first) == ref
    assert edge.cached_prefix(ids + [5] * 9) == 40


def test_a_lossy_codec_runs_on_cut_slices(checkpoints):
    path = checkpoints("gpt_oss")
    ids = prompt()
    ref = engine(path).generate([ids], GREEDY)[0]["token_ids"]
    pieces, first = prefill_at_core(engine(path), ids)
    got = decode_at_edge(engine(path), ids, pieces, first, codec="int8")
    assert got[:4] == ref[:4]


def test_an_edge_skip_inside_the_window(checkpoints):
    """The edge holds a cached prefix that reaches into the window: the core sends from there on."""
    path = checkpoints("mixtral-sliding")
    ids = prompt()
    edge = engine(path)
    edge.generate([ids[:40] + [3]], SamplingParams(max_tokens=1))       # caches blocks [0, 40)
    pieces, first = prefill_at_core(engine(path), ids, skip=40)
    assert {(p.token_start, p.token_end) for p in pieces} == {(40, len(ids))}
    assert decode_at_edge(edge, ids, pieces, first, poison=False) == \
        engine(path).generate([ids], GREEDY)[0]["token_ids"]


def test_the_receiver_needs_each_layers_window_only():
    starts = [33, 0, 40]            # sliding (window 8), full, chunked whose chunk starts at the end
    r = KVReceiver("r", 3, 2, 40, 0, needed_from=starts)
    assert [r.needed(layer) for layer in range(3)] == [14, 80, 0]

    def chunk(layer, t0, t1, h0=0, h1=2):
        return m.KVChunk("r", layer, layer + 1, t0, t1, h0, h1, 4, "float32", "raw", 0, 0)
    r.on_chunk(chunk(0, 30, 40, 0, 1), 10, 0.0)      # more than the window: accepted
    r.on_chunk(chunk(1, 0, 40), 10, 0.0)
    assert not r.covered
    r.on_chunk(chunk(0, 33, 40, 1, 2), 10, 0.0)
    assert r.covered
    with pytest.raises(TransferFailed, match="twice"):
        r.on_chunk(chunk(0, 32, 34, 1, 2), 10, 0.0)
    short = KVReceiver("r", 3, 2, 40, 0, needed_from=starts)
    short.on_chunk(chunk(1, 0, 40), 10, 0.0)
    short.on_chunk(chunk(0, 34, 40), 10, 0.0)        # one token short of the window
    with pytest.raises(TransferFailed, match="incomplete"):
        short.on_done(m.PrefillDone("r", 5))
    with pytest.raises(ValueError, match="needed_from"):
        KVReceiver("r", 3, 2, 40, 0, needed_from=[0, 0])


def test_cut_slice_keeps_runs_of_layers_with_the_same_start():
    k = torch.arange(4 * 10 * 1 * 2, dtype=torch.float32).view(4, 10, 1, 2)
    piece = KVSlice(1, 5, 15, 0, k, -k)
    out = cut_slice(piece, [0, 0, 12, 12, 15])       # global layers 0..4; the piece holds 1..4
    assert [(p.layer, p.num_layers, p.token_start, p.token_end) for p in out] == [(1, 1, 5, 15), (2, 2, 12, 15)]
    assert torch.equal(out[1].k, k[1:3, 7:]) and torch.equal(out[1].v, -k[1:3, 7:])
