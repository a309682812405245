"""The persistent KV tier: full prefix-cache blocks evicted from the pool, kept on disk for later requests
and for the next run of the node (`--kv-tier-dir`, `--kv-tier-size`).

Life cycle:
1. Open (`KVTier(...)`, at engine start): the directory is created if missing, temporary files left by a
   crash are removed, and the index (key → file size, least recently used first, by modification time) is
   rebuilt from the listing alone: no file is read, so start-up costs one directory scan.
2. Spill (`spill`, engine thread): the block manager evicts a cached block, the engine copies its K/V out of
   the pool (memory only) and hands it here. The queue is bounded: when the writer is behind, the block is
   dropped (counted), never waited for. The writer thread encodes it with a wire codec (protocol/kv.py;
   lossless unless the operator chose a lossy one), writes `<key>.kvb.tmp`, then deletes least recently used
   files until the directory holds at most `capacity` bytes with it, and renames it into place (a write that
   fails, a full disk, evicts nothing; the temporary file is the one block over the bound meanwhile).
3. Lookup (`has`, engine thread): the index only, no I/O.
4. Load (`load`, reader thread): each block's file is read, checked (checksum, magic, key, geometry) and
   decoded to tensors, in prefix order, stopping at the first block that is missing or bad; a bad file
   (corrupted, truncated, another model's or salt's) is removed and is a miss, so the engine recomputes
   those tokens: a tier never yields KV it cannot prove is the block asked for. Each hit is touched (LRU).
5. Close (`close`): the writer drains what is queued (bounded wait) and stops; the reader stops.

Keys: a block's chained hash (shared/kv/block_manager.py: it covers every token of the prefix, the cache salt
through the first block) extended with the model fingerprint (shared/models/fingerprint.py) and the salt once more:
key = BLAKE2b-128("edgecore-kv-tier/1" ‖ fingerprint ‖ salt ‖ hash). Models and tenants sharing a directory
never read each other's blocks; the salt itself is never written (a tenant salt may be a secret).

File format (one file per block, named by its key in hex):
    b"EKVTIER1" | header length (u32 LE) | header (msgpack `TierHeader`: key, block hash, the `KVChunk` header
    of the wire format) | payload (encoded K then V) | CRC-32 of everything before (u32 LE).
The CRC catches corruption and truncation (at 1 GB/s, where a cryptographic hash ran at 0.2 here); the header's
key and block hash say which block the file holds, so a whole file put under another name is refused too.

Failures: a full, read-only or vanished directory makes writes fail: the block is dropped, counted as an
error, logged once (until a write succeeds again) and `healthy` is False; lookups and loads go on (misses).
One directory serves one engine at a time.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

from edgecore.protocol.events import KVData
from edgecore.protocol.kv import decode_chunk, encode_chunk
from edgecore.protocol.messages import KVChunk
from edgecore.shared.kv.wire import from_bits, to_bits

log = logging.getLogger(__name__)

MAGIC = b"EKVTIER1"
SUFFIX = ".kvb"
_LEN = struct.Struct("<I")              # the header's length, and the CRC after the payload
_MAX_HEADER = 1 << 16
DEFAULT_QUEUE_BLOCKS = 256


class TierHeader(msgspec.Struct, array_like=True, frozen=True):
    key: bytes             # the block's tier key (the file's name)
    block_hash: int        # the chained prefix-cache hash
    chunk: KVChunk         # the wire header of the payload (layers, tokens, heads, widths, dtype, codec, sizes)


@dataclass(frozen=True)
class BlockShape:
    """What every block of this engine's pool looks like: layers × tokens × heads × (K width, V width)."""
    layers: int
    tokens: int
    heads: int
    k_dim: int
    v_dim: int
    dtype: str             # "bfloat16" | "float16" | "float32"


