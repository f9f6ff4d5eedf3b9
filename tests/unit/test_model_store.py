"""The prepared model through the store: uploaded whole, fetched by a node that lacks it, checked
file by file (a local folder and a real S3 server)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from app.prepare.model_store import ModelFetchError, ensure_local_model, fetch_model, upload_model
from predictor.object_store import ObjectStore


def _model(folder: Path) -> Path:
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text('{"hidden_size": 8}')
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    (folder / "sub" / "tokenizer.json").write_text("{}")
    (folder / ".hidden").write_text("not part of the model")
    return folder


def test_upload_then_fetch_on_a_node_without_the_model(tmp_path: Path, object_store: ObjectStore) -> None:
    source = _model(tmp_path / "prepared" / "Tiny-1")
    manifest = upload_model(source, object_store)
    assert sorted(manifest["files"]) == ["config.json", "model.safetensors", "sub/tokenizer.json"]
    assert object_store.keys("models")[-1] == "models/Tiny-1/sub/tokenizer.json"

    target = tmp_path / "node_b" / "models" / "Tiny-1"
    assert ensure_local_model(target, object_store) == target
    for rel in manifest["files"]:
        assert (target / rel).read_bytes() == (source / rel).read_bytes()
    assert not (target / ".hidden").exists() and json.loads((target / ".foreserve-model.json").read_text())["source"] == object_store.uri
    assert [p.name for p in target.parent.iterdir()] == ["Tiny-1"]  # no temporary folder left
    (target / "config.json").write_text('{"hidden_size": 8, "local": true}')
    assert ensure_local_model(target, object_store) == target  # there: not fetched again
    assert "local" in (target / "config.json").read_text()


def test_a_damaged_object_is_refused_and_nothing_is_left_where_an_engine_would_load(tmp_path: Path, object_store: ObjectStore) -> None:
    upload_model(_model(tmp_path / "prepared" / "Tiny-1"), object_store)
    object_store.put("models/Tiny-1/model.safetensors", b"truncated")
    target = tmp_path / "node_c" / "Tiny-1"
    with pytest.raises(ModelFetchError, match="model.safetensors does not match its manifest"):
        ensure_local_model(target, object_store)
    assert not target.exists() and list(target.parent.iterdir()) == []


def test_no_model_anywhere_names_both_places(tmp_path: Path, object_store: ObjectStore) -> None:
    with pytest.raises(ModelFetchError, match="run `foreserve prepare --upload`"):
        ensure_local_model(tmp_path / "Missing", object_store)
    with pytest.raises(ModelFetchError, match="no store"):
        ensure_local_model(tmp_path / "Missing", None)
    with pytest.raises(ModelFetchError, match="not a prepared model folder"):
        upload_model(tmp_path, object_store)


def test_two_fetches_on_one_node_at_once_leave_one_whole_copy(tmp_path: Path) -> None:
    store = ObjectStore(tmp_path / "store")
    upload_model(_model(tmp_path / "prepared" / "Tiny-1"), store)
    target = tmp_path / "node" / "Tiny-1"
    target.parent.mkdir()
    errors = []

    def fetch() -> None:
        try:
            fetch_model(store, "Tiny-1", target)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=fetch) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and [p.name for p in target.parent.iterdir()] == ["Tiny-1"]
    assert (target / "model.safetensors").stat().st_size == 1 << 20
