"""How ``foreserve chaos`` scores a load scenario's requests (``loadtests/chaos/score.py``)."""

from __future__ import annotations

from loadtests.chaos.score import classify, overload, score


def _record(start: float, error: str | None = None, status: int = 200, tokens: int = 8, e2e_ms: float = 1000) -> dict:
    return {"start": start, "error": error, "status": status, "output_tokens": tokens, "max_tokens": 8, "e2e_ms": e2e_ms}


def test_each_request_is_answered_a_clean_error_hung_or_broken():
    assert classify(_record(0)) == "answered"
    assert classify(_record(0, tokens=5)) == "broken"  # a stream that stopped short without an error
    assert classify(_record(0, 'HTTP 503: {"error": {"message": "unavailable"}}', 503)) == "clean_error"
    assert classify(_record(0, "in-band error: The online pool failed")) == "clean_error"
    assert classify(_record(0, "not finished within the drain")) == "hung"
    assert classify(_record(0, "ConnectionResetError: reset by peer", 0)) == "broken"
    assert classify(_record(0, "HTTP 502: <html>Bad Gateway</html>", 502)) == "broken"  # not OpenAI's shape


def test_recovery_is_the_first_answer_to_a_request_sent_after_the_fault():
    records = [_record(100.0), _record(109.0, "not finished within the drain"), _record(112.0, e2e_ms=9000),
               _record(115.0, e2e_ms=2000), _record(111.0, "in-band error: x")]
    row = score(records, fault_at=110.0)
    assert (row["sent"], row["answered"], row["clean_error"], row["hung"], row["broken"]) == (5, 3, 1, 1, 0)
    assert row["recovery_s"] == 7.0  # sent at 115 s, answered 2 s later; the one sent at 112 s took 9 s
    assert score(records[:1], fault_at=110.0)["recovery_s"] is None
    assert score(records, fault_at=None)["recovery_s"] is None


def test_the_answers_open_at_the_fault_leave_out_those_refused_before_it():
    refused = 'HTTP 429: {"error": {"message": "busy"}}'
    records = [_record(100.0, e2e_ms=20000), _record(104.0, refused, 429, e2e_ms=1200),  # refused 5 s before the fault
               _record(108.0, refused, 429, e2e_ms=4000), _record(109.0, "not finished within the drain", e2e_ms=None)]
    row = score(records, fault_at=110.0)
    assert row["open_at_fault"] == 3  # the answer, the 429 that came after the fault, the hung one
    assert row["answered_of_those"] == 1


def test_chaos_refuses_bad_settings_before_starting_anything(tmp_path):
    import pytest

    from loadtests.chaos.run import run_chaos

    with pytest.raises(ValueError, match="unknown scenarios"):
        run_chaos(tmp_path, ["nope"])
    for kwargs, named in (({"rate": 0}, "--rate 0"), ({"duration_s": 10, "inject_s": 10}, "--inject-at 10"),
                          ({"storm_streams": 0}, "--storm-streams 0"), ({"overload_rate": -1}, "--overload-rate -1"),
                          ({"soak_minutes": 0}, "--soak-minutes 0"), ({"fuzz_examples": 0}, "--fuzz-examples 0"),
                          ({"flex_share": 1.5}, "--flex-share 1.5")):
        with pytest.raises(ValueError, match=f"^need .*{named} \\(must be"):
            run_chaos(tmp_path, ["engine_kill"], **kwargs)
    with pytest.raises(ValueError, match="^need --overload-shape shape '1024'"):
        run_chaos(tmp_path, ["overload"], overload_shapes=("1024",))
    for started_only in ("forward_error", "redeploy", "registry_outage", "drain"):  # their faults need its own service
        with pytest.raises(ValueError, match=rf"\['{started_only}'\] need the service this command starts"):
            run_chaos(tmp_path, [started_only], host="http://127.0.0.1:9")
    assert not list(tmp_path.iterdir())


def test_a_cancelled_answer_is_cut_not_broken():
    cancelled = {"status": 200, "error": None, "output_tokens": 0, "max_tokens": 64, "cancelled": True, "ttft_ms": 5.0}
    assert classify(cancelled) == "cut"
    assert classify({**cancelled, "cancelled": False}) == "broken"  # short without a reason


def test_the_memory_slope_is_in_mb_per_hour():
    from loadtests.chaos.soak import slope_mb_per_hour

    assert slope_mb_per_hour([(0.0, 100.0), (1800.0, 105.0), (3600.0, 110.0)]) == 10.0
    assert slope_mb_per_hour([(t, 500.0) for t in range(0, 600, 10)]) == 0.0
    assert slope_mb_per_hour([(0.0, 1.0), (10.0, 2.0)]) is None  # too few samples to say


def test_only_a_429_with_retry_after_is_sent_again_after_its_wait():
    import httpx

    from loadtests.chaos.probes import retry_wait

    assert retry_wait(httpx.Response(429, headers={"Retry-After": "3"})) == 3.0
    assert retry_wait(httpx.Response(429)) is None  # no wait named: the client gives up
    assert retry_wait(httpx.Response(503, headers={"Retry-After": "3"})) is None  # a drain: not the engine shedding
    assert retry_wait(httpx.Response(200)) is None


