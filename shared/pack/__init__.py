"""Packed checkpoints: lossless, smaller safetensors for shipping models to edges.

`pack_model(src, out)` writes a packed checkpoint; `PackedCheckpoint(dir)` reads
it (tensor by tensor, in parallel threads, checksums verified) and restores the
original safetensors files byte for byte with `unpack`. See `format.py`.
"""

from edgecore.shared.pack.format import MANIFEST, is_packed
from edgecore.shared.pack.reader import PackedCheckpoint
from edgecore.shared.pack.writer import pack_model, packed_from

__all__ = ["MANIFEST", "PackedCheckpoint", "is_packed", "pack_model", "packed_from"]
