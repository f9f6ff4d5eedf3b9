"""HFRunner: a causal LM of a supported architecture (``arch/``) with its KV cache in the paged pool.

The runner owns the batching (a step's chunks packed into one row set, ``step_inputs.py``), the
KV pool, the CPU fast paths (prepacked and fused linears, C++ ops) and the sampling; the model
family's decoder (``arch/*.py``) runs the forward, and ``attention.py`` the attention over the pool.
Head counts are read from the projection weights, so the same forward runs on DeepSpeed AutoTP
shards (see ``app/engine/parallel/tp.py``), whose row-parallel layers all-reduce inside their forward.
"""

from __future__ import annotations

import time

import torch

from app.config import EngineConfig
from app.engine.model.arch import arch_config, kv_bytes_per_token, load_model
from app.engine.model.arch.config import ArchConfig
from app.engine.model.arch.decoder import Kernels
from app.engine.model.attention import PagedAttention
from app.engine.model.cpu_linear import bf16_kernel_rows, pack_layers, warm_up
from app.engine.model.cpu_ops import CpuOps, cpu_ops
from app.engine.model.sampler import Sampler
from app.engine.model.setup import resolve_device, torch_dtype
from app.engine.model.step_inputs import Step, build_step
from app.engine.outputs import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from app.engine.runner import Runner


def end_tokens(arch: ArchConfig, tokenizer) -> tuple[int | None, frozenset[int]]:
    """The token a turn ends with (the tokenizer's EOS, else the config's first) and every token that
    ends a sequence (``generation_config.json``'s EOS ids: Llama 3 and Gemma have several)."""
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    ids = frozenset(arch.eos_token_ids) | ({tok_eos} if tok_eos is not None else set())
    return (tok_eos if tok_eos is not None else next(iter(arch.eos_token_ids), None)), ids


