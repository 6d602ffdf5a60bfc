"""The `gpu` extra pins the Triton and jax-triton the triton backend supports, and other versions are refused."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from pathlib import Path

import pytest

from flexjax.backends.triton import _versions

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

PINS = [f"jax-triton=={_versions.JAX_TRITON_VERSION}", f"triton=={_versions.TRITON_VERSION}"]


def _extras() -> dict[str, list[str]]:
    with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def test_gpu_extra_pins_the_supported_versions():
    """Triton and jax-triton pinned to the tested pair; absl-py, which Mosaic GPU imports and JAX does not
    install, brought along (the mosaic_gpu backend refuses without it, naming this extra)."""
    assert sorted(_extras()["gpu"]) == sorted(PINS + ["absl-py"])


def test_compile_extra_pins_the_same_versions():
    compile_pins = sorted(r for r in _extras()["compile"] if r.split("==")[0] in ("triton", "jax-triton"))
    assert compile_pins == PINS


@pytest.fixture
def installed(monkeypatch):
    """Sets the versions ``_versions`` reads: a dict of distribution -> version, absent = not installed."""
    versions: dict[str, str] = {}

    def version(name):
        if name not in versions:
            raise PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(_versions, "version", version)
    return versions


@pytest.mark.parametrize("interpret", [False, True])
@pytest.mark.parametrize("triton,jax_triton", [
    (_versions.TRITON_VERSION, _versions.JAX_TRITON_VERSION),
    ("3.6.1", "0.3.1"),
    ("3.6.0+git1a2b3c4", "0.3.1"),
    ("3.6.0rc1", "0.3.1"),
])
def test_supported_versions(installed, interpret, triton, jax_triton):
    installed.update({"triton": triton, "jax-triton": jax_triton})
    assert _versions.version_problem(interpret) is None


def test_newer_versions_are_refused(installed):
    installed.update({"triton": "3.9.0", "jax-triton": "0.4.0"})
    why = _versions.version_problem(False)
    assert why is not None
    for text in ("Triton 3.9.0", "jax-triton 0.4.0", "Triton 3.6.x", "jax-triton 0.3.1",
                 "pip install 'flexjax[gpu]'", "triton==3.6.0", "jax-triton==0.3.1"):
        assert text in why, (text, why)


def test_jax_triton_alone_is_refused(installed):
    installed.update({"triton": "3.6.0", "jax-triton": "0.4.0"})
    why = _versions.version_problem(False)
    assert why is not None and "jax-triton 0.4.0" in why
    assert _versions.version_problem(True) is None  # the interpreter does not use jax-triton


def test_interpreter_needs_only_triton(installed):
    installed["triton"] = "3.6.0"
    assert _versions.version_problem(True) is None
    installed.update({"triton": "3.9.0", "jax-triton": "0.4.0"})
    why = _versions.version_problem(True)
    assert why is not None and "Triton 3.9.0" in why and "0.4.0" not in why


def test_missing_packages_are_left_to_the_backend(installed):
    assert _versions.version_problem(False) is None
    installed["jax-triton"] = "0.3.1"
    assert _versions.version_problem(False) is None


@pytest.mark.parametrize("interpret", [False, True])
def test_unreadable_version_is_a_reason(installed, interpret):
    installed.update({"triton": "unknown", "jax-triton": "0.3.1"})
    why = _versions.version_problem(interpret)
    assert why is not None and "'unknown'" in why and "pip install 'flexjax[gpu]'" in why


def test_the_backend_refuses_unsupported_versions(installed, monkeypatch):
    """The reason reaches the caller: a named backend raises it, backend=None warns and moves on."""
    import warnings

    import jax

    import flexjax
    from flexjax.backends import triton as triton_backend

    installed.update({"triton": "3.9.0", "jax-triton": "0.4.0"})
    monkeypatch.setattr(triton_backend, "_missing_modules", lambda interpret: None)
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 32, 2, 16))
    with pytest.raises(NotImplementedError, match=r"backend 'triton' cannot serve.*Triton 3\.9\.0.*flexjax\[gpu\]"):
        flexjax.flex_attention(q, q, q, backend="triton", kernel_options={"target": "cuda"})
    from flexjax import backends

    monkeypatch.setitem(backends._PLATFORM_ORDER, jax.default_backend(), ("triton", "xla"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = flexjax.flex_attention(q, q, q)
    assert any("Triton 3.9.0" in str(w.message) and "using 'xla'" in str(w.message) for w in seen)
    assert out.shape == q.shape


def test_mosaic_gpu_without_its_package_refuses_with_the_extra(monkeypatch):
    """Where Mosaic GPU cannot import (absl-py missing, before JAX 0.12), the backend module still imports and
    refuses every call with the extra that brings the package; backend=None moves past it."""
    import jax

    import flexjax
    from flexjax.backends import mosaic_gpu

    reason = ("the mosaic_gpu backend needs the 'absl' package (Mosaic GPU imports it; JAX does not install it): "
              "pip install 'flexjax[gpu]'")
    monkeypatch.setattr(mosaic_gpu, "MISSING", reason)
    q = jax.numpy.zeros((1, 128, 2, 64), jax.numpy.bfloat16)
    with pytest.raises(NotImplementedError, match=r"flexjax\[gpu\]"):
        flexjax.explain(q, q, q, backend="mosaic_gpu")
    with pytest.raises(NotImplementedError, match=r"flexjax\[gpu\]"):
        mosaic_gpu.heuristics(90)
    assert flexjax.explain(q, q, q).backend == "xla"
