"""Batch chaos: a batch through OpenAI's Batch API, its offline engine replica SIGKILLed once a
quarter of its rows are done, then its job's driver once half are. Serve replaces the replica and
the job sends the rows it lost again; the Batch API submits the lost job again under the batch's id
when the batch is next read (``app/batch/api.py``), and it resumes from the rows already written.
The output must hold exactly one line per input line: none lost, none twice."""

from __future__ import annotations

import json
import signal
import time

import httpx

from loadtests.chaos import procs

ENDED = ("completed", "failed", "cancelled", "expired")


def _lines(model: str, lines: int) -> bytes:
    """Rows of growing lengths (8, 16, 24... tokens): run together, they finish one after another,
    so the job's progress climbs in steps and the faults land mid-job."""
    rows = [{"custom_id": f"row-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": model, "max_tokens": 8 * (i + 1), "ignore_eos": True,
                      "messages": [{"role": "user", "content": f"Count to {i + 3}."}]}} for i in range(lines)]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _driver(batch_id: str) -> list[int]:
    """The processes of the batch job's driver (``python -m foreserve.batch.job … <batch id>``)."""
    return procs.matching("foreserve.batch.job", batch_id)


def output_counts(content: bytes, lines: int) -> dict:
    """What a batch's output holds against its ``lines`` input lines: answered, failed (an error
    row), lost (an input line with no output line) and duplicated (output lines past one a line)."""
    rows = [json.loads(line) for line in content.splitlines() if line.strip()]
    ids = [r.get("custom_id") for r in rows]
    expected = {f"row-{i}" for i in range(lines)}
    failed = sum(r.get("error") is not None for r in rows)
    return {"answered": len(rows) - failed, "failed_rows": failed, "lost": len(expected - set(ids)),
            "duplicated": len(ids) - len(set(ids))}


def batch_faults(url: str, key: str, model: str, lines: int = 24, timeout_s: float = 900) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        upload = client.post("/v1/files", data={"purpose": "batch"},
                             files={"file": ("chaos.jsonl", _lines(model, lines), "application/jsonl")})
        upload.raise_for_status()
        batch = client.post("/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions",
                                                 "completion_window": "24h"}).json()
        t0, faults, trace = time.monotonic(), {}, []
        while time.monotonic() - t0 < timeout_s:
            batch = client.get(f"/v1/batches/{batch['id']}").json()
            done = batch["request_counts"]["completed"] + batch["request_counts"]["failed"]
            trace.append((round(time.monotonic() - t0, 1), batch["status"], done))
            if batch["status"] in ENDED:
                break
            if "engine_killed" not in faults and done >= lines // 4:
                faults["engine_killed"] = {"rows_done": done, "pids": procs.signal_role("offline", signal.SIGKILL),
                                           "at_s": round(time.monotonic() - t0, 1)}
            elif "engine_killed" in faults and "driver_killed" not in faults and done >= lines // 2:
                if pids := _driver(batch["id"]):
                    procs.kill(pids, signal.SIGKILL)
                    faults["driver_killed"] = {"rows_done": done, "pids": pids, "at_s": round(time.monotonic() - t0, 1)}
            time.sleep(1)
        took_s = round(time.monotonic() - t0, 1)
        counts = {"answered": 0, "failed_rows": 0, "lost": lines, "duplicated": 0}
        if batch.get("output_file_id"):
            content = client.get(f"/v1/files/{batch['output_file_id']}/content")
            counts = output_counts(content.content, lines)
    ended = batch["status"] in ENDED
    killed_at = faults.get("driver_killed", {}).get("at_s")
    broken = counts["lost"] + counts["duplicated"] + int(ended and batch["status"] != "completed")
    return {"sent": lines, "answered": counts["answered"], "clean_error": counts["failed_rows"],
            "hung": 0 if ended else lines - counts["answered"], "broken": broken, **counts,
            "status": batch["status"], "batch_id": batch["id"], "faults": faults, "took_s": took_s,
            "recovery_s": None if killed_at is None or not ended else round(took_s - killed_at, 1),
            "progress": trace[::5] + trace[-1:], "broken_examples": [] if not broken else [batch.get("errors")]}
