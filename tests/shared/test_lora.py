"""LoRA adapters in the engine (shared/models/lora.py): greedy float32 output equals transformers + peft, mixed-adapter
batches equal each request alone, prefix cache scoped by adapter, bad adapters refused whole."""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import pytest
import torch

from edgecore.shared.engine.engine_thread import EngineThread
from edgecore.shared.engine.engine import LLMEngine
from edgecore.shared.engine.handle import EngineRequest
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.errors import RequestError
from edgecore.shared.models.lora import AdapterError, adapter_salt
from tests.shared import lora_checkpoints

PROMPTS = [[5, 17, 33, 2, 71, 8, 40], [9, 9, 12, 60, 3], list(range(10, 40))]
N = 8


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory):
    return lora_checkpoints.build(tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def expected(root):
    """transformers + peft's greedy tokens per (adapter, prompt index)."""
    return {(name, i): lora_checkpoints.reference(root, name, p, N)
            for name in [None, *lora_checkpoints.ADAPTERS] for i, p in enumerate(PROMPTS)}


def make_engine(root) -> LLMEngine:
    engine = LLMEngine.from_dir(root / "base", dtype="float32")
    for name in lora_checkpoints.ADAPTERS:
        engine.lora.load(name, str(root / name))
    return engine


def run(engine: LLMEngine, requests: list[tuple[str | None, int]], tag: str) -> list[list[int]]:
    """Add every (adapter, prompt index) request at once, step to the end; each request's tokens."""
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(requests))]
    for rid, (adapter, p) in zip(ids, requests):
        engine.add_request(rid, PROMPTS[p], params, adapter=adapter)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[rid] for rid in ids]


def test_each_adapter_alone_equals_peft(root, expected):
    engine = make_engine(root)
    for name in [None, *lora_checkpoints.ADAPTERS]:
        for i in range(len(PROMPTS)):
            assert run(engine, [(name, i)], f"alone-{name}-{i}") == [expected[(name, i)]], (name, i)
    assert len({tuple(expected[(n, 0)]) for n in [None, *lora_checkpoints.ADAPTERS]}) > 1   # adapters matter


def test_mixed_batch_equals_each_alone(root, expected):
    """Base and three adapters in one step, decode rows gathered per row and prefill runs per adapter."""
    engine = make_engine(root)
    names = [None, *lora_checkpoints.ADAPTERS]
    requests = [(names[k % len(names)], k % len(PROMPTS)) for k in range(12)]
    got = run(engine, requests, "mixed")
    assert got == [expected[r] for r in requests]


@pytest.mark.parametrize("pad_limit", [0.0, 2.0, 100.0])
def test_uneven_groups_both_paths(root, expected, monkeypatch, pad_limit):
    """Adapters with different row counts in one step (padded batched products, or one adapter at a time when
    padding would cost too much: PAD_LIMIT 0 forces that path) give each request's own tokens."""
    import edgecore.shared.models.lora as lora
    monkeypatch.setattr(lora, "PAD_LIMIT", pad_limit)
    engine = make_engine(root)
    requests = [("attn", 0), ("attn", 1), ("attn", 2), ("mlp", 0), (None, 1), ("all", 2), ("all", 0)]
    assert run(engine, requests, "uneven") == [expected[r] for r in requests]


def test_prefix_cache_is_scoped_by_adapter(root, expected):
    engine = make_engine(root)
    prompt = PROMPTS[2]          # 30 tokens: whole blocks get cached
    run(engine, [("attn", 2)], "warm")
    assert engine.cached_prefix(prompt, adapter="attn") > 0
    assert engine.cached_prefix(prompt) == 0
    assert engine.cached_prefix(prompt, adapter="mlp") == 0
    assert run(engine, [("mlp", 2), (None, 2), ("attn", 2)], "after") == [
        expected[("mlp", 2)], expected[(None, 2)], expected[("attn", 2)]]
    adapter = engine.lora.get("attn")
    assert adapter is not None and adapter_salt(None, adapter) != adapter_salt("", adapter)


