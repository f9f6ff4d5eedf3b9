"""The ``drain`` scenario: SIGTERM to the ``foreserve serve`` this command started, with streams
open. The open streams must be answered in full, requests sent meanwhile must get a 503 with
Retry-After (until nothing listens: a refused connection, which a client retries, never a reset),
and once the command has exited none of its processes and nothing new in /dev/shm may be left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import httpx

from loadtests.chaos import procs
from loadtests.chaos.probes import retry_wait

SHM = "/dev/shm"


def _shm() -> set[str]:
    return set(os.listdir(SHM)) if os.path.isdir(SHM) else set()


def _stream(url: str, headers: dict, body: dict, out: dict, first: threading.Event, tries: int = 10) -> None:
    """One streamed chat: ``out`` gets ``answered`` (usage says every token asked for, then [DONE])
    or what went wrong. A 429 with Retry-After (the engine shedding the backlog a previous scenario
    left) is sent again after it, as a client would; ``first`` is set once the stream is open."""
    tokens, done, error = None, False, None
    try:
        for _ in range(tries):
            with httpx.stream("POST", f"{url}/v1/chat/completions", headers=headers, json=body, timeout=600) as response:
                if (wait := retry_wait(response)) is not None:
                    time.sleep(wait)
                    continue
                if response.status_code != 200:
                    error = f"HTTP {response.status_code}"
                    break
                for line in response.iter_lines():
                    first.set()
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line.removeprefix("data: "))
                        error = chunk.get("error", error)
                        tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                break
        else:
            error = f"429 {tries} times"
    except httpx.HTTPError as exc:
        error = type(exc).__name__
    first.set()
    out["outcome"] = "answered" if done and not error and tokens == body["max_tokens"] else f"{error or 'cut'}"


RESETS = ("ReadError", "RemoteProtocolError")  # the connection closed with no answer


CLEAN = ("200", "503+retry", "429+retry", "refused")


def probe_outcome(response: httpx.Response) -> str:
    """``503+retry`` (the drain) or ``429+retry`` (the engine shedding a backlog a previous
    scenario left) where the refusal names a Retry-After, else the status code."""
    if response.status_code in (429, 503) and response.headers.get("retry-after"):
        return f"{response.status_code}+retry"
    return str(response.status_code)


def _probe(url: str, headers: dict, model: str) -> str:
    """One new request during the drain: ``probe_outcome``, ``refused`` (nothing listens any
    more) or the error that ended it."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    try:
        response = httpx.post(f"{url}/v1/chat/completions", headers=headers, json=body, timeout=60)
    except httpx.ConnectError:
        return "refused"
    except httpx.HTTPError as exc:
        return type(exc).__name__
    return probe_outcome(response)


def unclean_probes(probes: list[str]) -> tuple[list[str], int]:
    """The drain's probes, in the order sent, that got neither an answer, a refusal with Retry-After
    nor a refused connection; and 1 if the last one that reached the service was reset as it stopped.

    NOTE: that reset is counted apart. Serve's proxy stops last and is killed (``ProxyActor.shutdown``
    does nothing in Ray 2.60): a request it took after the app's replicas began to stop waits for
    them, then is reset when the proxy dies. A reset while the drain went on is unclean."""
    unclean = [p for p in probes if p not in CLEAN]
    answers = [p for p in probes if p != "refused"]
    at_exit = int(bool(answers) and answers[-1] in RESETS)
    return unclean[:len(unclean) - at_exit], at_exit


def drain(service, url: str, key: str, model: str, streams: int = 4, max_tokens: int = 48,
          timeout_s: float = 300, group: bool = False) -> dict:
    """``group``: SIGINT to the command's process group, as Ctrl-C in its terminal sends it (Ray's
    own processes included), instead of SIGTERM to the command alone."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    shm_before = _shm()
    outs = [{} for _ in range(streams)]
    firsts = [threading.Event() for _ in range(streams)]
    threads = [threading.Thread(target=_stream, args=(url, headers, body, out, first), daemon=True)
               for out, first in zip(outs, firsts)]
    for t in threads:
        t.start()
    for first in firsts:
        first.wait(120)
    t0 = time.monotonic()
    if group:
        os.killpg(service.proc.pid, signal.SIGINT)
    else:
        service.proc.send_signal(signal.SIGTERM)
    probes, trace = [], []
    while service.proc.poll() is None and time.monotonic() - t0 < timeout_s:
        sent = time.monotonic()
        probes.append(_probe(url, headers, model))
        trace.append((round(sent - t0, 2), round(time.monotonic() - sent, 2), probes[-1]))
        if probes[-1] == "refused":
            break
        time.sleep(0.25)
    for t in threads:
        t.join(max(1.0, timeout_s - (time.monotonic() - t0)))
    try:
        code = service.proc.wait(max(1.0, timeout_s - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:  # still running: reported as not stopped
        code = None
    stopped_s = round(time.monotonic() - t0, 1)
    time.sleep(5)  # what a clean stop leaves must be gone by now
    left = procs.session(service.proc.pid)
    counts = {o: probes.count(o) for o in sorted(set(probes))}
    streamed = [out.get("outcome", "hung") for out in outs]
    unclean, at_exit = unclean_probes(probes)
    return {"sent": streams + len(probes), "answered": streamed.count("answered") + counts.get("200", 0),
            "clean_error": counts.get("503+retry", 0) + counts.get("429+retry", 0), "hung": streamed.count("hung"),
            "broken": sum(o not in ("answered", "hung") for o in streamed) + len(unclean) + int(code is None) + len(left),
            "recovery_s": None, "health_ok_after_s": None, "probes": counts, "reset_at_exit": at_exit,
            "probe_trace": trace, "streams": streamed,
            "exit_code": code, "stopped_after_s": stopped_s, "left_processes": left,
            "left_in_dev_shm": sorted(_shm() - shm_before),
            "broken_examples": sorted({o for o in streamed if o not in ("answered", "hung")} | set(unclean))[:3]}