def test_a_batch_output_is_scored_line_by_line_against_its_input():
    import json

    from loadtests.chaos.batch import output_counts

    def line(custom_id: str, error: dict | None = None) -> str:
        return json.dumps({"custom_id": custom_id, "response": None if error else {"status_code": 200}, "error": error})

    whole = "\n".join(line(f"row-{i}") for i in range(4)).encode()
    assert output_counts(whole, 4) == {"answered": 4, "failed_rows": 0, "lost": 0, "duplicated": 0}
    bad = "\n".join([line("row-0"), line("row-0"), line("row-1", {"message": "x"}), line("row-2")]).encode()
    assert output_counts(bad, 4) == {"answered": 3, "failed_rows": 1, "lost": 1, "duplicated": 1}


def _replaced_offline() -> list[tuple[float, float, tuple[int, ...]]]:
    """An offline replica flat at 1,600 MB for 21 minutes, scaled to zero and started again (a new
    pid, first sampled mid-load at 1,184 MB), then 1,635 MB rising 0.1 MB a minute."""
    old = [(float(t), 1600.0, (11,)) for t in range(0, 1270, 10)]
    new = [(1300.0, 1184.0, (12,))] + [(float(t), 1635.0 + (t - 1310) / 600, (12,)) for t in range(1310, 1800, 10)]
    return old + new


def test_a_role_whose_processes_were_replaced_gets_the_slope_of_its_longest_lived_ones():
    from loadtests.chaos.soak import memory_figures

    proxy = [(float(t), 200.0 + t / 360, (5,)) for t in range(0, 1800, 10)]  # +10 MB/hour, the same process all along
    figures = memory_figures({"offline": _replaced_offline(), "proxy": proxy, "online": []}, window_s=300.0)
    # across both processes a least-squares line would read the restart as growth (or loss)
    assert figures["rss_slope_mb_per_hour"] == {"offline": 0.0, "proxy": 10.0}
    assert figures["rss_slope_after_first_window_mb_per_hour"] == {"offline": 0.0, "proxy": 10.0}
    assert figures["rss_processes_replaced"] == {"offline": 1, "proxy": 0}


def test_the_soak_plots_each_roles_rss(tmp_path):
    from loadtests.chaos.soak import plot_rss

    samples = {"online": [(t, 1000.0 + t / 60, (7,)) for t in range(0, 600, 10)],
               "proxy": [(t, 200.0, (5,)) for t in range(0, 600, 10)], "offline": _replaced_offline()}
    plot_rss(samples, {"online": 60.0, "proxy": 0.0, "offline": 0.0}, 120.0, tmp_path / "rss.png")
    assert (tmp_path / "rss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_reset_counts_apart_only_as_the_last_probe_before_the_port_closed():
    from loadtests.chaos.drain import unclean_probes

    assert unclean_probes(["200", "503+retry", "503+retry", "ReadError", "refused"]) == ([], 1)
    assert unclean_probes(["503+retry", "RemoteProtocolError"]) == ([], 1)  # the service exited during it
    assert unclean_probes(["503+retry", "ReadError", "503+retry", "refused"]) == (["ReadError"], 0)
    assert unclean_probes(["ReadError", "ReadError", "refused"]) == (["ReadError"], 1)
    assert unclean_probes(["503+retry", "500", "refused"]) == (["500"], 0)
    assert unclean_probes(["refused"]) == ([], 0)


def test_a_drain_probe_shed_with_a_429_and_retry_after_is_a_clean_answer():
    # the engine may still shed a probe sent as the drain begins (a backlog a previous scenario left):
    # a 429 with Retry-After is as clean as a 503 with it; one without says nothing a client can act on
    import httpx

    from loadtests.chaos.drain import probe_outcome, unclean_probes

    assert probe_outcome(httpx.Response(429, headers={"Retry-After": "2"})) == "429+retry"
    assert probe_outcome(httpx.Response(503, headers={"Retry-After": "2"})) == "503+retry"
    assert probe_outcome(httpx.Response(429)) == "429"
    assert probe_outcome(httpx.Response(200)) == "200"
    assert unclean_probes(["429+retry", "503+retry", "refused"]) == ([], 0)
    assert unclean_probes(["429", "503+retry", "refused"]) == (["429"], 0)


def test_overload_tells_refusals_at_the_door_from_those_after_a_whole_wait():
    def refused(why: str, e2e_ms: float) -> dict:
        body = f'{{"error": {{"message": "The online pool is too busy to answer in time: {why}; retry after 2 s."}}}}'
        return {**_record(0, f"HTTP 429: {body}", 429, 0, e2e_ms), "retry_after": "2", "tier": "online"}

    door = ("this request's first token is about 4.6 s away, 4.1 s of it for others ahead (alone it takes 0.5 s), "
            "past this pool's max_queue_delay_ms (4000)")
    late = "it waited 3.9 s without starting, and its first token can no longer come within this pool's max_queue_delay_ms (4000)"
    records = [refused(door, ms) for ms in (30, 40, 900)] + [refused(late, ms) for ms in (4100, 4700)]
    records += [{**_record(i), "tier": "online", "ttft_ms": 500 + 100 * i} for i in range(4)]
    row = overload(records)
    assert (row["refused_429"], row["refused_with_retry_after"]) == (5, 5)
    assert (row["refused_at_admission"], row["refused_after_waiting"]) == (3, 2)
    assert row["refusal_p99_ms"] == 900 and row["late_refusal_p99_ms"] == 4700  # the door's, then the waited ones'
    assert (row["admitted_online_ttft_p50_ms"], row["admitted_online_ttft_p99_ms"]) == (700, 800)
