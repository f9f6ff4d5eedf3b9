"""The autoscaling policies on synthetic Serve contexts: up, down, hold, flap suppression, budget."""

from __future__ import annotations

import pytest
from ray.serve._private.common import DeploymentID
from ray.serve.autoscaling_policy import _apply_app_level_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from autoscale.decisions import read_decisions
from autoscale.policy import ElasticPolicy, OfflinePolicy, OnlinePolicy, ScalingConfig

pytestmark = pytest.mark.ray  # Serve's autoscaling context and config classes; starts nothing

ONLINE = DeploymentID(name="online", app_name="foreserve")
OFFLINE = DeploymentID(name="offline", app_name="foreserve")
CAPACITY = 8192


def replica_metrics(replicas: int, *, ttft_ms=0.0, tpot_ms=0.0, oldest_ms=0.0, kv_used=0, waiting=0, running=0) -> dict:
    ids = [f"r{i}" for i in range(replicas)]

    def each(value):
        return {r: float(value) for r in ids}

    return {
        "kv_capacity_tokens": each(CAPACITY), "kv_used_tokens": each(kv_used),
        "waiting_predicted_tokens": each(waiting), "recent_ttft_ms_p90": each(ttft_ms),
        "recent_tpot_ms_p90": each(tpot_ms), "oldest_pending_ms": each(oldest_ms),
        "ttft_slo_ms": each(2000), "tpot_slo_ms": each(250), "num_running": each(running), "num_waiting": each(0),
    }


def context(dep: DeploymentID, replicas: int, *, target=None, min_replicas=0, max_replicas=4, queued=0.0,
            now=1000.0, state=None, config=None, **metrics) -> AutoscalingContext:
    return AutoscalingContext(
        deployment_id=dep, deployment_name=dep.name, app_name=dep.app_name,
        current_num_replicas=replicas, target_num_replicas=replicas if target is None else target,
        running_replicas=[], total_num_requests=queued, total_queued_requests=queued,
        aggregated_metrics=replica_metrics(replicas, **metrics), raw_metrics={},
        capacity_adjusted_min_replicas=min_replicas, capacity_adjusted_max_replicas=max_replicas,
        policy_state=state or {}, last_scale_up_time=None, last_scale_down_time=None,
        current_time=now, config=config or AutoscalingConfig(min_replicas=min_replicas, max_replicas=max_replicas),
    )


@pytest.fixture
def policy(tmp_path):
    return ElasticPolicy(replica_budget=3, calm_s=20, decision_log=str(tmp_path / "decisions.jsonl"))


def tick(policy, online, offline):
    decisions, state = policy({ONLINE: online, OFFLINE: offline})
    return decisions[ONLINE], decisions[OFFLINE], state


def test_online_scales_up_on_slo_kv_queue_age_and_handle_queue(policy):
    calm_offline = context(OFFLINE, 1, min_replicas=0, max_replicas=2)
    for signal in ({"ttft_ms": 1900}, {"tpot_ms": 240}, {"oldest_ms": 1700}, {"kv_used": 6000, "waiting": 2000},
                   {"queued": 3.0, "running": 8}):
        online, offline, _ = tick(policy, context(ONLINE, 1, min_replicas=1, max_replicas=2, **signal), calm_offline)
        assert (online, offline) == (2, 0), signal  # online grows, offline yields its replica


def test_a_startup_queue_is_not_pressure(policy):
    """Calls queued at the online handle while its replica has no work (the handles do not know the new
    replica yet) must not make offline give up its replica."""
    calm_offline = context(OFFLINE, 1, min_replicas=0, max_replicas=2)
    online, offline, _ = tick(policy, context(ONLINE, 1, min_replicas=1, max_replicas=2, queued=2.0), calm_offline)
    assert (online, offline) == (1, 1)


