"""The batch job's actors: ``PredictStage`` (Ray Data, the length predictor), ``EngineStage`` (an
``LLMEngine`` of the job's own) and ``ServeStage`` (a running Serve app's offline pool). A batch's
finished rows go to the job's output store in chunks of the actor's own under ``parts/<batch>/``
(``app/batch/io.py``), so any node can run any batch. ``foreserve/batch/job.py`` drives them."""

from __future__ import annotations

import logging
import time
import uuid

from app import paths
from app.api.errors import APIError
from app.api.prompt import request_prompt
from app.batch.io import CHAT_URL, FLUSH_ROWS, InputRow, ResultRow, ResultStore, error_row, ok_row
from app.config import EngineConfig
from app.engine.request import EngineRequest, Prediction, SamplingParams

logger = logging.getLogger(__name__)
FEEDBACK_FLUSH_S = 1.0  # an engine's feedback records reach the store this often, and when a batch ends


class PredictStage:
    """Ray Data actor: adds ``bucket``, ``bound_tokens`` (what the offline pool reserves: its
    ``bound_quantile`` of the predicted distribution), ``predictor_bound_tokens`` (the version's own,
    for the feedback record) and ``predictor_version`` columns.

    ``predictor`` is what the driver pinned at the job's start (``job.pin_predictor``): a registry
    version number (downloaded into this node's cache if it is not there), a model directory or
    ``max``; ``version`` labels it. A stage that Ray Data starts again loads that same version, and
    one that cannot load it fails rather than predict with another."""

    def __init__(self, predictor: str, version: str, threads: int = 1, bound_quantile: float | None = None) -> None:
        t0 = time.perf_counter()
        from app.engine.model.setup import on_short_lived_thread
        from predictor.loading import load_predictor

        store = paths.predictor_store() if predictor.isdigit() else None
        # NOTE: Ray Data calls __call__ on another thread than __init__: see on_short_lived_thread
        self.predictor = on_short_lived_thread(lambda: load_predictor(predictor, version=version, store=store))
        # NOTE: the offline pool's quantile: what its engines reserve (None: the version's bound)
        self.offline_config = None if bound_quantile is None else EngineConfig(bound_quantile=bound_quantile)
        self.threads = threads
        print(f"predictor {self.predictor.version} ready in {time.perf_counter() - t0:.1f} s", flush=True)

    def __call__(self, batch: dict) -> dict:
        import torch

        t0 = time.perf_counter()
        torch.set_num_threads(self.threads)  # NOTE: per calling thread (OpenMP), like the runner's
        pred = self.predictor.predict(list(batch["text"]))
        print(f"predicted {len(pred.buckets)} rows in {time.perf_counter() - t0:.1f} s", flush=True)
        batch["bucket"] = list(pred.buckets)
        batch["predictor_bound_tokens"] = list(pred.bound_tokens)
        batch["bound_tokens"] = list(pred.bound_tokens)
        if self.offline_config is not None:
            batch["bound_tokens"] = [self.offline_config.reservation_bound(p, b, self.predictor.buckets.max_tokens)
                                     for p, b in zip(pred.probabilities.tolist(), pred.bound_tokens)]
        batch["predictor_version"] = [str(self.predictor.version)] * len(pred.buckets)
        return batch


def completion_body(request_id: str, model: str, text: str, prompt_tokens: int, output_tokens: int,
                    finish_reason: str | None, chat: bool = True) -> dict:
    """A finished answer as an OpenAI chat completion, or (``chat`` False) a text completion, with usage."""
    from app.api.completions import Completion, CompletionChoice
    from app.api.schemas import ChatCompletion, Choice, ResponseMessage, Usage

    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=output_tokens, total_tokens=prompt_tokens + output_tokens)
    reason = "length" if finish_reason == "length" else "stop"
    if not chat:
        return Completion(id=request_id, model=model, usage=usage, service_tier="flex",
                          choices=[CompletionChoice(text=text, finish_reason=reason)]).model_dump()
    return ChatCompletion(id=request_id, model=model, usage=usage, service_tier="flex",
                          choices=[Choice(message=ResponseMessage(content=text), finish_reason=reason)]).model_dump()





