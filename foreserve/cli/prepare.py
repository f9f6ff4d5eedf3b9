"""`foreserve prepare` (model, traces, first predictor) and `foreserve generate` (one answer, no server)."""

from __future__ import annotations

import argparse
import json


def cmd_prepare(args: argparse.Namespace) -> int:
    from foreserve.prepare import prepare

    summary = prepare(force=args.force, predictor=not args.no_predictor, model=args.model)
    if args.upload is not None:
        from pathlib import Path

        from app import paths
        from app.prepare.model_store import upload_model

        store = paths.store(args.upload or None)
        manifest = upload_model(Path(summary["model_dir"]), store)
        summary["uploaded"] = {"store": store.uri, "model": manifest["name"], "files": len(manifest["files"]),
                               "bytes": sum(f["bytes"] for f in manifest["files"].values())}
    print(json.dumps(summary, indent=2, default=str))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream one answer from the engine (no server): a chat turn through the model's template, or the
    raw prompt continued where the model has none (a base model): a quick way to see a model work."""
    import asyncio

    from app.config import load_pool_config
    from app.engine.async_engine import AsyncLLMEngine
    from app.engine.engine import LLMEngine
    from app.engine.request import EngineRequest, SamplingParams
    from app.runtime_env import traced

    from app.prepare.model import ensure_served_model

    overrides = {key: value for key, value in (("model", args.model), ("dtype", args.dtype)) if value}
    config = traced(load_pool_config(args.pool, args.config, tensor_parallel_size=args.tp, **overrides))
    ensure_served_model(config.model)
    engine = LLMEngine.from_config(config)
    prompt = args.prompt
    if getattr(engine.tokenizer, "chat_template", None):
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=False
        )
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    aengine = AsyncLLMEngine(engine)

    async def stream() -> None:
        async for out in aengine.generate(EngineRequest(prompt=prompt, sampling=sampling)):
            print(out.text_delta, end="", flush=True)
        print()

    try:
        asyncio.run(stream())
    finally:
        aengine.shutdown()
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("prepare", help="build the embedded model folder, the ShareGPT traces and a first length predictor (idempotent)")
    p.add_argument("--force", action="store_true", help="rebuild even if present")
    p.add_argument("--no-predictor", action="store_true", help="skip training the first length predictor")
    p.add_argument("--model", default="SmolLM2-135M-Instruct", metavar="MODEL",
                   help="also make this model ready: a packaged model's short name (gemma-3-270m) or a .gguf file, "
                        "converted into the data dir's models/; a HF folder, checked. The traces and the first "
                        "predictor are still the embedded model's")
    p.add_argument("--upload", nargs="?", const="", metavar="STORE",
                   help="then put the model into the store (STORE, else $FORESERVE_STORE), checksummed, so that "
                        "cluster nodes without it fetch it where their engines start (docs/cluster.md)")
    p.set_defaults(func=cmd_prepare)

    g = sub.add_parser("generate", help="stream one answer from a model (no server): a chat turn, or the raw prompt "
                       "continued on a model without a chat template")
    g.add_argument("prompt")
    g.add_argument("--model", metavar="MODEL", help="a HF folder, a .gguf file or a packaged model's short name "
                   "(default: the config's, else SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), help="weights dtype (default: the config's, auto)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size (DeepSpeed AutoTP ranks)")
    g.add_argument("--config", help="serve_config.yaml to read the pool from (default: the repository's)")
    g.add_argument("--pool", default="online", choices=("online", "offline"), help="which pool's engine settings")
    g.set_defaults(func=cmd_generate)