def test_online_holds_between_levels_and_shrinks_one_at_a_time_when_calm(policy):
    offline = context(OFFLINE, 0, min_replicas=0, max_replicas=2)
    # 50% of the TTFT SLO: between calm (40%) and scale-up (80%): hold
    assert tick(policy, context(ONLINE, 2, min_replicas=1, ttft_ms=1000), offline)[0] == 2
    # calm: one replica less per decision, not straight to the minimum
    assert tick(policy, context(ONLINE, 3, min_replicas=1, ttft_ms=100), offline)[0] == 2
    # calm but the KV demand still needs two replicas
    assert tick(policy, context(ONLINE, 3, min_replicas=1, kv_used=3000, waiting=900), offline)[0] == 2


def test_scale_up_is_proportional_to_pressure(policy):
    offline = context(OFFLINE, 0, min_replicas=0, max_replicas=2)
    # TTFT at 2x the SLO = 2.5x the scale-up level: 1 -> 3 (capped by the budget of 3, offline floor 0)
    assert tick(policy, context(ONLINE, 1, min_replicas=1, max_replicas=8, ttft_ms=4000), offline)[0] == 3


def test_offline_yields_down_to_its_min_and_waits_for_calm_before_growing_back(policy, tmp_path):
    state = {}

    def step(now, offline_replicas, **online_signals):
        nonlocal state
        online = context(ONLINE, 1, min_replicas=1, max_replicas=1, now=now, state=state.get(ONLINE), **online_signals)
        offline = context(OFFLINE, offline_replicas, min_replicas=0, max_replicas=2, now=now,
                          state=state.get(OFFLINE), kv_used=4000, waiting=60000)
        on, off, state = tick(policy, online, offline)
        return off

    assert step(0, 2, ttft_ms=3000) == 1  # online pressured: offline gives up one replica per decision
    assert step(1, 1, ttft_ms=3000) == 0  # ...down to its min_replicas (0)
    assert step(2, 0, ttft_ms=3000) == 0
    assert step(5, 0) == 0  # online calm for 5 s < calm_s: offline stays yielded
    assert step(15, 0, ttft_ms=1000) == 0  # back between the levels: the calm clock restarts
    assert step(30, 0) == 0  # calm for 15 s only
    # calm for 21 s: offline comes back; with no replica nothing reports its backlog, so first one...
    assert step(36, 0) == 1
    assert step(38, 1) == 2  # ...then what its backlog asks for (64k tokens = 2 replicas)
    reasons = [(d["pool"], d["desired"], d["reason"]) for d in read_decisions(tmp_path / "decisions.jsonl")]
    assert ("offline", 0, "yield") in reasons and ("offline", 2, "backlog") in reasons
    # logged on change only: six offline ticks said "0 (yield/wait_calm)" but the log has each once
    assert sum(1 for r in reasons if r == ("offline", 0, "wait_calm")) == 1


def test_budget_is_shared_online_first(tmp_path):
    policy = ElasticPolicy(replica_budget=3, calm_s=0, decision_log=str(tmp_path / "d.jsonl"))
    online = context(ONLINE, 2, min_replicas=1, max_replicas=3, ttft_ms=1000)  # hold at 2
    offline = context(OFFLINE, 0, min_replicas=0, max_replicas=3, waiting=200000)  # wants 7
    on, off, _ = tick(policy, online, offline)
    assert (on, off) == (2, 1)  # offline gets what online leaves
    # online may not take the offline pool's floor
    offline_floor = context(OFFLINE, 1, min_replicas=1, max_replicas=3)
    on, off, _ = tick(policy, context(ONLINE, 2, min_replicas=1, max_replicas=8, ttft_ms=8000), offline_floor)
    assert (on, off) == (2, 1)


