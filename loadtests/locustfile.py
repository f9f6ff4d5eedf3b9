"""Locust users for foreserve's OpenAI chat endpoint (streaming), run by ``foreserve loadtest``.

Run it as its own process (importing locust after ray or mlflow in one process breaks gevent)::

    locust -f loadtests/locustfile.py --headless --host http://127.0.0.1:8000 \
        --fs-workload workload.jsonl --fs-stages steady:60:1 --fs-records records.jsonl

Open loop (default): one dispatcher sends requests at Poisson arrival times whose rate follows the
stages (``ramp:30:0.2-1,steady:60:1,burst:10:3``), each request in its own greenlet, so a slow server
never slows the arrivals; after the last stage it waits up to ``--fs-drain-s`` for requests in flight.
Closed loop (``--fs-mode closed``): the stages give the number of users, each sending its next
request when the last one ended (plus ``--fs-think-s``).

Each request streams and fires Locust events ``TTFT``, ``TPOT``, ``ITL`` (one per gap between content
chunks) and ``E2E`` named by tier, besides Locust's own ``chat[tier]`` line that counts failures; and
appends one record to ``--fs-records`` (loadtests/summary.py reads them) the moment it ends.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
import threading
import time
from pathlib import Path

import gevent
from locust import HttpUser, LoadTestShape, events, task
from locust.exception import StopUser
from urllib3 import PoolManager

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # loadtests.stages, run from any directory
from loadtests.stages import parse_stages  # noqa: E402


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--fs-workload", required=True, help="JSONL of {prompt, max_tokens, tier}, sent in order (cycled)")
    parser.add_argument("--fs-stages", default="steady:60:1", help="name:seconds:level[,...]; level = rps (open) or users (closed)")
    parser.add_argument("--fs-mode", choices=("open", "closed"), default="open")
    parser.add_argument("--fs-records", required=True, help="append one JSON line per finished request here")
    parser.add_argument("--fs-model", default="", help="model id sent in the body (default: the first of GET /v1/models)")
    parser.add_argument("--fs-seed", type=int, default=0, help="seed of the arrival times")
    parser.add_argument("--fs-arrivals", choices=("poisson", "constant"), default="poisson",
                        help="open loop: Poisson arrivals at the stage's rate, or one every 1/rate s")
    parser.add_argument("--fs-drain-s", type=float, default=120, help="open loop: wait this long for requests in flight")
    parser.add_argument("--fs-think-s", type=float, default=0, help="closed loop: pause between a user's requests")
    parser.add_argument("--fs-ignore-eos", choices=("true", "false"), default="true",
                        help="generate exactly max_tokens (the benchmark convention)")
    parser.add_argument("--fs-api-key", default="", help="Bearer key, if the service has API keys")


class _Run:
    """What the users of this process share: the workload, the stages, the records file."""

    def __init__(self, options, host: str) -> None:
        self.items = [json.loads(line) for line in Path(options.fs_workload).read_text().splitlines() if line.strip()]
        if not self.items:
            raise ValueError(f"{options.fs_workload}: no requests")
        self.next_item = itertools.cycle(self.items).__next__
        self.stages = parse_stages(options.fs_stages)
        self.options = options
        self.model = options.fs_model or _first_model(host, options.fs_api_key)
        self.records = open(options.fs_records, "a", buffering=1)  # noqa: SIM115 - closed at quit
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.done = False  # the open-loop dispatcher has sent everything and drained

    def write(self, record: dict) -> None:
        with self.lock:
            self.records.write(json.dumps(record) + "\n")


RUN: _Run | None = None


def _first_model(host: str, api_key: str) -> str:
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        return requests.get(f"{host}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    except (requests.RequestException, ValueError, KeyError, IndexError):
        return ""  # the requests will then show the server's own error


@events.test_start.add_listener
def _start(environment, **_) -> None:
    global RUN
    RUN = _Run(environment.parsed_options, environment.host)


@events.quitting.add_listener
def _quit(environment, **_) -> None:
    if RUN is not None:
        RUN.records.close()


class StagedShape(LoadTestShape):
    """Open loop: one dispatcher user until it is done. Closed loop: the stage's user count."""

    def tick(self):
        if RUN is None:
            return (1, 1)
        t = time.monotonic() - RUN.started
        if RUN.options.fs_mode == "open":
            limit = RUN.stages.total_s + RUN.options.fs_drain_s + 10
            return None if RUN.done or t > limit else (1, 1)
        level = RUN.stages.level_at(t)
        return None if level is None else (max(1, round(level)), 100)


