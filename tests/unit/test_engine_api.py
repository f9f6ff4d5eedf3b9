"""The engine's narrow API: one typed request in, one place that ends requests, an injected clock,
a state for preempted requests, and trace replay kept out of the engine (ReplayRunner)."""

from __future__ import annotations

import pytest

from app.engine.clock import ModelledClock, WallClock
from app.engine.request import EngineRequest, Prediction, RequestStatus, SamplingParams
from app.engine.sim.replay import REPLAY_EOS, ReplayRunner
from tests.engine_helpers import add, make_engine, run_all
from tests.fake_runner import EOS, FakeRunner


def test_a_preempted_request_says_so_until_it_is_admitted_again():
    engine = make_engine("paged", kv_tokens=64)  # 4 blocks; both need 50 tokens
    add(engine, "a", 10, 40)
    b = add(engine, "b", 10, 40)
    seen: list[RequestStatus] = []
    run_all(engine, on_step=lambda e: seen.append(b.status))
    assert RequestStatus.PREEMPTED in seen and b.num_preemptions >= 1
    first = seen.index(RequestStatus.PREEMPTED)
    assert RequestStatus.RUNNING in seen[first:]  # re-admitted after it
    assert b.status is RequestStatus.FINISHED_LENGTH and b.finish_reason == "length"


def test_abort_of_a_preempted_request_frees_nothing_twice():
    engine = make_engine("paged", kv_tokens=64)
    add(engine, "a", 10, 40)
    b = add(engine, "b", 10, 40)
    while b.status is not RequestStatus.PREEMPTED:
        engine.step()
    assert engine.abort("b") and b.finish_reason == "abort"
    run_all(engine)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_eos_ends_a_request_unless_ignored_and_max_tokens_ends_it_as_length():
    engine = make_engine(kv_tokens=512, eos_at={"eos": 3, "ign": 3})
    for rid, ignore in (("eos", False), ("ign", True)):
        engine.add_request(EngineRequest(prompt_token_ids=[5] * 4, request_id=rid,
                                         sampling=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=ignore)))
    outputs = run_all(engine)
    assert [len(outputs["eos"]), outputs["eos"][-1].finish_reason, outputs["eos"][-1].new_token_ids] == [3, "stop", [EOS]]
    assert [len(outputs["ign"]), outputs["ign"][-1].finish_reason] == [6, "length"]


def test_replay_ends_each_request_at_its_recorded_length_and_never_before():
    inner = FakeRunner(16, eos_at={"early": 2})  # the fake model would stop "early" at 2 tokens
    engine = make_engine(kv_tokens=512)
    engine.runner = runner = ReplayRunner(inner, {"early": 9, "replayed": 5})
    for rid in ("early", "replayed", "free"):
        engine.add_request(EngineRequest(prompt_token_ids=[5] * 4, request_id=rid,
                                         sampling=SamplingParams(max_tokens=12, temperature=0.0)))
    outputs = run_all(engine)
    assert {rid: len(outs) for rid, outs in outputs.items()} == {"early": 9, "replayed": 5, "free": 12}
    tokens = [o.new_token_ids[0] for o in outputs["early"]]
    assert tokens[-1] == EOS and EOS not in tokens[:-1]  # its own early EOS was replaced
    assert outputs["early"][-1].finish_reason == "stop" and outputs["free"][-1].finish_reason == "length"
    assert runner.steps is inner.steps  # the wrapped runner's attributes show through


def test_replay_gives_a_runner_without_eos_one():
    class NoEos(FakeRunner):
        eos_token_id = None

    runner = ReplayRunner(NoEos(16), {"r": 3})
    assert runner.eos_token_id == REPLAY_EOS


def test_the_engine_keeps_no_time_of_its_own():
    engine = make_engine(step_s=0.25)
    assert isinstance(engine.clock, ModelledClock) and engine.clock() == 0.0
    add(engine, "a", 4, 3)
    run_all(engine)
    assert engine.clock() == pytest.approx(0.25 * engine.stats().steps)
    engine.clock.idle_until(100.0)
    assert engine.stats().wall_s == 100.0
    with pytest.raises(RuntimeError, match="modelled"):
        WallClock().idle_until(1.0)


