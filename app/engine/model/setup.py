"""Where and how a model runs: its dtype by name, its device, and the thread that builds it."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
T = TypeVar("T")


def on_short_lived_thread(build: Callable[[], T]) -> T:
    """``build()`` run on a thread of its own that ends with it; its exception is re-raised here.

    OpenMP keeps one thread team per thread that runs parallel work, and two teams in one process
    make every step slower: a model loaded on one thread and stepped on another (Ray Data's actors
    call ``__call__`` on a worker thread, the async engine steps on its own) ran its decode steps
    ~1.2x slower on 2 cores, measured here (Ray Data batch job: 1.5x against the same engine in one
    thread). Loading on a thread that ends frees its team, so the stepping thread owns the only one.
    """
    # NOTE: leaving the ``with`` joins the executor's one worker thread, which frees its team
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="foreserve-load") as loader:
        return loader.submit(build).result()


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    return dtype if isinstance(dtype, torch.dtype) else _DTYPES[dtype]


def resolve_device(device: str) -> torch.device:
    """``auto`` is the first CUDA device when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
