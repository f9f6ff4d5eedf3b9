"""One way to name the model: ``model:`` once in the app's args, inherited by the pools unless one
names its own; a packaged short name, a GGUF file or a folder; the served id derived from it."""

from __future__ import annotations

import json

import pytest

from app.config import AppConfig, EngineConfig


def test_pools_inherit_the_apps_model_and_name_unless_they_set_their_own():
    config = AppConfig.model_validate({"model": "gemma-3-270m", "pools": {"online": {}, "offline": {}}})
    assert {p.model for p in config.pools.values()} == {"gemma-3-270m"}
    assert {p.model_id for p in config.pools.values()} == {"gemma-3-270m"}
    named = AppConfig.model_validate({"model": "gemma-3-270m", "served_model_name": "g",
                                      "pools": {"online": {}, "offline": {"model": "GEMMA-3-270M"}}})
    assert [p.model_id for p in named.pools.values()] == ["g", "g"] and named.pools["offline"].model == "GEMMA-3-270M"
    with pytest.raises(ValueError, match="same model"):
        AppConfig.model_validate({"pools": {"online": {}, "offline": {"model": "gemma-3-270m"}}})
    assert EngineConfig().model_id == "SmolLM2-135M-Instruct"


def test_a_model_setting_names_its_folder(home, tmp_path):
    from app.prepare.model import model_folder, model_name

    assert model_folder("") == home / "models" / "SmolLM2-135M-Instruct"
    assert model_folder("Gemma-3-270M") == home / "models" / "gemma-3-270m" and model_name("Gemma-3-270M") == "gemma-3-270m"
    assert model_folder(str(tmp_path / "x" / "my-model.Q8_0.gguf")) == home / "models" / "my-model.Q8_0"
    assert model_name(str(tmp_path / "x" / "my-model.Q8_0.gguf")) == "my-model.Q8_0"
    assert model_folder(str(tmp_path / "qwen")) == tmp_path / "qwen" and model_name(str(tmp_path / "qwen")) == "qwen"
    assert EngineConfig(model=str(tmp_path / "qwen")).model_path == tmp_path / "qwen"


def test_serving_a_folder_of_an_unknown_architecture_fails_before_anything_starts(home, tmp_path):
    from app.engine.model.arch import UnsupportedModel
    from app.prepare.model import ensure_served_model

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel is not supported"):
        ensure_served_model(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="neither a folder, a .gguf file nor a packaged model"):
        ensure_served_model(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="GGUF file"):
        ensure_served_model(str(tmp_path / "nowhere.gguf"))
