"""The MLA latent layout end to end between two engines: a prefill-only engine's latent KV goes through
KV chunks (encode, checksum, decode) into another engine's paged latent cache, which decodes. Lossless
codecs give exactly the single-node tokens; every codec round-trips the latent planes' shapes."""

import numpy as np
import pytest
import torch

from edgecore.protocol.codecs import CODECS
from edgecore.protocol.kv import decode_chunk, encode_chunk
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.kv.transfer import KVSlice
from edgecore.shared.kv.wire import DTYPE_NAMES, from_bits, to_bits
from tests.conftest import make_engine
from tests.shared.deepseek_checkpoints import deepseek_checkpoint

pytest.importorskip("transformers")
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = deepseek_checkpoint(tmp_path_factory.mktemp("v3"), "v3-qlora-yarn-grouped")
    return path


def transfer(core, edge, prompt, codec: str, chunk_tokens: int = 64):
    """Prefill on `core`, ship its latent KV as chunks of `chunk_tokens` tokens × all layers, decode on `edge`.
    Returns (tokens, raw bytes shipped, encoded bytes shipped)."""
    core.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0), prefill_only=True)
    first = None
    while core.has_unfinished():
        for out in core.step():
            first = out.new_token_ids[0]
    edge.reserve("r", prompt, PARAMS)
    dtype = DTYPE_NAMES[core.dtype]
    raw = encoded = 0
    layers = core.config.num_hidden_layers
    for start in range(0, len(prompt), chunk_tokens):
        end = min(start + chunk_tokens, len(prompt))
        planes = [core.read_kv("r", layer, start, end) for layer in range(layers)]
        k = torch.stack([p[0] for p in planes])                    # [layers, tokens, 1, kv_lora_rank]
        v = torch.stack([p[1] for p in planes])                    # [layers, tokens, 1, qk_rope_head_dim]
        data = encode_chunk("r", to_bits(k), to_bits(v), layer_start=0, token_start=start, dtype=dtype,
                            codec=codec, total_tokens=len(prompt))
        raw, encoded = raw + data.chunk.raw_len, encoded + len(data.payload)
        kb, vb = decode_chunk(data)
        assert kb.shape == tuple(k.shape) and vb.shape == tuple(v.shape)
        edge.write_kv("r", KVSlice(0, start, end, 0, from_bits(kb, dtype), from_bits(vb, dtype)))
    core.release("r")
    edge.activate("r", first)
    tokens = []
    while edge.has_unfinished():
        for out in edge.step():
            tokens += out.new_token_ids
    return tokens, raw, encoded


def test_lossless_transfer_equals_single_node(checkpoint):
    prompt = torch.randint(2, 257, (200,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = make_engine(checkpoint, block_size=16, num_blocks=64).generate([prompt], PARAMS)[0]["token_ids"]
    for codec in ("raw", "lossless"):
        core = make_engine(checkpoint, block_size=16, num_blocks=64)
        edge = make_engine(checkpoint, block_size=8, num_blocks=64)      # other block size: slots differ
        tokens, raw, encoded = transfer(core, edge, prompt, codec)
        assert tokens == ref, codec
        mla = core.config.mla
        assert raw == 200 * core.config.num_hidden_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim) * 4
        assert edge.block_manager.num_used == 0 and core.block_manager.num_used == 0


@pytest.mark.parametrize("codec", [c for c in CODECS if not CODECS[c].lossless])
def test_lossy_codecs_carry_latent_planes(checkpoint, codec):
    prompt = torch.randint(2, 257, (150,), generator=torch.Generator().manual_seed(5)).tolist()
    core = make_engine(checkpoint, block_size=16, num_blocks=64)
    edge = make_engine(checkpoint, block_size=16, num_blocks=64)
    tokens, raw, encoded = transfer(core, edge, prompt, codec)
    assert len(tokens) == 24 and encoded < raw


def test_chunk_with_inconsistent_planes_is_refused():
    from edgecore.protocol.errors import CodecError
    k = np.zeros((1, 4, 1, 8), np.uint16)
    with pytest.raises(CodecError, match="differ"):
        encode_chunk("r", k, np.zeros((1, 3, 1, 2), np.uint16), layer_start=0, token_start=0, dtype="bfloat16",
                     codec="raw")
    data = encode_chunk("r", k, np.zeros((1, 4, 1, 2), np.uint16), layer_start=0, token_start=0,
                        dtype="bfloat16", codec="raw")
    import msgspec
    bad = type(data)(msgspec.structs.replace(data.chunk, raw_len=data.chunk.raw_len + 1), data.payload)
    with pytest.raises(CodecError, match="raw_len"):
        decode_chunk(bad)
