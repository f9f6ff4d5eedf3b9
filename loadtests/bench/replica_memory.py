"""RSS of a replica's work in one process, without Serve or Ray: does memory grow with requests?

    python -m loadtests.bench.replica_memory engine --requests 1500 --concurrency 4 --cancel 0.05
    python -m loadtests.bench.replica_memory predictor --prompts 12000 --threads 8
    MALLOC_ARENA_MAX=2 python -m loadtests.bench.replica_memory predictor ...   # the replicas' setting

``engine`` drives ``EngineServer("online")`` (serve_config.yaml's online pool) with ShareGPT chats of
the prepared training traces (max_tokens their true length, at most 64), ``--cancel`` of them
closed by their client after 3 items; ``predictor`` runs the champion on the traces' prompts in
batches of 1 to 8 from ``--threads`` threads. Both print the process's RSS every ``--every`` items;
``engine`` also prints the error items so far by status (the online pool sheds load on a busy
machine: a run with refusals is not a memory figure). ``--distinct N`` sends the same N prompts again
and again. Feedback the engine writes goes to a temporary data dir, never to the prepared one."""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from app import paths
from app.prepare.traces import TraceRecord, load_trace
from app.runtime_env import process_defaults


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def _traces(limit: int) -> list[TraceRecord]:
    rows = load_trace("train")
    random.Random(0).shuffle(rows)
    return rows[:limit]


def engine(requests: int, concurrency: int, cancel: float, every: int, distinct: int = 0) -> None:
    rows = _traces(distinct or requests)
    rows = [rows[i % len(rows)] for i in range(requests)]  # the same prompts again past ``distinct``
    model = paths.model_dir()
    home = Path(tempfile.mkdtemp(prefix="foreserve-memory-"))
    (home / "models").mkdir()
    (home / "models" / model.name).symlink_to(model)
    os.environ["FORESERVE_HOME"] = str(home)  # NOTE: feedback records land here, not in the prepared data dir
    from deployments.engine_server import EngineServer

    server = EngineServer("online")
    rnd = random.Random(1)
    t0, done, failed = time.time(), 0, collections.Counter()

    async def one(i: int, slots: asyncio.Semaphore) -> None:
        nonlocal done
        row, cut = rows[i], rnd.random() < cancel
        request = {"request_id": f"r{i}", "messages": [{"role": "user", "content": row.user}],
                   "sampling": {"max_tokens": max(1, min(row.output_tokens, 64)), "temperature": 0}}
        async with slots:
            stream = server.generate(request)
            items = 0
            async for item in stream:
                items += 1
                if "error" in item:  # refused or failed: no work done, so it must not count as a request served
                    failed[item["error"].get("status_code")] += 1
                if cut and items == 3:
                    await stream.aclose()
                    break
        done += 1
        if done % every == 0:
            print(f"{done} requests  RSS {rss_mb():.0f} MB  {time.time() - t0:.0f} s  errors {dict(failed)}", flush=True)

    async def run() -> None:
        slots = asyncio.Semaphore(concurrency)
        await asyncio.gather(*(one(i, slots) for i in range(len(rows))))

    print(f"engine up  RSS {rss_mb():.0f} MB  MALLOC_ARENA_MAX={os.environ.get('MALLOC_ARENA_MAX')}", flush=True)
    try:
        asyncio.run(run())
    finally:
        server.shutdown()
    print(f"end  RSS {rss_mb():.0f} MB", flush=True)


def predictor(prompts: int, threads: int, every: int) -> None:
    from predictor.loading import load_predictor_or_max

    users = [row.user for row in _traces(prompts)]
    model = load_predictor_or_max("champion", store=paths.predictor_store())
    model.predict(["warm-up"])
    rnd, batches, i = random.Random(0), [], 0
    while i < len(users):
        size = rnd.randint(1, 8)
        batches.append(users[i:i + size])
        i += size
    print(f"predictor {model.version} up  RSS {rss_mb():.0f} MB  MALLOC_ARENA_MAX={os.environ.get('MALLOC_ARENA_MAX')}",
          flush=True)
    t0, done = time.time(), 0
    with ThreadPoolExecutor(threads) as pool:
        for batch, _ in zip(batches, pool.map(model.predict, batches)):
            done += len(batch)
            if done // every != (done - len(batch)) // every:
                print(f"{done} prompts  RSS {rss_mb():.0f} MB  {time.time() - t0:.0f} s", flush=True)
    print(f"end  RSS {rss_mb():.0f} MB", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    e = sub.add_parser("engine", help="the online EngineServer under concurrent chats")
    e.add_argument("--requests", type=int, default=1500)
    e.add_argument("--concurrency", type=int, default=4)
    e.add_argument("--cancel", type=float, default=0.05, help="share of chats closed by their client mid-way")
    e.add_argument("--every", type=int, default=100, help="print RSS every this many requests")
    e.add_argument("--distinct", type=int, default=0,
                   help="cycle through this many prompts (0: every request a new one): does RSS grow with new shapes only?")
    p = sub.add_parser("predictor", help="the champion length predictor from several threads")
    p.add_argument("--prompts", type=int, default=12000)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--every", type=int, default=1000, help="print RSS every this many prompts")
    args = parser.parse_args(argv)
    process_defaults()
    if args.what == "engine":
        engine(args.requests, args.concurrency, args.cancel, args.every, args.distinct)
    else:
        predictor(args.prompts, args.threads, args.every)


if __name__ == "__main__":
    main()
