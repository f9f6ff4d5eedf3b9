"""LLMEngine: ``step() = schedule() -> runner.execute() -> update()``, plus request intake and stats."""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import dataclass

from app.config import EngineConfig
from app.engine.kv.allocation import make_policy
from app.engine.text.detokenizer import Detokenizer, FinalText
from app.engine.kv.pool import KVPool
from app.engine.request import Request, RequestOutput, RequestStatus, Runner, SamplingParams
from app.engine.scheduler import make_scheduler
from predictor.base import LengthPrediction, LengthPredictor, MaxPredictor
from predictor.buckets import LengthBuckets

logger = logging.getLogger(__name__)
FINISH_REASONS = {"stopped": "stop", "length": "length", "aborted": "abort"}  # engine -> OpenAI words


class RequestRejected(ValueError):
    """The request can never run on this engine (too long for the model or the KV pool)."""


@dataclass
class EngineStats:
    steps: int
    forward_s: float
    wall_s: float
    output_tokens: int
    preemptions: int
    overflow_preemptions: int
    recomputed_tokens: int
    mean_running_batch: float
    peak_kv_used_tokens: int
    kv_capacity_tokens: int
    kv_used_tokens: int
    num_waiting: int
    num_running: int
    predictor_fallbacks: int = 0


class LLMEngine:
    """One replica's engine. Not thread-safe: drive it from one thread (see AsyncLLMEngine)."""

    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        num_blocks: int,
        tokenizer=None,
        predictor: LengthPredictor | None = None,
        feedback=None,
    ) -> None:
        """``feedback``: a ``predictor.feedback.FeedbackWriter``; every finished request that came
        with its predictor text appends one record (the retraining loop's labels)."""
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.buckets = LengthBuckets(max_tokens=config.default_max_tokens, num_buckets=config.num_buckets)
        self.predictor = predictor or MaxPredictor(self.buckets)
        self._max_predictor = MaxPredictor(self.buckets)
        self.predictor_fallbacks = 0
        self.feedback = feedback
        self._feedback_info: dict[str, tuple[str, str | None, int]] = {}
        self.pool = KVPool(num_blocks, config.block_size_tokens)
        self.policy = make_policy(config.allocation, self.pool, self.buckets, config.max_model_len_tokens)
        self._sim_clock_s = 0.0
        self._t0 = time.perf_counter()
        self.scheduler = make_scheduler(config.scheduler, config, self.policy, self.clock)
        self._detok: dict[str, Detokenizer | FinalText] = {}
        self.forward_s = 0.0
        self.output_tokens = 0
        self._trace = _open_step_trace(config)
        self._last_step_end: float | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, predictor: LengthPredictor | None = None, feedback=None) -> "LLMEngine":
        """Build the real runner (tensor-parallel when configured) and size the pool for it."""
        from app.engine.model.llama import model_config
        from app.engine.model.hf_runner import HFRunner, on_short_lived_thread

        hf_config = model_config(config.model_path)
        num_blocks = config.kv_pool_blocks(HFRunner.kv_bytes_per_token(hf_config, config.cache_dtype))
        if config.tensor_parallel_size > 1 and config.use_ray_tp_workers():
            from app.engine.parallel.ray_ranks import RayTPRunner

            runner: Runner = RayTPRunner(config, num_blocks)
        elif config.tensor_parallel_size > 1:
            from app.engine.parallel.tp import TPRunner

            runner = TPRunner(config, num_blocks)  # its ranks are processes of their own
        else:
            runner = on_short_lived_thread(lambda: HFRunner(config, num_blocks))  # see its docstring
        return cls(config, runner, num_blocks, tokenizer=runner.tokenizer, predictor=predictor, feedback=feedback)

    # -- time ------------------------------------------------------------------------------
    def clock(self) -> float:
        """Seconds since start: modelled time for a simulated runner, wall time otherwise."""
        if self.runner.simulated:
            return self._sim_clock_s
        return time.perf_counter() - self._t0

    def idle_until(self, t_s: float) -> None:
        """Simulated runners only: let modelled time pass with nothing to run (open-loop arrivals)."""
        if not self.runner.simulated:
            raise RuntimeError("only a simulated engine's clock can be moved")
        self._sim_clock_s = max(self._sim_clock_s, t_s)

    # -- intake ----------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: list[int] | None = None,
        sampling: SamplingParams | None = None,
        *,
        prompt: str | None = None,
        request_id: str | None = None,
        tier: str = "online",
        priority: int = 0,
        prediction: tuple[int, list[float] | None, int] | None = None,
        rank_tokens: float | None = None,
        true_output_tokens: int | None = None,
        force_true_length: bool = False,
        detokenize: bool = True,
        stream_text: bool = True,
        predictor_text: str | None = None,
        predictor_version: str | None = None,
        predictor_bound_tokens: int | None = None,
        output_token_ids: list[int] | None = None,
        emitted_chars: int = 0,
    ) -> Request:
        """Queue a request. ``prediction`` is (bucket, probabilities, bound_tokens); without it
        the engine's predictor is asked with ``predictor_text`` (the user's message; default the
        prompt), one prompt at a time: batch callers should pass it. ``rank_tokens`` is the
        predictor's length estimate for ordering (``LengthPrediction.rank_tokens``); without it the
        online scheduler orders by the bound. A failing predictor never
        fails the request: it falls back to ``max`` reservation and is counted. The engine's own
        predictor's bound is re-read at ``bound_quantile``; a caller that did so itself passes the
        predictor's original bound as ``predictor_bound_tokens`` (the feedback record keeps it).

        ``output_token_ids`` resumes an answer another replica started (and lost): they count as
        generated (max_tokens, stop strings, feedback), are recomputed like a preempted sequence's,
        and only the text after the first ``emitted_chars`` characters is streamed.

        ``stream_text=False`` (vLLM's final-only output): the text comes whole in the finished
        output, decoded once, instead of a delta per token (a batch row saves the per-step decoding;
        with stop strings the text is still followed token by token)."""
        sampling = sampling or SamplingParams(max_tokens=self.config.default_max_tokens)
        if prompt_token_ids is None:
            if prompt is None or self.tokenizer is None:
                raise ValueError("give prompt_token_ids, or a prompt and an engine with a tokenizer")
            prompt_token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        if not prompt_token_ids:
            raise RequestRejected("the prompt is empty")
        if output_token_ids and len(output_token_ids) >= sampling.max_tokens:
            raise RequestRejected(f"nothing left to generate: {len(output_token_ids)} of max_tokens {sampling.max_tokens} done")
        total = len(prompt_token_ids) + sampling.max_tokens
        limit = self.sequence_limit_tokens
        if total > limit:
            raise RequestRejected(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({sampling.max_tokens}) = {total} "
                f"exceeds this engine's limit of {limit} tokens"
            )
        if predictor_text is None:
            predictor_text = prompt
        if prediction is None:
            prediction, rank_tokens, predictor_version = self.predict(predictor_text or "")
            bucket, probs, predictor_bound_tokens = prediction
            prediction = (bucket, probs, self.config.reservation_bound(probs, predictor_bound_tokens,
                                                                       self.predictor.buckets.max_tokens))
        bucket, probs, bound_tokens = prediction
        req = Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            arrival_s=self.clock(),
            tier=tier,
            priority=priority,
            predicted_output_tokens=max(1, min(int(bound_tokens), sampling.max_tokens)),
            predicted_bucket=bucket,
            bucket_probs=probs,
            rank_output_tokens=None if rank_tokens is None else float(rank_tokens),
            true_output_tokens=true_output_tokens,
            force_true_length=force_true_length and true_output_tokens is not None,
            prompt=prompt,
            output_token_ids=list(output_token_ids or []),
        )
        req.predicted_output_tokens = min(max(req.predicted_output_tokens, req.num_output_tokens + 1), sampling.max_tokens)
        self.scheduler.add(req)
        if self.feedback is not None and predictor_text is not None:
            # NOTE: the predictor's bound as it came (growth and preemption raise req.predicted_output_tokens
            # later), at its own quantile whatever the pool reserved: the labels and the retraining
            # trigger judge the predictor, not the pool's choice.
            own = bound_tokens if predictor_bound_tokens is None else predictor_bound_tokens
            self._feedback_info[req.request_id] = (predictor_text, predictor_version, max(1, min(int(own), sampling.max_tokens)))
        if detokenize and self.tokenizer is not None and not stream_text and not sampling.stop and not emitted_chars:
            self._detok[req.request_id] = FinalText(self.tokenizer)
        elif detokenize and self.tokenizer is not None:
            self._detok[req.request_id] = Detokenizer(self.tokenizer, sampling.stop)
            if req.output_token_ids:
                self._detok[req.request_id].resume(req.output_token_ids, emitted_chars)
        return req

    @property
    def sequence_limit_tokens(self) -> int:
        """The longest prompt + output one request may reach here: the context, or the KV pool if smaller."""
        return min(self.config.max_model_len_tokens, self.pool.capacity_tokens)

    def predict(self, text: str) -> tuple[tuple[int, list[float], int], float | None, str | None]:
        """The engine's own predictor on one text: ((bucket, probs, bound), rank tokens, version)."""
        try:
            pred: LengthPrediction = self.predictor.predict([text])
            version = getattr(self.predictor, "version", None)
        except Exception:  # noqa: BLE001 - a broken predictor must not fail requests
            logger.exception("length predictor failed; reserving for max_tokens")
            self.predictor_fallbacks += 1
            pred, version = self._max_predictor.predict([text]), "max-fallback"
        rank = pred.rank_tokens[0] if pred.rank_tokens else None
        return (pred.buckets[0], pred.probabilities[0].tolist(), pred.bound_tokens[0]), rank, version

    def abort(self, request_id: str) -> bool:
        self._detok.pop(request_id, None)
        req = self.scheduler.abort(request_id)
        if req is not None:
            self._record_feedback(req)
        return req is not None

    def _record_feedback(self, req: Request) -> None:
        info = self._feedback_info.pop(req.request_id, None)
        if info is None or self.feedback is None:
            return
        from predictor.feedback import FeedbackRecord

        text, version, bound = info
        try:
            self.feedback.append(FeedbackRecord(
                request_id=req.request_id,
                prompt=text,
                predicted_bucket=req.predicted_bucket if req.predicted_bucket >= 0 else None,
                predicted_bound_tokens=bound,
                output_tokens=req.num_output_tokens,
                finish_reason=FINISH_REASONS.get(req.finish_reason or "", req.finish_reason or "unknown"),
                ignore_eos=req.sampling.ignore_eos or req.force_true_length,
                tier=req.tier,
                model_id=self.config.served_model_name,
                predictor_version=version,
                source="offline" if req.tier == "offline" else "online",
            ))
        except Exception:  # noqa: BLE001 - losing a label must not fail the request
            logger.exception("could not write the feedback record of %s", req.request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched_out = self.scheduler.schedule()
        if not sched_out.chunks:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("scheduler admitted nothing with an empty pool: a request cannot fit")
            return []
        result = self.runner.execute(sched_out)
        self.forward_s += result.step_s
        if self.runner.simulated:
            self._sim_clock_s += result.step_s
        self.scheduler.observe_step(sched_out.num_tokens, result.step_s)
        if self._trace is not None:
            self._trace_step(sched_out, result.step_s)
        touched = self.scheduler.update(sched_out, result, self.runner.eos_token_id)
        self.output_tokens += len(touched)
        return [self._output(req) for req in touched]

    def _trace_step(self, sched_out, forward_s: float) -> None:
        now = self.clock()
        decode = sum(1 for c in sched_out.chunks if len(c.token_ids) == 1 and c.num_output_tokens > 0)
        record = {
            "t": round(now, 4),
            # NOTE: step end to step end: what a streaming client sees between tokens
            "interval_s": round(now - self._last_step_end, 4) if self._last_step_end is not None else None,
            "forward_s": round(forward_s, 4),
            "decode_rows": decode,
            "prefill_tokens": sched_out.num_tokens - decode,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "budget": self.scheduler.step_token_budget(),
            "max_running": self.scheduler.max_running(),
            "kv_free_tokens": self.pool.num_free_blocks * self.pool.block_size_tokens,
            # (cached tokens, new tokens, sampled) per sequence: enough to re-cost the step (plan calibrate-cpu)
            "chunks": [[c.start_pos, len(c.token_ids), int(c.sample)] for c in sched_out.chunks],
        }
        self._trace.write(json.dumps(record) + "\n")
        self._last_step_end = now

    def _output(self, req: Request) -> RequestOutput:
        text = ""
        detok = self._detok.get(req.request_id)
        if detok is not None:
            text, hit_stop = detok.add(req.output_token_ids)
            if hit_stop and not req.status.finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
            elif hit_stop and req.status is RequestStatus.FINISHED_LENGTH:  # completed on the last allowed token
                req.status, req.finish_reason = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_STOPPED.value
            if req.status.finished:
                text += detok.finish()
        if req.status.finished:
            self._detok.pop(req.request_id, None)
            self._record_feedback(req)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=req.output_token_ids[-1:],
            text_delta=text,
            finished=req.status.finished,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
        )

    def stats(self) -> EngineStats:
        s = self.scheduler.stats
        return EngineStats(
            steps=s.steps,
            forward_s=self.forward_s,
            wall_s=self.clock(),
            output_tokens=self.output_tokens,
            preemptions=s.preemptions,
            overflow_preemptions=s.overflow_preemptions,
            recomputed_tokens=s.recomputed_tokens,
            mean_running_batch=s.scheduled_seqs / s.steps if s.steps else 0.0,
            peak_kv_used_tokens=self.pool.peak_used_tokens,
            kv_capacity_tokens=self.pool.capacity_tokens,
            kv_used_tokens=self.pool.used_tokens,
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            predictor_fallbacks=self.predictor_fallbacks,
        )

    def shutdown(self) -> None:
        self.runner.shutdown()
        if self._trace is not None:
            self._trace.close()
            self._trace = None


def _open_step_trace(config: EngineConfig):
    """``FORESERVE_STEP_TRACE=DIR``: one JSONL line per step (composition, forward time, the interval
    since the previous step, the scheduler's budget) in DIR/steps-<scheduler>-<pid>.jsonl."""
    folder = os.environ.get("FORESERVE_STEP_TRACE")
    if not folder:
        return None
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"steps-{config.scheduler}-{os.getpid()}.jsonl")
    return open(path, "a", buffering=1)  # NOTE: line-buffered: a killed replica keeps its lines
