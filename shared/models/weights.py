"""Checkpoint reading: safetensors files, single or sharded, memory-mapped.

Life cycle: `checkpoint_files(dir)` resolves `model.safetensors` or the
shards listed in `model.safetensors.index.json`; `iter_weights(dir)` yields
(name, lazy slice) pairs straight from the memory map, so a loader copies
each tensor (or only its rank's shard of it) once into its parameter and no
second full copy of the checkpoint exists. A packed checkpoint (see
`shared/pack`) is read through the same entry point.
"""

from __future__ import annotations

import json
from pathlib import Path
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

from safetensors import SafetensorError, safe_open

from edgecore.shared.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

SliceIndex = int | slice | tuple[int | slice, ...]


class WeightSlice(Protocol):
    """A checkpoint tensor not yet read: a safetensors slice or a packed tensor (shared/pack/reader.py)."""

    def get_shape(self) -> Sequence[int]: ...

    def get_dtype(self) -> str: ...

    def __getitem__(self, item: SliceIndex) -> torch.Tensor: ...


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {exc}") from None
        files = sorted({model_dir / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{index} names shard {f.name}, which is missing")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(f"model directory {model_dir} has no model.safetensors or model.safetensors.index.json")


def iter_weights(model_dir: str | Path) -> Iterator[tuple[str, WeightSlice]]:
    """(checkpoint name, lazy safetensors slice) for every tensor in the checkpoint.

    A packed checkpoint yields lazy packed tensors instead, which decode (checksum
    verified) on slicing or straight into a destination with `decode_jobs`.
    """
    from edgecore.shared.pack import PackedCheckpoint, is_packed
    if is_packed(model_dir):
        # The lazy tensors keep the checkpoint (and its memory map) alive until the last one is
        # decoded, possibly in another thread; the map closes when they are gone.
        yield from PackedCheckpoint(model_dir).lazy()
        return
    for path in checkpoint_files(model_dir):
        try:
            handle = safe_open(str(path), framework="pt")
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read weights file {path}: {exc}") from None
        with handle as f:
            for name in f.keys():
                try:
                    yield name, f.get_slice(name)
                except SafetensorError as exc:
                    raise ModelLoadError(f"{path}: tensor '{name}' is corrupt: {exc}") from None


def weight_index(model_dir: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name → (dtype, shape) for every tensor, read from headers only (or the pack manifest)."""
    from edgecore.shared.pack import PackedCheckpoint, is_packed
    if is_packed(model_dir):
        packed = PackedCheckpoint(model_dir)
        try:
            return packed.index()
        finally:
            packed.close()
    out = {}
    for name, sl in iter_weights(model_dir):
        out[name] = (str(sl.get_dtype()), tuple(sl.get_shape()))
    return out
