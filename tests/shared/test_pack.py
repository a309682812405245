"""Packed checkpoints: byte-identical round trips, same tokens, corruption named by tensor."""

import filecmp
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.errors import ModelLoadError
from edgecore.shared.models.fingerprint import model_fingerprint
from edgecore.shared.models.loader import load_model
from edgecore.shared.pack import PackedCheckpoint, pack_model
from tests.conftest import make_engine


def round_trip(src, tmp_path):
    pack_model(src, tmp_path / "packed")
    packed = PackedCheckpoint(tmp_path / "packed")
    packed.unpack(tmp_path / "unpacked")
    packed.close()
    return tmp_path / "packed", tmp_path / "unpacked"


def test_bundled_model_round_trip_is_byte_identical_and_smaller(model_dir, tmp_path):
    packed, unpacked = round_trip(model_dir, tmp_path)
    assert filecmp.cmp(unpacked / "model.safetensors", model_dir / "model.safetensors", shallow=False)
    assert (packed / "model.edgepack").stat().st_size < 0.75 * (model_dir / "model.safetensors").stat().st_size
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert filecmp.cmp(packed / name, model_dir / name, shallow=False)
    assert model_fingerprint(packed) == model_fingerprint(model_dir)


def test_packed_model_generates_the_same_tokens(model_dir, tmp_path, golden):
    packed, _ = round_trip(model_dir, tmp_path)
    prompts = [c["prompt_ids"] for c in golden["cases"]]
    params = SamplingParams(max_tokens=32, temperature=0)
    assert [r["token_ids"] for r in make_engine(packed).generate(prompts, params)] == \
           [r["token_ids"] for r in make_engine(model_dir).generate(prompts, params)]