class ChatUser(HttpUser):
    # NOTE: the open-loop dispatcher runs once; closed-loop users loop, pacing themselves
    wait_time = staticmethod(lambda: RUN.options.fs_think_s if RUN else 0)
    # NOTE: open-loop requests share this user's session: keep a connection per request in flight
    pool_manager = PoolManager(maxsize=1024)

    @task
    def chat(self) -> None:
        if RUN.options.fs_mode == "open":
            self.dispatch()
            raise StopUser()
        self.send(RUN.next_item(), time.time())

    def dispatch(self) -> None:
        """Poisson (or evenly spaced) arrivals at the stages' rate; every request in its own greenlet."""
        rng = random.Random(RUN.options.fs_seed)
        t0 = time.monotonic()
        due = 0.0
        flying = []
        while True:
            rate = RUN.stages.level_at(due)
            if rate is None:
                break
            if rate <= 0:
                due += 0.1
                continue
            wait = t0 + due - time.monotonic()
            if wait > 0:
                gevent.sleep(wait)
            flying.append(gevent.spawn(self.send, RUN.next_item(), time.time(), (time.monotonic() - t0 - due) * 1000))
            flying = [g for g in flying if not g.dead]
            due += 1 / rate if RUN.options.fs_arrivals == "constant" else rng.expovariate(rate)
        gevent.joinall(flying, timeout=RUN.options.fs_drain_s)
        gevent.killall([g for g in flying if not g.dead], block=True, timeout=10)
        RUN.done = True

    def send(self, item: dict, start: float, lag_ms: float = 0.0) -> None:
        tier = item.get("tier", "online")
        body = {"model": RUN.model, "messages": [{"role": "user", "content": item["prompt"]}], "max_tokens": item["max_tokens"],
                "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
                "ignore_eos": RUN.options.fs_ignore_eos == "true", "service_tier": "flex" if tier == "flex" else "default"}
        headers = {"Authorization": f"Bearer {RUN.options.fs_api_key}"} if RUN.options.fs_api_key else {}
        record = {"tier": tier, "start": start, "lag_ms": round(lag_ms, 2), "max_tokens": item["max_tokens"],
                  "shape": item.get("shape"),
                  "status": 0, "error": None, "ttft_ms": None, "e2e_ms": None, "itl_ms": [], "output_tokens": 0}
        t0 = time.perf_counter()
        last = None
        try:
            with self.client.post("/v1/chat/completions", json=body, headers=headers, stream=True,
                                  name=f"chat[{tier}]", catch_response=True) as response:
                record["status"] = response.status_code
                record["request_id"] = response.headers.get("x-foreserve-request-id")
                if response.status_code != 200:
                    record["error"] = f"HTTP {response.status_code}: {response.text[:200]}"
                    record["retry_after"] = response.headers.get("Retry-After")
                    response.failure(record["error"])
                else:
                    for line in response.iter_lines():
                        if not line.startswith(b"data: "):
                            continue
                        data = line[6:]
                        if data == b"[DONE]":
                            break
                        chunk = json.loads(data)
                        if "error" in chunk:
                            record["error"] = f"in-band error: {chunk['error'].get('message')}"
                            break
                        if chunk.get("usage"):
                            record["output_tokens"] = chunk["usage"]["completion_tokens"]
                        if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                            now = time.perf_counter()
                            if last is None:
                                record["ttft_ms"] = round((now - t0) * 1000, 2)
                            else:
                                record["itl_ms"].append(round((now - last) * 1000, 2))
                            last = now
                            if item.get("cancel_after") and len(record["itl_ms"]) + 1 >= item["cancel_after"]:
                                record["cancelled"] = True  # the client walks away mid-answer (on purpose)
                                break
                    if record["error"] is None and record["ttft_ms"] is None:
                        record["error"] = "the stream ended without content"
                    if record["error"]:
                        response.failure(record["error"])
                    else:
                        response.success()
        except Exception as exc:  # noqa: BLE001 - a failed request is a result, never a crashed user
            record["error"] = record["error"] or f"{type(exc).__name__}: {exc}"
        except BaseException:  # GreenletExit: still running when the drain ended; counted as a failure
            record["error"] = "not finished within the drain"
            self._finish(record, t0)
            raise
        self._finish(record, t0)

    def _finish(self, record: dict, t0: float) -> None:
        record["e2e_ms"] = round((time.perf_counter() - t0) * 1000, 2)
        RUN.write(record)
        self._fire(record)

    def _fire(self, record: dict) -> None:
        if record["error"] or record.get("cancelled"):  # NOTE: a cancelled answer has no E2E or TPOT to report
            return
        fire = self.environment.events.request.fire
        tokens = record["output_tokens"]
        tpot = (record["e2e_ms"] - record["ttft_ms"]) / (tokens - 1) if tokens > 1 else 0.0
        for kind, ms in (("TTFT", record["ttft_ms"]), ("TPOT", tpot), ("E2E", record["e2e_ms"])):
            fire(request_type=kind, name=record["tier"], response_time=ms, response_length=tokens, exception=None, context={})
        for gap in record["itl_ms"]:
            fire(request_type="ITL", name=record["tier"], response_time=gap, response_length=0, exception=None, context={})
