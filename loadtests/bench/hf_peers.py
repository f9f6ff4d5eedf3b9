"""Peer baselines for `bench throughput`: plain transformers, at the same KV budget as our engine.

- ``hf_static``: ``model.generate`` on static batches in arrival order, each batch sized by
  max-length reservation (sum of prompt + max_tokens fits the KV budget): the FasterTransformer
  baseline of the S3 paper.
- ``hf_continuous``: transformers' own continuous batching (``ContinuousBatchingManager``: paged
  cache of exactly ``kv_tokens``, FIFO scheduler, soft-reset preemption), ``sdpa`` attention.

Every request generates exactly its forced length (its true output length capped at max_tokens;
EOS ignored). Only those useful tokens count, never padding or tokens past a request's length.
Each peer returns one result row of the benchmark JSON contract (DESIGN.md).
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

PEERS = ("hf_static", "hf_continuous")


@dataclass(frozen=True)
class PeerRequest:
    prompt_token_ids: list[int]
    forced_output_tokens: int  # generates exactly this many tokens


def normalize_requests(requests: list[Any], tokenizer, max_tokens: int) -> list[PeerRequest]:
    """Accept objects or dicts with ``prompt_token_ids`` (or ``prompt`` text, already chat-templated)
    and ``output_tokens`` (true length; capped at ``max_tokens`` here)."""
    out = []
    for r in requests:
        get = r.get if isinstance(r, dict) else lambda k, _r=r: getattr(_r, k, None)
        ids = get("prompt_token_ids")
        if ids is None:
            prompt = get("prompt")
            if prompt is None:
                raise ValueError("a peer request needs prompt_token_ids or prompt")
            ids = tokenizer.encode(prompt, add_special_tokens=False)
        true_len = get("output_tokens")
        if true_len is None or int(true_len) < 1:
            raise ValueError(f"a peer request needs output_tokens >= 1, got {true_len!r}")
        out.append(PeerRequest(list(ids), min(int(true_len), max_tokens)))
    return out


def _row(policy, scheduler, wall_s, reqs, batch_sizes, peak_kv, preemptions, recomputed) -> dict:
    useful = sum(r.forced_output_tokens for r in reqs)
    return {
        "policy": policy,
        "scheduler": scheduler,
        "wall_s": round(wall_s, 3),
        "output_tokens": useful,
        "output_tokens_per_s": round(useful / wall_s, 2) if wall_s > 0 else 0.0,
        "requests_per_s": round(len(reqs) / wall_s, 3) if wall_s > 0 else 0.0,
        "mean_running_batch": round(sum(batch_sizes) / len(batch_sizes), 2) if batch_sizes else 0.0,
        "peak_kv_used_tokens": int(peak_kv),
        "preemptions": preemptions,
        "recomputed_tokens": recomputed,
    }


# --------------------------------------------------------------------------------------- static


def static_batches(reqs: list[PeerRequest], kv_tokens: int, max_tokens: int) -> list[list[PeerRequest]]:
    """Arrival order; a batch takes requests while sum(prompt + max_tokens) <= kv_tokens (at least one)."""
    batches: list[list[PeerRequest]] = []
    cur: list[PeerRequest] = []
    reserved = 0
    for r in reqs:
        need = len(r.prompt_token_ids) + max_tokens
        if cur and reserved + need > kv_tokens:
            batches.append(cur)
            cur, reserved = [], 0
        cur.append(r)
        reserved += need
    if cur:
        batches.append(cur)
    return batches


@torch.inference_mode()
def run_hf_static(model, tokenizer, requests: list[Any], kv_tokens: int, max_tokens: int) -> dict:
    """Static batching with ``generate``: left padding, greedy, EOS disabled, each batch runs for the
    longest forced length in it. ``peak_kv_used_tokens`` is the real cache peak, batch × (padded
    prompt + generated), which padding can push past the budget: what was physically held."""
    reqs = normalize_requests(requests, tokenizer, max_tokens)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = model.device
    batch_steps: list[int] = []  # one entry per decode step: the physical batch size
    peak_kv = 0
    t0 = time.perf_counter()
    for batch in tqdm(static_batches(reqs, kv_tokens, max_tokens), desc="hf_static batches", leave=False):
        width = max(len(r.prompt_token_ids) for r in batch)
        new_tokens = max(r.forced_output_tokens for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):  # NOTE: left padding, so every row's next token is at the end
            n = len(r.prompt_token_ids)
            ids[i, width - n :] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
            mask[i, width - n :] = 1
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # NOTE: EOS masked out: every row runs the full length
            pad_token_id=pad_id,
            use_cache=True,
        )
        generated = out.shape[1] - width
        if generated != new_tokens:
            raise RuntimeError(f"generate produced {generated} tokens, expected {new_tokens}")
        peak_kv = max(peak_kv, len(batch) * (width + generated))
        batch_steps.extend([len(batch)] * generated)
    wall_s = time.perf_counter() - t0
    return _row("hf_static", "static", wall_s, reqs, batch_steps, peak_kv, 0, 0)


# ----------------------------------------------------------------------------------- continuous


class _CBProbe:
    """Wraps the manager's scheduler and offloading manager (instance attributes only) to record the
    batch size and physically held KV of every step and each preemption (soft reset or CPU offload)."""

    def __init__(self, batch_processor) -> None:
        self.bp = batch_processor
        self.batch_sizes: list[int] = []
        self.peak_kv_tokens = 0
        self.preemptions = 0
        self.recomputed_tokens = 0
        sched, offl = batch_processor.scheduler, batch_processor.offloading_manager
        schedule_batch, offload_requests = sched.schedule_batch, offl.offload_requests

        def schedule_batch_probe(*args, **kwargs):
            result = schedule_batch(*args, **kwargs)
            if result[0]:
                self.batch_sizes.append(len(result[0]))
            self.peak_kv_tokens = max(self.peak_kv_tokens, self.used_tokens())
            return result

        def offload_requests_probe(*args, **kwargs):
            before = {rid: s.current_len() for rid, s in sched.active_requests.items()}
            ok = offload_requests(*args, **kwargs)
            gone = [rid for rid in before if rid not in sched.active_requests]
            self.preemptions += len(gone)
            # NOTE: with cpu_offload_space=0 (our setting) every victim is soft reset: its prompt and
            # generated tokens are prefilled again, exactly like our engine's recompute preemption.
            self.recomputed_tokens += sum(before[rid] for rid in gone)
            return ok

        sched.schedule_batch = schedule_batch_probe
        offl.offload_requests = offload_requests_probe

    def used_tokens(self) -> int:
        cache = self.bp.cache
        return max(
            sum(len(blocks) for blocks in ca.block_table.values()) * ca.tokens_per_page
            for ca in cache.cache_allocators.values()
        )


@torch.no_grad()  # NOTE: not inference_mode: the manager's thread updates its tensors in place
def run_hf_continuous(
    model,
    tokenizer,
    requests: list[Any],
    kv_tokens: int,
    max_tokens: int,
    block_size_tokens: int = 16,
    max_batch_tokens: int = 512,
) -> dict:
    """transformers' continuous batching with a paged cache of ``kv_tokens`` (num_blocks × block size),
    per-request ``max_new_tokens`` = forced length and ``eos_token_id=-1`` (EOS disabled). Prefix
    sharing is off (our engine has none) and the per-step token budget matches our chunked prefill."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    reqs = normalize_requests(requests, tokenizer, max_tokens)
    num_blocks = max(1, kv_tokens // block_size_tokens)
    cb_config = ContinuousBatchingConfig(
        page_size=block_size_tokens,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        allow_block_sharing=False,
        use_async_batching=False,
        use_cuda_graph=False,
        auto_switch_to_flash=False,
        scheduler_type="fifo",
        cpu_offload_space=0.0,
    )
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=-1, pad_token_id=tokenizer.pad_token_id)
    manager = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
    try:
        manager.warmup()  # NOTE: builds the batch processor (paged cache) before the clock starts
        bp = manager.batch_processor
        capacity = bp.cache.num_blocks * block_size_tokens
        if capacity < kv_tokens - block_size_tokens:
            raise RuntimeError(f"paged cache holds {capacity} tokens, asked for {kv_tokens}")
        probe = _CBProbe(bp)
        manager.start()
        t0 = time.perf_counter()
        ids = {}
        for i, r in enumerate(reqs):
            rid = manager.add_request(
                input_ids=r.prompt_token_ids,
                request_id=f"peer-{i}",
                max_new_tokens=r.forced_output_tokens,
                eos_token_id=-1,
            )
            ids[rid] = r
        done: dict[str, Any] = {}
        with tqdm(total=len(reqs), desc="hf_continuous", leave=False) as bar:
            while len(done) < len(reqs):
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' continuous batching loop stopped before finishing")
                    continue
                if result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"request {result.request_id} failed: {result.error}")
                    done[result.request_id] = result
                    bar.update(1)
        wall_s = time.perf_counter() - t0
    finally:
        if manager.is_running():
            manager.stop(block=True, timeout=30)
        manager.destroy()
    for rid, result in done.items():
        if len(result.generated_tokens) != ids[rid].forced_output_tokens:
            raise RuntimeError(
                f"{rid} generated {len(result.generated_tokens)} tokens, expected {ids[rid].forced_output_tokens}"
            )
    row = _row(
        "hf_continuous", "hf_paged", wall_s, reqs, probe.batch_sizes, probe.peak_kv_tokens,
        probe.preemptions, probe.recomputed_tokens,
    )
    row["kv_capacity_tokens"] = capacity
    return row


