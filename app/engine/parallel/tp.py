"""TPRunner: one replica sharded over ``tensor_parallel_size`` rank processes with DeepSpeed AutoTP.

The driver (the engine's process) spawns the ranks, pickles each ``SchedulerOutput`` once and sends
it to every rank over a pipe; every rank runs ``HFRunner``'s forward on its shard (local heads,
its own shard of the KV pool) and DeepSpeed's row-parallel layers all-reduce inside it. Rank 0
samples and sends the tokens back; the other ranks only acknowledge.

CPU notes: DeepSpeed's shared-memory all-reduce crashes unless ``LOCAL_SIZE`` equals the TP size,
so every rank gets it (with ``MASTER_ADDR/PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
``OMP_NUM_THREADS`` = cores // tp). The op is compiled on first use (~45 s, cached afterwards).
"""

from __future__ import annotations

import os
import pickle
import threading
import time
import traceback
import weakref
from contextlib import contextmanager
from multiprocessing import connection

from app.config import EngineConfig
from app.engine.outputs import ModelRunnerOutput, SchedulerOutput
from app.engine.runner import Runner
from app.heap import release_free_heap
from app.ports import free_port

STARTUP_TIMEOUT_S = 900.0
ERROR_GRACE_S = 30.0  # after one rank fails, how long the others get to answer
_SHUTDOWN = b""
_ENV_LOCK = threading.Lock()


class TPGroupError(RuntimeError):
    """A rank died or the ranks disagree; the group was shut down."""


