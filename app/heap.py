"""The C heap of a foreserve process: giving back to the OS the pages a start-up freed.

Loading a model frees much of what it allocated (the file's tensors once copied, the unfused
q/k/v and gate/up weights, the warm-up's activations) among blocks it keeps, and glibc's malloc
keeps such free pages mapped: its heap only shrinks from the top. An online engine replica held
141 MB of them after its start (1,383 MB of RSS, 1,242 MB after ``malloc_trim(0)``; measured with
``loadtests.bench.replica_memory engine``, ``MALLOC_ARENA_MAX=2``), which it never needed again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Hand the free pages of every malloc arena back to the OS (glibc's ``malloc_trim(0)``; tens of
    milliseconds). Call it once a start-up has freed what it will not use again, not per request.
    False where the C library has no such call (musl, macOS): nothing is done there."""
    trim = _malloc_trim()
    if trim is None:
        log.debug("no malloc_trim in this C library: the heap's free pages stay mapped")
        return False
    trim(0)
    return True