def is_chat(request) -> bool:
    from app.api.schemas import ChatCompletionRequest

    return isinstance(request, ChatCompletionRequest)


def _rows(batch: list[dict], skip: set[int]):
    """(row, prediction, predictor text) for every predicted row of a batch that is not in ``skip``
    (lines some part already answers: a retried batch after a crash)."""
    from app.batch.io import SCHEMAS

    for item in batch:
        if int(item["line"]) in skip:
            continue
        schema = SCHEMAS[item.get("url", CHAT_URL)]
        row = InputRow(int(item["line"]), str(item["custom_id"]), schema.model_validate_json(item["request"]))
        own = item.get("predictor_bound_tokens", item["bound_tokens"])
        prediction = Prediction(bucket=int(item["bucket"]), bound_tokens=int(item["bound_tokens"]),
                                version=str(item["predictor_version"]), predictor_bound_tokens=int(own))
        yield row, prediction, str(item["text"])


def _sampling(body, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                          stop=body.stop_list, ignore_eos=body.ignore_eos)


def _flush_feedback(writer) -> None:
    try:
        writer.flush()
    except Exception:  # noqa: BLE001 - feedback stays buffered for the next flush; the rows are what counts
        logger.exception("could not store the batch's feedback records; kept for the next flush")


class EngineStage:
    """Engine actor: runs batches of predicted rows through its own ``LLMEngine``. Finished rows
    reach the store in chunks of at most ``FLUSH_ROWS`` (``PartWriter``), all of a batch's before
    ``run`` returns; a retry of a batch skips the rows its earlier attempts stored."""

    def __init__(self, engine: dict, out: str) -> None:
        t0 = time.perf_counter()
        from app.engine.engine import LLMEngine
        from app.prepare.model_store import ensure_local_model
        from predictor.feedback import FeedbackWriter

        self.config = EngineConfig.model_validate(engine)
        ensure_local_model(self.config.model_path, paths.store())  # a node without it fetches it from the store
        self.feedback = FeedbackWriter(paths.feedback_store(), flush_s=FEEDBACK_FLUSH_S)
        self.engine = LLMEngine.from_config(self.config, feedback=self.feedback)
        print(f"engine ready in {time.perf_counter() - t0:.1f} s ({self.engine.pool.capacity_tokens} KV tokens)", flush=True)
        self.store = ResultStore(out)

    def run(self, batch: list[dict], key: str) -> int:
        """Generate every row of ``batch`` not answered yet into ``parts/<key>/``; returns the
        number of rows in the batch."""
        config, rows = self.config, {}
        results = self.store.writer(key, flush_rows=FLUSH_ROWS)
        for row, prediction, text in _rows(batch, self.store.done_lines(key)):
            try:
                ids, max_tokens = request_prompt(self.engine.tokenizer, row.request, self.engine.sequence_limit_tokens,
                                            config.default_max_tokens)
                req = self.engine.add_request(EngineRequest(
                    prompt_token_ids=ids, sampling=_sampling(row.request, max_tokens), request_id=f"batch-{uuid.uuid4().hex}",
                    tier="offline", prediction=prediction, predictor_text=text, stream_text=False))
            except (APIError, ValueError) as exc:  # too long for the context or for this replica's KV
                row.error = f"line {row.line}: {exc}"
                results.append(error_row(row))
                continue
            rows[req.request_id] = (row, req.predicted_output_tokens, [])
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                row, bound, texts = rows[out.request_id]
                texts.append(out.text_delta)
                if out.error is not None:  # this row alone failed (NaN logits): an error line, the others go on
                    row.error = f"line {row.line}: {out.error}"
                    results.append(error_row(row))
                elif out.finished:
                    body = completion_body(out.request_id, row.request.model, "".join(texts), out.num_prompt_tokens,
                                           out.num_output_tokens, out.finish_reason, is_chat(row.request))
                    results.append(ok_row(row, body, bound))
        results.flush()
        _flush_feedback(self.feedback)
        return len(batch)  # NOTE: progress only; the results are in the store


SERVE_ATTEMPTS = 3  # a row whose offline replica goes away under it is sent again this many times in all


class ServeStage:
    """Actor that sends every row of a batch to a running foreserve app's offline pool (whose
    replicas run the same engine, and whose router and autoscaler see the batch's load) at once."""

    def __init__(self, engine: dict, out: str, app_name: str) -> None:
        from ray import serve
        from app.engine.text.tokenizer import load_tokenizer

        self.config = EngineConfig.model_validate(engine)
        self.limit = self.config.sequence_limit_tokens()
        self.tokenizer = load_tokenizer(self.config.model_path, self.config.chat_template)
        self.app_name = app_name
        self.pool = serve.get_deployment_handle("offline", app_name).options(stream=True)
        self.store = ResultStore(out)

    def _one(self, row: InputRow, prediction: Prediction, text: str) -> ResultRow:
        from deployments.engine_server import GenerateRequest

        config = self.config
        try:
            ids, max_tokens = request_prompt(self.tokenizer, row.request, self.limit, config.default_max_tokens)
        except APIError as exc:
            row.error = f"line {row.line}: {exc}"
            return error_row(row)
        # NOTE: a max fallback's NO_BOUND reserves max_tokens
        prediction = prediction.model_copy(update={"bound_tokens": min(prediction.bound_tokens, max_tokens)})
        request = GenerateRequest(request_id=f"batch-{uuid.uuid4().hex}", prompt_token_ids=ids, num_prompt_tokens=len(ids),
                                  sampling=_sampling(row.request, max_tokens), prediction=prediction, predictor_text=text)
        from ray.exceptions import ActorUnavailableError, RayActorError

        from deployments.pool_gate import wait_until_up

        for attempt in range(1, SERVE_ATTEMPTS + 1):
            texts, last = [], None
            if attempt > 1:  # NOTE: the replica went away: the pool may have yielded to online
                wait_until_up(self.app_name, "offline")
            try:
                for item in self.pool.generate.remote(request.model_dump()):
                    if "error" in item:
                        row.error = f"line {row.line}: {item['error']['message']}"
                        return error_row(row)
                    texts.append(item["text"])
                    last = item
                break
            except (RayActorError, ActorUnavailableError):
                # NOTE: the replica was drained by a scale-down (or died): requeue the row, recompute it
                if attempt == SERVE_ATTEMPTS:
                    raise
        body = completion_body(request.request_id, row.request.model, "".join(texts), last["prompt_tokens"],
                               last["completion_tokens"], last["finish_reason"], is_chat(row.request))
        return ok_row(row, body, prediction.bound_tokens)

    def run(self, batch: list[dict], key: str) -> int:
        """Send every row of ``batch`` not answered yet; the answers go to ``parts/<key>/`` in chunks."""
        from concurrent.futures import ThreadPoolExecutor, as_completed

        from deployments.pool_gate import wait_until_up

        results = self.store.writer(key, flush_rows=FLUSH_ROWS)
        rows = list(_rows(batch, self.store.done_lines(key)))
        if rows:  # NOTE: one controller query per batch, not per row: do not wake a pool yielded to online
            wait_until_up(self.app_name, "offline")
        with ThreadPoolExecutor(max_workers=len(rows) or 1) as pool:
            try:
                for future in as_completed([pool.submit(self._one, *args) for args in rows]):
                    results.append(future.result())
            finally:
                results.flush()  # NOTE: what finished before a failure stays answered
        return len(batch)


def running_app(app_name: str = "foreserve") -> bool:
    """Whether this Ray cluster runs a foreserve Serve app with an offline pool (checked without
    starting Serve)."""
    import ray

    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    if not any("SERVE_CONTROLLER" in name for name in names):
        return False
    from deployments.pool_gate import serve_status

    app = serve_status().applications.get(app_name)
    return app is not None and "offline" in app.deployments and app.status == "RUNNING"
