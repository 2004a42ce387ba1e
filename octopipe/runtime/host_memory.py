"""Host-memory policy for CPU ranks: keep freed memory in the process instead of giving it back.

Consumed by `runtime/launch.py`: every local gloo child, and `init_from_env` (torchrun) on CPU,
both at process start. Not applied later in a process that already runs threads and forks
(an Engine built inside pytest, say): changing malloc's thresholds there, then forking, made
the children crash at exit. A pipeline step allocates and frees activations of the same sizes
over and over. glibc's malloc serves large blocks with fresh `mmap`s and returns freed memory to
the kernel, so every step touches new pages and pays a page fault per 4 KiB: on this project's CPU
runs that made compute ops 1.3-1.5x slower than the same layers profiled in a loop, and made
measured step times disagree with the simulator. Raising malloc's mmap and trim thresholds keeps
freed blocks in the heap for reuse, as the CUDA caching allocator does on GPUs.

No effect off glibc (macOS, musl) or with OCTOPIPE_KEEP_HOST_MEMORY=0.
"""

from __future__ import annotations

import ctypes
import os

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 * 2**20  # glibc's largest accepted value on 64-bit
_TRIM_THRESHOLD = 2**30

_applied: bool | None = None


def keep_freed_host_memory() -> bool:
    """Apply the policy once per process; True if it is in effect."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("OCTOPIPE_KEEP_HOST_MEMORY", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    return _applied
