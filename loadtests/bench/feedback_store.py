"""What recording feedback costs the engine's path: each finished request's ``append``, timed where
the engine calls it, with the record stored synchronously (one durable put per request) and with
the background flush serving uses (``deployments.engine_server.FEEDBACK_FLUSH_S``), on each store given.

``foreserve bench feedback --store DIR_OR_URI [--store …]``; the JSON report has per store and mode
the append latency (median, p99, max, in µs), the records/s the caller sustains, and how long
``close`` took to store what was left."""

from __future__ import annotations

import time

import numpy as np

from predictor.feedback import FeedbackRecord, FeedbackWriter
from predictor.object_store import ObjectStore


def _record(i: int) -> FeedbackRecord:
    return FeedbackRecord(request_id=f"bench-{i}", prompt="Summarise the plot of a long novel in three sentences. " * 4,
                          predicted_bucket=3, predicted_bound_tokens=409, output_tokens=200 + i % 300, finish_reason="stop",
                          tier="online", model_id="SmolLM2-135M-Instruct", predictor_version="7")


def measure(store: ObjectStore, flush_s: float | None, records: int) -> dict:
    records_in = [_record(i) for i in range(records)]
    writer = FeedbackWriter(store, flush_s=flush_s)
    latencies = []
    t0 = time.perf_counter()
    for record in records_in:
        start = time.perf_counter()
        writer.append(record)
        latencies.append(time.perf_counter() - start)
    elapsed = time.perf_counter() - t0
    c0 = time.perf_counter()
    writer.close()
    us = np.array(latencies) * 1e6
    return {"mode": "sync put per request" if flush_s is None else f"background flush every {flush_s:g} s",
            "records": records, "append_us_p50": round(float(np.median(us)), 1),
            "append_us_p99": round(float(np.percentile(us, 99)), 1), "append_us_max": round(float(us.max()), 1),
            "records_per_s": round(records / elapsed, 1), "close_s": round(time.perf_counter() - c0, 3),
            "chunks": writer.chunks_written}


def run(stores: list[str], records: int = 500, flush_s: float = 1.0) -> dict:
    results = []
    for uri in stores:
        root = ObjectStore(uri).child(f"bench-feedback-{int(time.time())}")
        for mode in (None, flush_s):
            results.append({"store": uri.split("?")[0], **measure(root.child("sync" if mode is None else "bg"), mode, records)})
    return {"records": records, "results": results}


def print_report(report: dict) -> None:
    print(f"{'store':<28} {'mode':<34} {'p50 µs':>9} {'p99 µs':>9} {'max µs':>10} {'rec/s':>10} {'close s':>8}")
    for r in report["results"]:
        print(f"{r['store'][:28]:<28} {r['mode']:<34} {r['append_us_p50']:>9} {r['append_us_p99']:>9} "
              f"{r['append_us_max']:>10} {r['records_per_s']:>10} {r['close_s']:>8}")
