"""The runner's linear layers on a CPU: oneDNN's prepacked weights, bfloat16 weights for few rows,
or the skinny-operand MKL path.

Activations stay float32 on a CPU whatever the weights' dtype. ``fast_linear`` picks, per module,
the fastest way to apply it; see docs/engine.md ("Linear layers on the CPU") for the measurements.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from app.engine.model.cpu_kernels import cpu_flags

# Up to this many rows, a float32 CPU linear runs as (W @ x^T)^T: MKL's sgemm handles the skinny
# operand far better that way round than as x @ W^T. Whole decode steps of SmolLM2-135M, measured
# here: 1.8x faster at batch 2-4, 1.15x at 8-32, even at 128; prefill chunks of 256+ rows lose.
SKINNY_ROWS = 128
# Up to this many rows, bfloat16 weights on a CPU without native bfloat16 go through foreserve's
# kernels (``csrc/bf16_linear.cpp`` at 1 row, ``csrc/bf16_packed.cpp`` for more: half the weight bytes
# of float32, widened in registers). All linears of SmolLM2-135M's layers, 2 threads, AMD EPYC (Zen 3,
# AVX2), against oneDNN's prepacked float32, two runs: 1.7-2.7x faster at 1-4 rows, 1.2-1.6x at 8-64,
# 1.0-1.2x at 96, 0.6-1.0x at 512 (``python -m loadtests.bench.linear_microbench``; docs/engine.md).
BF16W_ROWS = 96
# Up to this many rows, the same kernels serve on a CPU with native bfloat16 but no AMX where they
# were built without AVX512-BF16 (AVX-NE-CONVERT only): their AVX2 micro-kernel, which oneDNN's
# bfloat16 kernels outrun past 16 rows. Whole decode steps of SmolLM2-135M, 2 threads, 512 cached
# tokens, AMD EPYC (Zen 4), against oneDNN's bfloat16 kernels, two runs: 1.1-2.0x the tokens/s at
# 1-8 rows, level at 16, 0.7-1.06x at 24-64 (``runner_microbench --bf16-kernel-rows``;
# docs/benchmarks/llama-cpp.md). Built with AVX512-BF16 (``packed_rows_rounded``), their vdpbf16ps
# micro-kernel takes up to ``BF16W_ROWS``: at 300 cached tokens, 2 threads, decode steps of 24-64
# rows ran 1.2-1.3x faster than on oneDNN's kernels past 16 rows, and a step's linears at 96-512
# rows level with them (``linear_microbench``). With AMX, oneDNN's kernels take every row count
# (they ran batch 1 level with llama.cpp and batch 8 at 2.9x it).
NATIVE_BF16W_ROWS = 16

FastLinear = Callable[[torch.Tensor], torch.Tensor]


def onednn_rows(n: int) -> int:
    """The rows a oneDNN linear runs ``n`` rows at: ``n`` up to 16, else ``n`` rounded up to one of 8
    steps per doubling (less than 1/8 more rows: 17 -> 18, 33 -> 36, 100 -> 104, 300 -> 320). oneDNN and the
    allocator keep buffers per shape: at exact row counts an engine grew 340 MB over 1,300 mixed
    requests and went on growing; so padded, 105 MB, most of it in the first 200."""
    if n <= 16:
        return n
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


def onednn_row_counts(limit: int) -> list[int]:
    """Every row count ``onednn_rows`` runs 1 to ``limit`` rows at (56 for 512)."""
    return sorted({onednn_rows(n) for n in range(1, limit + 1)})


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear on a prepacked weight, ``x``'s rows padded to ``onednn_rows`` (and cut back)."""
    n = x.shape[0]
    rows = onednn_rows(n)
    if rows == n:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise(F.pad(x, (0, 0, 0, rows - n)), packed, bias, "none", [], "")[:n]


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU has bfloat16 instructions oneDNN's bfloat16 kernels use (AVX512-BF16,
    AVX-NE-CONVERT or AMX; torch asks oneDNN)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def amx() -> bool:
    """Whether this CPU has AMX's bfloat16 tiles (``amx_bf16`` among /proc/cpuinfo's flags)."""
    return "amx_bf16" in cpu_flags().split()


def bf16_kernel_rows() -> int:
    """Up to how many rows foreserve's kernels run a bfloat16 linear on this CPU (0: never):
    ``BF16W_ROWS`` without native bfloat16 or where the kernels were built with AVX512-BF16 (but no
    AMX), ``NATIVE_BF16W_ROWS`` with native bfloat16 but only AVX2 kernels, 0 with AMX."""
    if not native_bf16():
        return BF16W_ROWS
    if amx():
        return 0
    from app.engine.model.cpu_kernels import packed_rows_rounded

    return BF16W_ROWS if packed_rows_rounded() else NATIVE_BF16W_ROWS


def _pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """oneDNN's prepacked (blocked) copy of ``weight``, or None where oneDNN is missing or its
    product disagrees with ``F.linear`` (checked once, on a random input)."""
    if not torch.backends.mkldnn.is_available():
        return None
    tol = 1e-4 if weight.dtype == torch.float32 else 2e-2
    try:
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
            got = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
            ok = torch.allclose(got.float(), F.linear(x, weight, bias).float(), rtol=tol, atol=tol)
    except (AttributeError, RuntimeError):
        return None
    return packed if ok else None


def _plain_cpu_linear(module: torch.nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return type(module) is torch.nn.Linear and w is not None and w.device.type == "cpu"


def prepack(module: torch.nn.Module) -> torch.Tensor | None:
    """oneDNN's prepacked copy of a plain CPU ``nn.Linear``'s weight: float32, or bfloat16 on a CPU
    with native bfloat16 (``native_bf16``); None otherwise.

    NOTE: the blocked layout streams the weights at full memory bandwidth for any row count; MKL's
    sgemm on the plain layout does so only for 2-4 rows. All linears of SmolLM2-135M, 30 layers,
    measured here against the previous path (ms): 1 row 8.6 vs 24.5, 8 rows 11.8 vs 26.3, 12 rows 13.3 vs 43.3, 64 rows 37 vs
    87, 512 rows 215 vs 494. These ops (``torch.ops.mkldnn``) are what torch.compile's freezing pass
    emits for the same linears; torch is pinned, and a failure falls back to the plain path."""
    if not _plain_cpu_linear(module):
        return None
    w = module.weight
    if w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and native_bf16()):
        return _pack(w, module.bias)
    return None


class BF16Linear:
    """A linear with bfloat16 weights: up to ``rows`` rows, foreserve's kernel (``linear_bf16w``: the
    weights as stored for 1 row, their packed panels, ``packed``, for more); more rows, ``dense``.

    Without native bfloat16, ``dense`` is oneDNN's float32 prepacked copy of the same bfloat16-rounded
    values, so the answer does not depend on which path a step took beyond float32's summation order;
    two more copies of the weights in memory: the packed panels (as many bytes as the weights) and the
    float32 copy (twice as many). With native bfloat16, ``dense`` is oneDNN's bfloat16 kernel, whose
    rows are rounded to bfloat16 (one more copy: its prepacked weights); where the kernels were built
    with AVX512-BF16, the packed panels round the rows to bfloat16 too (``packed_rows_rounded``), and
    only one row keeps float32 products."""

    def __init__(self, op: Callable, weight: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None,
                 dense: FastLinear, rows: int) -> None:
        self.op, self.weight, self.packed, self.bias, self.dense, self.rows = op, weight, packed, bias, dense, rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.rows:
            return self.op(x, self.weight, self.bias, self.packed)
        return self.dense(x)


def fast_linear(module: torch.nn.Module, bf16_op: Callable | None = None,
                bf16_pack: Callable | None = None, bf16_rows: int | None = None) -> FastLinear | None:
    """The fastest way to apply a plain CPU ``nn.Linear`` to float32 rows, as a function of them; None
    where there is none better than ``linear``'s plain path (e.g. a TP layer, or oneDNN missing).

    - float32 weights: oneDNN's prepacked copy.
    - bfloat16 weights, given ``bf16_op`` (foreserve's kernel: the bfloat16 weights widened in
      registers, float32 products and sums) and ``bf16_rows`` above 0 (default: ``bf16_kernel_rows()``):
      a ``BF16Linear`` that runs it up to ``bf16_rows`` rows, with ``bf16_pack``'s packed panels of the
      weights (where given) for more than one row; more rows go to oneDNN's bfloat16 prepacked copy
      on a CPU with native bfloat16, else to its float32 copy of the bfloat16-rounded weights.
    - other bfloat16 weights, native bfloat16: oneDNN's bfloat16 prepacked copy (rows cast to bfloat16,
      the result back to float32)."""
    if not _plain_cpu_linear(module):
        return None
    w, bias = module.weight, module.bias
    rows = bf16_kernel_rows() if bf16_rows is None else bf16_rows
    kernel = w.dtype == torch.bfloat16 and bf16_op is not None and rows > 0
    packed = prepack(module)  # float32, or bfloat16 on a CPU with native bfloat16
    if packed is not None:
        if w.dtype == torch.float32:
            return lambda x: onednn_linear(x, packed, bias)
        dense = lambda x: onednn_linear(x.to(torch.bfloat16), packed, bias).float()  # noqa: E731
        if not kernel:
            return dense
    elif not kernel:
        return None
    bias32 = None if bias is None else bias.detach().float()
    if packed is None:
        w32 = w.detach().float()
        packed32 = _pack(w32, bias32)
        dense = (lambda x: F.linear(x, w32, bias32)) if packed32 is None else (lambda x: onednn_linear(x, packed32, bias32))
    packed_w = bf16_pack(w.detach()) if bf16_pack is not None and w.shape[1] % 2 == 0 else None  # pairs of k
    return BF16Linear(bf16_op, w.detach(), packed_w, bias32, dense, rows)


def linear(module: torch.nn.Module, x: torch.Tensor, fast: FastLinear | torch.Tensor | None = None) -> torch.Tensor:
    """``module(x)`` for a 2-D ``x``, in ``x``'s dtype: through ``fast`` (``fast_linear``'s, or a
    float32 prepacked weight) when there is one; else a plain float32 ``nn.Linear`` on CPU with few
    rows goes the fast way round; else the module's own forward, ``x`` cast to its weights' dtype."""
    if isinstance(fast, torch.Tensor):
        return onednn_linear(x, fast, module.bias)
    if fast is not None:
        return fast(x)
    w = getattr(module, "weight", None)
    if type(module) is torch.nn.Linear and x.shape[0] <= SKINNY_ROWS and x.device.type == "cpu" \
            and x.dtype == torch.float32 and w.dtype == torch.float32:
        y = torch.mm(w, x.t()).t()
        return (y + module.bias if module.bias is not None else y).contiguous()
    if w is not None and w.dtype != x.dtype:
        return module(x.to(w.dtype)).to(x.dtype)
    return module(x)


def fuse_rows(modules: list[torch.nn.Module]) -> torch.nn.Linear | None:
    """One ``nn.Linear`` whose output rows are ``modules``' outputs side by side (q, k, v; gate, up),
    so a step makes one call where it made several; None unless all are plain CPU ``nn.Linear``s
    of one input size and dtype, all with or all without a bias.

    NOTE: no second copy: the modules' weights become views of the fused weight. One call instead
    of three (q, k, v) and two (gate, up) per layer saved ~2 ms of a 26 ms batch-1 decode step of
    SmolLM2-135M here (30 layers), most of it in the small k and v projections' fixed costs."""
    if not modules or not all(_plain_cpu_linear(m) for m in modules):
        return None
    ws = [m.weight for m in modules]
    has_bias = [m.bias is not None for m in modules]
    if len({(w.shape[1], w.dtype) for w in ws}) != 1 or len(set(has_bias)) != 1:
        return None
    with torch.no_grad():
        weight = torch.cat([w.detach() for w in ws])
        bias = torch.cat([m.bias.detach() for m in modules]) if has_bias[0] else None
    with torch.device("meta"):
        fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    fused.weight = torch.nn.Parameter(weight, requires_grad=False)
    fused.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
    start = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight = torch.nn.Parameter(weight[start:start + rows], requires_grad=False)
        if bias is not None:
            m.bias = torch.nn.Parameter(bias[start:start + rows], requires_grad=False)
        start += rows
    return fused


@dataclass(frozen=True)
class LayerLinears:
    """A decoder layer's linears as its family's forward calls them: the q, k and v projections (or
    one already fused), o, the MLP's gate and up (or one fused; None: not a gated MLP) and down."""

    qkv: list[torch.nn.Module]
    o: torch.nn.Module
    gate_up: list[torch.nn.Module] | None
    down: torch.nn.Module


def _fused(modules: list[torch.nn.Module]) -> torch.nn.Module | None:
    if len(modules) == 1:  # fused in the checkpoint
        return modules[0] if _plain_cpu_linear(modules[0]) else None
    return fuse_rows(modules)


def pack_layers(layers: list[LayerLinears], lm_head: torch.nn.Module, bf16_op: Callable | None = None,
                bf16_pack: Callable | None = None) -> tuple[dict[torch.nn.Module, FastLinear],
                                                            list[torch.nn.Module | None], list[torch.nn.Module | None]]:
    """A model's linears made fast: per layer q, k, v as one linear, and gate, up as one
    (``fuse_rows``; None where they cannot be); then ``fast_linear`` of every linear a step calls.
    Returns (the fast functions by module, fused q-k-v per layer, fused gate-up per layer); a module
    missing from the first runs ``linear``'s plain path."""
    modules: list[torch.nn.Module] = []
    fused_qkv: list[torch.nn.Module | None] = []
    fused_gate_up: list[torch.nn.Module | None] = []
    for layer in layers:
        qkv = _fused(layer.qkv)
        modules += [qkv] if qkv else layer.qkv
        gate_up = _fused(layer.gate_up) if layer.gate_up else None
        modules += [gate_up] if gate_up else (layer.gate_up or [])
        modules += [layer.o, layer.down]
        fused_qkv.append(qkv)
        fused_gate_up.append(gate_up)
    modules.append(lm_head)
    fast = {m: f for m in modules if (f := fast_linear(m, bf16_op, bf16_pack)) is not None}
    return fast, fused_qkv, fused_gate_up


def warm_up(fast: dict[torch.nn.Module, FastLinear], max_rows: Callable[[torch.nn.Module], int]) -> None:
    """Runs each weight shape among ``fast``'s linears once at every row count it can meet
    (``onednn_row_counts(max_rows(module))``), so that oneDNN builds all its primitives now.

    NOTE: oneDNN builds a primitive (about 1 MB of descriptors and JIT code) for each row count a
    prepacked linear meets, and keeps it in its cache. Met while serving, an engine's memory grew
    with every new step size for as long as it ran (one process, SmolLM2-135M in bfloat16, budget
    256: 24 new primitives and 14 of its 26 MB of growth over requests 150 to 600, heaptrack); built
    here, they cost ~240 MB and 0.8 s once (online pool), and the memory stays flat (docs/chaos.md)."""
    seen: set[tuple] = set()
    with torch.inference_mode():
        for module, f in fast.items():
            w = module.weight
            key = (tuple(w.shape), w.dtype, module.bias is None, max_rows(module))
            if key in seen:
                continue
            seen.add(key)
            for rows in onednn_row_counts(key[-1]):
                f(torch.zeros(rows, w.shape[1]))