class HFRunner(Runner):
    """Runs the model in this process. ``model`` lets a caller pass an already built (e.g. sharded) one."""

    def __init__(self, config: EngineConfig, num_blocks: int, model: torch.nn.Module | None = None,
                 with_tokenizer: bool = True) -> None:
        from app.engine.text.tokenizer import load_tokenizer

        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        # NOTE: OpenMP's thread count is per calling thread: a step run from another thread (the
        # async engine's, a Ray Data actor's UDF thread) would fall back to OMP_NUM_THREADS, which
        # Ray sets to an actor's CPU count (1 for fractional CPUs): 35% fewer tokens/s, measured
        self.threads = torch.get_num_threads()
        self.config = config
        self.dtype = torch_dtype(config.weights_dtype)
        self.block_size = config.block_size_tokens
        self.num_blocks = num_blocks
        family, self.arch = arch_config(config.model_path)  # refuses an unsupported model before it loads
        if model is None:
            self.device = resolve_device(config.device)
            model = load_model(config.model_path, config.model_impl, self.dtype, self.device, (family, self.arch))
        else:  # an already placed (e.g. sharded) model
            self.device = next(model.parameters()).device
        self.model = model.eval().requires_grad_(False)
        # NOTE: float32 activations on a CPU (bfloat16 weights are widened as they are read); the
        # weights' dtype elsewhere
        self.act_dtype = torch.float32 if self.device.type == "cpu" and self.dtype == torch.bfloat16 else self.dtype
        if self.act_dtype != self.dtype:
            for module in self.model.modules():  # norms: a few KB, read every layer in float32
                if "Norm" in type(module).__name__ and getattr(module, "weight", None) is not None:
                    module.to(self.act_dtype)
        self.tokenizer = load_tokenizer(config.model_path, config.chat_template) if with_tokenizer else None
        self.eos_token_id, self.eos_token_ids = end_tokens(self.arch, self.tokenizer)
        self.decoder = family.DECODER(self.model, self.arch)
        self.vocab_size = self.arch.vocab_size
        self._set_up_kernels(config, num_blocks)
        self.sampler = Sampler(config.seed)

    def _set_up_kernels(self, config: EngineConfig, num_blocks: int) -> None:
        """The KV pool, the fast linears (prepacked, q-k-v and gate-up fused) and the C++ ops."""
        d = self.decoder
        groups = d.linear_groups()
        packed: dict = {}
        fused_qkv: list = [None] * len(groups)
        fused_gate_up: list = [None] * len(groups)
        bf16_op = bf16_pack = None
        bf16w_rows = bf16_kernel_rows() if self.dtype == torch.bfloat16 and self.device.type == "cpu" else 0
        if config.cpu_prepacked_linears:
            if bf16w_rows:
                from app.engine.model.cpu_kernels import bf16_linear_op, bf16_pack_op

                bf16_op, bf16_pack = bf16_linear_op(), bf16_pack_op()
            packed, fused_qkv, fused_gate_up = pack_layers(groups, d.lm_head, bf16_op, bf16_pack)
            steps, sampled = config.max_num_batched_tokens, min(config.max_num_batched_tokens, config.max_num_seqs)
            warm_up(packed, lambda m: sampled if m is d.lm_head else steps)
        self.packed, self.fused_qkv, self.fused_gate_up = packed, fused_qkv, fused_gate_up
        self.layers, self.lm_head = d.layers, d.lm_head
        self.num_heads, self.num_kv_heads, self.head_dim = d.num_heads, d.num_kv_heads, d.head_dim
        shape = (len(groups), num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_dtype = torch_dtype(config.cache_dtype)
        self.k_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.ops = CpuOps()
        rms = d.rms_params()
        if config.cpu_paged_attention and self.device.type == "cpu" and self.act_dtype == torch.float32 \
                and self.kv_dtype in (torch.float32, torch.bfloat16):
            silu = all(type(d.activation(i)) is torch.nn.SiLU for i in range(len(d.layers)))
            self.ops = cpu_ops(fused_qkv, fused_gate_up, silu, bf16w_rows if bf16_op is not None else 0,
                               lambda: d.fused_layer_weights(fused_qkv, fused_gate_up, rms), groups, packed)
        attention = PagedAttention(self.k_cache, self.v_cache, self.num_heads, self.ops.paged_decode)
        d.bind(Kernels(attention, self.ops, packed, fused_qkv, fused_gate_up, self.act_dtype, rms))

    @staticmethod
    def kv_bytes_per_token(arch, dtype: str | torch.dtype) -> int:
        """K + V bytes one token takes over all layers (whole model, all ranks together)."""
        return kv_bytes_per_token(arch, torch_dtype(dtype))

    # -- step --------------------------------------------------------------------------------
    def execute(self, scheduler_output: SchedulerOutput, sample: bool = True) -> ModelRunnerOutput:
        """Run one step. ``sample=False`` (TP ranks other than 0) runs the forward only."""
        t0 = time.perf_counter()
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        self.sampler.drop(scheduler_output.finished_request_ids)
        sampled: dict[str, int] = {}
        if scheduler_output.chunks:
            with torch.inference_mode():
                # NOTE: the step's small index tensors are made on the runner's device. Only here: a
                # device context sends every torch call through a Python mode (microseconds each,
                # ~750 calls in a forward), so the forward and the sampler name devices themselves.
                with torch.device(self.device):
                    step = self._prepare(scheduler_output.chunks)
                logits = self.decoder.forward(step)
                if sample and step.sample_chunks:
                    cs = step.sample_chunks
                    tokens = self.sampler.sample(logits, [c.request_id for c in cs], [c.sampling for c in cs],
                                                 [c.num_output_tokens for c in cs])
                    sampled = {c.request_id: t for c, t in zip(cs, tokens)}
        return ModelRunnerOutput(sampled_token_ids=sampled, step_s=time.perf_counter() - t0)

    def _prepare(self, chunks: list[ScheduledChunk]) -> Step:
        # a step the fused layers take runs its prompt chunks as decode rows (``build_step``)
        return build_step(chunks, self.block_size, self.decoder.ropes, self.act_dtype,
                          paged=self.ops.paged_decode is not None,
                          paged_rows=self.ops.fused_rows if self.ops.decode_layer is not None else 0,
                          windows=self.decoder.windows, rope_dtype=self.kv_dtype)

    def shutdown(self) -> None:
        """Nothing to release in-process; kept for the Runner contract."""
