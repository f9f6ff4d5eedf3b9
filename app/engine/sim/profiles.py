"""Hardware and model profiles for the simulated runner (``--sim HARDWARE:MODEL``).

Figures are public datasheet numbers (SXM parts, dense bf16 without sparsity). The memory helpers
answer the question a real GPU runner answers from free device memory: how many KV bytes fit on
one tensor-parallel rank next to its shard of the weights.

Calibration (see ``kv_budget_bytes_per_rank``): HBM capacities are binary (an "80 GB" HBM part is
5 stacks x 16 GiB = 80 GiB = 85.9e9 bytes; nvidia-smi shows ~81,559 MiB), 95% of it is usable (the
rest goes to the CUDA context, NCCL buffers and allocator fragmentation), and 1 GiB per rank is
kept for activations. llama-3-70b (141.1 GB of bf16 weights) with tp=2 on an H100-80G then leaves
81.6 - 70.55 - 1.07 = ~10.0 GB of KV room per GPU, the "about 10 GB" the sizing issue states.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

GiB = 1 << 30
DEFAULT_ACTIVATION_RESERVE_BYTES = GiB  # per rank; logits + MLP intermediates of a 512-token step fit easily


class HardwareProfile(BaseModel):
    """One accelerator (one TP rank) as the roofline model sees it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Registry key, e.g. 'H100-80G'.")
    hbm_bytes: int = Field(gt=0, description="Device memory capacity in bytes (HBM is sized in GiB).")
    hbm_bandwidth_bytes_per_s: float = Field(gt=0, description="Peak HBM bandwidth (datasheet).")
    peak_flops: float = Field(gt=0, description="Dense bf16 tensor-core peak, FLOP/s (no sparsity).")
    interconnect_bandwidth_bytes_per_s: float = Field(
        gt=0, description="NVLink bandwidth per GPU as on the datasheet (both directions together)."
    )
    interconnect_latency_s: float = Field(ge=0, description="Fixed latency of one small all-reduce.")
    usable_memory_fraction: float = Field(
        0.95, gt=0, le=1, description="Share of HBM the engine may use (rest: CUDA context, NCCL, fragmentation)."
    )
    memory_efficiency: float = Field(
        0.85, gt=0, le=1, description="Achieved share of peak HBM bandwidth when streaming weights/KV."
    )
    mfu: float = Field(0.6, gt=0, le=1, description="Achieved share of peak FLOP/s in compute-bound (prefill) steps.")
    overhead_s: float = Field(3e-4, ge=0, description="Fixed cost per step: kernel launches, sampling, host sync.")

    @property
    def usable_hbm_bytes(self) -> int:
        return int(self.hbm_bytes * self.usable_memory_fraction)


class ModelProfile(BaseModel):
    """A Llama-family decoder (GQA attention, gated MLP, no biases) by its shape."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Registry key, e.g. 'llama-3-70b'.")
    num_layers: int = Field(gt=0, description="Decoder layers.")
    hidden_size: int = Field(gt=0, description="Model (embedding) width.")
    num_heads: int = Field(gt=0, description="Query heads.")
    num_kv_heads: int = Field(gt=0, description="Key/value heads (GQA groups).")
    head_dim: int = Field(gt=0, description="Width of one attention head.")
    intermediate_size: int = Field(gt=0, description="Gated-MLP inner width.")
    vocab_size: int = Field(gt=0, description="Vocabulary (embedding and LM-head rows).")
    tie_word_embeddings: bool = Field(False, description="LM head shares the input embedding table.")
    bytes_per_param: int = Field(2, gt=0, description="Bytes per weight and per KV element (2 for bf16).")
    num_params: int = Field(0, ge=0, description="Total parameters; 0 means computed from the shape.")

    @model_validator(mode="after")
    def _check(self) -> "ModelProfile":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads ({self.num_heads}) must be a multiple of num_kv_heads")
        if self.num_params == 0:
            # NOTE: frozen model; filling a derived default in the validator is the pydantic-sanctioned way.
            total = self.embedding_params + self.lm_head_params + self.layer_params * self.num_layers + self.hidden_size
            object.__setattr__(self, "num_params", total)  # + final norm
        return self

    # -- parameter counts -------------------------------------------------------------------
    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def layer_params(self) -> int:
        """One decoder layer: q, k, v, o projections, gate/up/down MLP and two RMSNorms."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        return attn + 3 * h * self.intermediate_size + 2 * h

    @property
    def matmul_params_per_token(self) -> int:
        """Weights every token multiplies through (all layers; not the embedding lookup or LM head)."""
        return self.layer_params * self.num_layers

    # -- bytes ------------------------------------------------------------------------------
    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.bytes_per_param

    @property
    def streamed_weight_bytes(self) -> int:
        """Weight bytes read from HBM every step: all but an untied input-embedding table (a lookup)."""
        untied_embedding = 0 if self.tie_word_embeddings else self.embedding_params
        return (self.num_params - untied_embedding) * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, whole model (all KV heads)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_param

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one TP rank holds: split evenly, or replicated when tp exceeds them (as vLLM does)."""
        check_tp(self, tp)
        return max(1, self.num_kv_heads // tp)

    def kv_bytes_per_token_per_rank(self, tp: int) -> int:
        return 2 * self.num_layers * self.kv_heads_per_rank(tp) * self.head_dim * self.bytes_per_param

    @classmethod
    def from_hf_config(cls, name: str, cfg, bytes_per_param: int = 2) -> "ModelProfile":
        """Profile of a Hugging Face Llama-family config (``AutoConfig``), e.g. to simulate the local model."""
        heads = cfg.num_attention_heads
        return cls(
            name=name,
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            bytes_per_param=bytes_per_param,
        )


def check_tp(model: ModelProfile, tp: int) -> None:
    """Raise ValueError unless ``tp`` ranks can shard this model's heads evenly."""
    if tp < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {tp}")
    if model.num_heads % tp:
        raise ValueError(f"{model.name}: {model.num_heads} attention heads cannot be split over tp={tp}")
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        raise ValueError(f"{model.name}: {model.num_kv_heads} KV heads cannot be split or replicated over tp={tp}")


