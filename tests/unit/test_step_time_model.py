"""The online scheduler's step sizing: the step-time model it learns from the steps it runs
(``StepTimeModel``: monotone, extrapolated, not dragged down by its own cap), the throughput knee,
the TPOT target and objective, and aging counted in measured steps."""

from __future__ import annotations

import random

import pytest

from tests.engine_helpers import make_engine


def test_online_tpot_cap_and_aging_follow_the_measured_steps():
    """The decode batch shrinks (to one) when even a small step misses the TPOT objective, never grows
    to the prefill floor; aging forgives aging_tokens_per_step tokens per measured step."""
    from app.engine.scheduler.online import MIN_STEP_TOKENS, TPOT_HEADROOM

    sched = make_engine("reserve_predicted", "online", tpot_slo_ms=250.0).scheduler
    assert sched.max_running() == sched.config.max_num_seqs and sched.aging_tokens_per_s() == 0.0  # nothing measured
    for tokens in (1, 4, 8, 16, 32, 1, 4, 8):  # a fixed cost above the objective: 300 ms + 1 ms a token
        sched.observe_step(tokens, 0.3 + 0.001 * tokens)
    assert sched.max_running() == 1 and sched.decode_step_budget() == MIN_STEP_TOKENS
    sched = make_engine("reserve_predicted", "online", tpot_slo_ms=250.0, tpot_slowdown=None).scheduler
    for tokens in (1, 4, 8, 16, 32, 1, 4, 8):  # 50 ms + 10 ms a token
        sched.observe_step(tokens, 0.05 + 0.01 * tokens)
    assert sched.max_running() == 16  # the knee: 16 tokens a step give 76 tokens/s, 95% of the 80 at the objective's 20
    assert int((TPOT_HEADROOM * 0.25 - 0.05) / 0.01) == 20
    sched.config.knee_throughput_fraction = 1.0
    assert sched.max_running() == 20  # steps fill up to the objective
    sched.config.knee_throughput_fraction = 0.9
    sched.config.tpot_slowdown = 4.0
    assert sched.max_running() == 16  # the knee, below four one-token steps (60 ms each: 240 ms, 19 tokens)
    sched.config.tpot_slowdown = 3.0
    assert sched.max_running() == 13  # three one-token steps, 180 ms, below the knee
    assert sched.aging_tokens_per_s() == 0.0  # the first 8 steps are a replica's warm-up: no pace yet
    for tokens in (1, 4, 8, 16, 32, 1, 4, 8):
        sched.observe_step(tokens, 0.05 + 0.01 * tokens)
    assert 0.25 / 0.37 < sched.aging_tokens_per_s() < 0.25 / 0.06  # a quarter token per (recent mean) step
    sched.config.aging_tokens_per_step = 1.0
    assert 1 / 0.37 < sched.aging_tokens_per_s() < 1 / 0.06
    fixed = make_engine("reserve_predicted", "online", aging_tokens_per_s=7.0).scheduler
    assert fixed.aging_tokens_per_s() == 7.0


def test_step_time_model_is_monotone_and_survives_its_own_cap():
    """Noisy steps at the size the cap allows must not drag the cap to one (the old straight-line fit
    did: its intercept rose above the objective and pinned the batch while requests waited)."""
    from app.engine.scheduler.online import StepTimeModel

    model = StepTimeModel()
    assert model.max_tokens_within(0.3) is None  # nothing measured yet
    for tokens, step_s in [(1, 0.08), (2, 0.09), (4, 0.13), (8, 0.17)] * 3:
        model.observe(tokens, step_s)
    rng = random.Random(0)
    for _ in range(300):
        model.observe(rng.choice([10, 11, 12]), rng.uniform(0.25, 0.6))
    # steps of 10-12 tokens average 0.42 s: the cap falls between 4 tokens (0.13 s) and them, not to one
    assert 4 < model.max_tokens_within(0.3) < 10
    points = model.curve()
    assert all(a[0] < b[0] or a[1] == b[1] for a, b in zip(points, points[1:]))
    assert all(a[1] <= b[1] for a, b in zip(points, points[1:]))
    assert model.max_tokens_within(0.05) == 0  # even one token misses: no step fits


def test_step_time_model_extrapolates_past_the_largest_step_run():
    from app.engine.scheduler.online import StepTimeModel

    model = StepTimeModel()
    for tokens, step_s in [(1, 0.05), (2, 0.06), (4, 0.08), (8, 0.1)] * 2:
        model.observe(tokens, step_s)
    assert model.max_tokens_within(0.2) == 16  # proportional past 8 tokens: 0.1 s * 16 / 8
    assert model.max_tokens_within(0.07) == 3  # interpolated between 2 (60 ms) and 4 (80 ms)


def test_knee_is_the_fewest_tokens_at_most_of_the_best_throughput():
    """Step time flat to 32 tokens, then linear (a GPU): the knee is where throughput stops rising;
    while it still rises at the largest size run, the steps may double to learn more."""
    from app.engine.scheduler.online import StepTimeModel

    model = StepTimeModel()
    assert model.knee_tokens(1000, 0.9) is None
    flat_then_linear = [(1, 0.010), (4, 0.010), (16, 0.010), (32, 0.010), (64, 0.020), (128, 0.040)]
    for tokens, step_s in flat_then_linear * 2:
        model.observe(tokens, step_s)
    assert model.knee_tokens(1000, 0.9) == 32  # 3,200 tokens/s from 32 tokens on
    assert model.knee_tokens(20, 0.9) == 20  # still rising at 16, the last size within the limit: grow to it
    rising = StepTimeModel()
    for tokens, step_s in [(1, 0.05), (2, 0.06), (4, 0.08), (8, 0.1)] * 2:
        rising.observe(tokens, step_s)
    assert rising.knee_tokens(1000, 0.9) == 16  # 8 tokens is the best so far and more than 1/0.9 of 4's
    assert rising.knee_tokens(12, 0.9) == 12


