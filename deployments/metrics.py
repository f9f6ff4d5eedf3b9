"""Prometheus metrics through Ray (``ray.serve.metrics``): Ray's metrics agent exports them on each
node's metrics port next to Serve's own (``ray_foreserve_*``). Serve adds deployment/replica tags."""

from __future__ import annotations

from ray.serve.metrics import Counter, Gauge, Histogram

# Seconds; TTFT/E2E up to minutes (offline), TPOT down to milliseconds.
LATENCY_BOUNDARIES_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300]
TPOT_BOUNDARIES_S = [0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.25, 0.5, 1, 2]
# estimated / measured time to first token (1: exact; Ray's histograms take positive boundaries only)
RATIO_BOUNDARIES = [0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.11, 1.25, 1.5, 2, 4]


class RequestMetrics:
    """Per tier (``online``/``flex``), observed by the ingress: what the client saw."""

    def __init__(self) -> None:
        tier = ("tier",)
        self.ttft = Histogram("foreserve_ttft_s", "Time to first token (HTTP ingress).", LATENCY_BOUNDARIES_S, tier)
        self.tpot = Histogram("foreserve_tpot_s", "Mean time per output token after the first.", TPOT_BOUNDARIES_S, tier)
        self.e2e = Histogram("foreserve_e2e_s", "End-to-end request latency.", LATENCY_BOUNDARIES_S, tier)
        self.requests = Counter("foreserve_requests", "Requests by tier and HTTP status.", ("tier", "status"))
        self.output_tokens = Counter("foreserve_output_tokens", "Generated tokens.", tier)
        self.fallbacks = Counter("foreserve_predictor_fallbacks", "Requests that reserved max_tokens because the predictor failed or timed out.", tier)
        self.resumes = Counter("foreserve_resumed_answers", "Answers resumed on another replica after theirs was lost mid-answer.", tier)

    def finished(self, tier: str, ttft_s: float, e2e_s: float, output_tokens: int) -> None:
        tags = {"tier": tier}
        self.ttft.observe(ttft_s, tags)
        self.e2e.observe(e2e_s, tags)
        if output_tokens > 1:
            self.tpot.observe((e2e_s - ttft_s) / (output_tokens - 1), tags)
        self.output_tokens.inc(output_tokens, tags)

    def status(self, tier: str, status_code: int) -> None:
        self.requests.inc(1, {"tier": tier, "status": str(status_code)})

    def fallback(self, tier: str) -> None:
        self.fallbacks.inc(1, {"tier": tier})

    def resumed(self, tier: str) -> None:
        self.resumes.inc(1, {"tier": tier})


class PoolMetrics:
    """Per engine replica, refreshed with every routing-stats report."""

    GAUGES = {
        "kv_used_tokens": "KV tokens held (physical blocks, reserved or written).",
        "kv_capacity_tokens": "KV pool size in tokens.",
        "num_running": "Sequences in the running batch.",
        "num_waiting": "Sequences waiting for admission.",
        "waiting_predicted_tokens": "Prompt + predicted output tokens of the waiting sequences.",
        "predictor_within1_acc": "Share of recent finished requests whose predicted bucket was within one of the real one.",
        "predictor_bound_held": "Share of recent finished requests whose real length fit the reserved bound.",
        "recent_ttft_ms_p90": "p90 time to first token in the engine, requests finished in the last 30 s.",
        "recent_tpot_ms_p90": "p90 time per output token in the engine, requests finished in the last 30 s.",
        "oldest_pending_ms": "How long the oldest request still without its first token has waited.",
    }
    COUNTERS = {"preemptions": "Preemptions (recompute).", "recomputed_tokens": "Tokens recomputed after preemption."}

    def __init__(self, pool: str) -> None:
        self.tags = {"pool": pool}
        self.gauges = {k: Gauge(f"foreserve_{k}", d, ("pool",)) for k, d in self.GAUGES.items()}
        self.counters = {k: Counter(f"foreserve_{k}", d, ("pool",)) for k, d in self.COUNTERS.items()}
        self._last = dict.fromkeys(self.COUNTERS, 0)
        self.ttft_ratios = Histogram("foreserve_ttft_estimate_ratio", "Each first token's estimate at admission (the "
                                     "load shedder's) over the engine's measured time to it (1: exact).",
                                     RATIO_BOUNDARIES, ("pool",))

    def ttft_ratio(self, ratio: float) -> None:
        self.ttft_ratios.observe(ratio, self.tags)

    def update(self, stats: dict) -> None:
        for key, gauge in self.gauges.items():
            if stats.get(key) is not None:
                gauge.set(stats[key], self.tags)
        for key, counter in self.counters.items():
            delta = stats.get(key, 0) - self._last[key]
            if delta > 0:
                counter.inc(delta, self.tags)
                self._last[key] = stats[key]