def test_a_given_prediction_travels_whole_and_the_engine_asks_its_predictor_otherwise():
    engine = make_engine(kv_tokens=512)
    given = Prediction(bucket=3, probabilities=(0.0, 0.0, 0.0, 1.0), bound_tokens=40, rank_tokens=12.5, version="7")
    req = engine.add_request(EngineRequest(prompt_token_ids=[5] * 4, request_id="given", prediction=given,
                                           sampling=SamplingParams(max_tokens=30)))
    assert req.prediction is given and req.predicted_output_tokens == 30  # clamped to max_tokens
    own = engine.add_request(EngineRequest(prompt_token_ids=[5] * 4, request_id="own", sampling=SamplingParams(max_tokens=30)))
    assert own.prediction.version == engine.predictor.version and own.prediction.bound_tokens >= 30  # the max predictor
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request(EngineRequest(request_id="nothing"))


def test_a_request_whose_row_cannot_be_sampled_fails_alone():
    """The runner's None for one row (NaN logits) ends that request with an error and frees its
    blocks; the requests in the same steps finish with every token, and the engine goes on."""
    engine = make_engine("paged", kv_tokens=256)
    inner = engine.runner.execute

    def poisoned(out):
        result = inner(out)
        for c in out.chunks:
            if c.request_id == "bad" and c.sample and c.num_output_tokens == 3:
                result.sampled_token_ids[c.request_id] = None
        return result

    engine.runner.execute = poisoned
    for rid in ("a", "bad", "c"):
        add(engine, rid, 10, 8)
    outputs = run_all(engine)
    last = outputs["bad"][-1]
    assert (last.finished, last.finish_reason, last.num_output_tokens, last.new_token_ids) == (True, "error", 3, [])
    assert "NaN" in last.error and all(o.error is None for o in outputs["bad"][:-1])
    for rid in ("a", "c"):
        assert [o.num_output_tokens for o in outputs[rid]] == list(range(1, 9)) and outputs[rid][-1].error is None
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    add(engine, "after", 10, 4)
    assert run_all(engine)["after"][-1].finish_reason == "length"


def test_a_burst_is_not_taken_whole():
    """Requests queued ahead count as others ahead: of a burst of short requests into a KV pool that
    holds two at a time (five 50 ms steps each), those whose turn comes within the 1 s limit are taken,
    the rest refused at once (the ingress's 429 with Retry-After); an answer resumed from a lost replica
    is always taken; and once the queue has moved, new requests are taken again."""
    from app.engine.engine import EngineOverloaded
    from tests.engine_helpers import run_all

    engine = make_engine("reserve_max", kv_tokens=32, block=16, max_queue_delay_ms=1000, step_s=0.05)
    for i in range(4):  # before the pace is known (the warm-up steps): nothing is shed
        add(engine, f"warm{i}", 10, 5)
    run_all(engine)
    taken, refused = [], []
    for i in range(12):
        try:
            add(engine, f"b{i}", 10, 5)
            taken.append(f"b{i}")
        except EngineOverloaded as exc:
            assert "others ahead" in str(exc)
            refused.append(f"b{i}")
    assert taken == [f"b{i}" for i in range(len(taken))] and 4 <= len(taken) <= 8 and refused  # waves of two, 0.25 s each
    engine.add_request(EngineRequest(request_id="resumed", prompt_token_ids=[5] * 10, resume_output_token_ids=[7, 7],
                                     sampling=SamplingParams(max_tokens=5, ignore_eos=True),
                                     prediction=Prediction(bucket=0, bound_tokens=5)))
    outputs = run_all(engine)
    assert all(outputs[rid][-1].num_output_tokens == 5 and outputs[rid][-1].error is None for rid in taken)
    add(engine, "after", 10, 5)


def test_without_a_queue_delay_limit_nothing_is_shed():
    """The queue that the limit sheds from above (12 behind a pool of two) is all taken without one."""
    from tests.engine_helpers import run_all

    engine = make_engine("reserve_max", kv_tokens=32, block=16, step_s=0.05)
    for i in range(4):
        add(engine, f"warm{i}", 10, 5)
    run_all(engine)
    for i in range(12):
        add(engine, f"b{i}", 10, 5)
    assert len(engine.scheduler.waiting) + len(engine.scheduler.running) == 12
    outputs = run_all(engine)
    assert all(outputs[f"b{i}"][-1].num_output_tokens == 5 and outputs[f"b{i}"][-1].error is None for i in range(12))


