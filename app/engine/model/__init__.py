"""The model the engine runs: the HF runner, Llama, the sampler and the CPU fast paths (csrc/)."""
