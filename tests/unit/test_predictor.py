"""The length predictor: buckets, decoding, metrics, input recipe, deterministic training, save/load,
the engine's feedback hook and its fallback when the predictor breaks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from predictor.base import LengthPrediction, LengthPredictor, OraclePredictor
from predictor.buckets import LengthBuckets
from predictor.training.dataset import Example, feedback_examples, read_eval_file, training_examples
from predictor.feedback import FeedbackRecord, read_feedback
from predictor.learned import LearnedPredictor, decode
from predictor.training.metrics import score_predictions
from predictor.model import LengthModel, ModelSpec, backbone_path, encode_prompts
from predictor.training.retrain import RetrainPolicy, is_holdout, mispredicted, trigger_reason
from predictor.training.train import TrainConfig, make_batches, train_model
from tests.engine_helpers import make_engine, run_all

B = LengthBuckets()  # 10 buckets of 102.4 tokens over 1024


@pytest.mark.parametrize(
    "tokens,bucket", [(0, 0), (1, 0), (102, 0), (103, 1), (512, 4), (513, 5), (1023, 9), (1024, 9), (1025, 9), (10**6, 9)]
)
def test_bucket_edges(tokens, bucket):
    assert B.bucket_of(tokens) == bucket
    if 0 < tokens <= B.max_tokens:
        assert B.upper_bound_tokens(bucket) >= tokens


def test_upper_bounds_are_integers_covering_the_range():
    assert [B.upper_bound_tokens(b) for b in range(10)] == [102, 204, 307, 409, 512, 614, 716, 819, 921, 1024]


@pytest.mark.parametrize("max_tokens,num_buckets", [(1024, 10), (3000, 35), (1000, 7), (4096, 13), (5, 10)])
def test_every_length_sits_in_the_bucket_whose_bound_covers_it(max_tokens, num_buckets):
    b = LengthBuckets(max_tokens=max_tokens, num_buckets=num_buckets)
    for n in range(1, max_tokens + 1):
        k = b.bucket_of(n)  # n in (k*M/N, (k+1)*M/N], exactly
        assert k * max_tokens < n * num_buckets <= (k + 1) * max_tokens
        assert b.upper_bound_tokens(k) >= n and (k == 0 or b.upper_bound_tokens(k - 1) < n)


def test_oracle_gives_a_repeated_prompt_each_of_its_lengths_in_order():
    # ShareGPT repeats prompts with other answers: keyed by text alone, all but one got a wrong bucket
    oracle = OraclePredictor([("hi", 50), ("bye", 300), ("hi", 900)], B)
    assert oracle.predict(["hi", "bye", "hi"]).bound_tokens == [102, 307, 921]
    assert oracle.predict(["hi", "bye", "hi"]).rank_tokens == [50.0, 300.0, 900.0]  # exact: orders perfectly
    assert oracle.predict(["hi"]).bound_tokens == [102]  # every call starts again from the first
    assert oracle.predict(["hi", "hi", "hi"]).buckets == [0, 8, 8]  # past the recorded ones: the last
    assert OraclePredictor({"a": 1024}, B).predict(["a"]).buckets == [9]
    with pytest.raises(KeyError, match="no true length for 1 prompt"):
        oracle.predict(["unknown"])


def test_training_examples_add_later_turns_but_no_validation_prompt(tmp_path):
    splits = {"train": [("first", 10)], "validation": [("asked later too", 7)],
              "train_later": [("continue", 300), ("asked later too", 50)]}
    for split, rows in splits.items():  # the traces' format: what app.prepare.traces writes
        lines = [json.dumps({"id": "id", "user": u, "prompt": f"<{u}>", "prompt_tokens": 3, "output_tokens": n}) for u, n in rows]
        (tmp_path / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    assert training_examples(tmp_path, "first") == [Example("first", 10)]
    assert training_examples(tmp_path, "all") == [Example("first", 10), Example("continue", 300)]
    with pytest.raises(ValueError, match="turns"):
        training_examples(tmp_path, "some")


def test_decode_bound_follows_the_quantile():
    spec = ModelSpec()
    probs = np.array([[0.5, 0.3, 0.2] + [0.0] * 7, [0.0] * 9 + [1.0], [0.1] * 10], dtype=np.float32)
    argmax, bounds, expected = decode(probs, spec, 0.8)
    assert argmax.tolist() == [0, 9, 0]
    assert bounds.tolist() == [204, 1024, 819]  # cdf 0.5, 0.8 -> bucket 1; last; 8th bucket
    assert decode(probs, spec, 0.5)[1].tolist() == [102, 1024, 512]
    assert expected[1] == pytest.approx(9.5 * 102.4)


def test_a_pool_reserves_at_its_own_quantile_of_the_predicted_distribution(tmp_path):
    from app.config import EngineConfig
    from app.engine.request import EngineRequest, Prediction, SamplingParams
    from predictor.base import NO_BOUND
    from predictor.feedback import FeedbackWriter

    probs = [0.5, 0.3, 0.2] + [0.0] * 7
    assert B.quantile_bound_tokens(probs, 0.7) == 204 and B.quantile_bound_tokens(probs, 0.5) == 102
    assert B.quantile_buckets(np.array([probs, [0.1] * 10]), 0.8).tolist() == [1, 7]
    offline, online = EngineConfig(bound_quantile=0.5), EngineConfig(bound_quantile=0.8)
    assert (offline.reservation_bound(probs, 204), online.reservation_bound(probs, 102)) == (102, 204)
    assert offline.reservation_bound(probs, 204, range_tokens=2048) == 204  # buckets of 204.8 tokens
    assert offline.reservation_bound(None, 300) == 300  # no distribution sent: the predictor's bound
    assert EngineConfig(bound_quantile=None).reservation_bound(probs, 300) == 300
    assert offline.reservation_bound([0.0] * 9 + [1.0], NO_BOUND) == NO_BOUND  # a max fallback stays max

    class Spread(LengthPredictor):  # the version's own bound: its 0.8 quantile
        name, version = "spread", "7"

        def predict(self, prompts) -> LengthPrediction:
            dist = np.array([[0.2] * 5 + [0.0] * 5] * len(prompts))
            return LengthPrediction([2] * len(prompts), dist, [self.buckets.quantile_bound_tokens(dist[0], 0.8)] * len(prompts))

    engine = make_engine(allocation="reserve_predicted", kv_tokens=512, default_max_tokens=100, bound_quantile=0.5)
    engine.predictor = Spread(engine.buckets)
    engine.feedback = FeedbackWriter(tmp_path)
    own = engine.add_request(EngineRequest(prompt_token_ids=[5] * 4, sampling=SamplingParams(max_tokens=100, ignore_eos=True),
                                           prompt="p", request_id="own"))
    assert own.predicted_output_tokens == 30  # the pool's 0.5 quantile, not the version's 40
    given = engine.add_request(EngineRequest(
        prompt_token_ids=[5] * 4, sampling=SamplingParams(max_tokens=100, ignore_eos=True), prompt="q", request_id="given",
        prediction=Prediction(bucket=2, probabilities=[0.2] * 5 + [0.0] * 5, bound_tokens=30, predictor_bound_tokens=40)))
    assert given.predicted_output_tokens == 30  # a caller's bound is the pool's already: not re-read
    assert engine.abort("own") and engine.abort("given")
    bounds = {r.request_id: r.predicted_bound_tokens for r in read_feedback(tmp_path)}
    assert bounds == {"own": 40, "given": 40}  # feedback keeps the predictor's own bound


def test_metrics_on_known_arrays():
    true = np.array([10, 150, 300, 2000])  # buckets 0, 1, 2, 9 (2000 counts as 1024)
    m = score_predictions(true, np.array([0, 2, 0, 9]), np.array([102, 204, 204, 1024]),
                          np.array([10, 150, 300, 1024]), np.array([1.0, 2.0, 3.0, 4.0]), B)
    assert m["n"] == 4
    assert m["exact_bucket_acc"] == 0.5
    assert m["within1_bucket_acc"] == 0.75
    assert m["kendall_tau"] == pytest.approx(1.0)
    assert m["mae_tokens"] == 0.0
    assert m["under_prediction_rate"] == 0.25  # 300 > 204


@pytest.fixture(scope="module")
def tokenizer():
    from predictor.encoder import WordPieceTokenizer

    return WordPieceTokenizer(backbone_path())


def test_long_prompts_keep_head_and_tail(tokenizer):
    spec = ModelSpec(max_input_tokens=32, head_tokens=10)
    text = "start " + "filler " * 200 + "the final question"
    ids = encode_prompts(tokenizer, [text, "short one"], spec)
    assert len(ids[0]) == 32
    assert ids[0][0] == tokenizer.cls_token_id and ids[0][-1] == tokenizer.sep_token_id
    decoded = tokenizer.decode(ids[0][1:-1])
    assert decoded.startswith("start filler") and decoded.endswith("the final question")
    assert len(ids[1]) == 4


def test_batches_cover_every_example_once_within_budget():
    rng = np.random.default_rng(0)
    lengths = list(rng.integers(3, 300, size=500))
    batches = make_batches(lengths, batch_tokens=1024, max_batch_size=16, rng=rng)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(500))
    for b in batches:
        assert len(b) <= 16
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 1024


TINY = [Example(f"question number {i} " + "word " * (i % 17), 20 + 37 * (i % 13)) for i in range(24)]
TINY_CONFIG = TrainConfig(epochs=1, batch_tokens=256, max_batch_size=8, seed=7)
TINY_SPEC = ModelSpec(max_input_tokens=32)


def test_training_is_deterministic_and_save_load_round_trips(tmp_path):
    torch.set_num_threads(1)
    m1, tok, h1 = train_model(TINY, TINY[:8], TINY_SPEC, TINY_CONFIG)
    m2, _, h2 = train_model(TINY, TINY[:8], TINY_SPEC, TINY_CONFIG)
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert h1 == [{**h2[0], "train_examples_per_s": h1[0]["train_examples_per_s"]}]
    m3, _, _ = train_model(TINY, None, TINY_SPEC, TINY_CONFIG.model_copy(update={"seed": 8}))
    assert not torch.equal(m3.bucket_head.weight, m1.bucket_head.weight)

    m1.save(tmp_path / "m", tok)
    loaded = LearnedPredictor.from_dir(tmp_path / "m", version="7")
    direct = LearnedPredictor(m1, tok).predict([e.text for e in TINY[:5]])
    again = loaded.predict([e.text for e in TINY[:5]])
    assert loaded.version == "7" and loaded.spec == m1.spec
    assert again.buckets == direct.buckets and again.bound_tokens == direct.bound_tokens
    np.testing.assert_allclose(again.probabilities, direct.probabilities, atol=1e-6)
    assert len(again.scores) == 5 and len(again.expected_tokens) == 5
    # the ranking estimate is the score in tokens: same order, within [1, max_tokens]
    ranks, scores = np.array(again.rank_tokens), np.array(again.scores)
    assert all(1.0 <= r <= TINY_SPEC.max_tokens for r in ranks)
    assert all((ranks[i] < ranks[j]) == (scores[i] < scores[j]) for i in range(5) for j in range(5) if i != j)

    # `plan scheduler-ab` replays a real predictor at the quantile it is given (the online pool's)
    from autoscale.planning.capacity import Workload
    from autoscale.planning.scheduler_ab import predict_workload

    work = Workload([10] * 5, [100] * 5, TINY_SPEC.max_tokens, [e.text for e in TINY[:5]])
    bounds = {}
    for q in (0.3, 0.99):
        want = LearnedPredictor.from_dir(tmp_path / "m", bound_quantile=q).predict(work.texts).bound_tokens
        bounds[q] = predict_workload(work, str(tmp_path / "m"), q).bounds
        assert bounds[q] == list(want)
    assert bounds[0.3] != bounds[0.99]
    assert predict_workload(work, str(tmp_path / "m")).bounds == list(again.bound_tokens)  # the version's own


def test_corrupt_model_dir_is_a_clear_error(tmp_path):
    (tmp_path / "bad").mkdir()
    with pytest.raises(ValueError, match="missing model.safetensors"):
        LengthModel.load(tmp_path / "bad")
    for name in ("model.safetensors", "predictor.json", "config.json"):
        (tmp_path / "bad" / name).write_text("garbage")
    with pytest.raises(ValueError, match="cannot load the length predictor"):
        LengthModel.load(tmp_path / "bad")


class BrokenPredictor(LengthPredictor):
    name = "broken"

    def predict(self, prompts) -> LengthPrediction:
        raise RuntimeError("model weights are gone")


def test_engine_falls_back_to_max_when_the_predictor_fails():
    engine = make_engine(allocation="reserve_predicted", kv_tokens=512)
    engine.predictor = BrokenPredictor(engine.buckets)
    from app.engine.request import EngineRequest, SamplingParams

    req = engine.add_request(EngineRequest(prompt_token_ids=[5] * 10, sampling=SamplingParams(max_tokens=40, ignore_eos=True),
                                           prompt="hello", request_id="r"))
    assert req.predicted_output_tokens == 40  # the max bound, clipped to max_tokens
    assert engine.stats().predictor_fallbacks == 1
    # past the buckets' range (default_max_tokens 100) it still reserves the request's whole max_tokens
    long = engine.add_request(EngineRequest(prompt_token_ids=[5] * 10, sampling=SamplingParams(max_tokens=300, ignore_eos=True),
                                            prompt="hi", request_id="l"))
    assert long.predicted_output_tokens == 300 and engine.stats().predictor_fallbacks == 2
    assert engine.abort("l")
    outs = run_all(engine)
    assert outs["r"][-1].finished and outs["r"][-1].num_output_tokens == 40


def test_engine_writes_one_feedback_record_per_finished_request(tmp_path):
    from app.engine.request import EngineRequest, Prediction, SamplingParams
    from predictor.feedback import FeedbackWriter

    engine = make_engine(allocation="reserve_predicted", kv_tokens=512, eos_at={"eos": 7, "over": 25})
    engine.feedback = FeedbackWriter(tmp_path)

    def add(request_id: str, sampling: SamplingParams, text: str | None = None, version: str | None = None, **kw):
        prediction = Prediction(bucket=0, bound_tokens=10, version=version) if text else None
        engine.add_request(EngineRequest(prompt_token_ids=[5] * 8, sampling=sampling, request_id=request_id,
                                         predictor_text=text, prediction=prediction, **kw))

    add("long", SamplingParams(max_tokens=30, ignore_eos=True), "write a lot", "3", tier="offline")
    add("eos", SamplingParams(max_tokens=30), "say hi", "3")
    add("gone", SamplingParams(max_tokens=30), "bye")
    add("over", SamplingParams(max_tokens=30), "tell me more")
    add("untracked", SamplingParams(max_tokens=30))  # no predictor text
    assert engine.abort("gone")
    run_all(engine)
    by_id = {r.request_id: r for r in read_feedback(tmp_path)}
    assert sorted(by_id) == ["eos", "gone", "long", "over"]
    assert (by_id["long"].output_tokens, by_id["long"].finish_reason, by_id["long"].tier) == (30, "length", "offline")
    assert by_id["long"].source == "offline" and by_id["long"].predictor_version == "3"
    assert (by_id["eos"].output_tokens, by_id["eos"].finish_reason) == (7, "stop")  # EOS counted
    assert by_id["long"].ignore_eos and not by_id["eos"].ignore_eos  # a client's length is no label
    assert by_id["eos"].predicted_bound_tokens == 10 and by_id["eos"].prompt == "say hi"
    assert (by_id["gone"].output_tokens, by_id["gone"].finish_reason) == (0, "abort")
    # the bound as admitted, not as grown: an answer that outgrew it is a misprediction
    over = by_id["over"]
    assert (over.output_tokens, over.predicted_bound_tokens, by_id["long"].predicted_bound_tokens) == (25, 10, 10)
    assert mispredicted(over, LengthBuckets(max_tokens=1024, num_buckets=10))


def _record(i: int, out: int, bound: int | None, bucket: int | None, reason: str = "stop",
            ignore_eos: bool = False) -> FeedbackRecord:
    return FeedbackRecord(request_id=str(i), prompt=f"p{i}", predicted_bucket=bucket, predicted_bound_tokens=bound,
                          output_tokens=out, finish_reason=reason, tier="online", model_id="m", predictor_version="1",
                          ignore_eos=ignore_eos)


def test_feedback_labels_and_retrain_trigger():
    recs = [_record(0, 50, 102, 0), _record(1, 300, 102, 0), _record(2, 1024, 1024, 9, "length"),
            _record(3, 200, 1024, 9, "length"), _record(4, 5, 102, 0, "abort")]
    assert [e.output_tokens for e in feedback_examples(recs, 1024)] == [50, 300, 1024]  # censored/aborted dropped
    assert mispredicted(recs[1], B) and not mispredicted(recs[0], B)
    # A client that ignored EOS ran to its own length: neither a label nor a misprediction.
    forced = [_record(5, 1024, 1024, 0, "length", ignore_eos=True), _record(6, 40, 40, 9, "stop", ignore_eos=True)]
    assert feedback_examples(forced, 1024) == []
    # Cut by its own max_tokens: at least that long, so only a prediction too short shows.
    assert not mispredicted(recs[3], B)  # 200 tokens cut, bucket 9 predicted: may well be right
    assert mispredicted(_record(7, 600, 1024, 0, "length"), B)  # cut at 600, bucket 0 predicted: too short
    policy = RetrainPolicy(every_records=10, min_records=4, window_records=4, mispredict_rate=0.5)
    assert trigger_reason(recs[:3], policy, B) is None  # fewer than min_records
    calm = [_record(i, 50, 102, 0) for i in range(6)]
    assert trigger_reason(calm, policy, B) is None
    assert "misprediction rate" in trigger_reason(calm + [_record(9, 900, 102, 0)] * 3, policy, B)
    assert "new labelled feedback records" in trigger_reason(calm * 2, policy, B)
    censored = [_record(3, 200, 1024, 9, "length")] * 8  # "at least 200": no label, counts toward no total
    assert trigger_reason(calm[:3] + censored, policy, B) is None
    # the window is the latest records by time, whatever order the writers' files were read in
    late_calm = [r.model_copy(update={"timestamp_s": 2e9}) for r in calm]
    early_bad = [_record(9, 900, 102, 0).model_copy(update={"timestamp_s": 1e9})] * 3
    assert trigger_reason(late_calm + early_bad, policy, B) is None
    assert trigger_reason(calm + forced * 4, policy, B) is None  # forced lengths count toward nothing
    assert is_holdout("same text", 0.2) == is_holdout("same text", 0.2)
    assert 0.1 < np.mean([is_holdout(f"prompt {i}", 0.2) for i in range(2000)]) < 0.3


def test_eval_file_errors_name_the_line(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "output_tokens": 3}) + "\n" + '{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="eval.jsonl:2"):
        read_eval_file(path)
    with pytest.raises(FileNotFoundError):
        read_eval_file(tmp_path / "nope.jsonl")


def test_micro_batches_bound_padding_and_cover_everything():
    class Stub(LearnedPredictor):
        def __init__(self):
            self.batch_size, self.max_batch_tokens = 4, 100

    lengths = [10, 500, 12, 11, 13, 9, 50, 49]
    batches = Stub()._micro_batches(lengths)
    assert sorted(i for b in batches for i in b) == list(range(8))
    for b in batches:
        assert len(b) <= 4 and (len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 100)
    assert [1] in [list(b) for b in batches]  # the long prompt runs alone


def test_a_job_resolves_its_predictor_once_or_falls_back_to_max(tmp_path, monkeypatch):
    from predictor.loading import load_predictor_or_max, resolve_predictor
    from predictor.store import Store

    store = Store(tmp_path, f"sqlite:///{tmp_path / 'empty.db'}")
    assert resolve_predictor("max") == ("max", "0")
    assert resolve_predictor(str(tmp_path)) == (str(tmp_path), f"dir:{tmp_path}")
    assert resolve_predictor("no-such-name") == ("max", "max-fallback")
    assert resolve_predictor("champion", store) == ("max", "max-fallback")  # an empty registry has none
    predictor = load_predictor_or_max("max", version="max-fallback")  # what the job's actor then loads
    assert predictor.name == "max" and predictor.version == "max-fallback"


def test_inputs_padded_to_a_multiple_predict_what_exact_widths_do(monkeypatch):
    """Inference pads each micro-batch to a multiple of ``PAD_MULTIPLE`` tokens (a few shapes, so the
    replica's memory stays flat); the attention mask makes the padding change nothing."""
    from predictor import learned
    from predictor.model import collate

    ids, mask = collate([[5, 6, 7], [5]], pad_id=0, multiple=64)
    assert ids.shape == mask.shape == (2, 64) and mask.sum().item() == 4
    torch.set_num_threads(1)
    model, tok, _ = train_model(TINY, None, TINY_SPEC, TINY_CONFIG)
    texts = [e.text for e in TINY[:9]]
    padded = LearnedPredictor(model, tok, bf16=False).predict(texts)
    monkeypatch.setattr(learned, "PAD_MULTIPLE", 1)
    exact = LearnedPredictor(model, tok, bf16=False).predict(texts)
    assert padded.buckets == exact.buckets and padded.bound_tokens == exact.bound_tokens
    np.testing.assert_allclose(padded.probabilities, exact.probabilities, atol=1e-5)
    np.testing.assert_allclose(padded.scores, exact.scores, atol=1e-4)
