"""How the process's C heap (glibc malloc, under torch's CPU allocator) keeps freed memory.

Why: glibc serves a request above its mmap threshold (dynamic, 32 MiB at most) with a fresh
mmap, and trims freed memory at the top of the heap back to the OS. A prefill's activations
(a 993-token gate/up output is 16 MB in float32) are freed and asked for again every layer, so
calls kept touching fresh pages: in a VM those page faults made the gate/up matmul take 42-53 ms
instead of 14.5 ms, and the shared-prefix and batched fp32 bench workloads 1.07-1.09x
longer (bench/prefill_memory.py: 113k page faults against 258 on the prefix; 1.3x while the
context gather still made 34 MB copies, see KVStorage.read_slots). Raising both thresholds
keeps the freed chunks in the heap for the next layer; the process then holds its peak working
set instead of returning it between calls, as an engine that pre-allocates does anyway.

Process-wide and glibc-only: elsewhere (musl, macOS) nothing changes. KVPAGE_KEEP_FREED_MEMORY=0
leaves malloc as it is."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
KEEP_BELOW = 1 << 30  # requests under 1 GiB come from the heap; a KV pool above it is mmapped


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds once per process; whether they were set."""
    if os.environ.get("KVPAGE_KEEP_FREED_MEMORY", "1") == "0":
        return False
    libc = _glibc()
    if libc is None:
        return False
    return bool(
        libc.mallopt(M_MMAP_THRESHOLD, KEEP_BELOW) and libc.mallopt(M_TRIM_THRESHOLD, KEEP_BELOW)
    )


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 -- only glibc has it (and mallopt's parameters)
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc
