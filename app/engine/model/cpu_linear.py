"""The runner's linear layers on a CPU: oneDNN's prepacked weights, or the skinny-operand MKL path.

See the README's "Prepacked linears on the CPU" for the measurements behind both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Up to this many rows, a float32 CPU linear runs as (W @ x^T)^T: MKL's sgemm handles the skinny
# operand far better that way round than as x @ W^T. Whole decode steps of SmolLM2-135M, measured
# here: 1.8x faster at batch 2-4, 1.15x at 8-32, even at 128; prefill chunks of 256+ rows lose.
SKINNY_ROWS = 128


def prepack(module: torch.nn.Module) -> torch.Tensor | None:
    """oneDNN's prepacked copy of a plain float32 CPU ``nn.Linear``'s weight, or None where oneDNN is
    missing or its product disagrees with ``F.linear`` (checked once, on a random input).

    NOTE: the blocked layout streams the weights at full memory bandwidth for any row count; MKL's
    sgemm on the plain layout does so only for 2-4 rows. All linears of SmolLM2-135M, 30 layers,
    measured here against the previous path (ms): 1 row 8.6 vs 24.5, 8 rows 11.8 vs 26.3, 12 rows 13.3 vs 43.3, 64 rows 37 vs
    87, 512 rows 215 vs 494. These ops (``torch.ops.mkldnn``) are what torch.compile's freezing pass
    emits for the same linears; torch is pinned, and a failure falls back to the plain path."""
    w = getattr(module, "weight", None)
    if type(module) is not torch.nn.Linear or w.device.type != "cpu" or w.dtype != torch.float32 \
            or not torch.backends.mkldnn.is_available():
        return None
    try:
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach())
            x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0))
            got = torch.ops.mkldnn._linear_pointwise(x, packed, module.bias, "none", [], "")
            ok = torch.allclose(got, F.linear(x, w, module.bias), rtol=1e-4, atol=1e-4)
    except (AttributeError, RuntimeError):
        return None
    return packed if ok else None


def linear(module: torch.nn.Module, x: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
    """``module(x)`` for a 2-D ``x``: through the prepacked weight when there is one (see ``prepack``);
    else a plain float32 ``nn.Linear`` on CPU with few rows goes the fast way round."""
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, module.bias, "none", [], "")
    if type(module) is torch.nn.Linear and x.shape[0] <= SKINNY_ROWS and x.device.type == "cpu" \
            and x.dtype == torch.float32:
        y = torch.mm(module.weight, x.t()).t()
        return (y + module.bias if module.bias is not None else y).contiguous()
    return module(x)