@dataclass
class TierCounters:
    """Cumulative counts (blocks, bytes, seconds) and the directory's state; read as a copy (`KVTier.counters`)."""
    hit_blocks: int = 0
    miss_blocks: int = 0
    read_bytes: int = 0
    read_seconds: float = 0.0
    written_blocks: int = 0
    written_bytes: int = 0
    dropped_blocks: int = 0      # spills the writer could not take (queue full) or could not store (errors)
    errors: int = 0              # failed writes, reads and deletions (I/O errors)
    removed_bad: int = 0         # files removed as corrupted, truncated or foreign
    used_bytes: int = 0
    files: int = 0
    healthy: bool = True         # the last write (if any) succeeded


def tier_key(fingerprint: str, block_hash: int, salt: str | None) -> bytes:
    """The file key of a block: its chained hash, extended with the model fingerprint and the cache salt."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"edgecore-kv-tier/1")
    fp = fingerprint.encode()
    h.update(len(fp).to_bytes(4, "little") + fp)
    if salt is None:
        h.update(b"\x00")
    else:
        raw = salt.encode("utf-8", "surrogatepass")
        h.update(b"\x01" + len(raw).to_bytes(8, "little") + raw)
    h.update(block_hash.to_bytes(8, "little"))
    return h.digest()


class BadTierFile(Exception):
    """A tier file that is not the block asked for (corrupted, truncated, foreign)."""


def decode_block(data: KVData, shape: BlockShape, rope: tuple[float, ...] | None, same_dtype: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One whole block's K/V from its wire chunk (a tier file's, or a peer edge's, edge/peer_pull.py), checked
    against this engine's block geometry (and, `same_dtype`, its dtype: a tier file; a peer's block is cast where
    it is written). Raises BadTierFile."""
    s, c = shape, data.chunk
    if ((c.layer_end - c.layer_start, c.token_end - c.token_start, c.head_end - c.head_start, c.head_dim)
            != (s.layers, s.tokens, s.heads, s.k_dim)) or (same_dtype and c.dtype != s.dtype):
        raise BadTierFile("block geometry differs from this engine's")
    try:
        k, v = decode_chunk(data, rope)
    except Exception as exc:        # a codec's own error (CodecError, ValueError...): the payload is bad
        raise BadTierFile(f"payload does not decode: {exc}") from None
    if v.shape != (s.layers, s.tokens, s.heads, s.v_dim):
        raise BadTierFile(f"V plane of shape {v.shape}")
    return from_bits(k, c.dtype), from_bits(v, c.dtype)


@dataclass(frozen=True)
class _Spill:
    key: bytes
    block_hash: int
    k: torch.Tensor        # [layers, tokens, heads, width]
    v: torch.Tensor


