"""``foreserve serve``: start (or join) Ray, deploy serve_config.yaml's app, print how to call it."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

# NOTE: starting Ray and deploying the app is the deployments' (the load tests start it too);
# re-exported here for the callers of ``foreserve.cli.serve``
from deployments.launch import application_schema, drain, metrics_urls, start, wait_ready  # noqa: F401
from deployments.launch import stop as _stop


def examples(url: str, model: str, auth: bool) -> str:
    key_header = ' -H "Authorization: Bearer $FORESERVE_API_KEY"' if auth else ""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Name three colors."}],
                       "max_tokens": 64, "stream": True})
    api_key = 'os.environ["FORESERVE_API_KEY"]' if auth else '"none"'
    return f"""
curl {url}/v1/chat/completions -H "Content-Type: application/json"{key_header} \\
  -d '{body}'

python - <<'EOF'
import os
from openai import OpenAI
client = OpenAI(base_url="{url}/v1", api_key={api_key})
reply = client.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Name three colors."}}],
                                       max_tokens=64, service_tier="flex")  # flex: the offline pool
print(reply.choices[0].message.content, reply.usage)
EOF
"""


def served_models(config_path: str | None, model: str | None) -> set[str]:
    """The model settings the pools will serve (``--model`` in place of the file's ``args.model``)."""
    from app.config import AppConfig, app_args

    args = app_args(config_path)
    return {pool.model for pool in AppConfig.model_validate({**args, **({"model": model} if model else {})}).pools.values()}


def cmd_serve(args: argparse.Namespace) -> int:
    from app import paths
    from app.prepare.model import ensure_served_model, packaged

    models = served_models(args.config, args.model)  # NOTE: a bad config or model fails here, before Ray starts
    if not paths.model_dir().exists():  # the embedded model, its traces and first predictor
        if args.no_prepare:
            raise RuntimeError(f"no model at {paths.model_dir()}; run `foreserve prepare` first")
        from foreserve.prepare import prepare

        name = next((packaged(m).name for m in models if m and packaged(m)), None)
        prepare(**({"model": name} if name else {}))
    for model in models:  # converted once (a packaged model, a GGUF file) or checked (a folder)
        ensure_served_model(model)
    url, took_s, config = start(args.config, args.host, args.port, args.proxy_location, model=args.model)
    model = config.pools["online"].model_id
    auth = bool(config.ingress.api_keys or os.environ.get("FORESERVE_API_KEYS") or os.environ.get("FORESERVE_API_KEY_SHA256"))
    print(f"\nforeserve is up at {url} in {took_s:.0f} s (model {model}; pools online + offline).\n"
          f"Prometheus metrics (ray_foreserve_*): {', '.join(metrics_urls())}\nTry:\n{examples(url, model, auth)}\n"
          "Ctrl-C stops it.", flush=True)
    if args.exit_when_ready:
        _stop()
        return 0
    signals = {"count": 0}
    for sig in (signal.SIGINT, signal.SIGTERM):  # NOTE: explicit, as a shell's `&` leaves SIGINT ignored
        signal.signal(sig, lambda *_: signals.update(count=signals["count"] + 1))
    while not signals["count"]:
        time.sleep(0.5)
    timeout_s = config.ingress.drain_timeout_s
    print(f"draining: new requests get 503 with Retry-After; open ones get up to {timeout_s:g} s "
          "(Ctrl-C again stops now)...", flush=True)
    t0 = time.monotonic()
    left = drain(timeout_s, interrupted=lambda: signals["count"] > 1)
    cut = f", {left} open requests cut" if left else ""
    print(f"drained in {time.monotonic() - t0:.1f} s{cut}; stopping foreserve...", flush=True)
    _stop()
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="start Ray (or join RAY_ADDRESS) and serve the OpenAI-compatible chat API",
        description="Deploys serve_config.yaml's foreserve app (ingress, online and offline engine pools, the "
        "length predictor) on a local Ray cluster, or on the cluster at RAY_ADDRESS, prints the URL and a "
        "ready-to-paste example, and runs until Ctrl-C or SIGTERM, then drains (new requests get 503 with "
        "Retry-After while open ones finish, up to the ingress's drain_timeout_s) and stops. Runs `foreserve prepare` first if the model is missing.",
    )
    p.add_argument("--model", metavar="MODEL",
                   help="the model both pools serve, in place of the config's args.model: a local HF folder (config, "
                        "safetensors, tokenizer), a .gguf file (converted once) or a packaged model's short name "
                        "(SmolLM2-135M-Instruct, the default; gemma-3-270m); its architecture must be one foreserve "
                        "runs (docs/models.md)")
    p.add_argument("--config", help="Serve config file (default: the repository's serve_config.yaml)")
    p.add_argument("--host", help="HTTP host (default: the config's http_options, 127.0.0.1; 0.0.0.0 when joining RAY_ADDRESS)")
    p.add_argument("--proxy-location", choices=("HeadOnly", "EveryNode", "Disabled"),
                   help="where Serve runs HTTP proxies (default: the config's, HeadOnly; EveryNode when joining RAY_ADDRESS)")
    p.add_argument("--port", type=int, help="HTTP port (default: the config's http_options, 8000)")
    p.add_argument("--no-prepare", action="store_true", help="fail instead of preparing a missing model")
    p.add_argument("--exit-when-ready", action="store_true", help="stop once the first request could be served (startup timing)")
    p.set_defaults(func=cmd_serve)
