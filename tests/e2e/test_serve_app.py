"""The whole Serve app on a real local Ray cluster and the real model, through HTTP and the official
``openai`` client: chat (streaming and not), error codes and shapes, API keys, a client that walks
away, the queue limit, the live retraining loop's hot swap and a killed replica. One app for the
module (startup is the expensive part); tests run in file order and share it."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
import yaml

from app import paths
from app.config import DEFAULT_CONFIG_PATH

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.ray, pytest.mark.mlflow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

KEY = "sk-test-key"
KEY_B = "sk-other-tenant"
SUMS = [f"What is {a} plus {b}? Reply with the number only." for a, b in
        [(2, 3), (7, 8), (10, 5), (4, 4), (6, 9), (12, 1), (3, 3), (9, 9), (5, 6), (8, 2), (11, 4), (13, 7), (1, 9), (6, 6)]]


def _config(tmp: Path) -> Path:
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    entry = data["applications"][0]
    args = entry["args"]
    args["ingress"].update(api_keys=[KEY, KEY_B], max_body_bytes=64 * 1024)
    for pool in ("online", "offline"):  # online's pool is smaller than the context: the engine's own 400
        args["pools"][pool].update(kv_cache_tokens=1536 if pool == "online" else 2048, torch_threads=1)
    args["predictor"].update(poll_s=1, timeout_ms=5000)
    args["predictor"]["retrain"].update(every_records=12, min_records=12, holdout_frac=0.5, original_examples=0,
                                        epochs=1, gate=False, num_cpus=0.25)
    for d in entry["deployments"]:
        if d["name"] == "online":
            d.update(max_ongoing_requests=3, max_queued_requests=1, health_check_period_s=1)
    path = tmp / "serve_config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    from app.ports import free_port
    from foreserve.cli.serve import _stop, start
    from predictor import registry
    from predictor.training.pipeline import train_and_register
    from tests.tiny_predictor import CONFIG, EVAL, SPEC, TRAIN

    tmp = tmp_path_factory.mktemp("serve")
    home = tmp / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / paths.model_dir().name).symlink_to(paths.model_dir())  # the prepared model, read-only
    mp = pytest.MonkeyPatch()
    mp.setenv("FORESERVE_HOME", str(home))
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    mp.delenv("FORESERVE_API_KEYS", raising=False)
    train_and_register(CONFIG, SPEC, train=TRAIN, evalset=EVAL, store=paths.predictor_store())  # a tiny champion: version 1
    assert registry.champion_version() == "1"
    port = free_port()
    try:
        config = _config(tmp)
        url, took_s, _ = start(str(config), port=port)
        yield {"url": url, "home": home, "startup_s": took_s, "config": config}
    finally:
        _stop()
        mp.undo()


def _client(served, key: str = KEY):
    from openai import OpenAI

    return OpenAI(base_url=served["url"] + "/v1", api_key=key, max_retries=0, timeout=120)


def _handle(name: str):
    from ray import serve

    return serve.get_deployment_handle(name, "foreserve")


def _feedback(served) -> list:
    from predictor.feedback import read_feedback

    return read_feedback(served["home"] / "feedback")


def test_models_health_and_chat(served):
    client = _client(served)
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"] and models[0].max_model_len == 1536  # online KV 1,536
    health = httpx.get(served["url"] + "/health").json()
    assert health["status"] == "ok" and health["predictor"]["version"] == "1" and set(health["pools"]) == {"online", "offline"}
    assert set(health["replicas"]) == {"online", "offline"} and health["replicas"]["online"] >= 1

    raw = client.chat.completions.with_raw_response.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": SUMS[0]}], max_tokens=16, temperature=0)
    reply = raw.parse()
    assert raw.headers["x-foreserve-predictor-version"] == "1" and raw.headers["x-foreserve-pool"] == "online"
    assert 1 <= int(raw.headers["x-foreserve-predicted-tokens"]) <= 16
    assert reply.choices[0].message.content.strip() and reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 16 and reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

    chunks = list(client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": SUMS[0]}], max_tokens=16, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content  # greedy: the stream says exactly what the answer said
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reply.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens

    flex = client.chat.completions.with_raw_response.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": SUMS[1]}], max_tokens=8, service_tier="flex")
    assert flex.headers["x-foreserve-pool"] == "offline" and flex.parse().service_tier == "flex"


BAD = [  # (what, body or raw bytes, status, param)
    ("malformed json", b'{"model": "SmolLM2-135M-Instruct", "messages": [', 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("empty messages", {"messages": []}, 400, "messages"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("n > 1", {"n": 2}, 400, "n"),
    ("max_tokens 0", {"max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens past the context", {"max_tokens": 5000}, 400, "max_tokens"),
    ("prompt longer than the context", {"messages": [{"role": "user", "content": "word " * 3000}]}, 400, "messages"),
    ("temperature 3", {"temperature": 3}, 400, "temperature"),
    ("top_p 0", {"top_p": 0}, 400, "top_p"),
    ("unknown model", {"model": "gpt-17"}, 404, "model"),
    ("body too large", {"messages": [{"role": "user", "content": "x" * 70_000}]}, 413, None),
    ("kv pool too small", {"max_tokens": 1600}, 400, "max_tokens"),
    ("json nested too deep", b"[" * 5000, 400, None),
    ("seed past int64", {"seed": 2**64}, 400, "seed"),
    ("stream as a string", {"stream": "yes"}, 400, "stream"),
    ("max_tokens as a string", {"max_tokens": "12"}, 400, "max_tokens"),
]


@pytest.mark.parametrize("what,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_errors(served, what, body, status, param):
    if isinstance(body, dict):
        body = json.dumps({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], **body}).encode()
    r = httpx.post(served["url"] + "/v1/chat/completions", content=body, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def test_api_keys_and_unknown_routes(served):
    url = served["url"]
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(url + "/v1/chat/completions", json=body).status_code == 401
    wrong = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    missing = httpx.get(url + "/v1/nothing-here", headers={"Authorization": f"Bearer {KEY}"})
    assert missing.status_code == 404 and "error" in missing.json()
    assert httpx.get(url + "/v1/chat/completions").status_code == 405
    bad_query = httpx.get(url + "/v1/batches?limit=abc", headers={"Authorization": f"Bearer {KEY}"})
    assert bad_query.status_code == 400 and bad_query.json()["error"]["param"] == "limit"


ROUTES = [("POST", "/v1/files"), ("GET", "/v1/files/file-x"), ("GET", "/v1/files/file-x/content"), ("POST", "/v1/batches"),
          ("GET", "/v1/batches"), ("GET", "/v1/batches/batch_x"), ("POST", "/v1/batches/batch_x/cancel"),
          ("POST", "/v1/chat/completions"), ("GET", "/v1/models")]


@pytest.mark.parametrize("auth", [None, "Bearer", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", f"Basic {KEY}",
                                  f"Bearer {KEY.upper()}", f"Bearer {KEY} {KEY_B}"])
def test_near_miss_keys_are_401_and_path_tricks_find_nothing(served, auth):
    headers = {} if auth is None else {"Authorization": auth}
    for method, path in ROUTES:
        r = httpx.request(method, served["url"] + path, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (method, path, r.status_code)
    for method, path in [("GET", "//v1/batches"), ("GET", "/v1//files/file-x"), ("GET", "/v1/batches%2Fbatch_x"), ("GET", "/v1/batches/..%2Fbatch_x"),
                         ("GET", "/v1/files/%2E%2E%2Ffile-x/content")]:
        r = httpx.request(method, served["url"] + path, headers=headers, timeout=30)
        assert r.status_code in (401, 404), (method, path, r.status_code)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_a_huge_header_is_431_and_the_service_stays_up(served):
    headers = {"Authorization": f"Bearer {KEY}", "X-Padding": "a" * (1 << 20)}
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(served["url"] + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 431 and r.json()["error"]["code"] == "request_header_fields_too_large"
    assert httpx.get(served["url"] + "/health", timeout=30).json()["status"] == "ok"


def test_extreme_sampling_values_do_not_crash_the_engine(served):
    """1e-50 passes the API's bounds but is 0 in float32: the engine must answer, and keep answering."""
    for extreme in ({"temperature": 1e-50}, {"top_p": 1e-50}, {"seed": 2**63 - 1}):
        r = httpx.post(served["url"] + "/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 2, **extreme})
        assert r.status_code == 200, (extreme, r.text)


def _online_stats() -> dict:
    return _handle("online").stats.remote().result()


def test_client_walking_away_frees_its_blocks(served):
    body = {"model": "SmolLM2-135M-Instruct", "stream": True, "max_tokens": 400, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a very long story about a dragon and a lighthouse."}]}
    with httpx.stream("POST", served["url"] + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        request_id = r.headers["x-foreserve-request-id"]
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert _online_stats()["kv_used_tokens"] > 0
    deadline = time.monotonic() + 30
    while (stats := _online_stats())["kv_used_tokens"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stats["kv_used_tokens"] == 0 and stats["num_running"] == 0
    deadline = time.monotonic() + 10
    while not (records := [f for f in _feedback(served) if f.request_id == request_id]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert records[0].finish_reason == "abort" and records[0].output_tokens < 400


def test_queue_limit_is_429_and_nothing_half_accepted(served):
    before = {f.request_id for f in _feedback(served)}

    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 48, "temperature": 0,
                "messages": [{"role": "user", "content": f"Count from 1 to 20, attempt {i}."}]}
        return await client.post("/v1/chat/completions", json=body)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=served["url"], timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
            return await asyncio.gather(*(one(c, i) for i in range(10)))

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 429}, codes  # 3 running + 1 queued at most, the rest turned away
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "2" and r.json()["error"]["type"] == "rate_limit_error"
    ok = [r.json()["id"] for r in responses if r.status_code == 200]
    deadline = time.monotonic() + 10  # feedback reaches the store within a flush period
    while len(after := [f for f in _feedback(served) if f.request_id not in before]) < len(ok) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sorted(f.request_id for f in after if f.request_id in ok) == sorted(ok) and len(after) == len(ok)


def test_feedback_retrains_and_the_new_champion_serves(served):
    client = _client(served)
    version = None
    for prompt in SUMS:  # short answers that end by EOS: usable labels
        raw = client.chat.completions.with_raw_response.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": prompt}], max_tokens=32, temperature=0)
        version = raw.headers["x-foreserve-predictor-version"]
    deadline = time.monotonic() + 240
    while version == "1" and time.monotonic() < deadline:
        time.sleep(2)
        raw = client.chat.completions.with_raw_response.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": SUMS[0]}], max_tokens=4)
        version = raw.headers["x-foreserve-predictor-version"]
    info = _handle("predictor").info.remote().result()
    assert version == "2", info
    assert info["swaps"] >= 1 and info["last_retrain"]["promoted"] and info["last_retrain"]["version"] == "2"
    from mlflow import MlflowClient

    assert MlflowClient().get_model_version("length-predictor", "2").tags["source"] == "feedback"


def test_batch_api_through_the_openai_client(served):
    """OpenAI's Files + Batch API: a job on the app's offline pool, one output line per input line
    (a bad line answered with an error), feedback from its rows, 4xx for bad calls."""
    import openai

    client = _client(served)
    lines = [json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "SmolLM2-135M-Instruct", "max_tokens": 12, "temperature": 0,
                                  "messages": [{"role": "user", "content": q}]}}) for i, q in enumerate(SUMS[:4])]
    lines.insert(2, json.dumps({"method": "POST", "body": {"messages": [{"role": "user", "content": "no id"}]}}))
    before = {f.request_id for f in _feedback(served)}
    file = client.files.create(file=("sums.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    assert file.bytes > 0 and file.purpose == "batch"
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"suite": "serve"})
    assert batch.status == "validating" and batch.metadata == {"suite": "serve"}
    deadline = time.monotonic() + 300
    while batch.status not in ("completed", "failed", "cancelled") and time.monotonic() < deadline:
        time.sleep(2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (5, 4, 1)
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in out] == ["b0", "b1", None, "b2", "b3"]
    assert "line 3: missing custom_id" in out[2]["error"]["message"]
    for x, (a, b) in zip([o for o in out if o["error"] is None], [(2, 3), (7, 8), (10, 5), (4, 4)]):
        body = x["response"]["body"]
        assert x["response"]["status_code"] == 200 and body["usage"]["completion_tokens"] == x["output_tokens"] <= 12
        assert body["choices"][0]["message"]["content"].strip()
    deadline = time.monotonic() + 10  # feedback reaches the store within a flush period
    while len(offline := [f for f in _feedback(served) if f.request_id not in before and f.tier == "offline"]) < 4 \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(offline) == 4  # batch rows are labels for retraining, like online requests
    assert client.files.content(file.id).text.splitlines() == lines
    assert [b.id for b in client.batches.list().data] == [batch.id]
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)

    other = _client(served, KEY_B)  # another tenant: none of it exists
    for call, arg in ((other.files.retrieve, file.id), (other.files.content, file.id), (other.batches.retrieve, batch.id),
                      (other.files.content, batch.output_file_id), (other.batches.cancel, batch.id)):
        with pytest.raises(openai.NotFoundError):
            call(arg)
    assert other.batches.list().data == []
    with pytest.raises(openai.NotFoundError):
        other.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert [b.id for b in client.batches.list().data] == [batch.id]