def kv_budget_bytes_per_rank(
    hardware: HardwareProfile,
    model: ModelProfile,
    tp: int,
    activation_reserve_bytes: int = DEFAULT_ACTIVATION_RESERVE_BYTES,
) -> int:
    """KV-cache bytes one rank can hold: usable HBM - weights / tp - activation reserve.

    Raises ValueError when the weights (plus the reserve) do not fit, e.g. llama-3-70b on one 80 GB GPU.
    """
    check_tp(model, tp)
    usable = hardware.usable_hbm_bytes
    weights = model.weight_bytes // tp
    budget = usable - weights - activation_reserve_bytes
    if budget <= 0:
        fitting = (t for t in (2, 4, 8, 16) if t > tp and _fits(hardware, model, t, activation_reserve_bytes))
        min_tp = next(fitting, None)
        hint = f"; try tensor-parallel size {min_tp}" if min_tp else ""
        raise ValueError(
            f"{model.name} does not fit on {hardware.name} with tp={tp}: weights need "
            f"{weights / 1e9:.1f} GB per GPU + {activation_reserve_bytes / 1e9:.1f} GB activation reserve, "
            f"but only {usable / 1e9:.1f} GB of {hardware.hbm_bytes / 1e9:.1f} GB is usable{hint}"
        )
    return budget


def _fits(hardware: HardwareProfile, model: ModelProfile, tp: int, reserve: int) -> bool:
    try:
        check_tp(model, tp)
    except ValueError:
        return False
    return hardware.usable_hbm_bytes - model.weight_bytes // tp - reserve > 0


HARDWARE: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        # NOTE: NVLink figures are the datasheet's bidirectional totals; the all-reduce model uses half.
        HardwareProfile(
            name="A100-80G", hbm_bytes=80 * GiB, hbm_bandwidth_bytes_per_s=2.039e12, peak_flops=312e12,
            interconnect_bandwidth_bytes_per_s=600e9, interconnect_latency_s=8e-6,
        ),
        HardwareProfile(
            name="H100-80G", hbm_bytes=80 * GiB, hbm_bandwidth_bytes_per_s=3.35e12, peak_flops=989e12,
            interconnect_bandwidth_bytes_per_s=900e9, interconnect_latency_s=6e-6,
        ),
        HardwareProfile(
            name="H200", hbm_bytes=141 * GiB, hbm_bandwidth_bytes_per_s=4.8e12, peak_flops=989e12,
            interconnect_bandwidth_bytes_per_s=900e9, interconnect_latency_s=6e-6,
        ),
    )
}

MODELS: dict[str, ModelProfile] = {
    p.name: p
    for p in (
        ModelProfile(
            name="llama-3-8b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
            intermediate_size=14336, vocab_size=128256,
        ),
        ModelProfile(
            name="llama-3-70b", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, head_dim=128,
            intermediate_size=28672, vocab_size=128256,
        ),
        ModelProfile(
            name="smollm2-135m", num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
            intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
        ),
    )
}


def parse_sim_spec(spec: str) -> tuple[HardwareProfile, ModelProfile]:
    """``"H100-80G:llama-3-70b"`` -> (hardware, model); ValueError naming the valid choices otherwise."""
    hw_name, sep, model_name = spec.strip().partition(":")
    if not sep or not hw_name or not model_name:
        raise ValueError(
            f"--sim expects HARDWARE:MODEL (e.g. H100-80G:llama-3-70b), got {spec!r}; "
            f"hardware: {', '.join(HARDWARE)}; models: {', '.join(MODELS)}"
        )
    if hw_name not in HARDWARE:
        raise ValueError(f"unknown hardware {hw_name!r} in --sim {spec!r}; choose one of: {', '.join(HARDWARE)}")
    if model_name not in MODELS:
        raise ValueError(f"unknown model {model_name!r} in --sim {spec!r}; choose one of: {', '.join(MODELS)}")
    return HARDWARE[hw_name], MODELS[model_name]