def test_knee_reads_the_curve_up_to_the_limit_between_two_sizes_measured():
    """The limit (the most tokens within the TPOT objective, interpolated) falls between two sizes
    measured: the knee reads the curve there, not only the sizes below it. An overload run on 2
    cores measured 1 token (59 ms) and 58 (250 ms): the limit was 57, and the knee, seeing only the
    1-token size below it, said 2 (twice the largest size run) with twenty answers running."""
    from app.engine.scheduler.online import StepTimeModel

    model = StepTimeModel()
    for tokens, step_s in [(1, 0.059), (58, 0.25)] * 4:
        model.observe(tokens, step_s)
    limit = model.max_tokens_within(0.25)
    assert limit == 58
    assert model.knee_tokens(57, 0.9) == 57  # 228 tokens/s at 57 against 17 at 1


def test_online_step_budget_is_the_knee_or_the_tpot_target():
    from app.engine.scheduler.online import MIN_STEP_TOKENS

    def scheduler(**settings):
        sched = make_engine("reserve_predicted", "online", tpot_slo_ms=100.0, max_num_seqs=128,
                            max_num_batched_tokens=512, **settings).scheduler
        for tokens in (1, 4, 16, 32, 64, 128):  # 10 ms flat to 32 tokens, then 0.3125 ms a token
            sched.observe_step(tokens, max(0.010, tokens * 0.0003125))
        return sched

    knee = scheduler(tpot_slowdown=None)
    assert knee.max_running() == 32 and knee.decode_step_budget() == 32
    assert scheduler().max_running() == 32  # the default: the knee, below 3.5 one-token steps (35 ms, 112 tokens)
    full = scheduler(tpot_slowdown=None, knee_throughput_fraction=1.0)  # the TPOT objective itself: 100 ms = 320 tokens
    assert full.max_running() == 128 and full.decode_step_budget() == 320  # max_num_seqs 128, budget 512
    target = scheduler(tpot_target_ms=20.0)  # 20 ms = 64 tokens
    assert target.max_running() == 64 and target.decode_step_budget() == 64
    slow = scheduler(tpot_target_ms=1.0)
    assert slow.max_running() == 1 and slow.decode_step_budget() == MIN_STEP_TOKENS
    above = scheduler(tpot_target_ms=500.0)  # never past the objective
    assert above.decode_step_budget() == 320


def test_online_step_budget_within_the_slowdown_follows_the_one_token_step():
    """Where throughput keeps rising with the step (a CPU), steps within tpot_slowdown one-token
    steps, the same multiple of the fixed cost on any machine; where it flattens (a GPU), the knee;
    never past the TPOT objective."""
    from app.engine.scheduler.online import MIN_STEP_TOKENS

    def scheduler(fixed_s: float, per_token_s: float, **settings):
        settings.setdefault("tpot_slowdown", 4.0)
        sched = make_engine("reserve_predicted", "online", tpot_slo_ms=250.0, max_num_seqs=128,
                            max_num_batched_tokens=512, **settings).scheduler
        for tokens in (1, 2, 4, 8, 16, 32, 64):
            sched.observe_step(tokens, fixed_s + per_token_s * tokens)
        return sched

    cpu = scheduler(0.012, 0.002)  # 14 ms alone: 56 ms steps hold 22 tokens
    assert cpu.max_running() == 22 and cpu.decode_step_budget() == 22
    assert scheduler(0.012, 0.002, tpot_slowdown=3.0).max_running() == 15  # 42 ms
    assert scheduler(0.012, 0.001).max_running() == 40  # half the per-token cost: 13 ms alone, 52 ms steps
    gpu = scheduler(0.010, 0.00002)  # nearly flat: 4 one-token steps hold 227 tokens (proportional past 64)
    assert gpu.max_running() == 128 and gpu.decode_step_budget() == 128  # the knee: twice the 64 run, to learn more
    slow = scheduler(0.1, 0.01)  # 110 ms alone: 4x is past the 250 ms objective, which caps it
    assert slow.max_running() == 15 and slow.decode_step_budget() == MIN_STEP_TOKENS
    fresh = make_engine("reserve_predicted", "online").scheduler
    assert fresh.config.tpot_slowdown == 3.5  # the default
    assert fresh.max_running() == fresh.config.max_num_seqs  # nothing measured yet: no cap


def test_one_token_step_is_read_off_the_smallest_size_measured():
    from app.engine.scheduler.online import StepTimeModel

    model = StepTimeModel()
    assert model.base_step_s() is None
    for tokens, step_s in [(8, 0.030), (16, 0.045), (3, 0.016), (4, 0.018)]:
        model.observe(tokens, step_s)
    assert model.base_step_s() == 0.016  # 3 tokens, the smallest run: at most a few tokens' cost over
    model.observe(1, 0.014)
    assert model.base_step_s() == 0.014


def test_the_fit_is_kept_until_the_next_step_and_callers_get_copies():
    from app.engine.scheduler.online import StepTimeModel

    model = StepTimeModel()
    for tokens in (1, 2, 4, 8):
        model.observe(tokens, 0.01 * tokens)
    first = model.curve()
    assert first == [(1.0, 0.01), (2.0, 0.02), (4.0, 0.04), (8.0, 0.08)]
    first.append((9.0, 0.0))  # a caller's own list
    assert model.curve() == [(1.0, 0.01), (2.0, 0.02), (4.0, 0.04), (8.0, 0.08)]
    model.observe(8, 0.18)  # the 8-token bin's mean moves a tenth of the way: 0.09
    assert model.curve()[-1] == (8.0, pytest.approx(0.09))
