"""Host allocator policy for the processes that hold weights: trainer ranks and the engines' vLLM workers.

    from megatron_sortedrl.host_heap import fix_host_mmap_threshold, trim_host_heap, heap_info
    fix_host_mmap_threshold()   # first thing in the process, before large tensors are allocated and freed
    ...; trim_host_heap()       # after each step / weight load, when nothing of it is live any more
    heap_info()                 # glibc's mallinfo2 counters in bytes: what the heap holds in use and free

Why: glibc raises its mmap threshold (up to 32 MiB) whenever a mapped block is freed, so after the first
step or sync the 1-32 MiB tensors (gathered shards, packing buffers, activations, gradients, vLLM's reload
buffers) come from the heap, which keeps freed pages and fragments as sizes change from call to call.
Measured over 14 train+sync cycles at TP2 x PP2 with a 252M model, the bytes in use (mallinfo2) stayed
within 2 MiB while the heap's free bytes grew from ~100 MiB to 200-550 MiB per trainer rank: that was all
of the drift. A fixed threshold switches the raise off; large blocks are unmapped on free. Cost: one
mmap/munmap and fresh page faults per large allocation.

Written here with ctypes (no library offers glibc's `mallopt`/`malloc_trim`); elsewhere than glibc every
function does nothing (that allocator keeps its own policy).
"""

from __future__ import annotations

import ctypes
import ctypes.util

# Host allocations of at least this size get their own mapping, returned to the OS when freed.
HOST_MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h

_MALLINFO2_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in _MALLINFO2_FIELDS]


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None


def fix_host_mmap_threshold(nbytes: int = HOST_MMAP_THRESHOLD) -> bool:
    """Makes every host allocation of at least `nbytes` a mapping of its own (glibc `mallopt`); False elsewhere.

    Call it before large blocks are freed: a heap that already holds large free chunks serves from them
    whatever the threshold (hence first thing in a trainer rank's `setup`, and at import of the vLLM worker
    extension, which vLLM does before the engine's model loads)."""
    try:
        return bool(_libc().mallopt(_M_MMAP_THRESHOLD, int(nbytes)))
    except AttributeError:
        return False


def trim_host_heap() -> None:
    """Gives the heap's free pages back to the OS (glibc `malloc_trim`; nothing elsewhere).

    With large blocks mapped (`fix_host_mmap_threshold`) only small chunks remain in the heap; their free
    pages still grew by ~3 MiB per train+sync cycle on every trainer rank without it. Call it when the work
    of a step is no longer live (after an optimizer step, after a whole weight load), not in the middle of
    one: a trim there makes the next piece touch fresh pages again."""
    try:
        _libc().malloc_trim(0)
    except AttributeError:
        pass


def heap_info() -> dict[str, int] | None:
    """glibc's `mallinfo2` in bytes: `arena` (heap size), `uordblks` (in use), `fordblks` (free in the heap),
    `hblkhd` (in mapped blocks), `keepcost` (trimmable top); None where there is no `mallinfo2` (glibc < 2.33)."""
    libc = _libc()
    fn = getattr(libc, "mallinfo2", None)
    if fn is None:
        return None
    fn.restype = _MallInfo2
    info = fn()
    return {n: int(getattr(info, n)) for n in _MALLINFO2_FIELDS}
