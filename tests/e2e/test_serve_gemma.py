"""The whole app serving the second real model, Gemma 3 270M (a base model: no chat template of its
own), through the official ``openai`` client: completions streamed and not, as text and as token ids,
a chat through a template given in the config, flex, 8 at once, and bad input as 4xx."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import yaml

from app import paths
from app.config import DEFAULT_CONFIG_PATH

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.ray, pytest.mark.mlflow,
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]
MODEL = "gemma-3-270m"
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def _config(tmp: Path) -> Path:
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    args = data["applications"][0]["args"]
    args.update(model=MODEL, chat_template=TEMPLATE)
    for pool in ("online", "offline"):
        args["pools"][pool].update(kv_cache_tokens=4096, torch_threads=1)
    args["predictor"].update(timeout_ms=5000, retrain_enabled=False)
    path = tmp / "serve_config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    from app.ports import free_port
    from app.prepare.model import ensure_model
    from foreserve.cli.serve import _stop, start
    from predictor.training.pipeline import train_and_register
    from tests.tiny_predictor import CONFIG, EVAL, SPEC, TRAIN

    folder = ensure_model(name=MODEL)
    tmp = tmp_path_factory.mktemp("serve-gemma")
    home = tmp / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / MODEL).symlink_to(folder)  # the prepared model, read-only
    mp = pytest.MonkeyPatch()
    mp.setenv("FORESERVE_HOME", str(home))
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    mp.delenv("FORESERVE_API_KEYS", raising=False)
    train_and_register(CONFIG, SPEC, train=TRAIN, evalset=EVAL, store=paths.predictor_store())
    try:
        url, _, _ = start(str(_config(tmp)), port=free_port())
        yield url
    finally:
        _stop()
        mp.undo()


def _client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_completions_streamed_and_not_as_text_and_ids(served):
    from transformers import AutoTokenizer

    client = _client(served)
    card = client.models.list().data[0]
    assert card.id == MODEL and card.max_model_len == 2048
    prompt = "The capital of France is"
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    tok = AutoTokenizer.from_pretrained(paths.model_dir(MODEL))
    ids = tok(prompt)["input_ids"]
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-") and reply.choices[0].text
    assert reply.usage.prompt_tokens == len(ids) and 1 <= reply.usage.completion_tokens <= 12
    assert reply.choices[0].finish_reason in ("stop", "length")
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    events = list(stream)
    assert "".join(c.text for e in events for c in e.choices) == reply.choices[0].text
    assert events[-1].usage.completion_tokens == reply.usage.completion_tokens
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == reply.choices[0].text


def test_a_chat_through_the_configured_template_and_flex(served):
    client = _client(served)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a color."}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens >= 1
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="1, 2, 3,", max_tokens=8, temperature=0,
                                                      extra_body={"service_tier": "flex"})  # the SDK's own args lack it
    assert raw.headers["x-foreserve-pool"] == "offline" and raw.parse().choices[0].text


def test_eight_completions_at_once(served):
    from openai import AsyncOpenAI

    async def run() -> list:
        client = AsyncOpenAI(base_url=served + "/v1", api_key="none", max_retries=0, timeout=300)
        calls = [client.completions.create(model=MODEL, prompt=f"Count from {i}:", max_tokens=24, temperature=0.7,
                                           seed=i) for i in range(8)]
        return await asyncio.gather(*calls)

    replies = asyncio.run(run())
    assert len(replies) == 8 and all(r.usage.completion_tokens >= 1 for r in replies)


@pytest.mark.parametrize("body,status,match", [
    ({"prompt": "hi", "n": 2}, 400, "n > 1"),
    ({"prompt": ""}, 400, "prompt must not be empty"),
    ({"prompt": "hi", "echo": True}, 400, "echo is not supported"),
    ({"prompt": "hi", "max_tokens": 4096}, 400, "maximum context length is 2048"),
    ({"prompt": [1, 2, 10**9]}, 400, "prompt token ids"),
    ({"prompt": "hi", "model": "other"}, 404, "other"),
    ({"prompt": "hi", "max_tokens": "12"}, 400, "max_tokens"),
])
def test_bad_completions_are_4xx_in_openais_shape(served, body, status, match):
    reply = httpx.post(served + "/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert reply.status_code == status, reply.text
    assert match in reply.json()["error"]["message"]


def test_a_batch_of_completions_through_the_batch_api(served):
    """OpenAI's Batch API on the Gemma app: /v1/completions lines (text and token ids) and a chat
    line through the configured template, read by the job with the served model's tokenizer."""
    import json
    import time

    client = _client(served)
    lines = [json.dumps({"custom_id": "t", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}}),
             json.dumps({"custom_id": "i", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": [2, 818, 5279, 529, 7001, 563], "max_tokens": 8, "temperature": 0}}),
             json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8}})]
    file = client.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 300
    while batch.status not in ("completed", "failed", "cancelled") and time.monotonic() < deadline:
        time.sleep(2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    out = {x["custom_id"]: x for x in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())}
    assert all(x["error"] is None for x in out.values()), out
    text = out["t"]["response"]["body"]
    assert text["object"] == "text_completion" and text["model"] == MODEL and text["choices"][0]["text"]
    direct = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert text["choices"][0]["text"] == direct.choices[0].text  # the job tokenized with Gemma's tokenizer
    assert out["i"]["response"]["body"]["usage"]["prompt_tokens"] == 6
    assert out["c"]["response"]["body"]["object"] == "chat.completion"
