"""glibc heap settings for CPU inference: large tensors come from the heap and freed memory is kept.

Why: by default glibc serves each allocation above a (self-adjusting) threshold with its own `mmap`
and returns it to the kernel on free, and trims the heap's free top beyond twice that threshold, so
every prefill step's activations (megabytes per op) land on fresh pages and pay a page fault per
4 KiB on first touch. Prefill of 32 x 128 tokens on the bundled model spent about 30% of its time
that way (96 -> 66 ms). Fixing the mmap threshold at its maximum (32 MiB) and raising the trim
threshold keeps such blocks in the heap, reused from one step to the next, which is what PyTorch's
CPU tuning guides get by preloading jemalloc or tcmalloc. Servers step their engine on a thread, and
glibc gives other threads their own arenas: heaps of at most 64 MiB that it unmaps whole once they
empty, whatever the thresholds. So all threads share the main heap (one arena): a new core's
500-request batch faulted 15k-21k pages in six runs that way, against 20k-346k (two runs of
seven above 100k) with per-thread arenas.

Life cycle: `load_model` and `ModelRunner` call `retain_freed_memory()` when they run on CPU; the settings are
process-wide and last until exit. A process's resident memory then stays near its peak instead of
shrinking between steps, until the engine has been idle a moment: then `return_free_memory()` hands the
heap's free pages back to the kernel (a burst's activations do not stay resident while nothing runs).
No-op off glibc or with EDGECORE_CPU_MALLOC=0.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

from edgecore.shared.node.env import cpu_malloc_tuning_enabled

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 << 20     # glibc's upper limit on 64-bit; larger blocks are still mmapped
TRIM_THRESHOLD = 1 << 30      # free memory at the heap's top kept before returning it to the kernel

_applied: bool | None = None


def retain_freed_memory() -> bool:
    """Apply the settings (once per process); True when they are in effect."""
    global _applied
    if _applied is None:
        _applied = cpu_malloc_tuning_enabled() and _mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) \
            and _mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) and _mallopt(M_ARENA_MAX, 1)
    return _applied


def return_free_memory() -> None:
    """Give the heap's free pages back to the kernel (glibc's malloc_trim), if the settings are in effect."""
    libc = _libc() if _applied else None
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        trim(0)


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _mallopt(param: int, value: int) -> bool:
    libc = _libc()
    if libc is None:
        return False
    mallopt = getattr(libc, "mallopt", None)     # glibc; musl has none
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(param, value) == 1