def special_tensor(dtype, n=5000):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(n, generator=g).to(dtype)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0,
                             torch.finfo(dtype).tiny / 4, -torch.finfo(dtype).tiny / 2, torch.finfo(dtype).max])
    t[:len(specials)] = specials.to(dtype)
    return t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_random_tensors_with_special_values_round_trip(tmp_path, model_dir, dtype):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(model_dir / "config.json", src / "config.json")
    tensors = {"big": special_tensor(dtype).reshape(50, 100), "empty": torch.zeros(0, dtype=dtype),
               "zeros": torch.zeros(3000, dtype=dtype), "small": torch.arange(7).to(dtype),
               "ints": torch.arange(100, dtype=torch.int64)}
    save_file(tensors, str(src / "model.safetensors"), metadata={"note": "special values"})
    _, unpacked = round_trip(src, tmp_path)
    assert (unpacked / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    manifest = json.loads((tmp_path / "packed" / "edgecore-pack.json").read_text())
    assert {t["name"]: t["encoding"] for t in manifest["tensors"]}["big"] == "planes"


def test_sharded_checkpoint_round_trip(tmp_path, model_dir):
    from safetensors.torch import load_file
    src = tmp_path / "sharded"
    shutil.copytree(model_dir, src)
    (src / "model.safetensors").unlink()
    tensors = load_file(str(model_dir / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[:10], names[10:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(src / fname))
        weight_map.update({n: fname for n in part})
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    packed, unpacked = round_trip(src, tmp_path)
    for i in (1, 2):
        fname = f"model-{i:05d}-of-00002.safetensors"
        assert filecmp.cmp(unpacked / fname, src / fname, shallow=False)
    a, b = load_model(src), load_model(packed)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_corrupted_pack_names_the_tensor(model_dir, tmp_path):
    pack_model(model_dir, tmp_path / "packed")
    manifest = json.loads((tmp_path / "packed" / "edgecore-pack.json").read_text())
    victim = next(t for t in manifest["tensors"] if t["name"] == "model.layers.1.mlp.up_proj.weight")
    data = bytearray((tmp_path / "packed" / "model.edgepack").read_bytes())
    data[victim["offset"] + victim["length"] - 10] ^= 0x55        # a mantissa byte
    (tmp_path / "packed" / "model.edgepack").write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(tmp_path / "packed")
    data[victim["offset"] + 2] ^= 0xFF                            # inside the zstd frame
    (tmp_path / "packed" / "model.edgepack").write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(tmp_path / "packed")
    (tmp_path / "packed" / "model.edgepack").write_bytes(bytes(data[: victim["offset"]]))
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(tmp_path / "packed")


def test_large_tensors_are_chunked_and_decode_straight_into_merged_parameters(model_dir, tmp_path):
    manifest = pack_model(model_dir, tmp_path / "packed")
    embed = next(t for t in manifest["tensors"] if t["name"] == "model.embed_tokens.weight")
    assert len(embed["chunks"]) == -(-2048 * 192 // manifest["chunk_values"]) >= 2     # a partial last chunk
    a, b = load_model(model_dir), load_model(tmp_path / "packed")
    names = [n for n, _ in a.named_parameters()]
    assert any("qkv_proj" in n for n in names) and any("gate_up_proj" in n for n in names)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_a_plain_zstd_level_packs_the_same_tensors(model_dir, tmp_path):
    pack_model(model_dir, tmp_path / "packed", level=3)
    PackedCheckpoint(tmp_path / "packed").unpack(tmp_path / "unpacked")
    assert filecmp.cmp(tmp_path / "unpacked" / "model.safetensors", model_dir / "model.safetensors", shallow=False)


def test_an_older_pack_version_is_refused_by_name(model_dir, tmp_path):
    pack_model(model_dir, tmp_path / "packed")
    path = tmp_path / "packed" / "edgecore-pack.json"
    path.write_text(path.read_text().replace('"version": 2', '"version": 1'))
    with pytest.raises(ModelLoadError, match="unsupported pack format edgecore-pack v1"):
        load_model(tmp_path / "packed")


def test_a_manifest_whose_chunks_do_not_add_up_is_refused(model_dir, tmp_path):
    pack_model(model_dir, tmp_path / "packed")
    path = tmp_path / "packed" / "edgecore-pack.json"
    manifest = json.loads(path.read_text())
    victim = next(t for t in manifest["tensors"] if t["encoding"] == "planes")
    victim["chunks"] = victim["chunks"][:-1] if len(victim["chunks"]) > 1 else victim["chunks"] * 2
    path.write_text(json.dumps(manifest))
    with pytest.raises(ModelLoadError, match=f"'{victim['name']}' is corrupt"):
        load_model(tmp_path / "packed")


def _edit_manifest(packed, edit) -> None:
    path = packed / "edgecore-pack.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("field, value", [("dtype", "F16"), ("shape", [1, -1]), ("begin", 0)])
def test_a_manifest_that_disagrees_with_the_original_header_is_refused(model_dir, tmp_path, field, value):
    """BF16 bytes read as F16 would load wrong weights without a checksum error: the manifest's dtype, shape
    and byte range must be the original header's."""
    pack_model(model_dir, tmp_path / "packed")
    victim = {}

    def edit(manifest):
        t = next(t for t in manifest["tensors"] if t["begin"] > 0 and t[field] != value)
        t[field] = value
        victim["name"] = t["name"]
    _edit_manifest(tmp_path / "packed", edit)
    with pytest.raises(ModelLoadError, match=f"'{victim['name']}'.*original header"):
        load_model(tmp_path / "packed")


@pytest.mark.parametrize("edit", [
    lambda m: m["shards"][0].update(file="../../outside.safetensors"),
    lambda m: m["shards"][0].update(file="/tmp/absolute.safetensors"),
    lambda m: m["files"].update({"../private.txt": {"size": 1, "sha256": "0"}}),
])
def test_unsafe_file_names_in_a_manifest_are_refused_before_anything_is_written(model_dir, tmp_path, edit):
    pack_model(model_dir, tmp_path / "packed")
    _edit_manifest(tmp_path / "packed", edit)
    out = tmp_path / "deep" / "er" / "out"
    with pytest.raises(ModelLoadError, match="unsafe"):
        PackedCheckpoint(tmp_path / "packed").unpack(out)
    assert not (tmp_path / "deep").exists() and not (tmp_path / "outside.safetensors").exists()


def test_a_malformed_manifest_is_one_error_naming_it(model_dir, tmp_path):
    pack_model(model_dir, tmp_path / "packed")
    _edit_manifest(tmp_path / "packed", lambda m: m.pop("tensors"))
    with pytest.raises(ModelLoadError, match="edgecore-pack.json is malformed"):
        load_model(tmp_path / "packed")
    pack_model(model_dir, tmp_path / "p2")
    with pytest.raises(ModelLoadError, match="must differ"):          # unpacking over its own files
        PackedCheckpoint(tmp_path / "p2").unpack(tmp_path / "p2")


def test_a_packed_fp8_checkpoint_loads_as_the_unpacked_one(tmp_path):
    from tests.shared.test_deepseek_fp8 import fp8_checkpoint
    path, _, _ = fp8_checkpoint(tmp_path)
    pack_model(path, tmp_path / "packed")
    ours, packed = load_model(path), load_model(tmp_path / "packed")
    for (name, a), (_, b) in zip(ours.state_dict().items(), packed.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_core_ships_the_weights_it_serves_packed_again_for_a_new_checkpoint(model_dir, tmp_path):
    """The copy a core ships to edges is of the checkpoint it loaded: a core restarted on retrained weights
    (same shapes, same data directory) packs them again; an unchanged one is not packed again; a core whose
    model directory changed under it answers 503 rather than ship weights it does not serve."""
    import asyncio
    import os

    from edgecore.core.model_server import ModelServer
    from edgecore.shared.openai.errors import ApiError
    src = tmp_path / "model"
    shutil.copytree(model_dir, src)
    running = ModelServer(str(src), tmp_path / "data")
    manifest = asyncio.run(running.ensure_packed()) / "edgecore-pack.json"
    first = json.loads(manifest.read_text())
    stamp = manifest.stat().st_mtime_ns
    asyncio.run(running.ensure_packed())
    assert manifest.stat().st_mtime_ns == stamp                       # unchanged: not packed again
    from safetensors.torch import load_file
    tensors = load_file(src / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 2   # "retrained": same shapes, new weights
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    os.utime(src / "model.safetensors", ns=(stamp + 10**9, stamp + 10**9))
    with pytest.raises(ApiError) as e:
        asyncio.run(running.ensure_packed())
    assert e.value.status == 503 and json.loads(manifest.read_text()) == first
    restarted = ModelServer(str(src), tmp_path / "data")
    asyncio.run(restarted.ensure_packed())
    assert json.loads(manifest.read_text())["shards"][0]["sha256"] != first["shards"][0]["sha256"]
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["packed-model"]    # swapped in, no leftovers