def test_kv_frees_at_the_running_answers_predicted_ends():
    from app.engine.ttft import admission_steps

    def steps_until_admitted(*args, **kwargs) -> int | None:  # the last request's start
        starts = admission_steps(*args, **kwargs)
        return None if starts is None else starts[-1]

    assert steps_until_admitted(10, 10, []) == 0  # fits now
    assert steps_until_admitted(80, 10, [(50, 40), (5, 30), (20, 40)]) == 20  # 10 + 30 (at 5) + 40 (at 20)
    # behind a queued request of 40 tokens for 100 steps: it takes the first 40 freed (at 20), so 80 at 50
    assert steps_until_admitted(80, 10, [(50, 40), (5, 30), (20, 40)], [(100, 40)]) == 50
    # a pool of 32 holding two 16-token answers of 5 steps, 6 more queued: waves of two, 5 steps each
    assert steps_until_admitted(16, 0, [(5, 16), (5, 16)], [(5, 16)] * 6) == 20
    assert steps_until_admitted(200, 10, [(5, 30)]) is None  # more than the whole pool
    # KV to spare, but two sequences at most: the third starts at the first end, the fourth at the second
    assert steps_until_admitted(10, 1000, [(5, 10), (9, 10)], slots=2) == 5
    assert steps_until_admitted(10, 1000, [(5, 10), (9, 10)], [(30, 10)], slots=2) == 9


def test_new_requests_are_shed_when_their_kv_frees_past_the_queue_delay():
    """The rate of first tokens lags when long answers fill the KV: a new request whose reservation
    frees only at the running answers' predicted ends, past the limit at the engine's step time, is
    refused; one that fits in what is left, or whose KV frees in time, is taken."""
    from app.engine.engine import EngineOverloaded

    engine = make_engine("reserve_predicted", kv_tokens=256, max_queue_delay_ms=1000, step_s=0.05)
    for rid in ("long1", "long2"):
        add(engine, rid, 10, 100, predicted=100)  # 110 tokens each of the 256
    for _ in range(8):
        engine.step()
    assert engine.scheduler.recent_step_s is None  # warm-up steps say nothing of the pace: nothing shed on it
    add(engine, "early", 10, 100, predicted=100)
    engine.abort("early")
    for _ in range(4):
        engine.step()
    assert engine.scheduler.recent_step_s == pytest.approx(0.05)
    with pytest.raises(EngineOverloaded, match=r"first token is about 4\.\d s away"):
        add(engine, "big", 10, 100, predicted=100)  # waits ~95 steps of 0.05 s for long1's end
    assert "big" not in engine.scheduler.requests
    add(engine, "small", 10, 10, predicted=10)  # 20 tokens: fits in the 36 left
    while engine.scheduler.requests["long1"].num_output_tokens < 85:
        engine.step()
    add(engine, "big", 10, 100, predicted=100)  # long1 ends in ~15 steps: 0.75 s
    run_all(engine)


def test_new_requests_are_shed_when_a_batch_slot_frees_past_the_queue_delay():
    """KV to spare does not make room when the running batch is full (``max_num_seqs``, or the
    online scheduler's TPOT cap): a new request starts only as a running answer ends, and is
    refused when that is past the limit at the engine's step time."""
    from app.engine.engine import EngineOverloaded

    engine = make_engine("reserve_predicted", kv_tokens=4096, max_num_seqs=2, max_queue_delay_ms=1000, step_s=0.05)
    for rid in ("long1", "long2"):
        add(engine, rid, 10, 100, predicted=100)
    for _ in range(12):
        engine.step()
    assert engine.scheduler.recent_step_s == pytest.approx(0.05)
    with pytest.raises(EngineOverloaded, match=r"first token is about 4\.\d s away"):
        add(engine, "third", 10, 10, predicted=10)  # ~88 steps of 0.05 s until long1 ends
    while engine.scheduler.requests["long1"].num_output_tokens < 85:
        engine.step()
    add(engine, "third", 10, 10, predicted=10)  # long1 ends in ~15 steps: 0.75 s
    run_all(engine)