def test_offline_idle_replica_and_backlog_without_online(tmp_path):
    log = str(tmp_path / "d.jsonl")
    policy = OfflinePolicy(offline_idle_replicas=1, decision_log=log)
    assert policy(context(OFFLINE, 2, min_replicas=0, max_replicas=4))[0] == 1  # idle: keep one warm
    assert policy(context(OFFLINE, 1, min_replicas=0, max_replicas=4, waiting=100000))[0] == 4  # 100k/32k -> 4
    assert policy(context(OFFLINE, 0, min_replicas=0, max_replicas=4, queued=5))[0] == 1
    assert OfflinePolicy(offline_idle_replicas=0, decision_log=log)(context(OFFLINE, 1, max_replicas=4))[0] == 0
    assert OnlinePolicy(decision_log=log)(context(ONLINE, 1, min_replicas=1, ttft_ms=5000))[0] == 4


def test_no_flapping_through_serves_delays(tmp_path):
    """Through Serve's own wrapper: oscillating pressure never moves the online pool down."""
    policy = _apply_app_level_autoscaling_config(ElasticPolicy(replica_budget=4, decision_log=str(tmp_path / "d.jsonl")))
    online_cfg = AutoscalingConfig(min_replicas=1, max_replicas=3, upscale_delay_s=0, downscale_delay_s=30)
    offline_cfg = AutoscalingConfig(min_replicas=0, max_replicas=2, upscale_delay_s=0, downscale_delay_s=0,
                                    downscale_to_zero_delay_s=0)
    state: dict = {}
    targets = []
    online_target = 2
    for t in range(0, 60, 2):
        ttft = 100 if (t // 10) % 2 == 0 else 1000  # calm 10 s, between levels 10 s, ...
        online = context(ONLINE, 2, target=online_target, min_replicas=1, max_replicas=3, ttft_ms=ttft, now=float(t),
                         state=state.get(ONLINE), config=online_cfg)
        offline = context(OFFLINE, 1, min_replicas=0, max_replicas=2, now=float(t), state=state.get(OFFLINE),
                          config=offline_cfg)
        decisions, state = policy({ONLINE: online, OFFLINE: offline})
        online_target = decisions[ONLINE]
        targets.append(online_target)
    assert set(targets) == {2}  # calm spells (10 s) are shorter than the 30 s downscale delay


def test_thresholds_validated():
    with pytest.raises(ValueError, match="hysteresis"):
        ScalingConfig(calm_slo_ratio=0.9, scale_up_slo_ratio=0.8)
    with pytest.raises(ValueError):
        ScalingConfig(offline_backlog_tokens_per_replica=0)
    with pytest.raises(ValueError):
        ScalingConfig(no_such_threshold=1)


def test_budget_holds_at_every_instant_online_waits_for_offline_to_yield(policy):
    # budget 3: offline still runs 2, online (1) is under pressure and wants 3
    online = context(ONLINE, 1, min_replicas=1, max_replicas=3, ttft_ms=5000)
    offline = context(OFFLINE, 2, min_replicas=0, max_replicas=3)
    on, off, _ = tick(policy, online, offline)
    assert (on, off) == (1, 1)  # offline yields one; online grows only into replicas already given back
    on, off, _ = tick(policy, online, context(OFFLINE, 1, min_replicas=0, max_replicas=3))
    assert (on, off) == (2, 0)


def test_offline_shrinks_only_when_backlog_would_half_fill_fewer_replicas(tmp_path):
    policy = OfflinePolicy(offline_idle_replicas=0, decision_log=str(tmp_path / "d.jsonl"))
    # 3 replicas, 40k tokens: 2 would do, but 2 replicas would be more than half full: hold 3
    assert policy(context(OFFLINE, 3, max_replicas=4, waiting=40000 // 3))[0] == 3
    assert policy(context(OFFLINE, 3, max_replicas=4, waiting=30000 // 3))[0] == 2  # 30k half-fills 2 (65k)


INGRESS = DeploymentID(name="ingress", app_name="foreserve")
# the pools' delays and bounds as serve_config.yaml deploys them on 2 cores
ONLINE_AS_DEPLOYED = AutoscalingConfig(min_replicas=1, max_replicas=1, upscale_delay_s=0, downscale_delay_s=60)
OFFLINE_AS_DEPLOYED = AutoscalingConfig(min_replicas=0, max_replicas=1, upscale_delay_s=0, downscale_delay_s=2,
                                        downscale_to_zero_delay_s=2)


def ingress_context(held_requests: float, held_tokens: float, now: float = 0.0, state=None) -> AutoscalingContext:
    """The ingress (fixed at one replica) reporting the flex calls it holds while offline is at zero."""
    ctx = context(INGRESS, 1, min_replicas=1, max_replicas=1, now=now, state=state,
                  config=AutoscalingConfig(min_replicas=1, max_replicas=1))
    ctx.aggregated_metrics = {"held_requests": {"r0": held_requests}, "held_tokens": {"r0": held_tokens}}
    return ctx


def test_flex_calls_held_at_the_ingress_wake_offline_only_once_online_is_calm(tmp_path):
    """Through Serve's wrapper: calls held at the ingress are not at the offline handle, so Serve's
    cold-start rule does not fire; they are offline backlog, granted only after online's calm_s."""
    policy = _apply_app_level_autoscaling_config(ElasticPolicy(
        replica_budget=2, calm_s=10, offline_idle_replicas=0, decision_log=str(tmp_path / "d.jsonl")))
    online_cfg, offline_cfg = ONLINE_AS_DEPLOYED, OFFLINE_AS_DEPLOYED
    state: dict = {}
    offline_targets = []
    for t in range(0, 30):
        ttft = 5000 if t < 10 else 100  # online pressured for 10 s, then calm
        contexts = {
            ONLINE: context(ONLINE, 1, min_replicas=1, max_replicas=1, ttft_ms=ttft, now=float(t),
                            state=state.get(ONLINE), config=online_cfg),
            OFFLINE: context(OFFLINE, 0, min_replicas=0, max_replicas=1, now=float(t), state=state.get(OFFLINE),
                             config=offline_cfg),
            INGRESS: ingress_context(3, 900, float(t), state.get(INGRESS)),
        }
        decisions, state = policy(contexts)
        assert decisions[INGRESS] == 1
        offline_targets.append(decisions[OFFLINE])
    # pressure until t=9 (last pressured tick), calm from t=10: offline comes back at t=19, not before
    assert offline_targets[:19] == [0] * 19 and offline_targets[19:] == [1] * 11
    back = [d for d in read_decisions(tmp_path / "d.jsonl") if d["pool"] == "offline" and d["desired"] == 1]
    assert back[0]["reason"] == "backlog" and "3 held at the ingress" in back[0]["detail"]
    # with nothing held and offline_idle_replicas 0 it stays at zero
    decisions, _ = policy({ONLINE: context(ONLINE, 1, min_replicas=1, max_replicas=1, now=100.0, config=online_cfg),
                           OFFLINE: context(OFFLINE, 0, min_replicas=0, max_replicas=1, now=100.0, config=offline_cfg),
                           INGRESS: ingress_context(0, 0, 100.0)})
    assert decisions[OFFLINE] == 0


def test_offline_work_yielded_past_offline_max_yield_s_gets_one_replica_until_its_backlog_is_done(tmp_path):
    """Online pressured without end (one replica, its max, on a budget of two) must not starve flex
    work: after ``offline_max_yield_s`` of waiting the offline pool gets one replica back, keeps it
    while it has backlog though online stays pressured, and yields again once that is done."""
    policy = _apply_app_level_autoscaling_config(ElasticPolicy(
        replica_budget=2, calm_s=20, offline_max_yield_s=60, offline_idle_replicas=1,
        decision_log=str(tmp_path / "d.jsonl")))
    online_cfg = AutoscalingConfig(min_replicas=1, max_replicas=1, upscale_delay_s=0, downscale_delay_s=60)
    offline_cfg = AutoscalingConfig(min_replicas=0, max_replicas=1, upscale_delay_s=0, downscale_delay_s=0,
                                    downscale_to_zero_delay_s=0)  # NOTE: Serve times its delays by the wall clock
    state: dict = {}
    offline_replicas = 0
    targets = []
    for t in range(0, 200):
        # the flex work: held at the ingress while offline is at zero; in its replica's KV after, until t=150
        held = (3, 900) if offline_replicas == 0 and t < 150 else (0, 0)
        backlog = {"kv_used": 900} if offline_replicas and t < 150 else {}
        contexts = {
            ONLINE: context(ONLINE, 1, min_replicas=1, max_replicas=1, ttft_ms=5000, now=float(t),
                            state=state.get(ONLINE), config=online_cfg),
            OFFLINE: context(OFFLINE, offline_replicas, min_replicas=0, max_replicas=1, now=float(t),
                             state=state.get(OFFLINE), config=offline_cfg, **backlog),
            INGRESS: ingress_context(*held, float(t), state.get(INGRESS)),
        }
        decisions, state = policy(contexts)
        assert decisions[ONLINE] == 1
        offline_replicas = decisions[OFFLINE]  # the replica starts at once
        targets.append(offline_replicas)
    assert targets[:60] == [0] * 60  # yielded: online is pressured
    assert targets[60:150] == [1] * 90  # waited 60 s: one replica, kept while its backlog lasts
    assert targets[-40:] == [0] * 40  # backlog done, online still pressured: yielded again
    share = [d for d in read_decisions(tmp_path / "d.jsonl") if d["pool"] == "offline" and d["reason"] == "share"]
    assert share and share[0]["desired"] == 1 and "waited 60 s" in share[0]["detail"]


def test_a_yield_pending_in_serves_downscale_delay_is_not_cancelled_by_a_pause_in_pressure(tmp_path, monkeypatch):
    """Through Serve's wrapper, which holds a downscale until ``downscale_to_zero_delay_s`` of
    consecutive decisions: online pressured, then between the levels for a tick, then pressured...
    While online is not yet calm the offline pool keeps wishing for what it yielded to, so the delay
    runs out and the replica goes; repeating Serve's still-unchanged target would restart the delay
    every other tick and the yield would never happen."""
    import ray.serve.autoscaling_policy as serve_policy

    clock = {"now": 0.0}
    monkeypatch.setattr(serve_policy.time, "time", lambda: clock["now"])  # Serve times its delays by the wall clock
    policy = _apply_app_level_autoscaling_config(ElasticPolicy(
        replica_budget=2, calm_s=3, offline_idle_replicas=1, decision_log=str(tmp_path / "d.jsonl")))
    online_cfg, offline_cfg = ONLINE_AS_DEPLOYED, OFFLINE_AS_DEPLOYED
    state: dict = {}
    offline_target, targets = 1, []
    for t in range(0, 8):
        clock["now"] = float(t)
        ttft = 1900 if t % 2 == 0 else 1000  # 95% of the TTFT SLO (pressure), then 50% (between the levels)
        decisions, state = policy({
            ONLINE: context(ONLINE, 1, min_replicas=1, max_replicas=1, ttft_ms=ttft, now=float(t),
                            state=state.get(ONLINE), config=online_cfg),
            OFFLINE: context(OFFLINE, 1 if offline_target else 0, target=offline_target, min_replicas=0, max_replicas=1,
                             now=float(t), state=state.get(OFFLINE), config=offline_cfg),
        })
        offline_target = decisions[OFFLINE]
        targets.append(offline_target)
    assert targets == [1, 1, 0, 0, 0, 0, 0, 0]  # the yield at t=0 takes effect at t=2, the delay's end
    reasons = [d["reason"] for d in read_decisions(tmp_path / "d.jsonl") if d["pool"] == "offline"]
    assert reasons[0] == "yield" and all(r in ("yield", "wait_calm") for r in reasons)