def _online_replica() -> tuple[str, str, int]:
    """The online pool's live replica: its actor name, namespace and process id."""
    import ray
    from ray.util.state import list_actors

    cluster = ray.get_runtime_context().gcs_address  # NOTE: not Ray's guess, which fails beside another local Ray
    [actor] = [a for a in list_actors(cluster, filters=[("state", "=", "ALIVE")], detail=True, limit=1000)
               if "#online#" in (a.name or "") and a.name.startswith("SERVE_REPLICA")]
    return actor.name, actor.ray_namespace, actor.pid


def _replaced(old_name: str, old_pid: int, timeout_s: float = 300) -> str:
    """Wait until the online pool runs a replica other than ``old_name`` and ``old_pid`` is gone (the
    timeout is against a hang); the new replica's name."""
    import os

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            name, _, pid = _online_replica()
        except ValueError:  # none alive, or the old and the new for a moment
            name, pid = old_name, old_pid
        try:
            os.kill(old_pid, 0)
            old_alive = True
        except ProcessLookupError:
            old_alive = False
        if name != old_name and not old_alive:
            return name
        assert time.monotonic() < deadline, f"{old_name} (pid {old_pid}) never replaced"
        time.sleep(0.5)


def _stream_then(served, fault) -> tuple[int, str]:
    """A streamed answer of 48 tokens (ignore_eos) with ``fault()`` called after its first content
    chunk; the completion tokens it reported and the text, read to its end."""
    body = {"model": "SmolLM2-135M-Instruct", "stream": True, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": SUMS[2]}]}
    text, usage, faulted = [], None, False
    with httpx.stream("POST", served["url"] + "/v1/chat/completions", json=body, timeout=300,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            assert "error" not in chunk, chunk
            text += [c["delta"].get("content") or "" for c in chunk.get("choices", [])]
            usage = chunk.get("usage") or usage
            if not faulted and "".join(text):
                fault()
                faulted = True
    assert faulted
    return usage["completion_tokens"], "".join(text)


def test_a_killed_replica_is_replaced_and_its_open_answer_resumed(served):
    """SIGKILL (ray.kill) of the online replica with an answer streaming: Serve starts another and the
    ingress resumes the answer there, to its last token."""
    import ray

    name, namespace, pid = _online_replica()
    tokens, text = _stream_then(served, lambda: ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True))
    assert tokens == 48 and text.strip(), (tokens, text)
    assert _replaced(name, pid) != name
    reply = _client(served).chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": SUMS[2]}], max_tokens=8)
    assert reply.choices[0].message.content


def test_a_frozen_replica_is_replaced_and_its_request_answered(served):
    """A replica frozen whole (SIGSTOP: alive to the OS, answering nothing) fails Serve's health
    check within health_check_timeout_s, is stopped at once (the controller runs with
    RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS, docs/serving.md), is replaced, and the answer open on it
    is resumed there."""
    import os
    import signal

    import ray
    from ray.util.state import list_actors

    cluster = ray.get_runtime_context().gcs_address
    [controller] = [a for a in list_actors(cluster, filters=[("state", "=", "ALIVE")], detail=True, limit=1000)
                    if a.name == "SERVE_CONTROLLER_ACTOR"]
    environ = Path(f"/proc/{controller.pid}/environ").read_bytes().split(b"\0")
    assert b"RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS=1" in environ  # else a frozen replica's stop waits it out
    name, _, pid = _online_replica()
    t0 = time.monotonic()
    try:
        tokens, text = _stream_then(served, lambda: os.kill(pid, signal.SIGSTOP))
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    print(f"an answer open on a frozen replica finished in {time.monotonic() - t0:.1f} s")
    assert tokens == 48 and text.strip(), (tokens, text)
    assert _replaced(name, pid) != name
