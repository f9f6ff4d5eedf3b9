"""Tensor parallelism: DeepSpeed TP ranks and the Ray actors that host them."""