def test_unload_and_reload(root, expected):
    engine = make_engine(root)
    engine.lora.unload("mlp")
    with pytest.raises(RequestError, match="does not exist"):
        engine.add_request("x", PROMPTS[0], adapter="mlp")
    with pytest.raises(AdapterError, match="cannot be found"):
        engine.lora.unload("mlp")
    engine.lora.load("mlp2", str(root / "mlp"))
    assert run(engine, [("mlp2", 0), ("all", 1)], "reload") == [expected[("mlp", 0)], expected[("all", 1)]]
    assert sorted(engine.lora.fingerprints()) == ["all", "attn", "mlp2"]
    assert len(engine.lora.slots) == 4      # the freed slot was reused


def test_unload_while_running_finishes_with_it(root, expected):
    engine = make_engine(root)
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    engine.add_request("r", PROMPTS[0], params, adapter="all")
    tokens = [t for out in engine.step() for t in out.new_token_ids]
    engine.lora.unload("all")
    assert engine.lora.slots[3] is not None     # still in use
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == expected[("all", 0)]
    engine.lora.load("again", str(root / "attn"))    # the slot is collected once nothing uses it
    assert engine.lora.get("again").slot == 3


def test_an_unloaded_adapter_is_freed_when_its_last_request_ends(root):
    """Its slot and stacked weights go when the last request on it finishes or is aborted, not at the next
    load/unload (which may never come)."""
    engine = make_engine(root)
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    engine.add_request("m", PROMPTS[0], params, adapter="mlp")
    engine.add_request("a1", PROMPTS[0], params, adapter="all")
    engine.add_request("a2", PROMPTS[1], params, adapter="all")
    engine.step()
    engine.lora.unload("mlp")
    engine.lora.unload("all")
    assert engine.lora.slots[2] is not None and engine.lora.slots[3] is not None     # still in use
    engine.abort("m")
    assert engine.lora.slots[2] is None                       # its only request aborted
    engine.abort("a1")
    assert engine.lora.slots[3] is not None                   # a2 still runs on it
    while engine.has_unfinished():
        engine.step()
    assert [a.name if a else None for a in engine.lora.slots] == [None, "attn"]
    assert all(a.shape[0] == 2 and b.shape[0] == 2 for layer in engine.lora.layers
               for a, b in layer.stacks.values())             # the stacks hold the base and "attn" only


@pytest.mark.timeout(60)
async def test_loading_reads_the_files_off_the_engine_thread(root, tmp_path):
    """/v1/load_lora_adapter's read: an adapter whose config is a FIFO nobody writes yet (a stalled disk) blocks
    only its own load; requests keep running, and the load finishes once the file is there."""
    slow = tmp_path / "slow"
    slow.mkdir()
    shutil.copy(root / "attn" / "adapter_model.safetensors", slow)
    os.mkfifo(slow / "adapter_config.json")
    aengine = EngineThread(LLMEngine.from_dir(root / "base", dtype="float32"))
    aengine.start()
    load = asyncio.ensure_future(aengine.load_adapter("slow", str(slow)))
    try:
        await asyncio.sleep(0.2)                              # the load is waiting on the FIFO
        request = EngineRequest("base", PROMPTS[0], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))

        async def run() -> list:
            return [out async for out in aengine.generate(request)]
        outs = await asyncio.wait_for(run(), 15)              # not stuck behind the load
        assert outs[-1].finished and not load.done()
    finally:
        config = (root / "attn" / "adapter_config.json").read_bytes()
        await asyncio.wait_for(asyncio.to_thread((slow / "adapter_config.json").write_bytes, config), 10)
        fingerprint = await asyncio.wait_for(load, 10)
        aengine.stop()
    assert fingerprint == aengine.engine.lora.fingerprints()["slow"]


def _copy(root, tmp_path, name="all"):
    dst = tmp_path / name
    shutil.copytree(root / name, dst)
    return dst