# -------------------------------------------------------------------------------------- harness


@functools.lru_cache(maxsize=1)
def load_peer_model(model_path: str | None = None):
    """The serving model as a plain HF causal LM (float32, sdpa) and its tokenizer, loaded once.

    NOTE: the peers get their own copy rather than our runner's: continuous batching switches the
    model's attention implementation while it runs, and our runner may shard or wrap its model."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.prepare.model import ensure_model

    path = model_path or str(ensure_model())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    return model, tokenizer


def run_peer(name: str, runner: Any, requests: list[Any], kv_tokens: int, max_tokens: int, **cb_kwargs) -> dict:
    """Run peer ``name`` (``hf_static`` | ``hf_continuous``) on ``requests``; ``runner`` is accepted
    for the benchmark's call signature and only used for its ``model_path`` (or ``config.model_path``).
    ``cb_kwargs`` (``block_size_tokens``, ``max_batch_tokens``) go to ``hf_continuous`` only."""
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")
    model_path = getattr(runner, "model_path", None) or getattr(getattr(runner, "config", None), "model_path", None)
    model, tokenizer = load_peer_model(str(model_path) if model_path else None)
    if name == "hf_static":
        return run_hf_static(model, tokenizer, requests, kv_tokens, max_tokens)
    return run_hf_continuous(model, tokenizer, requests, kv_tokens, max_tokens, **cb_kwargs)


if __name__ == "__main__":  # quick manual check: python -m loadtests.bench.hf_peers --requests 8
    import argparse
    import json

    from app.prepare.traces import load_trace

    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--kv-tokens", type=int, default=2048)
    ap.add_argument("--peers", default=",".join(PEERS))
    args = ap.parse_args()
    recs = load_trace("validation", limit=args.requests)
    reqs = [{"prompt": r.prompt, "output_tokens": r.output_tokens} for r in recs]
    for peer in args.peers.split(","):
        print(json.dumps(run_peer(peer, None, reqs, args.kv_tokens, args.max_tokens)), flush=True)
