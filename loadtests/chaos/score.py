"""One scenario's row of the chaos summary, from the load test's per-request records
(``loadtests/locustfile.py``: status, error, start, e2e_ms, output_tokens, max_tokens)."""

from __future__ import annotations

HUNG = "not finished within the drain"  # the locustfile's error for a request still open at the end


def classify(record: dict) -> str:
    """``answered`` (every token asked for), ``cut`` (the client cancelled it on purpose), ``clean_error`` (a status code with OpenAI's error body,
    or an error chunk then [DONE]), ``hung`` (still open when the drain ended) or ``broken`` (a
    reset, a truncated stream, a body that is not OpenAI's error)."""
    error = record.get("error")
    if record.get("cancelled") and not error:
        return "cut"
    if not error:
        return "answered" if record.get("output_tokens", 0) >= record.get("max_tokens", 0) else "broken"
    if error == HUNG:
        return "hung"
    if (record.get("status", 0) >= 400 and '"error"' in error) or error.startswith("in-band error"):
        return "clean_error"
    return "broken"


def _open_at(record: dict, at: float) -> bool:
    """Whether ``record``'s request was open at wall-clock ``at``: sent before it, and not refused
    before it (a 429 that came back earlier was never an answer for the fault to lose)."""
    if record["start"] >= at:
        return False
    ended = record["start"] + record["e2e_ms"] / 1000 if record.get("e2e_ms") is not None else None
    return not (classify(record) == "clean_error" and ended is not None and ended < at)


def score(records: list[dict], fault_at: float | None) -> dict:
    """Counts per class; given the fault (wall-clock ``fault_at``), how many answers were open at it
    and how many of those were answered in full, and the first request that started after it and
    was answered, in seconds from the fault (None: none was)."""
    counts = {"sent": len(records), "answered": 0, "clean_error": 0, "cut": 0, "hung": 0, "broken": 0}
    for record in records:
        counts[classify(record)] += 1
    recovery, before = None, {}
    if fault_at is not None:  # open when it struck (or answered before): each must be answered
        open_then = [r for r in records if _open_at(r, fault_at)]
        before = {"open_at_fault": len(open_then), "answered_of_those": sum(classify(r) == "answered" for r in open_then)}
        later = [r["start"] + r["e2e_ms"] / 1000 for r in records
                 if r["start"] >= fault_at and classify(r) == "answered"]
        recovery = round(min(later) - fault_at, 1) if later else None
    examples = sorted({r["error"][:160] for r in records if classify(r) in ("broken", "hung")})[:3]
    return {**counts, **before, "recovery_s": recovery, "broken_examples": examples}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


LATE_REFUSAL = "without starting"  # in the 429 of a request refused unstarted, its first token past the limit


def overload(records: list[dict]) -> dict:
    """Under overload: how many were refused with 429 (and with Retry-After); of those, how many at
    admission and how fast (p99 ms), and how many once their wait had passed ``max_queue_delay_ms``
    unstarted (their p99 is that limit and a step); and the admitted online requests' TTFT (p50,
    p99; p99 of the first and the second half of the arrivals: bounded TTFT does not grow with the
    backlog)."""
    refused = [r for r in records if r.get("status") == 429]
    late, door = [], []
    for r in refused:
        (late if LATE_REFUSAL in (r.get("error") or "") else door).append(r)
    online = sorted((r for r in records if r.get("tier") == "online" and r.get("ttft_ms") is not None),
                    key=lambda r: r["start"])
    ttfts = [r["ttft_ms"] for r in online]
    half = len(ttfts) // 2
    return {"refused_429": len(refused), "refused_with_retry_after": sum(bool(r.get("retry_after")) for r in refused),
            "refused_at_admission": len(door), "refusal_p99_ms": _pct([r["e2e_ms"] for r in door], 0.99),
            "refused_after_waiting": len(late), "late_refusal_p99_ms": _pct([r["e2e_ms"] for r in late], 0.99),
            "admitted_online_ttft_p50_ms": _pct(ttfts, 0.5), "admitted_online_ttft_p99_ms": _pct(ttfts, 0.99),
            "ttft_p99_first_half_ms": _pct(ttfts[:half], 0.99), "ttft_p99_second_half_ms": _pct(ttfts[half:], 0.99)}