@pytest.mark.parametrize("change, message", [
    (lambda d: (d / "adapter_model.safetensors").unlink(), "adapter_model.safetensors: missing"),
    (lambda d: (d / "adapter_config.json").unlink(), "adapter_config.json: cannot read"),
    (lambda d: _edit(d, bias="all"), "bias='all' is not supported"),
    (lambda d: _edit(d, r=80), "rank 80 exceeds the limit of 64"),
    (lambda d: _edit(d, use_dora=True), "use_dora=true is not supported"),
    (lambda d: _edit(d, r=8), "has rank 16, the config says r=8"),
    (lambda d: _retensor(d, lambda k, t: (k.replace("q_proj", "qq_proj"), t)), "target module 'qq_proj'"),
    (lambda d: _retensor(d, lambda k, t: (k, t[:, :-1] if "q_proj.lora_A" in k else t)), "do not fit the base"),
    (lambda d: _retensor(d, lambda k, t: (k.replace("layers.1.", "layers.7."), t)), "names layer 7"),
    (lambda d: _retensor(d, lambda k, t: (None if "o_proj.lora_B" in k else k, t)), "but not its pair"),
])
def test_bad_adapters_are_refused_whole(root, expected, tmp_path, change, message):
    engine = make_engine(root)
    before = engine.lora.fingerprints()
    bad = _copy(root, tmp_path)
    change(bad)
    with pytest.raises(AdapterError, match=message.replace("(", r"\(").replace(")", r"\)")):
        engine.lora.load("bad", str(bad))
    assert engine.lora.fingerprints() == before
    assert run(engine, [("attn", 1)], "still") == [expected[("attn", 1)]]


def test_bad_first_adapter_installs_nothing(root, tmp_path):
    engine = LLMEngine.from_dir(root / "base", dtype="float32")
    bad = _copy(root, tmp_path)
    _edit(bad, bias="lora_only")
    with pytest.raises(AdapterError):
        engine.lora.load("bad", str(bad))
    assert not engine.lora.fingerprints() and len(engine.lora.slots) == 1
    assert all(layer.self_attn.lora is None for layer in engine.model.model.layers)


def test_max_rank_limit(root):
    engine = LLMEngine.from_dir(root / "base", dtype="float32")
    engine.lora.max_rank = 8
    with pytest.raises(AdapterError, match="rank 16 exceeds the limit of 8"):
        engine.lora.load("all", str(root / "all"))
    assert engine.lora.load("mlp", str(root / "mlp")).rank == 8


def _edit(d, **changes):
    path = d / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _retensor(d, fn):
    from safetensors.torch import load_file, save_file
    path = d / "adapter_model.safetensors"
    tensors: dict[str, torch.Tensor] = {}
    for key, value in load_file(str(path)).items():
        new_key, new_value = fn(key, value)
        if new_key is not None:
            tensors[new_key] = new_value.contiguous()
    save_file(tensors, str(path))


def test_an_edges_own_layer0_kv_uses_the_adapter(root):
    """`write_first_layer_kv` (an edge computing layer 0 of a lossy transfer) applies the request's adapter: its
    K/V equal a prefill's under that adapter, and differ from the base model's."""
    engine = make_engine(root)
    prompt = PROMPTS[2]
    layer0 = {}
    for adapter in ("attn", None):
        rid = f"edge-{adapter}"
        engine.reserve(rid, prompt, SamplingParams(max_tokens=1), adapter=adapter)
        engine.write_first_layer_kv(rid)
        layer0[adapter] = engine.read_kv(rid, 0, 0, len(prompt))
        engine.release(rid)
    engine.add_request("core", prompt, SamplingParams(max_tokens=1), prefill_only=True, adapter="attn")
    while engine.has_unfinished():
        engine.step()
    k, v = engine.read_kv("core", 0, 0, len(prompt))
    torch.testing.assert_close(layer0["attn"][0], k)
    torch.testing.assert_close(layer0["attn"][1], v)
    assert not torch.allclose(layer0[None][0], k)
