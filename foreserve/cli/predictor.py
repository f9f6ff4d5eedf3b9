"""`foreserve predictor train|eval|promote|list|retrain|collect|server`: the length predictor and its MLflow registry."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from app import paths
from app.prepare.traces import ensure_traces
from foreserve.cli.common import write_json


def cmd_train(args: argparse.Namespace) -> int:
    from predictor.training.pipeline import FULL_SPEC, FULL_TRAIN, QUICK_SPEC, QUICK_TRAIN, train_and_register

    def merged(base, overrides: dict):  # validated, unlike model_copy(update=...)
        return type(base).model_validate({**base.model_dump(), **{k: v for k, v in overrides.items() if v is not None}})

    config = merged(QUICK_TRAIN if args.quick else FULL_TRAIN, {
        "epochs": args.epochs, "max_train_examples": args.max_examples, "lr": args.lr, "seed": args.seed,
        "freeze_embeddings": False if args.train_embeddings else None})
    spec = merged(QUICK_SPEC if args.quick else FULL_SPEC, {
        "max_input_tokens": args.max_input_tokens, "bound_quantile": args.bound_quantile})
    turns = args.turns or ("first" if args.quick else "all")
    summary = train_and_register(config, spec, promote=not args.no_promote, turns=turns,
                                 extra_params={"recipe": "quick" if args.quick else "full"},
                                 store=paths.predictor_store(), trace_dir=ensure_traces(later=turns == "all"))
    write_json(args.json, summary, echo=True)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from predictor.training.dataset import examples_hash, read_eval_file, selection_examples
    from predictor.learned import LearnedPredictor
    from predictor.loading import load_predictor
    from predictor.training.train import evaluate

    if args.bound_quantile is not None and not 0 < args.bound_quantile <= 1:
        raise ValueError(f"--bound-quantile is a quantile in (0, 1], got {args.bound_quantile}")
    examples = read_eval_file(Path(args.data)) if args.data else selection_examples(ensure_traces())
    predictor = load_predictor(args.version or "champion", store=paths.predictor_store())
    if not isinstance(predictor, LearnedPredictor):
        raise ValueError(f"{args.version or 'champion'!r} is no learned predictor: eval scores the champion, a version or a model directory")
    t0 = time.perf_counter()
    metrics = evaluate(predictor, examples, args.bound_quantile)
    elapsed_s = time.perf_counter() - t0
    metrics.update(version=predictor.version, data=args.data or "sharegpt validation (deduplicated against train)",
                   eval_set_hash=examples_hash(examples), prompts_per_s=round(len(examples) / elapsed_s, 1))
    write_json(args.json, metrics, echo=True)
    return 0


def cmd_promote(args: argparse.Namespace) -> int:
    from predictor import registry
    from predictor.training.dataset import examples_hash, selection_examples
    from predictor.training.pipeline import champion_metrics, load_predictor
    from predictor.training.train import evaluate

    store = paths.predictor_store()
    registry.configure(store)
    registry.get_version_info(args.version)  # an unknown version fails now, not after the evaluation
    if args.force:
        registry.set_champion(args.version)
        print(f"champion -> v{args.version} (forced, no gate)")
        return 0
    examples = selection_examples(ensure_traces())
    eval_hash = examples_hash(examples)
    candidate = evaluate(load_predictor(args.version, store=store), examples)
    accepted, reason = registry.promote_if_better(args.version, candidate, champion_metrics(examples, eval_hash, store),
                                                  eval_hash)
    print(f"{'promoted' if accepted else 'not promoted'} v{args.version}: {reason}")
    return 0 if accepted else 1


def cmd_list(args: argparse.Namespace) -> int:
    from predictor import registry

    registry.configure(paths.predictor_store())
    rows = registry.list_versions()
    if args.json:
        write_json(args.json, {"versions": rows}, echo=True)
        return 0
    if not rows:
        print("no versions of length-predictor yet: run `foreserve prepare` or `foreserve predictor train`")
        return 0
    print(f"{'version':>7}  {'aliases':<10} {'source':<9} {'exact':>6} {'±1':>6} {'tau':>6} {'mae':>7} {'under':>6}  gate")
    for r in rows:
        tags, m = r.get("tags", {}), r.get("metrics", {})

        def f(key: str, fmt: str = ".3f") -> str:
            value = m.get(key, tags.get(f"metric.{key}"))
            return format(float(value), fmt) if value is not None else "-"

        print(f"{r['version']:>7}  {','.join(r.get('aliases', [])):<10} {tags.get('source', '-'):<9} "
              f"{f('exact_bucket_acc'):>6} {f('within1_bucket_acc'):>6} {f('kendall_tau'):>6} "
              f"{f('mae_tokens', '.1f'):>7} {f('under_prediction_rate'):>6}  {tags.get('gate', '-')}")
    return 0


def cmd_retrain(args: argparse.Namespace) -> int:
    from app.config import load_predictor_config
    from predictor.training.retrain import retrain_from_feedback

    if not args.from_feedback:
        raise ValueError("say what to retrain from: --from-feedback (the only source so far)")
    policy = load_predictor_config(args.config).retrain
    policy = policy.model_validate({**policy.model_dump(), **{k: v for k, v in {
        "epochs": args.epochs, "min_records": args.min_records, "holdout_frac": args.holdout_frac,
        "original_examples": args.original_examples}.items() if v is not None}})
    report = retrain_from_feedback(policy, paths.feedback_store(), force=args.force, promote=not args.no_promote,
                                   store=paths.predictor_store(),
                                   trace_dir=ensure_traces() if policy.original_examples else None)
    write_json(args.json, report, echo=True)
    return 0


def cmd_collect(args: argparse.Namespace) -> int:
    from app.prepare.collect import collect_feedback

    write_json(args.json, collect_feedback(
        args.prompts, split=args.split, offset=args.offset, max_tokens=args.max_tokens,
        temperature=args.temperature, seed=args.seed, torch_threads=args.threads,
        root=paths.feedback_store(), store=paths.predictor_store(), trace_dir=ensure_traces(),
    ), echo=True)
    return 0


def cmd_server(args: argparse.Namespace) -> int:
    import signal

    from predictor.tracking_server import TrackingServer

    server = TrackingServer(args.backend_store_uri, args.artifacts, host=args.host, port=args.port, workers=args.workers)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    url = server.start()
    print(f"MLflow tracking server up: {url} (backend {args.backend_store_uri}, artifacts {args.artifacts})")
    print(f"on every node that runs foreserve:  export MLFLOW_TRACKING_URI=http://<this host>:{args.port}", flush=True)
    try:
        while not stop and server.process is not None and server.process.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        exited = server.process is not None and server.process.poll() is not None
        server.stop()
    return 1 if exited else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    pred = sub.add_parser("predictor", help="train, evaluate and promote the output-length predictor (MLflow)")
    ps = pred.add_subparsers(dest="predictor_command", required=True)

    t = ps.add_parser("train", help="fine-tune on the ShareGPT train split, register in MLflow, gate and promote",
                      description="Logs params and per-epoch metrics to MLflow (experiment length-predictor), "
                      "registers a version, compares it with the champion on the same eval set and moves "
                      "the champion alias only if it is better.")
    t.add_argument("--quick", action="store_true", help="the few-minute recipe `foreserve prepare` uses")
    t.add_argument("--epochs", type=int)
    t.add_argument("--max-examples", type=int, help="train on a seeded sample of this many examples")
    t.add_argument("--max-input-tokens", type=int, help="encoder tokens per prompt (head + tail kept), <= 512")
    t.add_argument("--bound-quantile", type=float, help="reservation bound quantile of the predicted distribution")
    t.add_argument("--lr", type=float)
    t.add_argument("--seed", type=int)
    t.add_argument("--train-embeddings", action="store_true",
                   help="fine-tune the word embeddings too (frozen by default: half the weights, 2x slower steps on CPU)")
    t.add_argument("--turns", choices=("all", "first"), help="train on every turn of the train conversations (default) or "
                   "on first turns only (default with --quick); the later turns are 2.5x more examples")
    t.add_argument("--no-promote", action="store_true", help="register only; leave the champion alias alone")
    t.add_argument("--json", metavar="FILE", help="write the summary here")
    t.set_defaults(func=cmd_train)

    e = ps.add_parser("eval", help="score a version on a JSONL of {prompt, output_tokens} lines",
                      description="Default data: the ShareGPT validation split minus prompts seen in train.")
    e.add_argument("--data", metavar="FILE.jsonl")
    e.add_argument("--version", help="registry version (default: the champion) or a model directory")
    e.add_argument("--bound-quantile", type=float, help="override the version's reservation quantile")
    e.add_argument("--json", metavar="OUT")
    e.set_defaults(func=cmd_eval)

    p = ps.add_parser("promote", help="gate a version against the champion and move the alias if it wins")
    p.add_argument("version")
    p.add_argument("--force", action="store_true", help="move the alias without the gate")
    p.set_defaults(func=cmd_promote)

    li = ps.add_parser("list", help="registered versions, newest first, with their metrics and aliases")
    li.add_argument("--json", metavar="OUT")
    li.set_defaults(func=cmd_list)

    r = ps.add_parser("retrain", help="retrain from the engine's feedback records (S3's loop), gate, promote")
    r.add_argument("--from-feedback", action="store_true", help="use the feedback store in the data dir")
    r.add_argument("--force", action="store_true", help="retrain even if the trigger has not fired")
    r.add_argument("--epochs", type=int)
    r.add_argument("--min-records", type=int)
    r.add_argument("--original-examples", type=int, help="ShareGPT examples mixed in (default from config)")
    r.add_argument("--holdout-frac", type=float, help="share of feedback prompts held out to gate (default from config)")
    r.add_argument("--no-promote", action="store_true")
    r.add_argument("--config", help="serve_config.yaml whose predictor.training.retrain policy applies (default: the repository's)")
    r.add_argument("--json", metavar="OUT")
    r.set_defaults(func=cmd_retrain)

    c = ps.add_parser("collect", help="run trace prompts through the real engine (natural EOS) to fill the feedback store",
                      description="What serving does for every request, offline: the champion predicts, the engine "
                      "generates until EOS or max_tokens, and each finished request appends a feedback record "
                      "carrying the serving model's own length. Prompts the store already answered are skipped: "
                      "run the same command again to resume a stopped collection (prompts are matched by trace id alone, so "
                      "a rerun with other settings does not answer them again).")
    c.add_argument("--prompts", type=int, default=200, help="how many trace prompts (default 200)")
    c.add_argument("--split", choices=("train", "validation"), default="validation")
    c.add_argument("--offset", type=int, default=0, help="skip this many prompts of the split")
    c.add_argument("--max-tokens", type=int, default=1024)
    c.add_argument("--temperature", type=float, default=0.7)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--threads", type=int, help="torch threads of the engine")
    c.add_argument("--json", metavar="OUT")
    c.set_defaults(func=cmd_collect)

    sv = ps.add_parser("server", help="run the registry for a cluster: an MLflow tracking server that serves the artifacts",
                       description="One registry every node reaches over HTTP: MLflow's tracking server on a backend "
                       "store (PostgreSQL on a cluster; sqlite for a try-out) with the artifacts kept under --artifacts "
                       "and served by the server, so no node reads another's disk. Runs until Ctrl-C or SIGTERM. "
                       "Then export MLFLOW_TRACKING_URI=http://HOST:PORT before `foreserve prepare` and `foreserve "
                       "serve`: the replicas get it too. docs/cluster.md shows the whole setup.")
    sv.add_argument("--backend-store-uri", required=True, metavar="URI",
                    help="where runs and versions live, e.g. postgresql://mlflow@db-host/mlflow")
    sv.add_argument("--artifacts", required=True, metavar="DIR_OR_URI",
                    help="where the server keeps the predictors' files: a folder on its host, or s3://bucket/prefix")
    sv.add_argument("--host", default="0.0.0.0", help="interface to listen on (default: all, so other nodes reach it)")
    sv.add_argument("--port", type=int, default=5000)
    sv.add_argument("--workers", type=int, default=2, help="server worker processes (default 2)")
    sv.set_defaults(func=cmd_server)