def test_new_requests_are_shed_when_the_prompts_ahead_take_past_the_queue_delay():
    """Room in the KV and the batch does not compute a prompt: each step carries the running
    answers' decodes first and prompts in what its token budget leaves. With 30 answers decoding
    in steps of 32 tokens, two a step go to prompts: a 100-token prompt is 50 steps (2.5-2.7 s: steps
    of 32 tokens priced proportionally past the 30 measured) away from its first token, past the limit;
    a 10-token one is 5 steps away, taken."""
    from app.engine.engine import EngineOverloaded

    engine = make_engine("reserve_predicted", kv_tokens=8192, max_num_batched_tokens=32, max_queue_delay_ms=1000,
                         step_s=0.05)
    for i in range(30):
        add(engine, f"long{i}", 1, 100, predicted=100)
    for _ in range(12):
        engine.step()
    assert sum(1 for r in engine.scheduler.running if r.output_token_ids) == 30
    with pytest.raises(EngineOverloaded, match=r"first token is about 2\.\d s away"):
        add(engine, "long prompt", 100, 10, predicted=10)
    add(engine, "short prompt", 10, 10, predicted=10)
    for _ in range(5):
        engine.step()
    assert engine.scheduler.requests["short prompt"].num_output_tokens == 1  # as estimated


def test_each_step_of_the_estimate_is_priced_at_what_steps_of_its_size_took():
    """Steps that carry prompt chunks take longer than the decode-only steps that set the recent
    step time (10 ms + 1 ms a token here: 18 ms for 8 decodes, 74 ms at the 64-token budget). An
    1,800-token prompt behind 8 decodes is 33 steps of 56 prompt tokens and one of 8: about 2.4 s,
    which the estimate gives and the engine takes; the recent pace alone said 0.6 s."""
    # NOTE: the knee alone: steps up to 3.5 one-token steps (38.5 ms) would hold 28 tokens, not 64
    engine = make_engine("reserve_predicted", "online", kv_tokens=16384, max_num_batched_tokens=64,
                         max_queue_delay_ms=2000, step_s=lambda out: 0.010 + 0.001 * out.num_tokens,
                         tpot_slowdown=None)
    for i in range(8):
        add(engine, f"long{i}", 16, 400, predicted=400)
    for _ in range(40):
        engine.step()
    assert engine.scheduler.recent_step_s == pytest.approx(0.018, rel=0.05)
    req = add(engine, "long prompt", 1800, 10, predicted=10)  # alone 29 steps of 64 (2.1 s): taken
    assert req.ttft_estimate_s == pytest.approx(32 * 0.074 + (0.010 + 8 + 8) * 0.001 + 0.018, rel=0.02)
    assert req.own_ttft_s == pytest.approx(28 * 0.074 + 0.010 + 0.001 * 8, rel=0.02)
    start = engine.clock()
    while not engine.scheduler.requests["long prompt"].output_token_ids:
        engine.step()
    assert engine.clock() - start == pytest.approx(req.ttft_estimate_s, rel=0.05)


def run_recording_first_tokens(engine) -> tuple[dict[str, list], dict[str, float]]:
    """Step ``engine`` until done: each request's outputs, and the clock at its first token."""
    firsts: dict[str, float] = {}
    outputs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
            if out.new_token_ids and out.request_id not in firsts:
                firsts[out.request_id] = engine.clock()
    return outputs, firsts


def test_a_request_still_unstarted_when_its_wait_passes_the_queue_delay_is_refused_then():
    """The admission tests estimate; steps that slow down after admission make the estimate late.
    So a request admitted but not started (no KV, nothing computed) when it has waited past
    ``max_queue_delay_ms`` is refused then (``retryable``: the ingress's 429 with Retry-After), as
    Triton's queue policy rejects on timeout: every answer's first token comes within the limit
    and its own prefill. A request already started, and an answer resumed from a lost replica,
    are never refused."""
    limit_s, step_s = 1.0, 0.05
    engine = make_engine("reserve_max", kv_tokens=32, block=16, max_queue_delay_ms=limit_s * 1000, step_s=step_s)
    for i in range(12):  # taken before the first step (no pace known): two fit in the KV at a time
        add(engine, f"b{i}", 10, 5)
    engine.add_request(EngineRequest(request_id="resumed", prompt_token_ids=[5] * 10, resume_output_token_ids=[7],
                                     sampling=SamplingParams(max_tokens=5, ignore_eos=True),
                                     prediction=Prediction(bucket=0, bound_tokens=5)))
    outputs, firsts = run_recording_first_tokens(engine)
    ready = engine.shedder.ready_s
    refused = sorted(rid for rid, outs in outputs.items() if outs[-1].error is not None)
    assert refused and len(refused) < 12
    for rid in refused:  # refused whole, with no token, as the ingress's 429
        (out,) = outputs[rid]
        assert out.finished and out.retryable and out.new_token_ids == [] and "max_queue_delay_ms" in out.error
    for rid in set(outputs) - set(refused):  # answered whole, its first token within the limit and a prefill
        assert outputs[rid][-1].num_output_tokens == 5 and outputs[rid][-1].error is None
        assert rid == "resumed" or firsts[rid] - ready <= limit_s + step_s + 1e-9, (rid, firsts[rid] - ready)
    assert "resumed" not in refused
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_an_unstarted_request_whose_prompt_could_not_be_computed_within_the_queue_delay_is_refused():
    """A prompt takes steps to compute after its request starts: one started just before its wait
    passes ``max_queue_delay_ms`` gives its first token past the limit, an answer that misses its
    TTFT objective whatever comes after, and whose steps delay the others. So an unstarted request
    is refused once its own prompt, at the step budget the running decodes leave and the recent
    step time, can no longer be computed within the limit: every answer's first token comes within it."""
    limit_s, step_s = 1.0, 0.05
    engine = make_engine("reserve_max", kv_tokens=128, block=16, max_queue_delay_ms=limit_s * 1000, step_s=step_s,
                         max_num_batched_tokens=16)
    for i in range(12):  # 48-token prompts, 3 steps each at 16 tokens a step; two fit in the KV at a time
        add(engine, f"b{i}", 48, 5)
    outputs, firsts = run_recording_first_tokens(engine)
    ready = engine.shedder.ready_s
    refused = [rid for rid, outs in outputs.items() if outs[-1].error is not None]
    assert refused and len(refused) < 12
    for rid in refused:
        assert outputs[rid][-1].retryable and outputs[rid][-1].new_token_ids == []
    for rid in set(outputs) - set(refused):
        assert outputs[rid][-1].num_output_tokens == 5
        assert firsts[rid] - ready <= limit_s + 1e-9, (rid, firsts[rid] - ready)


def test_a_resumed_answer_recomputing_its_tokens_counts_as_a_prompt_ahead_not_a_decode():
    """An answer resumed from a lost replica (or preempted) has output tokens but no KV: until its
    prompt and tokens so far are computed again it takes prompt room from each step, not one decode
    token, and a new prompt waits behind it."""
    from app.engine.ttft import estimate_ttft

    engine = make_engine("reserve_predicted", kv_tokens=8192, max_num_batched_tokens=32, max_queue_delay_ms=10_000,
                         step_s=lambda out: 0.010 + 0.001 * out.num_tokens)
    for i in range(9):  # past the warm-up: the pace of full steps is known
        add(engine, f"warm{i}", 32, 1)
        engine.step()
    add(engine, "decoding", 10, 50, predicted=50)
    engine.step()
    engine.add_request(EngineRequest(request_id="resumed", prompt_token_ids=[5] * 10, resume_output_token_ids=[7] * 40,
                                     sampling=SamplingParams(max_tokens=100, ignore_eos=True),
                                     prediction=Prediction(bucket=0, bound_tokens=100)))  # 50 tokens to compute again
    new = add(engine, "new", 20, 5, predicted=5)
    # 50 + 20 tokens behind one decode, 31 a step: two full steps (42 ms) and one of 1 + 8 tokens
    assert new.ttft_estimate_s == pytest.approx(2 * 0.042 + 0.019, rel=0.05)
    assert new.own_ttft_s == pytest.approx(0.030)  # 20 tokens alone
    sched = engine.scheduler
    estimate = estimate_ttft(new, sched, engine.policy.reservation_tokens, engine.pool.capacity_tokens)
    assert (estimate.total_s, estimate.own_s) == (new.ttft_estimate_s, new.own_ttft_s)
    while not new.output_token_ids:
        engine.step()
    assert engine.clock() - new.arrival_s == pytest.approx(0.104)  # 42 + 42 + 20 ms (the third step: 10 tokens)
