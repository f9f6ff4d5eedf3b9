"""KV cache memory: the block pool, the allocation policies and the reservation timeline."""
