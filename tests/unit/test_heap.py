"""Giving the C heap's free pages back to the OS after a start-up (``app/heap.py``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import pytest

from app.heap import release_free_heap

pytestmark = pytest.mark.skipif(ctypes.util.find_library("c") is None or os.uname().sysname != "Linux",
                                reason="glibc's malloc_trim: Linux only")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_pages_a_start_up_freed_amid_live_ones_go_back_to_the_os():
    """200 MB of 4 KiB blocks, every 64th kept (as a model load leaves its temporaries freed among the
    weights it keeps): glibc holds the freed pages, as its heap cannot shrink past a live block, until
    they are released."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(4096) for _ in range(200 * 256)]
    for block in blocks:
        ctypes.memset(block, 1, 4096)  # touched: resident
    kept = blocks[::64]
    for i, block in enumerate(blocks):
        if i % 64:
            libc.free(block)
    held = _rss_mb()
    try:
        assert release_free_heap() is True
        assert held - _rss_mb() > 150  # of the ~197 MB freed
    finally:
        for block in kept:
            libc.free(block)