class KVTier:
    def __init__(self, directory: str | Path, capacity: int, fingerprint: str, shape: BlockShape,
                 codec: str = "lossless", rope: tuple[float, ...] | None = None,
                 queue_blocks: int = DEFAULT_QUEUE_BLOCKS):
        if capacity < 1:
            raise ValueError(f"the KV tier's size must be at least one byte, not {capacity}")
        self.dir = Path(directory)
        self.capacity, self.fingerprint, self.shape = capacity, fingerprint, shape
        self.codec, self.rope = codec, rope
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()      # key → file size, least recently used first
        self._counts = TierCounters()
        self._failing: str | None = None                          # the last write error (logged once)
        self._read_logged = False
        self._queue: queue.Queue[_Spill | None] = queue.Queue(maxsize=queue_blocks)
        self._open()
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgecore-kv-tier-read")
        self._writer = threading.Thread(target=self._write_loop, name="edgecore-kv-tier-write", daemon=True)
        self._writer.start()

    # ---- start-up -----------------------------------------------------------------------------------------
    def _open(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            found = []
            for entry in os.scandir(self.dir):
                if entry.name.endswith(SUFFIX + ".tmp"):
                    _unlink(Path(entry.path))
                    continue
                key = _parse_name(entry.name)
                if key is None or not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
                found.append((st.st_mtime_ns, key, st.st_size))
        except OSError as exc:
            self._fail(f"cannot read the KV tier directory {self.dir}: {exc}")
            return
        for _, key, size in sorted(found):
            self._index[key] = size
            self._counts.used_bytes += size
        while self._counts.used_bytes > self.capacity and self._index:   # a smaller --kv-tier-size than before
            self._unlink_evicted(self._pop_lru())
        self._counts.files = len(self._index)
        log.info("KV tier %s: %d blocks, %d of %d bytes", self.dir, len(self._index), self._counts.used_bytes,
                 self.capacity)

    # ---- engine thread -------------------------------------------------------------------------------------
    def key(self, block_hash: int, salt: str | None) -> bytes:
        return tier_key(self.fingerprint, block_hash, salt)

    def has(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def accepting(self) -> bool:
        """Whether a spill now would be queued (checked before copying a block out of the pool)."""
        return not self._queue.full()

    def spill(self, key: bytes, block_hash: int, k: torch.Tensor, v: torch.Tensor, wait: float = 0.0) -> bool:
        """Queue one block for writing (K/V copies the caller no longer touches); `wait` seconds at most for
        room (0: the engine's case, never wait). False when dropped (counted)."""
        try:
            if wait > 0:
                self._queue.put(_Spill(key, block_hash, k, v), timeout=wait)
            else:
                self._queue.put_nowait(_Spill(key, block_hash, k, v))
            return True
        except queue.Full:
            self.count_dropped()
            return False

    def count_dropped(self, blocks: int = 1) -> None:
        with self._lock:
            self._counts.dropped_blocks += blocks

    def count_misses(self, blocks: int) -> None:
        with self._lock:
            self._counts.miss_blocks += blocks

    def load(self, blocks: list[tuple[bytes, int]]) -> Future[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Read, check and decode these blocks ((key, hash), in prefix order) on the reader thread; the future
        holds the K/V of the longest verified leading run (a miss or a bad file ends it)."""
        return self._reader.submit(self._load, blocks)

    @property
    def counters(self) -> TierCounters:
        with self._lock:
            return TierCounters(**vars(self._counts))

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (within `timeout`), then stop both threads."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            log.warning("KV tier %s: the writer is still busy; blocks still queued may not be written", self.dir)
        self._writer.join(timeout)
        self._reader.shutdown(wait=False, cancel_futures=True)

    # ---- reader thread -------------------------------------------------------------------------------------
    def _load(self, blocks: list[tuple[bytes, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        started = time.perf_counter()
        nbytes = 0
        for key, block_hash in blocks:
            path = self._path(key)
            try:
                with open(path, "rb") as f:     # into a writable buffer: decoded planes may be views of it
                    data = bytearray(os.fstat(f.fileno()).st_size)
                    del data[f.readinto(data):]         # (shorter if it shrank meanwhile: the CRC fails)
                out.append(self._decode(data, key, block_hash))
                nbytes += len(data)
            except FileNotFoundError:
                self._forget(key)
                break
            except OSError as exc:
                self._error(f"cannot read {path}: {exc}")
                break
            except BadTierFile as exc:
                log.warning("KV tier: removing %s: %s", path.name, exc)
                with self._lock:
                    self._counts.removed_bad += 1
                self._remove(key)
                break
            self._touch(key, path)
        with self._lock:
            self._counts.hit_blocks += len(out)
            self._counts.miss_blocks += len(blocks) - len(out)
            self._counts.read_bytes += nbytes
            self._counts.read_seconds += time.perf_counter() - started
        return out

    def _decode(self, data: bytearray, key: bytes, block_hash: int) -> tuple[torch.Tensor, torch.Tensor]:
        if len(data) < len(MAGIC) + 2 * _LEN.size or not data.startswith(MAGIC):
            raise BadTierFile("not a KV tier file (or truncated)")
        body = memoryview(data)[:-_LEN.size]
        if zlib.crc32(body) != _LEN.unpack_from(data, len(body))[0]:
            raise BadTierFile("checksum mismatch (corrupted or truncated)")
        (hlen,) = _LEN.unpack_from(body, len(MAGIC))
        start = len(MAGIC) + _LEN.size
        if hlen > _MAX_HEADER or start + hlen > len(body):
            raise BadTierFile("header length out of range")
        try:
            header = msgspec.msgpack.decode(body[start:start + hlen], type=TierHeader)
        except msgspec.DecodeError as exc:
            raise BadTierFile(f"bad header: {exc}") from None
        if header.key != key or header.block_hash != block_hash:
            raise BadTierFile("another block's file (foreign model, salt or hash)")
        return decode_block(KVData(header.chunk, body[start + hlen:]), self.shape, self.rope)

    # ---- writer thread -------------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._write(item)
            except Exception:       # a bug must not kill the writer: the tier only loses blocks
                log.exception("KV tier: writing a block failed")
                self._error("unexpected failure while writing", log_it=False)
                self.count_dropped()

    def _write(self, item: _Spill) -> None:
        if self.has(item.key):
            self._touch(item.key, self._path(item.key))
            return
        s = self.shape
        data = encode_chunk("tier", to_bits(item.k), to_bits(item.v), layer_start=0, token_start=0, dtype=s.dtype,
                            codec=self.codec, rope=self.rope)
        header = msgspec.msgpack.encode(TierHeader(item.key, item.block_hash, data.chunk))
        body = b"".join((MAGIC, _LEN.pack(len(header)), header, data.payload))
        blob = body + _LEN.pack(zlib.crc32(body))
        if len(blob) > self.capacity:
            self.count_dropped()
            return
        path = self._path(item.key)
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:      # written before anything is evicted: a full disk costs no block
                f.write(blob)
            victims = []
            with self._lock:
                while self._index and self._counts.used_bytes + len(blob) > self.capacity:
                    victims.append(self._pop_lru())
            for key in victims:         # (deleted outside the lock: lookups never wait on the disk)
                self._unlink_evicted(key)
            os.replace(tmp, path)
        except OSError as exc:
            _unlink(tmp)
            self.count_dropped()
            self._fail(f"cannot write to the KV tier directory {self.dir}: {exc}")
            return
        with self._lock:
            old = self._index.pop(item.key, 0)
            self._index[item.key] = len(blob)
            self._counts.used_bytes += len(blob) - old
            self._counts.files = len(self._index)
            self._counts.written_blocks += 1
            self._counts.written_bytes += len(blob)
            self._counts.healthy = True
        if self._failing is not None:
            log.warning("KV tier %s: writes succeed again", self.dir)
            self._failing = None

    # ---- index and files (any thread) ----------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        return self.dir / (key.hex() + SUFFIX)

    def _pop_lru(self) -> bytes:
        """Take the least recently used block out of the index (lock held); its file is deleted next."""
        key, size = self._index.popitem(last=False)
        self._counts.used_bytes -= size
        self._counts.files = len(self._index)
        return key

    def _unlink_evicted(self, key: bytes) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._error(f"cannot delete an evicted block: {exc}")

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._counts.used_bytes -= size
                self._counts.files = len(self._index)

    def _remove(self, key: bytes) -> None:
        self._forget(key)
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._error(f"cannot remove a bad file: {exc}")

    def _touch(self, key: bytes, path: Path) -> None:
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        try:
            os.utime(path)        # the order survives a restart (the index is rebuilt by modification time)
        except OSError:
            pass

    def _error(self, message: str, log_it: bool = True) -> None:
        """A failed read or deletion: counted; the first one logged."""
        with self._lock:
            self._counts.errors += 1
            first, self._read_logged = not self._read_logged, True
        if log_it and first:
            log.warning("KV tier %s: %s (further read errors are counted, not logged)", self.dir, message)

    def _fail(self, message: str) -> None:
        """A write (or the directory) failed: counted; logged once until a write succeeds again."""
        with self._lock:
            self._counts.errors += 1
            self._counts.healthy = False
        if self._failing is None:
            log.warning("%s; the node keeps serving without storing KV there (misses) until writes succeed",
                        message)
        self._failing = message


def _parse_name(name: str) -> bytes | None:
    if not name.endswith(SUFFIX) or len(name) != 32 + len(SUFFIX):
        return None
    try:
        return bytes.fromhex(name[:32])
    except ValueError:
        return None


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            log.debug("KV tier: cannot remove %s: %s", path, exc)

