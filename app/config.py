"""Pydantic settings for the engine pools, the predictor and the Serve app. Every field says what it is.

serve_config.yaml is a Ray Serve config file (``serve run serve_config.yaml`` works); foreserve's own
settings are the ``args`` of its application, validated here as ``AppConfig``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from predictor.config import RetrainPolicy


# The schedulers' registry keys (app/engine/scheduler/__init__.py checks that its registry matches):
# named here so that validating a config does not import the schedulers, which import the config.
SCHEDULER_NAMES = ("fcfs", "offline", "online")


class EngineConfig(BaseModel):
    """One engine replica: model, KV pool, allocation policy, scheduler and SLOs."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("", description="The model this pool serves: a local HF folder (config, safetensors, tokenizer), a GGUF file (converted once into the data dir) or a packaged model's short name (SmolLM2-135M-Instruct, gemma-3-270m). Empty: the app's model (args.model), else the embedded SmolLM2-135M-Instruct.")
    served_model_name: str = Field("", description="The model id clients name (/v1/models). Empty: the app's, else the model's short name or folder name.")
    chat_template: str = Field("", description="A Jinja chat template (the text, or a file's path) for /v1/chat/completions, in place of the tokenizer's own; a model without one (a base model) needs it for chats. Empty: the app's, else the tokenizer's.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="Weights dtype (and the KV cache's, with kv_cache_dtype auto). auto: bfloat16 on a CUDA device or a CPU with native bfloat16 (AVX512-BF16, AVX-NE-CONVERT or AMX), float32 elsewhere. On a CPU, activations stay float32: bfloat16 weights halve the bytes a decode step streams (foreserve's kernels for few rows: up to 96 without native bfloat16, up to 16 with AVX512-BF16 but no AMX; oneDNN's kernels for more rows, and for all with AMX).")
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="KV cache dtype; auto: the weights' dtype. bfloat16 under float32 weights halves the KV bytes per token (attention reads half as much, so large batches step faster on a CPU) for a little precision, like vLLM's kv_cache_dtype.")
    cpu_prepacked_linears: bool = Field(True, description="float32 on a CPU: multiply by oneDNN's prepacked (blocked) copies of the linear weights, as torch.compile's freezing and vLLM's CPU backend do: 1.2-1.9x faster decode steps and 2.3x faster prefill linears here, for one more copy of the linear weights in memory.")
    cpu_paged_attention: bool = Field(True, description="On a CPU (float32 or bfloat16 KV): decode attention reads K/V straight from the paged pool (foreserve's C++ kernels, built on first use, 93 s here; they also do RoPE with the K/V store and the residual add with RMSNorm) instead of gathering each sequence's blocks and calling SDPA: 2-3x faster decode attention at long contexts here. Falls back to gather + SDPA where it cannot be built.")
    model_impl: Literal["auto", "foreserve", "transformers"] = Field("auto", description="Whose modules hold the weights: foreserve's plain-torch modules of the model's family (app/engine/model/arch/: loaded straight from safetensors, so an engine starts sooner), transformers' AutoModelForCausalLM, or auto: foreserve's wherever the folder has safetensors weights, else transformers'. Like vLLM's model_impl; the forward is the family's own either way, and an architecture foreserve has no family for is refused.")
    device: str = Field("auto", description="auto (cuda when available, else cpu), cpu, cuda or cuda:N: where the runner keeps weights and the KV pool.")
    max_model_len_tokens: int = Field(2048, ge=16, description="Longest prompt + output a sequence may reach.")
    default_max_tokens: int = Field(1024, ge=1, description="max_tokens when a request gives none; also the bucket range.")
    kv_cache_tokens: int | None = Field(8192, ge=1, description="KV pool size in tokens (per replica).")
    kv_cache_bytes: int | None = Field(None, ge=1, description="KV pool size in bytes; overrides kv_cache_tokens.")
    block_size_tokens: int = Field(16, ge=1, le=1024, description="Tokens per KV block.")
    max_num_seqs: int = Field(128, ge=1, description="Most sequences running at once.")
    max_num_batched_tokens: int = Field(512, ge=1, description="Per-step token budget (chunked prefill).")
    allocation: str = Field("reserve_predicted", description="reserve_max | paged | reserve_predicted | oracle.")
    scheduler: str = Field("online", description="fcfs | offline | online.")
    max_overtakes: int = Field(256, ge=0, description="Offline packing: after this many admissions passes that admitted smaller requests past it, a request that does not fit makes the queue wait for it (no starvation).")
    ttft_slo_ms: float = Field(2000.0, gt=0, description="Online time-to-first-token objective.")
    tpot_slo_ms: float = Field(250.0, gt=0, description="Online time-per-output-token objective.")
    tpot_target_ms: float | None = Field(None, gt=0, description="Online: the step time the scheduler sizes each step for (decode rows plus the prefill chunk, read off the measured step-time model), at most tpot_slo_ms. Lower gives a lower TPOT for a smaller batch and fewer tokens/s. None: the throughput knee, capped by tpot_slowdown.")
    tpot_slowdown: float | None = Field(3.5, ge=1, description="Online, without tpot_target_ms: a step (decode rows plus the prefill chunk) takes at most this many times the measured one-token step, the TPOT an answer gets alone, besides stopping at the throughput knee. With a step time a + b * tokens, k one-token steps run at 1 - 1/k of the most tokens/s the per-token cost b allows (0.71 at 3.5) on any machine; where tokens/s keeps rising with the batch (a CPU) the knee alone lets steps grow near tpot_slo_ms (docs/engine.md). None: the knee alone.")
    knee_throughput_fraction: float = Field(0.9, gt=0, le=1, description="Online, without tpot_target_ms: steps carry at most the fewest tokens that still run at this fraction of the best tokens/s measured within tpot_slo_ms, the throughput knee (where a GPU's step time stays flat, TPOT stays far below the objective), and at most tpot_slowdown one-token steps; 1: no knee, steps fill up to the objective or the slowdown.")
    aging_tokens_per_s: float | None = Field(None, ge=0, description="Online SRF aging: predicted tokens forgiven per second waited; default (None): aging_tokens_per_step per measured engine step.")
    aging_tokens_per_step: float = Field(0.25, ge=0, description="Online SRF aging when aging_tokens_per_s is None: predicted tokens forgiven per engine step waited. 1 is the pace a running request would have kept (a request waits about its own run time behind shorter work); 0.25 lets it wait about 4x that, which keeps shortest-first order under overload: 1.06-1.38x lower mean E2E and 1.17-3.24x goodput vs FCFS in the simulator at 1.5-6 req/s, against 1.06-1.28x and 1.17-1.82x at 1 (plan scheduler-ab, calibrated CPU, bucket noise 1).")
    num_buckets: int = Field(10, ge=1, description="Output-length buckets of the predictor.")
    bound_quantile: float | None = Field(0.7, gt=0, le=1, description="What this pool reserves for a predicted request: the upper edge of the bucket where the predicted length distribution reaches this quantile (re-read from the predictor's probabilities). Lower fits more sequences and preempts more: 0.7 gave 1.13x the tokens/s of 0.8 on the throughput benchmark here (README); the online pool keeps 0.8 for fewer preemptions. None: the bound the predictor sends (its version's quantile).")
    tensor_parallel_size: int = Field(1, ge=1, description="Ranks sharding one replica (DeepSpeed AutoTP).")
    tp_workers: Literal["auto", "processes", "ray"] = Field("auto", description="TP ranks as Ray actors in the replica's placement group (ray), as child processes (processes), or ray whenever Ray is initialized (auto).")
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads per rank; default: torch's (OMP_NUM_THREADS: a Ray actor's CPUs, else the cores; TP ranks: cores / TP).")
    seed: int = Field(0, description="Seed for requests that give none (sampling stays per request).")
    max_queue_delay_ms: float | None = Field(None, gt=0, description="Load shedding: a request is refused (429 with Retry-After at the ingress) only when the wait that others cause would push its first token past this and it would have met it otherwise (a prompt whose own prefill alone takes longer: only when the wait others cause is itself past this), by an estimate that plays the coming steps forward at the measured step times (app/engine/ttft.py); a request admitted but not started is refused by the same rule once its wait leaves its own prompt no time. A request with nothing ahead of it is never refused. serve_config.yaml sets it to the TTFT objective. Nothing is shed before the replica's warm-up steps, and an answer resumed from a lost replica is always taken (docs/serving.md). None: only the deployment's queue limits refuse.")
    stall_timeout_s: float = Field(20.0, gt=0, description="A replica's health check fails when its engine loop has had requests but finished no step for this long (a hung forward, a deadlock): Serve replaces it. Ten times this before the first step (kernels compiled on first use).")
    step_trace_dir: str | None = Field(None, description="Write one JSONL line per engine step into this folder (the CLI and the deployments fill it from FORESERVE_STEP_TRACE).")
    fault_dir: str | None = Field(None, description="Chaos testing only (foreserve chaos sets it): a file named forward_error in this folder makes the engine's next step raise, as a kernel or device fault would, and is removed. None: off.")

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        from app.engine.kv.allocation import POLICIES

        if self.allocation not in POLICIES:
            raise ValueError(f"unknown allocation policy {self.allocation!r}; choose one of {sorted(POLICIES)}")
        if self.scheduler not in SCHEDULER_NAMES:
            raise ValueError(f"unknown scheduler {self.scheduler!r}; choose one of {sorted(SCHEDULER_NAMES)}")
        if self.kv_cache_tokens is None and self.kv_cache_bytes is None:
            raise ValueError("set kv_cache_tokens or kv_cache_bytes")
        if self.default_max_tokens >= self.max_model_len_tokens:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) must be below max_model_len_tokens ({self.max_model_len_tokens})"
            )
        return self

    def use_ray_tp_workers(self) -> bool:
        if self.tp_workers != "auto":
            return self.tp_workers == "ray"
        try:
            import ray
        except ImportError:
            return False
        return ray.is_initialized()

    @property
    def weights_dtype(self) -> str:
        """The weights' dtype, ``auto`` resolved (see ``dtype``)."""
        if self.dtype != "auto":
            return self.dtype
        import torch

        from app.engine.model.cpu_linear import native_bf16

        cuda = self.device.startswith("cuda") or (self.device == "auto" and torch.cuda.is_available())
        return "bfloat16" if cuda or native_bf16() else "float32"

    @property
    def cache_dtype(self) -> str:
        """The KV cache's dtype, ``auto`` resolved."""
        return self.weights_dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    @property
    def model_path(self) -> Path:
        from app.prepare.model import model_folder

        return model_folder(self.model)

    @property
    def model_id(self) -> str:
        """The id clients name: ``served_model_name``, else the model's own name."""
        from app.prepare.model import model_name

        return self.served_model_name or model_name(self.model)

    def kv_pool_blocks(self, kv_bytes_per_token: int) -> int:
        """Blocks in the pool, from bytes (if given) or tokens."""
        if self.kv_cache_bytes is not None:
            tokens = self.kv_cache_bytes // max(kv_bytes_per_token, 1)
        else:
            tokens = self.kv_cache_tokens or 0
        blocks = tokens // self.block_size_tokens
        if blocks < 1:
            raise ValueError(f"KV budget of {tokens} tokens is smaller than one block ({self.block_size_tokens})")
        return blocks

    def reservation_bound(self, probs: list[float] | None, bound_tokens: int, range_tokens: int | None = None) -> int:
        """The bound this pool reserves for a prediction: ``bound_quantile`` of the predicted
        distribution (``probs`` over equal buckets covering ``range_tokens``, default
        ``default_max_tokens``) when there is one, else the predictor's own bound (and always a
        max-reservation fallback's)."""
        from predictor.base import NO_BOUND
        from predictor.buckets import LengthBuckets

        q = self.bound_quantile
        if q is None or not probs or bound_tokens >= NO_BOUND:
            return bound_tokens
        buckets = LengthBuckets(max_tokens=range_tokens or self.default_max_tokens, num_buckets=len(probs))
        return buckets.quantile_bound_tokens(probs, q)

    def sequence_limit_tokens(self) -> int:
        """The longest prompt + output one sequence may reach: max_model_len, or the KV pool's size
        where that is smaller (the engine refuses any request past it). The front ends default
        max_tokens within it, so a request that gives none is never refused for a max_tokens it did
        not send."""
        per_token = 1
        if self.kv_cache_bytes is not None:
            from app.engine.model.arch import arch_config, kv_bytes_per_token

            per_token = kv_bytes_per_token(arch_config(self.model_path)[1], self.cache_dtype)
        return min(self.max_model_len_tokens, self.kv_pool_blocks(per_token) * self.block_size_tokens)


DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent.parent / "serve_config.yaml"


INHERITED = ("model", "served_model_name", "chat_template")  # the app's settings a pool takes unless it sets its own


def load_pool_config(pool: str = "online", path: str | Path | None = None, **overrides) -> EngineConfig:
    """The EngineConfig of one pool (``online`` or ``offline``) from serve_config.yaml, with the
    app's ``model`` and ``served_model_name`` where the pool names none."""
    path = Path(path) if path else DEFAULT_CONFIG_PATH
    args = app_args(path)
    pools = args.get("pools") or {}
    if pool not in pools:
        raise ValueError(f"{path}: no pool {pool!r}; pools defined: {sorted(pools)}")
    inherited = {key: args[key] for key in INHERITED if args.get(key)}
    return EngineConfig(**{**inherited, **(pools[pool] or {}), **overrides})


class PredictorConfig(BaseModel):
    """The length predictor that serves, and its retraining loop (``predictor:`` in serve_config.yaml)."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field("champion", description="champion (the MLflow alias), a registry version, a model directory, or max.")
    bound_quantile: float | None = Field(None, gt=0, le=1, description="The predictor's own bound: this quantile of the predicted length distribution (empty: the version's own, 0.8). Feedback records keep it; a pool reserves at its own bound_quantile, or at this one where that is null.")
    timeout_ms: float = Field(500, gt=0, description="A prediction slower than this is abandoned: the request reserves for max_tokens (counted).")
    poll_s: float = Field(30, gt=0, description="How often serving checks the registry for a newly promoted champion.")
    retrain: RetrainPolicy = Field(default_factory=RetrainPolicy, description="When and how feedback retrains the predictor.")
    retrain_enabled: bool = Field(True, description="Run the retraining trigger while serving.")


def load_predictor_config(path: str | Path | None = None) -> PredictorConfig:
    """The ``predictor:`` section of serve_config.yaml (defaults when absent)."""
    path = Path(path) if path else DEFAULT_CONFIG_PATH
    return PredictorConfig(**(app_args(path).get("predictor") or {}))


class IngressConfig(BaseModel):
    """The HTTP front door (``ingress:`` in the app's args)."""

    model_config = ConfigDict(extra="forbid")

    api_keys: list[str] = Field(default_factory=list, description="Accepted bearer keys, readable in the Serve config; `foreserve serve` hands FORESERVE_API_KEYS to the replicas as SHA-256 digests instead. None of either: no auth.")
    max_body_bytes: int = Field(1_048_576, ge=1024, description="Larger request bodies get 413.")
    max_header_bytes: int = Field(65_536, ge=1024, description="Requests whose header names and values add up to more get 431.")
    max_file_bytes: int = Field(200 * 1_048_576, ge=1024, description="Larger batch input uploads (POST /v1/files) get 413.")
    retry_after_s: int = Field(2, ge=1, description="Retry-After sent with 429 when a pool is at its queue limit.")
    drain_timeout_s: float = Field(60.0, ge=0, description="On SIGTERM or Ctrl-C, `foreserve serve` first drains: new requests get 503 with Retry-After, and the open ones get this long to finish before the service stops (a second Ctrl-C stops at once).")
    flex_max_wait_s: float = Field(600.0, ge=0, description="A flex request waits at the ingress at most this long while the autoscaler has the offline pool at zero (it yielded to online); then it goes anyway and Serve starts the pool.")
    flex_max_held: int = Field(256, ge=1, description="At most this many flex requests wait at each ingress replica while the offline pool is at zero (the app's bound is this times the ingress replicas); more get 429 with Retry-After. Each held call takes one of the ingress's 1,024 concurrent slots, so this keeps most of them for online traffic.")


class AppConfig(BaseModel):
    """The ``args`` of the foreserve Serve application (``deployments/builder.py: build_app``)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("", description="The model both pools serve unless a pool names its own (pools.<pool>.model): a local HF folder, a GGUF file or a packaged model's short name (SmolLM2-135M-Instruct, gemma-3-270m), as `foreserve serve --model` sets it. Empty: the embedded SmolLM2-135M-Instruct.")
    served_model_name: str = Field("", description="The model id clients name (/v1/models) for both pools. Empty: the model's short name or folder name.")
    chat_template: str = Field("", description="A Jinja chat template (the text, or a file's path) for /v1/chat/completions on both pools, in place of the tokenizer's own, as vLLM's --chat-template; a base model (no template of its own) needs one for chats and otherwise serves /v1/completions only. Empty: the tokenizer's.")
    ingress: IngressConfig = Field(default_factory=IngressConfig, description="HTTP front door settings.")
    pools: dict[Literal["online", "offline"], EngineConfig] = Field(description="One engine config per pool: online and offline.")
    predictor: PredictorConfig = Field(default_factory=PredictorConfig, description="The length predictor and its retraining.")
    store: str = Field("", description="Where foreserve keeps mutable state every node must see (feedback, batch files, "
                       "records, parts and results): a folder or a URI pyarrow.fs opens, e.g. "
                       "s3://bucket/foreserve?endpoint_override=host:9000&scheme=http (credentials from the nodes' "
                       "environment). Empty: $FORESERVE_STORE, else the data dir (one machine; see docs/cluster.md).")

    @model_validator(mode="after")
    def _both_pools(self) -> "AppConfig":
        missing = {"online", "offline"} - set(self.pools)
        if missing:
            raise ValueError(f"pools: missing {sorted(missing)}; the app serves an online and an offline pool")
        for name, pool in self.pools.items():  # a pool inherits the app's model unless it names its own
            inherit = {key: getattr(self, key) for key in INHERITED if not getattr(pool, key)}
            if inherit:
                self.pools[name] = pool.model_copy(update=inherit)
        if self.pools["online"].model_id != self.pools["offline"].model_id:
            raise ValueError("pools: online and offline must serve the same model (served_model_name)")
        return self


APP_NAME = "foreserve"


def app_entry(path: str | Path | None = None) -> dict:
    """The foreserve application's entry (``name``, ``args``, ``deployments``...) of a Serve config file."""
    path = Path(path) if path else DEFAULT_CONFIG_PATH
    data = load_yaml(path)
    apps = data.get("applications")
    if apps is None:  # a bare args mapping
        return {"name": APP_NAME, "args": data}
    for entry in apps:
        if entry.get("name", APP_NAME) == APP_NAME or len(apps) == 1:
            return entry
    raise ValueError(f"{path}: no application named {APP_NAME!r}")


def app_args(path: str | Path | None = None) -> dict:
    return app_entry(path).get("args") or {}


def load_app_config(path: str | Path | None = None) -> AppConfig:
    return AppConfig.model_validate(app_args(path))


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"config file {path} does not exist")
    with path.open() as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data