@contextmanager
def _environ(updates: dict[str, str]):
    """Set env vars while a child starts (spawned children copy the parent's environment)."""
    with _ENV_LOCK:
        old = {k: os.environ.get(k) for k in updates}
        os.environ.update(updates)
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def shm_path(master_addr: str, port: int, rank: int) -> str:
    """The buffer DeepSpeed's CPU shm all-reduce creates for ``rank`` (named after MASTER_ADDR and
    MASTER_PORT) and never unlinks (69 MB each): the ranks unlink theirs once all have mapped them."""
    return f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{master_addr}_{port}_{rank}"


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _watch_parent(parent_pid: int) -> None:
    """Rank-side: exit when the driver is gone (a rank may be spinning inside an all-reduce)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)


def _error(exc: BaseException) -> tuple[str, object, str]:
    text = "".join(traceback.format_exception(exc))
    try:
        pickle.dumps(exc)
        return ("error", exc, text)
    except Exception:
        return ("error", RuntimeError(str(exc)), text)


def build_rank_runner(rank: int, world: int, config: EngineConfig, num_blocks: int, master_port: int):
    """Rank-side setup (a process or a Ray actor, with the rank's env vars already set): join the
    process group (gloo on CPUs, NCCL on GPUs), shard the model with DeepSpeed AutoTP, wrap it in an ``HFRunner`` over this rank's
    KV shard."""
    import torch

    torch.set_num_threads(config.torch_threads or 1)
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # N ranks' bars are noise (and tqdm's lock leaks a semaphore)

    from app.engine.model.hf_runner import HFRunner
    from app.engine.model.setup import torch_dtype

    dtype = torch_dtype(config.weights_dtype)
    deepspeed.init_distributed(dist_backend=dist_backend(config.device), auto_mpi_discovery=False, verbose=False)
    model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=dtype).eval()
    engine = deepspeed.init_inference(
        model, tensor_parallel={"tp_size": world}, dtype=dtype, replace_with_kernel_inject=False
    )
    runner = HFRunner(config, num_blocks, model=engine.module, with_tokenizer=False)
    torch.distributed.barrier()  # every rank has mapped every shm buffer: the names can go
    _unlink(shm_path(os.environ["MASTER_ADDR"], master_port, rank))
    release_free_heap()  # the full model each rank loaded before sharding it (app/heap.py)
    return runner


def dist_backend(device: str) -> str:
    """The process group's backend: NCCL between GPUs, gloo (with DeepSpeed's shm all-reduce) on CPUs."""
    import torch

    on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return "nccl" if on_gpu else "gloo"


def rank_env(rank: int, world: int, master_addr: str, master_port: int, threads: int,
             local_rank: int | None = None) -> dict[str, str]:
    """What one rank needs in its environment (LOCAL_SIZE = world: DeepSpeed's CPU shm all-reduce).
    ``local_rank``: the rank's GPU among those it sees; a Ray actor given one GPU sees only it (0);
    None: ``rank`` (processes on one machine that see every GPU)."""
    return {
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "RANK": str(rank),
        "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank if local_rank is None else local_rank), "LOCAL_SIZE": str(world),
        "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }


def setup_driver(runner: Runner, config: EngineConfig, num_blocks: int, with_tokenizer: bool = True) -> tuple[int, int]:
    """The driver-side state both TP runners share (tokenizer, sizes, threads per rank);
    returns (world size, torch threads per rank)."""
    from app.engine.model.arch import arch_config
    from app.engine.model.hf_runner import end_tokens
    from app.engine.text.tokenizer import load_tokenizer

    runner.tp_size = world = config.tensor_parallel_size
    if world < 2:
        raise ValueError(f"{type(runner).__name__} needs tensor_parallel_size >= 2, got {world}; use HFRunner")
    arch = arch_config(config.model_path)[1]
    if world > arch.num_key_value_heads:  # AutoTP shards by KV heads: a rank would hold none
        raise ValueError(f"tensor_parallel_size {world} exceeds the model's {arch.num_key_value_heads} KV heads")
    threads = config.torch_threads or max(1, (os.cpu_count() or 1) // world)
    runner.config = config.model_copy(update={"torch_threads": threads})
    runner.num_blocks = num_blocks
    runner.block_size = config.block_size_tokens
    runner.tokenizer = load_tokenizer(config.model_path, config.chat_template) if with_tokenizer else None
    runner.eos_token_id, runner.eos_token_ids = end_tokens(arch, runner.tokenizer)
    runner.broken = False
    return world, threads


def _rank_main(rank: int, world: int, config: EngineConfig, num_blocks: int, conn, env: dict[str, str]) -> None:
    """Entry point of one rank process."""
    os.environ.update(env)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    try:
        runner = build_rank_runner(rank, world, config, num_blocks, int(env["MASTER_PORT"]))
        conn.send(("ready", {"num_heads": runner.num_heads, "num_kv_heads": runner.num_kv_heads}, ""))
    except BaseException as exc:  # noqa: BLE001 - reported to the driver
        conn.send(_error(exc))
        conn.close()
        os._exit(1)
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            break
        if msg == _SHUTDOWN:
            break
        try:
            out = runner.execute(pickle.loads(msg), sample=rank == 0)
            conn.send(("ok", out.sampled_token_ids if rank == 0 else None, ""))
        except Exception as exc:  # noqa: BLE001
            conn.send(_error(exc))
    conn.close()
    # NOTE: skip interpreter teardown: gloo/DeepSpeed destructors can block once a peer is gone.
    os._exit(0)


def _stop(procs, conns, shm_paths: list[str]) -> None:
    """Ask every rank to exit, then terminate/kill what is left. Safe to call twice."""
    for c in conns:
        try:
            c.send_bytes(_SHUTDOWN)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 10.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(5.0)
        if p.is_alive():
            p.kill()
            p.join(5.0)
    for c in conns:
        c.close()
    for path in shm_paths:
        _unlink(path)


class TPRunner(Runner):
    """Same contract as ``HFRunner``: ``TPRunner(config, num_blocks)``, ``execute``, ``shutdown``."""

    def __init__(self, config: EngineConfig, num_blocks: int, with_tokenizer: bool = True) -> None:
        import torch.multiprocessing as mp

        world, threads = setup_driver(self, config, num_blocks, with_tokenizer)
        self.master_port = port = free_port()
        ctx = mp.get_context("spawn")
        self._procs, self._conns = [], []
        for rank in range(world):
            env = rank_env(rank, world, "127.0.0.1", port, threads)
            parent_end, child_end = ctx.Pipe()
            with _environ(env):
                p = ctx.Process(target=_rank_main, args=(rank, world, self.config, num_blocks, child_end, env),
                                name=f"foreserve-tp{rank}", daemon=True)
                p.start()
            child_end.close()
            self._procs.append(p)
            self._conns.append(parent_end)
        shm = [shm_path("127.0.0.1", port, r) for r in range(world)]
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns, shm)
        try:
            self.rank_info = self._collect(STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        if self.broken:
            raise TPGroupError("the tensor-parallel group was shut down after an earlier failure")
        payload = pickle.dumps(scheduler_output, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, c in enumerate(self._conns):
            try:
                c.send_bytes(payload)
            except OSError:
                self._fail(f"rank {rank} is gone (exit code {self._procs[rank].exitcode})", [])
        replies = self._collect(None)
        return ModelRunnerOutput(sampled_token_ids=replies[0], step_s=time.perf_counter() - t0)

    def _collect(self, timeout_s: float | None) -> list:
        """One reply per rank. Raises the rank's exception; a dead or silent rank breaks the group."""
        replies: list = [None] * self.tp_size
        pending = set(range(self.tp_size))
        failures: list[tuple[int, BaseException, str]] = []
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        by_obj = {id(c): r for r, c in enumerate(self._conns)} | {id(p.sentinel): r for r, p in enumerate(self._procs)}
        while pending:
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            objs = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            ready = connection.wait(objs, timeout=wait_s)
            if not ready:
                self._fail(f"ranks {sorted(pending)} did not answer within the time limit", failures)
            for obj in ready:
                rank = by_obj[id(obj)]
                if rank not in pending:
                    continue
                try:
                    kind, payload, text = self._conns[rank].recv()
                except (EOFError, OSError):
                    code = self._procs[rank].exitcode
                    self._fail(f"rank {rank} died (exit code {code})", failures)
                pending.discard(rank)
                if kind == "error":
                    failures.append((rank, payload, text))
                    deadline = time.monotonic() + ERROR_GRACE_S
                else:
                    replies[rank] = payload
        if failures:
            rank, exc, text = failures[0]
            if isinstance(exc, BaseException):
                exc.add_note(f"raised on TP rank {rank}:\n{text}")
                raise exc
            raise RuntimeError(f"TP rank {rank} failed:\n{text}")
        return replies

    def _fail(self, why: str, failures: list) -> None:
        self.broken = True
        detail = "".join(f"\n--- rank {r} ---\n{t}" for r, _, t in failures)
        self.shutdown()
        raise TPGroupError(f"tensor-parallel group failed: {why}{detail}")

    def shutdown(self) -> None:
        """Stop every rank process (idempotent)."""
        self._finalizer()
