"""The pallas backend against the dense reference, in interpret mode on CPU.

The GPU template (what Triton runs) is exercised by default; the TPU template (scalar
prefetch, hoisted row/col blocks) through ``kernel_options={"target": "tpu",
"interpret": True}``. Shapes are small and lengths unequal and not multiples of the
block, so padding, GQA and edge tiles are always on the path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from catalog import CATALOG, SHAPES, check_case, inputs, run_case

import flexjax

TPU_INTERPRET = {"target": "tpu", "interpret": True}
# What the default run covers; the rest of the catalog runs with -m slow.
FAST = ("causal+soft_cap", "sliding_window+alibi", "document+t5", "per_head_mask+relative_bias")


def _check(name, shape="gqa_unequal", dtype=jnp.float32, kernel_options=None, block_size=64):
    return check_case("pallas", name, SHAPES[shape], dtype, kernel_options, block_size)


@pytest.mark.parametrize("name", FAST)
def test_catalog(name):
    _check(name)


@pytest.mark.slow
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name", [c.name for c in CATALOG])
def test_catalog_all_shapes(name, shape):
    _check(name, shape)


@pytest.mark.parametrize("name,shape", [pytest.param("document+t5", "mqa_ragged", marks=pytest.mark.slow),
                                        ("causal+soft_cap", "mha")])
def test_catalog_heads(name, shape):
    _check(name, shape)


@pytest.mark.parametrize("name", ["causal+soft_cap"])
def test_catalog_bfloat16(name):
    _check(name, dtype=jnp.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("name", [c.name for c in CATALOG])
def test_catalog_low_precision(name, dtype):
    _check(name, dtype=dtype)


# T5 reads its table along kv_idx - q_idx: a diagonal value on TPU (relative bias at 128-aligned
# tiles is in test_pallas_tpu_diagonal.py; the whole catalog in the slow test below).
@pytest.mark.parametrize("name", ["sliding_window+alibi", pytest.param("padding", marks=pytest.mark.slow),
                                  pytest.param("document+t5", marks=pytest.mark.slow)])
def test_catalog_tpu_template(name):
    _check(name, kernel_options=TPU_INTERPRET)


@pytest.mark.slow
@pytest.mark.parametrize("name", [c.name for c in CATALOG])
def test_catalog_tpu_template_all(name):
    _check(name, kernel_options=TPU_INTERPRET)


@pytest.mark.parametrize("options", [
    {"block_q": 32, "block_kv": 16, "bwd_block_q": 16, "bwd_block_kv": 32},  # tiles split the mask blocks
    {"block_q": 128, "block_kv": 64, "bwd_block_q": 64, "bwd_block_kv": 128},  # tiles regroup them
], ids=["split", "regroup"])
def test_tile_options(options):
    _check("sliding_window+alibi", kernel_options=options)


@pytest.mark.slow  # the xla backend's test_deterministic stays in the default suite
def test_deterministic():
    a = run_case("pallas", "prefix_lm+relative_bias", SHAPES["gqa_unequal"])
    b = run_case("pallas", "prefix_lm+relative_bias", SHAPES["gqa_unequal"])
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_fully_masked_rows_are_zero_with_finite_grads():
    out, lse, grads = _check("fully_masked_rows", "mha")
    assert np.all(np.asarray(out[:, :10]) == 0)
    assert np.all(np.isneginf(np.asarray(lse[:, :, :10])))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_traced_block_mask_under_jit():
    """A document mask built inside jit from run-time ids (hoisted row/col blocks)."""
    S = 96
    q, k, v, _ = inputs((1, S, S, 2, 2, 16, 16), jnp.float32)

    def attention(backend):
        @jax.jit
        def f(q, k, v, ids):
            bm = flexjax.create_block_mask(flexjax.masks.document(ids), None, None, S, S, block_size=32)
            return flexjax.flex_attention(q, k, v, block_mask=bm, backend=backend)

        return f

    ids = jnp.asarray(np.searchsorted([20, 70], np.arange(S), side="right"), jnp.int32)
    np.testing.assert_allclose(attention("pallas")(q, k, v, ids), attention("reference")(q, k, v, ids),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")  # JAX 0.11
@pytest.mark.parametrize("name", [c.name for c in CATALOG])
def test_catalog_on_gpu(name):
    """The compiled Triton kernels (no interpreter) against the reference, bfloat16.

    benchmarks/gpu_tests.py runs the same check without pytest, for gpu_check.sh.
    """
    _check(name, dtype=jnp.bfloat16, kernel_options={"target": "cuda"})


def test_kernel_options_are_checked():
    q, k, v, _ = inputs(SHAPES["mha"], jnp.float32)
    bm = flexjax.create_block_mask(flexjax.masks.causal, None, None, 192, 192, block_size=64)

    def call(options):
        return flexjax.flex_attention(q, k, v, block_mask=bm, backend="pallas", kernel_options=options)

    with pytest.raises(ValueError, match="unknown kernel_options key 'blok_q'"):
        call({"blok_q": 16})
    with pytest.raises(ValueError, match="block_q.*divide the BlockMask's block"):
        call({"block_q": 48})
    with pytest.raises(ValueError, match="target"):
        call({"target": "metal"})
    with pytest.raises(NotImplementedError, match="TPU tiles must be multiples"):
        call({"target": "tpu", "interpret": True, "block_q": 32})


def test_platform_order():
    from flexjax.backends import platform_backends

    for platform in ("gpu", "cuda"):
        # triton first where jax-triton imports (tests/test_triton_backend_dispatch.py), then pallas.
        assert platform_backends(platform)[:2] == ("triton", "pallas")
        assert platform_backends(platform)[-1] == "xla"
    assert platform_backends("tpu") == ("pallas", "xla")
    assert platform_backends("cpu") == ("xla",)
