"""The store for mutable state, on a local folder and on a real S3-compatible server: whole objects,
listing, keys, pickling; and chunked records from many writers."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path

import pytest
from pydantic import BaseModel

from predictor.object_store import ObjectStore, object_at
from predictor.records import ChunkWriter, read_records


class Row(BaseModel):
    n: int
    text: str = ""


def test_put_get_replace_list_delete(object_store: ObjectStore) -> None:
    assert object_store.keys() == [] and not object_store.exists("a/b.json")
    object_store.put("a/b.json", b"one")
    object_store.put("a/b.json", b"two")
    object_store.put("a/c/d.jsonl", b"x\n")
    object_store.put("top", b"")
    assert object_store.get("a/b.json") == b"two" and object_store.size("a/b.json") == 3
    assert object_store.keys() == ["a/b.json", "a/c/d.jsonl", "top"]
    assert object_store.keys("a") == ["a/b.json", "a/c/d.jsonl"] and object_store.keys("nope") == []
    assert object_store.child("a").keys() == ["b.json", "c/d.jsonl"]
    assert object_store.child("a", "c").get("d.jsonl") == b"x\n"
    object_store.delete("a/b.json")
    object_store.delete("a/b.json")  # gone already: no error
    assert not object_store.exists("a/b.json")
    with pytest.raises(FileNotFoundError):
        object_store.get("a/b.json")
    with pytest.raises(FileNotFoundError):
        object_store.size("missing")


def test_bad_keys_are_refused(object_store: ObjectStore) -> None:
    for key in ("", "../x", "a/../../x", "a//b"):
        with pytest.raises(ValueError):
            object_store.get(key)


def test_a_store_pickles_as_its_uri_and_opens_again(object_store: ObjectStore) -> None:
    object_store.put("k", b"v")
    copy = pickle.loads(pickle.dumps(object_store))
    assert copy == object_store and copy.get("k") == b"v"


def test_a_local_put_leaves_no_temporary_file_and_never_lists_one(tmp_path: Path) -> None:
    store = ObjectStore(tmp_path)
    store.put("x/y.json", b"{}")
    (tmp_path / "x" / ".y.json.1234.partial").write_bytes(b"half")  # a writer killed mid-put
    assert store.keys() == ["x/y.json"]
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == [".y.json.1234.partial", "y.json"]
    assert ObjectStore(f"file://{tmp_path}").keys() == ["x/y.json"]
    assert ObjectStore(tmp_path).local_root == tmp_path and ObjectStore("s3://b/p").local_root is None


def test_child_keeps_the_uri_options() -> None:
    store = ObjectStore("s3://bucket/base?endpoint_override=h:1&scheme=http")
    assert store.child("feedback", "x").uri == "s3://bucket/base/feedback/x?endpoint_override=h:1&scheme=http"


def test_chunk_writers_in_threads_lose_nothing_and_never_share_an_object(object_store: ObjectStore) -> None:
    writers = [ChunkWriter(object_store), ChunkWriter(object_store, flush_s=0.05)]

    def write(t: int) -> None:
        for i in range(50):
            writers[t % 2].append(Row(n=t * 1000 + i))

    threads = [threading.Thread(target=write, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for writer in writers:
        writer.close()
    rows, skipped = read_records(object_store, Row)
    assert skipped == 0 and sorted(r.n for r in rows) == sorted(t * 1000 + i for t in range(4) for i in range(50))
    names = {key.rsplit("-", 1)[0] for key in object_store.keys()}
    assert names == {w.name for w in writers}
    assert sum(w.records_written for w in writers) == 200


def test_background_flush_stores_without_the_caller_waiting(object_store: ObjectStore) -> None:
    writer = ChunkWriter(object_store, flush_s=3600)  # a flush far away: only close stores
    writer.append_many([Row(n=1), Row(n=2)])
    assert object_store.keys() == [] and writer.pending == 2
    writer.close()
    assert [r.n for r in read_records(object_store, Row)[0]] == [1, 2] and writer.pending == 0


class FlakyStore(ObjectStore):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.fail = True

    def put(self, key: str, data: bytes) -> None:
        if self.fail:
            raise OSError(28, "No space left on device")
        super().put(key, data)


def test_a_failed_put_keeps_the_records_for_the_next_flush(tmp_path: Path) -> None:
    store = FlakyStore(tmp_path)
    writer = ChunkWriter(store, max_pending=3)
    with pytest.raises(OSError, match="No space"):
        writer.append_many([Row(n=1), Row(n=2)])
    assert writer.pending == 2
    with pytest.raises(OSError):
        writer.append_many([Row(n=3), Row(n=4)])  # over max_pending: the oldest is dropped, and counted
    assert writer.pending == 3 and writer.dropped == 1
    store.fail = False
    writer.append(Row(n=5))
    assert [r.n for r in read_records(store, Row)[0]] == [3, 4, 5]  # 1 was dropped; 2 was pushed out by 5
    assert writer.dropped == 2


def test_unreadable_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    store = ObjectStore(tmp_path)
    store.put("old-1-deadbeef.jsonl", b'{"n": 1}\nnot json {\n\n{"n": "x"}\n{"n": 2')
    store.put("notes.txt", b"ignored")
    rows, skipped = read_records(store, Row)
    assert [r.n for r in rows] == [1] and skipped == 3


def test_object_at_splits_a_uri_into_its_store_and_key(tmp_path: Path, object_store: ObjectStore) -> None:
    store, key = object_at("s3://bucket/jobs/in.jsonl?endpoint_override=h:1&scheme=http")
    assert (store.uri, key) == ("s3://bucket/jobs?endpoint_override=h:1&scheme=http", "in.jsonl")
    assert object_at(tmp_path / "a.jsonl") == (ObjectStore(tmp_path), "a.jsonl")
    with pytest.raises(ValueError):
        object_at("s3://bucket")
    object_store.put("in/x.jsonl", b"{}\n")
    store, key = object_at(object_store.child("in", "x.jsonl").uri)
    assert store.get(key) == b"{}\n"
