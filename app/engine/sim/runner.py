"""SimRunner: the real scheduler and KV allocation driven by an analytic step-time model.

No tensors are touched. Each step's time is a roofline estimate after Pope et al., "Efficiently
Scaling Transformer Inference" (MLSys 2023), for one tensor-parallel rank (all ranks do the same):

    memory_s  = (weights / tp  +  KV read (every sequence's context)  +  KV written) / (HBM bw * eff)
    compute_s = (2 * matmul params * new tokens  +  2 * vocab * hidden * sampled tokens
                 +  attention FLOPs) / tp / (peak FLOP/s * MFU)
    comm_s    = 2 all-reduces per layer of (new tokens x hidden) activations, ring algorithm:
                2 (tp-1)/tp * bytes / link bw + latency each; one logits all-gather when sampling
    step_s    = max(memory_s, compute_s) + comm_s + overhead_s

Attention FLOPs: a query at position p attends to p + 1 keys; QK^T and AV cost 2 * heads * head_dim
FLOPs per (query, key) pair each, so 4 * layers * heads * head_dim * sum(p + 1). A chunk of n new
tokens starting at s sums to n * s + n (n + 1) / 2 (causal masking skips the upper triangle).

At batch 1 a decode step streams all weights once (memory-bound: llama-3-8b on an H100 ~ 15 GB /
2.85 TB/s ~ 5.3 ms); a step turns compute-bound at about peak*MFU / (bw*eff) ~ 200 new tokens on
an H100 (2 FLOPs per 2-byte weight per token), i.e. for prefill chunks or very large decode batches.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.engine.sim.profiles import (
    DEFAULT_ACTIVATION_RESERVE_BYTES,
    HardwareProfile,
    ModelProfile,
    check_tp,
    kv_budget_bytes_per_rank,
    parse_sim_spec,
)
from app.engine.outputs import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from app.engine.runner import Runner

DUMMY_TOKEN_ID = 1  # sampled for every sequence; never EOS (eos_token_id is None)


@dataclass(frozen=True, slots=True)
class StepCost:
    """One step's modelled time, broken down (seconds)."""

    memory_s: float
    compute_s: float
    comm_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return max(self.memory_s, self.compute_s) + self.comm_s + self.overhead_s

    @property
    def compute_bound(self) -> bool:
        return self.compute_s > self.memory_s


