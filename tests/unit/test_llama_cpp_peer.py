"""The llama.cpp peer's own logic (loadtests/bench/llama_cpp.py); running llama-server needs
`make llama-cpp`, which `make test` never builds."""

from __future__ import annotations

import pytest


def test_best_try_is_the_fastest_slot_count_that_finished_everything():
    from loadtests.bench.llama_cpp import best_try

    tries = [{"slots": 4, "wall_s": 110.0, "finished": 32, "failed": 0},
             {"slots": 8, "wall_s": 101.0, "finished": 32, "failed": 0},
             {"slots": 16, "wall_s": 52.0, "finished": 17, "failed": 15}]  # fastest, but failed requests
    assert best_try(tries) == (tries[1], True)
    failing = [{"slots": 8, "wall_s": 50.0, "finished": 20, "failed": 12},
               {"slots": 16, "wall_s": 40.0, "finished": 17, "failed": 15}]
    assert best_try(failing) == (failing[0], False)


def test_missing_build_says_how_to_make_it(tmp_path, monkeypatch):
    from loadtests.bench.llama_cpp import LlamaCppMissing, binary, gguf

    monkeypatch.setenv("FORESERVE_LLAMA_CPP", str(tmp_path))
    with pytest.raises(LlamaCppMissing, match="make llama-cpp"):
        binary("llama-server")
    with pytest.raises(ValueError, match="unknown llama.cpp dtype"):
        gguf("q8_0")
    with pytest.raises(ValueError, match="no packaged q4_k_m GGUF of SmolLM2-135M-Instruct"):
        gguf("q4_k_m", tmp_path / "SmolLM2-135M-Instruct")  # that one ships as Q4_1 (Gemma 3's as Q4_K_M)


def test_loadtest_dtype_rewrites_every_pool(tmp_path):
    import yaml

    from app.config import DEFAULT_CONFIG_PATH
    from loadtests.ab import scheduler_config

    out = scheduler_config(DEFAULT_CONFIG_PATH, tmp_path / "serve_config.yaml", None, dtype="bfloat16")
    pools = yaml.safe_load(out.read_text())["applications"][0]["args"]["pools"]
    source = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())["applications"][0]["args"]["pools"]
    assert {name: pool["dtype"] for name, pool in pools.items()} == {"online": "bfloat16", "offline": "bfloat16"}
    assert pools["online"]["scheduler"] == source["online"]["scheduler"]  # no scheduler given: left alone
