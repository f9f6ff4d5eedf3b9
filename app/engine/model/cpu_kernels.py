"""foreserve's own CPU kernel: decode attention straight from the paged KV pool (``csrc/paged_decode.cpp``).

Built on first use with torch's C++ extension loader (g++ and ninja, ~25 s here), once per machine
and source: the build lands in ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``)
under ``foreserve-<cpu>`` (``-march=native``, so a build is never shared between CPUs with
different instruction sets), outside any one ``FORESERVE_HOME``, and later processes load it in
well under a second. Where it cannot be built (no compiler, another OS), ``paged_decode_op()`` is None,
one warning says why, and the runner keeps its gather + SDPA path.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
# NOTE: -ffast-math lets GCC vectorize the softmax's exp (glibc's libmvec); finite math stays off, so
# the -inf/FLT_MAX logic keeps its meaning. No -fopenmp at link time: at::parallel_for resolves to
# torch's own libgomp, the one OpenMP runtime (and thread team) of the process.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"]
_lock = threading.Lock()
_loaded: dict[str, object] = {}

PagedDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def cpu_tag() -> str:
    """A short name for this CPU's instruction set (the build uses ``-march=native``), Python and
    torch (torch's loader does not tell builds for two environments apart)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    key = f"{flags}|{sys.version_info[:2]}|{torch.__version__}"
    return f"{platform.machine()}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


def build_directory() -> Path:
    """Where the kernel is built: torch's extensions folder, one subfolder per CPU instruction set."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / f"foreserve-{cpu_tag()}"


def paged_decode_op() -> PagedDecode | None:
    """``paged_decode(q [n, H, D], k_pool, v_pool [blocks, block, KVH, D], tables [n, max_blocks],
    lens [n], scale) -> [n, H, D]`` on the CPU: float32 queries and output, float32 or bfloat16 K/V;
    None where the kernel cannot be built."""
    with _lock:
        if "op" not in _loaded:
            _loaded["op"] = _build()
        return _loaded["op"]  # type: ignore[return-value]


def _build() -> PagedDecode | None:
    if platform.system() != "Linux":
        log.warning("paged decode kernel: built on Linux only; using gather + SDPA")
        return None
    try:
        from torch.utils.cpp_extension import load

        build_dir = build_directory()
        build_dir.mkdir(parents=True, exist_ok=True)
        # NOTE: torch's own build lock is a file that a process killed mid-build leaves behind, and
        # every later load would wait on it forever. An flock dies with its process: holding it,
        # no other process builds here, so a leftover torch lock is stale and goes.
        with open(build_dir / "foreserve.lock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            module = load(name="foreserve_paged_decode", sources=[str(SOURCE)], extra_cflags=CFLAGS,
                          build_directory=str(build_dir), verbose=False)
    except Exception as e:  # noqa: BLE001 - a missing compiler or a failed build only costs speed
        log.warning("paged decode kernel could not be built (%s: %s); using gather + SDPA", type(e).__name__, e)
        return None
    return module.paged_decode
