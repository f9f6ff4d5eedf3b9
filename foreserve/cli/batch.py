"""`foreserve batch submit|status|results|cancel`: offline jobs as Ray Jobs (app/batch/jobs.py, foreserve/batch/job.py)."""

from __future__ import annotations

import argparse
import sys


def _progress_line(report: dict) -> str:
    rate = report.get("output_tokens_per_s")
    return (f"{report['job_id']}: {report['ray_status']} {report.get('rows_done', 0)}/{report.get('rows_total', '?')} rows"
            + (f", {rate} output tok/s" if rate else ""))


def cmd_submit(args: argparse.Namespace) -> int:
    from app.batch import jobs

    extra = ["--batch-size", str(args.batch_size), "--engine-cpus", str(args.engine_cpus)]
    extra += (["--predictor", args.predictor] if args.predictor else []) + (["--engine", args.engine] if args.engine else [])
    extra += [f"--engine-resource={r}" for r in args.engine_resource]
    extra += ["--start-timeout", str(args.start_timeout)] if args.start_timeout is not None else []
    job_id = jobs.submit(args.input, args.output, args.job_id, args.replicas, args.tp, args.backend, args.parquet, extra)
    print(f"submitted {job_id} (output: {args.output}); follow it with: foreserve batch status {job_id}")
    if not args.wait:
        return 0
    from tqdm import tqdm

    bar = tqdm(unit="row", desc=job_id)

    def show(report: dict) -> None:
        bar.total = report.get("rows_total") or bar.total
        bar.n = report.get("rows_done", 0)
        bar.set_postfix_str(f"{report['ray_status']} {report.get('output_tokens_per_s', 0)} tok/s")
        bar.refresh()

    report = jobs.wait(job_id, on_progress=show)
    bar.close()
    print(jobs.dumps(report))
    if report["ray_status"] != "SUCCEEDED":
        print(f"job {job_id} {report['ray_status']}: {report.get('message')}; logs: ray job logs {report['ray_job_id']}", file=sys.stderr)
        return 1
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from app.batch import jobs

    report = jobs.status(args.job_id)
    print(jobs.dumps(report) if args.json else _progress_line(report))
    return 0


def cmd_results(args: argparse.Namespace) -> int:
    from app.batch import jobs

    data = jobs.results(args.job_id)  # NOTE: from its output folder or store URI
    if args.to:
        with open(args.to, "wb") as f:
            f.write(data)
        print(f"wrote {args.to}", file=sys.stderr)
    else:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from app.batch import jobs

    stopped = jobs.stop(args.job_id)
    print(f"{args.job_id}: {'stopping' if stopped else 'already finished'}; resubmit with the same --job-id and --output to resume")
    return 0


def add_parser(sub) -> None:
    batch = sub.add_parser("batch", help="offline batch jobs (OpenAI batch-line JSONL/Parquet) as Ray Jobs").add_subparsers(
        dest="batch", required=True)
    s = batch.add_parser("submit", help="submit a batch job (starts a local Ray cluster if none runs)",
                         description="Rows in OpenAI's batch format ({custom_id, method, url, body}); results.jsonl in the "
                                     "output dir has one line per input line. The same --job-id and --output resume a "
                                     "stopped job without redoing or duplicating rows.")
    s.add_argument("input", help="JSONL or Parquet: a local file or the URI of one object (s3://bucket/rows.jsonl?...)")
    s.add_argument("--output", required=True, help="a folder or a store URI for results.jsonl, status.json and parts/ "
                   "(on a cluster: one every node sees)")
    s.add_argument("--job-id", help="Ray job submission id (default: generated); reuse it to resume")
    s.add_argument("--wait", action="store_true", help="follow progress until the job ends")
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel size of each engine actor")
    s.add_argument("--replicas", type=int, default=1, help="engine actors of the job (backend actors)")
    s.add_argument("--backend", choices=["auto", "actors", "serve"], default="auto",
                   help="actors: the job's own engine actors; serve: the running app's offline pool; auto: serve if it runs")
    s.add_argument("--batch-size", type=int, default=256,
                   help="rows an engine admits together (its offline scheduler packs them by predicted length)")
    s.add_argument("--predictor", help="champion (default), a registry version, a model dir or max")
    s.add_argument("--engine", metavar="JSON", help='engine settings over the offline pool\'s, e.g. \'{"kv_cache_tokens": 16384}\'')
    s.add_argument("--engine-cpus", type=float, default=1.0, help="Ray CPUs per engine actor and TP rank (default 1)")
    s.add_argument("--engine-resource", action="append", default=[], metavar="NAME=AMOUNT",
                   help="a custom Ray resource every engine actor also needs, e.g. gpu_node=0.01 (repeatable)")
    s.add_argument("--start-timeout", type=float, metavar="S",
                   help="seconds an engine actor may take to be placed and loaded, at start or after a restart, "
                        "before the job fails (default 300)")
    s.add_argument("--parquet", action="store_true", help="also write results.parquet")
    s.set_defaults(func=cmd_submit)
    st = batch.add_parser("status", help="a job's state and progress (rows done/total, output tokens/s)")
    st.add_argument("job_id")
    st.add_argument("--json", action="store_true", help="the full status as JSON")
    st.set_defaults(func=cmd_status)
    r = batch.add_parser("results", help="a finished job's results.jsonl (stdout or --to FILE)")
    r.add_argument("job_id")
    r.add_argument("--to", help="write here instead of stdout")
    r.set_defaults(func=cmd_results)
    c = batch.add_parser("cancel", help="stop a job (what it finished stays; resubmit to resume)")
    c.add_argument("job_id")
    c.set_defaults(func=cmd_cancel)
