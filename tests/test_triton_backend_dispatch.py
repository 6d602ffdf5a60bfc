"""The triton backend in the default environment: registered, dispatched first on GPU, refused clearly without Triton.

``make test``'s .venv has neither triton nor jax-triton (the kernels' own checks run in
``make test-compile``'s environment, the tests marked ``triton``), so here the backend must import,
validate its kernel_options and explain why it cannot serve.
"""

from __future__ import annotations

import importlib.util
import warnings

import jax
import numpy as np
import pytest

import flexjax
from flexjax import backends

HAVE_TRITON = all(importlib.util.find_spec(m) is not None for m in ("triton", "jax_triton"))


def _qkv(S=64):
    q = jax.random.normal(jax.random.PRNGKey(0), (1, S, 2, 16))
    return q, q * 0.5, q * 0.25


def test_triton_is_registered_and_after_mosaic_gpu_on_gpu():
    assert "triton" in backends.available_backends()
    for platform in ("gpu", "cuda"):
        assert backends.platform_backends(platform) == ("mosaic_gpu", "triton", "pallas", "xla")
    assert backends.platform_backends("tpu")[0] == "pallas"
    assert backends.platform_backends("cpu") == ("xla",)
    names = backends.kernel_option_names("triton")
    assert {"target", "interpret", "compute_capability", "block_q", "block_kv", "autotune"} <= set(names)


def test_triton_kernel_option_typo_names_the_key():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="block_qq"):
        flexjax.flex_attention(q, k, v, backend="triton", kernel_options={"block_qq": 32})


@pytest.mark.skipif(HAVE_TRITON, reason="triton and jax-triton are installed here")
def test_named_triton_backend_without_triton_raises_with_the_reason():
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="backend 'triton' cannot serve this call: .*triton"):
        flexjax.flex_attention(q, k, v, backend="triton")


@pytest.mark.skipif(HAVE_TRITON, reason="triton and jax-triton are installed here")
def test_backend_none_on_gpu_falls_through_triton_with_a_warning(monkeypatch):
    """What a GPU user without jax-triton sees: a warning naming why, then the next backend."""

    monkeypatch.setitem(backends._PLATFORM_ORDER, jax.default_backend(), ("triton", "xla"))
    q, k, v = _qkv()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = flexjax.flex_attention(q, k, v)
    msgs = [str(w.message) for w in seen]
    assert any("backend 'triton' cannot serve this call" in m and "using 'xla'" in m for m in msgs), msgs
    ref = flexjax.flex_attention(q, k, v, backend="reference")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)

