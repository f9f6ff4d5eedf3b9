"""LLMEngine: ``step() = schedule() -> runner.execute() -> update()``, plus request intake and stats."""

from __future__ import annotations

import logging
import uuid

from app.config import EngineConfig
from app.engine.clock import Clock, WallClock
from app.engine.faults import FaultFile
from app.engine.kv.allocation import make_policy
from app.engine.kv.pool import KVPool
from app.engine.outputs import EngineStats, RequestOutput
from app.engine.request import FINISH_REASONS, EngineRequest, Prediction, Request, RequestStatus, SamplingParams
from app.engine.runner import Runner
from app.engine.scheduler import make_scheduler
from app.engine.shedding import EngineOverloaded, LoadShedder  # noqa: F401 - EngineOverloaded: raised from here
from app.engine.step_trace import StepTrace
from app.engine.text.detokenizer import Detokenizer, FinalText
from app.engine.ttft import estimate_ttft, own_ttft_s
from predictor.base import LengthPredictor, MaxPredictor
from predictor.buckets import LengthBuckets

logger = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """The request can never run on this engine (too long for the model or the KV pool)."""


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
        clock: Clock | None = None,
    ) -> None:
        """``feedback``: a ``predictor.feedback.FeedbackWriter``; every finished request that came
        with its predictor text appends one record (the retraining loop's labels). ``clock``: wall
        time unless given (a simulated runner's callers pass a ``ModelledClock``)."""
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.clock = clock or WallClock()
        self.buckets = LengthBuckets(max_tokens=config.default_max_tokens, num_buckets=config.num_buckets)
        self.predictor = predictor or MaxPredictor(self.buckets)
        self._max_predictor = MaxPredictor(self.buckets)
        self.predictor_fallbacks = 0
        self.feedback = feedback
        self.pool = KVPool(num_blocks, config.block_size_tokens)
        self.policy = make_policy(config.allocation, self.pool, self.buckets, config.max_model_len_tokens)
        self.scheduler = make_scheduler(config.scheduler, config, self.policy, self.clock)
        self._detok: dict[str, Detokenizer | FinalText] = {}
        self.forward_s = 0.0
        self.output_tokens = 0
        self._trace = StepTrace(config.step_trace_dir, config.scheduler) if config.step_trace_dir else None
        self._faults = FaultFile(config.fault_dir) if config.fault_dir else None
        self.shedder = LoadShedder(config.max_queue_delay_ms) if config.max_queue_delay_ms is not None else None

    @classmethod
    def from_config(cls, config: EngineConfig, predictor: LengthPredictor | None = None, feedback=None) -> "LLMEngine":
        """Build the real runner (tensor-parallel when configured) and size the pool for it."""
        from app.engine.model.build import build_runner

        runner, num_blocks = build_runner(config)
        return cls(config, runner, num_blocks, tokenizer=runner.tokenizer, predictor=predictor, feedback=feedback)

    # -- intake ----------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> Request:
        """Queue a request. Without ``request.prediction`` the engine's predictor is asked with
        ``predictor_text`` (default the prompt), one prompt at a time: batch callers should pass
        one. A failing predictor never fails the request: it falls back to ``max`` reservation and
        is counted. The engine's own prediction is re-read at this pool's ``bound_quantile``."""
        sampling = request.sampling or SamplingParams(max_tokens=self.config.default_max_tokens)
        prompt_token_ids = request.prompt_token_ids
        if prompt_token_ids is None:
            if request.prompt is None or self.tokenizer is None:
                raise ValueError("give prompt_token_ids, or a prompt and an engine with a tokenizer")
            prompt_token_ids = self.tokenizer.encode(request.prompt, add_special_tokens=False)
        if not prompt_token_ids:
            raise RequestRejected("the prompt is empty")
        resumed = request.resume_output_token_ids
        if resumed and len(resumed) >= sampling.max_tokens:
            raise RequestRejected(f"nothing left to generate: {len(resumed)} of max_tokens {sampling.max_tokens} done")
        total = len(prompt_token_ids) + sampling.max_tokens
        limit = self.sequence_limit_tokens
        if total > limit:
            raise RequestRejected(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({sampling.max_tokens}) = {total} "
                f"exceeds this engine's limit of {limit} tokens"
            )
        predictor_text = request.predictor_text if request.predictor_text is not None else request.prompt
        prediction = request.prediction or self.predict(predictor_text or "")
        req = Request(
            request_id=request.request_id or uuid.uuid4().hex,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            arrival_s=self.clock(),
            prediction=prediction,
            tier=request.tier,
            priority=request.priority,
            prompt=request.prompt,
            predictor_text=predictor_text,
            output_token_ids=list(resumed),
        )
        bound = max(1, min(int(prediction.bound_tokens), sampling.max_tokens))
        req.predicted_output_tokens = min(max(bound, req.num_output_tokens + 1), sampling.max_tokens)
        if self.shedder is not None and not resumed:  # NOTE: a resumed answer is always taken
            self._estimate(req)
        self.scheduler.add(req)
        if request.detokenize and self.tokenizer is not None:
            final_only = not request.stream_text and not sampling.stop and not request.resume_emitted_chars
            detok = FinalText(self.tokenizer) if final_only else Detokenizer(self.tokenizer, sampling.stop)
            if resumed and not final_only:
                detok.resume(req.output_token_ids, request.resume_emitted_chars)
            self._detok[req.request_id] = detok
        return req

    def _estimate(self, req: Request) -> None:
        """Estimate ``req``'s time to first token (app/engine/ttft.py) and refuse it
        (``EngineOverloaded``) if the shedding rule says so (app/engine/shedding.py)."""
        # NOTE: played forward just far enough to decide (a queue of thousands would cost each admission more)
        estimate = estimate_ttft(req, self.scheduler, self.policy.reservation_tokens, self.pool.capacity_tokens,
                                 max_delay_s=5 * self.shedder.limit_s)
        self.shedder.check_admission(estimate)
        if estimate is not None:
            req.ttft_estimate_s, req.own_ttft_s = estimate.total_s, estimate.own_s

    @property
    def sequence_limit_tokens(self) -> int:
        """The longest prompt + output one request may reach here: the context, or the KV pool if smaller."""
        return min(self.config.max_model_len_tokens, self.pool.capacity_tokens)

    def predict(self, text: str) -> Prediction:
        """The engine's own predictor on one text, its bound re-read at this pool's quantile."""
        try:
            pred = self.predictor.predict([text])
            version = getattr(self.predictor, "version", None)
        except Exception:  # noqa: BLE001 - a broken predictor must not fail requests
            logger.exception("length predictor failed; reserving for max_tokens")
            self.predictor_fallbacks += 1
            pred, version = self._max_predictor.predict([text]), "max-fallback"
        probs = pred.probabilities[0].tolist()
        own = int(pred.bound_tokens[0])
        return Prediction(
            bucket=int(pred.buckets[0]),
            probabilities=tuple(probs),
            bound_tokens=self.config.reservation_bound(probs, own, self.predictor.buckets.max_tokens),
            rank_tokens=pred.rank_tokens[0] if pred.rank_tokens else None,
            version=None if version is None else str(version),
            predictor_bound_tokens=own,
        )

    def abort(self, request_id: str) -> bool:
        self._detok.pop(request_id, None)
        req = self.scheduler.abort(request_id)
        if req is not None:
            self._record_feedback(req)
        return req is not None

    def _record_feedback(self, req: Request) -> None:
        if req.predictor_text is None or self.feedback is None:
            return
        from app.engine.labels import feedback_record

        try:
            self.feedback.append(feedback_record(req, self.config.model_id))
        except Exception:  # noqa: BLE001 - losing a label must not fail the request
            logger.exception("could not write the feedback record of %s", req.request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        refused = [] if self.shedder is None else [self._refuse(r) for r in self._late()]
        sched_out = self.scheduler.schedule()
        if not sched_out.chunks:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("scheduler admitted nothing with an empty pool: a request cannot fit")
            return refused
        if self._faults is not None:
            self._faults.before_forward()
        requests = self.scheduler.requests
        firsts = {c.request_id for c in sched_out.chunks
                  if c.sample and (r := requests.get(c.request_id)) is not None and r.first_token_s is None}
        result = self.runner.execute(sched_out)
        self.forward_s += result.step_s
        self.clock.advance(result.step_s)
        self.scheduler.observe_step(sched_out.num_tokens, result.step_s)
        if self._trace is not None:
            self._trace.write(self.clock(), sched_out, result.step_s, self.scheduler, self.pool)
        touched = self.scheduler.update(sched_out, result)
        if self.shedder is not None:
            self.shedder.stepped(self.clock())
        self.output_tokens += len(touched)
        outputs = [self._output(req, req.request_id in firsts) for req in touched]
        failed = [rid for rid, token in result.sampled_token_ids.items() if token is None]
        return refused + outputs + [out for rid in failed if (out := self._fail(rid)) is not None]

    def _fail(self, request_id: str) -> RequestOutput | None:
        """End a request whose row the runner could not sample (NaN or infinite logits): it alone
        fails, with an error its caller sees; the step's other requests go on."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return None  # aborted while the step ran
        logger.error("request %s failed: its logits could not be sampled (NaN or infinite); the others go on", request_id)
        return self._end_with_error(req, RequestStatus.FINISHED_ERROR,
                                    "the model produced invalid values (NaN or infinite logits) for this request")

    def _late(self) -> list[Request]:
        """The unstarted requests whose wait has passed what the shedding rule allows them
        (``LoadShedder.late``), their own prompt's time as estimated at admission (or now, if the
        pool had no pace then)."""
        if not self.scheduler.waiting:
            return []

        def own(req: Request) -> float | None:
            if req.own_ttft_s is None:
                req.own_ttft_s = own_ttft_s(req, self.scheduler)
            return req.own_ttft_s

        return self.shedder.late(self.scheduler.waiting, self.clock(), own)

    def _refuse(self, req: Request) -> RequestOutput:
        """Refuse an admitted request whose first token can no longer come within
        ``max_queue_delay_ms``, unstarted (429). The client's 429 carries this reason; ``foreserve
        chaos`` tells these refusals from those at admission by its "without starting"
        (``loadtests/chaos/score.py``)."""
        waited = self.clock() - self.shedder.since_s(req)
        return self._end_with_error(req, RequestStatus.FINISHED_ABORTED, retryable=True, error=(
            f"it waited {waited:.1f} s without starting for others ahead (alone its prompt takes {req.own_ttft_s:.1f} s), "
            f"and its first token can no longer come within this pool's max_queue_delay_ms "
            f"({self.shedder.limit_s * 1000:g})"))

    def _end_with_error(self, req: Request, status: RequestStatus, error: str, retryable: bool = False) -> RequestOutput:
        self.scheduler.finish(req, status)
        self._detok.pop(req.request_id, None)
        return RequestOutput(request_id=req.request_id, new_token_ids=[], text_delta="", finished=True,
                             finish_reason=req.finish_reason, num_prompt_tokens=req.num_prompt_tokens,
                             num_output_tokens=req.num_output_tokens, error=error, retryable=retryable)

    def _end_status(self, req: Request, hit_stop: bool) -> RequestStatus | None:
        """The one place a request's end is decided, after each new token: a stop string or EOS
        ends it as stopped (also on the last allowed token), reaching max_tokens as length."""
        last = req.output_token_ids[-1]
        is_eos = last == self.runner.eos_token_id or last in self.runner.eos_token_ids
        if hit_stop or (is_eos and not req.sampling.ignore_eos):
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.sampling.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(self, req: Request, first: bool = False) -> RequestOutput:
        """``first``: this step gave ``req`` its first token here (the output carries its TTFT)."""
        text, hit_stop = "", False
        detok = self._detok.get(req.request_id)
        if detok is not None:
            text, hit_stop = detok.add(req.output_token_ids)
        status = self._end_status(req, hit_stop)
        if status is not None:
            self.scheduler.finish(req, status)
            if detok is not None:
                text += detok.finish()
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
            ttft_s=req.first_token_s - req.arrival_s if first else None,
            ttft_estimate_s=req.ttft_estimate_s if first else None,
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


__all__ = ["FINISH_REASONS", "EngineOverloaded", "EngineRequest", "EngineStats", "LLMEngine", "Prediction",
           "RequestRejected"]
