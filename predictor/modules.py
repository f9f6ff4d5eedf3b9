"""torch module helpers shared by the predictor's BERT and the engine's Llama (which imports them from here:
the engine depends on the predictor's side, never the other way round)."""

from __future__ import annotations

import torch
from torch import nn


def embedding(num_embeddings: int, embedding_dim: int, **kwargs) -> nn.Embedding:
    """``nn.Embedding``, without its random init when built on the meta device (for a checkpoint's
    tensors to be assigned).

    NOTE: on the meta device that init runs ``normal_`` through ``torch._refs``, which imports
    ``torch._dynamo`` and sympy: 0.8 s of a model's load here, for values about to be replaced."""
    if torch.get_default_device().type == "meta":
        kwargs["_weight"] = torch.empty(num_embeddings, embedding_dim)
    return nn.Embedding(num_embeddings, embedding_dim, **kwargs)
