"""MoE and new-attention families against transformers (fp32): logits within 1e-4 over the prompt
and 24 greedy steps, greedy tokens identical, a batch of mixed prompt lengths equal to one-by-one.
Prompts are longer than the sliding windows and attention chunks (8), blocks small (4), so that
windows cross block boundaries and released blocks are exercised."""

import pytest
import torch

from edgecore.shared.engine.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.helpers import stepwise_logits
from tests.shared.moe_checkpoints import ARCHS, build, reference, to_mxfp4_checkpoint

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def prompts(n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, 257, (length,), generator=g).tolist() for length in (37, 21, 9)[:n]]


def check_against_transformers(path, hf):
    engine = make_engine(path, block_size=4, num_blocks=256)
    prompt = prompts(1)[0]
    tokens, ref_logits, margin = reference(hf, prompt, 24)
    assert margin > 1e-3, f"greedy choices too close to call ({margin})"   # 10x the tolerance
    ours = stepwise_logits(engine, prompt + tokens, len(prompt))[:-1]
    assert (ours - ref_logits).abs().max().item() <= 1e-4
    assert engine.generate([prompt], GREEDY)[0]["token_ids"] == tokens
    return engine


@pytest.mark.parametrize("name", ARCHS)
def test_logits_and_greedy_match_transformers(tmp_path, name):
    path, hf = build(tmp_path, name)
    engine = check_against_transformers(path, hf)
    batch = engine.generate(prompts(), GREEDY)
    alone = [engine.generate([p], GREEDY)[0] for p in prompts()]
    assert [r["token_ids"] for r in batch] == [r["token_ids"] for r in alone]


def test_gpt_oss_mxfp4_experts_load_dequantized(tmp_path):
    path, hf = build(tmp_path, "gpt_oss")
    to_mxfp4_checkpoint(path, hf)
    check_against_transformers(path, hf)


def held_blocks(engine, prompt, steps):
    """Blocks the request holds after each step of a greedy generation of `steps` tokens."""
    engine.add_request("long", prompt, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
    held = []
    while engine.has_unfinished():
        engine.step()
        seq = engine.get("long")
        if seq is not None:
            held.append(sum(1 for b in seq.table.blocks if b >= 0))
    return held


def test_sliding_window_model_releases_blocks_no_layer_sees(tmp_path):
    """Mixtral, window 8 on every layer, blocks of 4: a long generation holds about window/block + 2
    blocks, not its whole history, and gives the same tokens as transformers."""
    path, hf = build(tmp_path, "mixtral-sliding")
    engine = make_engine(path, block_size=4, num_blocks=64, prefix_caching=False)
    prompt = prompts(1)[0]
    held = held_blocks(engine, prompt, 40)
    assert max(held[1:]) <= 4 and engine.block_manager.num_free == 64
    tokens, _, _ = reference(hf, prompt, 40)
    assert engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0][
        "token_ids"] == tokens


def test_model_with_full_layers_keeps_every_block(tmp_path):
    path, _ = build(tmp_path, "gpt_oss")       # sliding and full layers alternate
    engine = make_engine(path, block_size=4, num_blocks=64, prefix_caching=False)
    held = held_blocks(engine, prompts(1)[0], 12)
    assert held[-1] == -(-(37 + 11) // 4)
