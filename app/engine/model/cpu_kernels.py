"""foreserve's own CPU kernels: decode attention straight from the paged KV pool
(``csrc/paged_decode.cpp``), a linear layer with bfloat16 weights for few rows (``csrc/bf16_linear.cpp``,
and ``csrc/bf16_packed.cpp`` on the weights packed in panels), RoPE with the store of a step's K/V into the pool (``csrc/rope_store.cpp``), the residual add with
the RMSNorm after it (``csrc/rms_norm.cpp``), and SiLU(gate) * up and a whole decoder layer of a
decode step in one call (``csrc/decode_layer.cpp``).

One extension, built on first use with torch's C++ extension loader (g++ and ninja, about a minute on 2 cores), once per machine,
source and checkout: the build lands in ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``)
under ``foreserve-<cpu>`` (``-march=native``, so a build is never shared between CPUs with
different instruction sets), outside any one ``FORESERVE_HOME``, and later processes load it in
well under a second. Where it cannot be built (no compiler, another OS), ``paged_decode_op()`` and
the other ops are None, one warning says why, and the runner keeps torch's paths.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("module.cpp", "paged_decode.cpp", "bf16_linear.cpp", "bf16_packed.cpp", "rope_store.cpp",
                        "rms_norm.cpp", "decode_layer.cpp")]
# NOTE: -ffast-math lets GCC vectorize the softmax's exp (glibc's libmvec); finite math stays off, so
# the -inf/FLT_MAX logic keeps its meaning. No -fopenmp at link time: at::parallel_for resolves to
# torch's own libgomp, the one OpenMP runtime (and thread team) of the process.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"]
_lock = threading.Lock()
_loaded: dict[str, object] = {}

PagedDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
LinearBF16W = Callable[..., torch.Tensor]


@functools.cache
def cpu_flags() -> str:
    """The first line of /proc/cpuinfo that lists this CPU's instruction-set flags (``flags`` on
    x86, ``Features`` on Arm), or "" where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def cpu_tag() -> str:
    """A short name for this CPU's instruction set (the build uses ``-march=native``), Python, torch
    and this checkout's sources (torch's loader does not tell builds for two environments apart, and
    two checkouts sharing one folder would rebuild it whenever the other had built last)."""
    key = f"{cpu_flags()}|{sys.version_info[:2]}|{torch.__version__}|{SOURCES[0].parent.resolve()}"
    return f"{platform.machine()}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


def build_directory() -> Path:
    """Where the kernel is built: torch's extensions folder, one subfolder per CPU instruction set."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / f"foreserve-{cpu_tag()}"


def paged_decode_op() -> PagedDecode | None:
    """``paged_decode(q [n, H, D], k_pool, v_pool [blocks, block, KVH, D], tables [n, max_blocks],
    lens [n], scale) -> [n, H, D]`` on the CPU: float32 queries and output, float32 or bfloat16 K/V;
    None where the kernels cannot be built."""
    module = _module()
    return None if module is None else module.paged_decode


def bf16_linear_op() -> LinearBF16W | None:
    """``linear_bf16w(x [m, k] float32, w [n, k] bfloat16, bias [n] | None = None, packed = None)
    -> [m, n] float32`` on the CPU, products and sums in float32 (``packed``: ``pack_bf16w(w)``,
    which more than one row runs on); None where the kernels cannot be built."""
    module = _module()
    return None if module is None else module.linear_bf16w


def bf16_pack_op() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``pack_bf16w(w [n, k] bfloat16) -> packed`` (``csrc/bf16_packed.cpp``): the weights in panels
    of 16 output features for ``linear_bf16w``; None where the kernels cannot be built."""
    module = _module()
    return None if module is None else module.pack_bf16w


def packed_rows_rounded() -> bool:
    """Whether ``linear_bf16w`` rounds rows to bfloat16 on the packed panels (built with AVX512-BF16:
    its vdpbf16ps multiplies bfloat16 pairs, ``csrc/bf16_packed.cpp``); False where the rows stay
    float32 (AVX2) or the kernels cannot be built."""
    module = _module()
    return module is not None and bool(module.bf16_packed_rounds_rows())


def rope_store_op() -> Callable | None:
    """``rope_store(qkv, cos, sin, slots, k_pool, v_pool, heads, kv_heads) -> qk [T, H + KVH, D]``
    (``csrc/rope_store.cpp``): RoPE on the fused projection's q and k, k and v stored into one layer
    of the pool; None where the kernels cannot be built."""
    module = _module()
    return None if module is None else module.rope_store


def add_rms_norm_op() -> Callable | None:
    """``add_rms_norm(h, delta | None, weight, eps) -> x`` (``csrc/rms_norm.cpp``): ``h += delta`` in
    place, then ``weight * h / sqrt(mean(h^2) + eps)``, float32; None where the kernels cannot be built."""
    module = _module()
    return None if module is None else module.add_rms_norm


def silu_mul_op() -> Callable | None:
    """``silu_mul(gate_up [T, 2 I]) -> silu(gate) * up [T, I]`` (``csrc/decode_layer.cpp``), float32;
    None where the kernels cannot be built."""
    module = _module()
    return None if module is None else module.silu_mul


def decode_layer_op() -> Callable | None:
    """``decode_layer(h, delta, input_norm, qkv_w, o_w, post_norm, gate_up_w, down_w, eps, cos, sin,
    slots, k_pool, v_pool, tables, lens, heads, kv_heads, scale, packed=[]) -> delta`` (``csrc/decode_layer.cpp``;
    ``packed``: the four weights' ``pack_bf16w``):
    one Llama layer of a decode step, bfloat16 weights, ``h`` updated in place; None where the
    kernels cannot be built."""
    module = _module()
    return None if module is None else module.decode_layer


def _module():
    with _lock:
        if "module" not in _loaded:
            _loaded["module"] = _build()
        return _loaded["module"]


def _build():
    if platform.system() != "Linux":
        log.warning("CPU kernels: built on Linux only; using torch's paths")
        return None
    try:
        from torch.utils.cpp_extension import load

        build_dir = build_directory()
        build_dir.mkdir(parents=True, exist_ok=True)
        # NOTE: torch's own build lock is a file that a process killed mid-build leaves behind, and
        # every later load would wait on it forever. An flock dies with its process: holding it,
        # no other process builds here, so a leftover torch lock is stale and goes.
        with open(build_dir / "foreserve.lock", "w") as held, _pinned_ninja():
            fcntl.flock(held, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            return load(name="foreserve_cpu_kernels", sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS,
                        build_directory=str(build_dir), verbose=False)
    except Exception as e:  # noqa: BLE001 - a missing compiler or a failed build only costs speed
        log.warning("CPU kernels could not be built (%s: %s); using torch's paths", type(e).__name__, e)
        return None


@contextlib.contextmanager
def _pinned_ninja() -> Iterator[None]:
    """The pinned ninja of this environment (requirements.txt), found before any other on ``PATH``
    while the build runs. torch's loader runs whichever ``ninja`` comes first; two versions keep build
    logs the other reads as foreign and starts over, so a process with the venv's ``bin`` on its
    ``PATH`` and one without would each rebuild everything (minutes on 2 cores)."""
    here = Path(sys.executable).parent
    if not (here / "ninja").exists():
        yield
        return
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = f"{here}{os.pathsep}{path}"
    try:
        yield
    finally:
        os.environ["PATH"] = path