class SimRunner(Runner):
    """A cost-model runner for what-if runs on hardware this machine does not have."""

    simulated = True
    eos_token_id = None
    tokenizer = None

    def __init__(
        self,
        hardware: HardwareProfile,
        model: ModelProfile,
        tp_size: int = 1,
        *,
        activation_reserve_bytes: int = DEFAULT_ACTIVATION_RESERVE_BYTES,
    ) -> None:
        check_tp(model, tp_size)
        self.hardware = hardware
        self.model = model
        self.tp_size = tp_size
        self.activation_reserve_bytes = activation_reserve_bytes
        # Raises (clearly) now if the weights do not fit, rather than at pool sizing.
        self._kv_budget_bytes = kv_budget_bytes_per_rank(hardware, model, tp_size, activation_reserve_bytes)
        self.kv_bytes_per_token: int = model.kv_bytes_per_token_per_rank(tp_size)  # per rank

        # NOTE: everything execute() needs is folded into a handful of floats here: it runs once per
        # simulated step (tens of thousands of times per benchmark), so the hot path is plain arithmetic.
        tp = tp_size
        bw = hardware.hbm_bandwidth_bytes_per_s * hardware.memory_efficiency
        flops = hardware.peak_flops * hardware.mfu
        lm_head_params = model.vocab_size * model.hidden_size
        body_bytes = model.streamed_weight_bytes - lm_head_params * model.bytes_per_param
        self._body_weight_s = body_bytes / tp / bw
        self._lm_head_weight_s = lm_head_params * model.bytes_per_param / tp / bw
        self._kv_token_s = self.kv_bytes_per_token / bw
        self._token_flop_s = 2.0 * model.matmul_params_per_token / tp / flops
        self._sampled_flop_s = 2.0 * lm_head_params / tp / flops
        self._attn_pair_flop_s = 4.0 * model.num_layers * model.num_heads * model.head_dim / tp / flops
        if tp > 1:
            # NOTE: datasheet NVLink figures count both directions; a ring step sends and receives at once,
            # so each direction moves at half of it.
            link_bw = hardware.interconnect_bandwidth_bytes_per_s / 2
            ring = 2.0 * (tp - 1) / tp
            act_bytes = model.hidden_size * model.bytes_per_param
            self._ar_fixed_s = 2 * model.num_layers * hardware.interconnect_latency_s
            self._ar_token_s = 2 * model.num_layers * ring * act_bytes / link_bw
            # vocab-parallel LM head: gather every rank's logit shard of each sampled token
            self._gather_fixed_s = hardware.interconnect_latency_s
            self._gather_sampled_s = (tp - 1) / tp * model.vocab_size * model.bytes_per_param / link_bw
        else:
            self._ar_fixed_s = self._ar_token_s = self._gather_fixed_s = self._gather_sampled_s = 0.0
        self._overhead_s = hardware.overhead_s

    @classmethod
    def from_spec(cls, spec: str, tp_size: int = 1, **kwargs) -> "SimRunner":
        """``SimRunner.from_spec("H100-80G:llama-3-70b", tp_size=2)``."""
        hardware, model = parse_sim_spec(spec)
        return cls(hardware, model, tp_size, **kwargs)

    # -- memory ---------------------------------------------------------------------------
    def kv_budget_bytes(self) -> int:
        """KV bytes one rank can hold next to its weight shard (what free device memory would give)."""
        return self._kv_budget_bytes

    def kv_budget_tokens(self) -> int:
        return self._kv_budget_bytes // self.kv_bytes_per_token

    # -- time -----------------------------------------------------------------------------
    def step_cost(self, chunks: list[ScheduledChunk]) -> StepCost:
        """The modelled time of running ``chunks`` as one step, by component."""
        new_tokens = sampled = kv_tokens = attn_pairs = 0
        for c in chunks:
            n = len(c.token_ids)
            s = c.start_pos
            new_tokens += n
            kv_tokens += s + n + n  # read the whole context, write the new tokens
            attn_pairs += n * s + n * (n + 1) // 2
            if c.sample:
                sampled += 1
        if not new_tokens:
            return StepCost(0.0, 0.0, 0.0, self._overhead_s)
        memory_s = self._body_weight_s + kv_tokens * self._kv_token_s
        compute_s = new_tokens * self._token_flop_s + attn_pairs * self._attn_pair_flop_s
        comm_s = self._ar_fixed_s + new_tokens * self._ar_token_s
        if sampled:
            memory_s += self._lm_head_weight_s
            compute_s += sampled * self._sampled_flop_s
            comm_s += self._gather_fixed_s + sampled * self._gather_sampled_s
        return StepCost(memory_s, compute_s, comm_s, self._overhead_s)

    def step_time_s(self, chunks: list[ScheduledChunk]) -> float:
        return self.step_cost(chunks).total_s

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        chunks = scheduler_output.chunks
        sampled_ids = {c.request_id: DUMMY_TOKEN_ID for c in chunks if c.sample}
        return ModelRunnerOutput(sampled_token_ids=sampled_ids, step_s=self.step_cost(chunks).total_s)

    def shutdown(self) -> None:
        """Nothing to release."""

    def describe(self) -> dict:
        """Config-style summary for benchmark JSON."""
        return {
            "hardware": self.hardware.name,
            "model": self.model.name,
            "tp_size": self.tp_size,
            "kv_bytes_per_token_per_rank": self.kv_bytes_per_token,
            "kv_budget_bytes_per_rank": self._kv_budget_bytes,
            "kv_budget_tokens": self.kv_budget_tokens(),
        }
