"""The xla backend against the dense reference over the catalog, forward and backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from catalog import BY_NAME, CATALOG, SHAPES, build, inputs, loss_and_grads, rotating_shapes, sweep
from checks import assert_close

import flexjax

# Small compute tiles (multiples of the 64 mask block) so that coarsening, several tiles
# per row and ragged edges are all exercised at test sizes.
SMALL_TILES = {"block_q": 128, "block_kv": 64, "bwd_block_q": 64, "bwd_block_kv": 128}


def _run(case, shape, dtype, backend, kernel_options=None):
    bm, params, attention = build(case, shape)
    q, k, v, do = inputs(shape, dtype)
    kw = {"backend": backend}
    if kernel_options:
        kw["kernel_options"] = kernel_options
    out, lse, grads = loss_and_grads(attention, q, k, v, do, params, **kw)
    return (out, lse, grads)


def _check(case, shape, dtype, kernel_options=None):
    got = _run(case, shape, dtype, "xla", kernel_options)
    if dtype == jnp.float32:
        truth = ref = _run(case, shape, jnp.float32, "reference")
    else:
        # Truth: the float32 reference on the same (rounded) inputs; the same-dtype
        # reference sets how much rounding error is expected.
        bm, params, attention = build(case, shape)
        q, k, v, do = inputs(shape, dtype)
        f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
        truth = loss_and_grads(attention, *f32, params, backend="reference")
        ref = _run(case, shape, dtype, "reference")
    assert_close(f"{case.name}/{dtype.__name__}", got, truth, ref, dtype)


_GRID = [(c.name, s) for c in CATALOG for s in SHAPES]


# Default: every case once, on the shapes in turn; `make test-all` runs the whole grid.
# ("full" and "causal" are covered by the API tests and the other cases' tiles; the three
# table-reading cases by test_catalog_default_tiles and test_catalog_low_precision.)
# "neg_inf_score" and "causal_bottom_right_cache" also run in test_cpu_kernel / test_decode;
# "causal+soft_cap" in test_catalog_low_precision, "chunked_causal" (a block-diagonal mask,
# as "document") in `make test-all`.
_COVERED = ("full", "causal", "prefix_lm+relative_bias", "document+t5", "per_head_mask+relative_bias",
            "neg_inf_score", "causal_bottom_right_cache", "causal+soft_cap", "chunked_causal")


@pytest.mark.parametrize("name,shape", sweep(_GRID, [p for p in rotating_shapes() if p[0] not in _COVERED],
                                             ids=[f"{c}-{s}" for c, s in _GRID]))
def test_catalog_float32(name, shape):
    _check(BY_NAME[name], SHAPES[shape], jnp.float32, SMALL_TILES)


# The default tiles pick the band forward for narrow masks and the loops otherwise.
_DEFAULT_TILES = ("sliding_window+alibi", "document+t5", "per_head_mask+relative_bias")


@pytest.mark.parametrize("name", sweep([c.name for c in CATALOG], _DEFAULT_TILES, ids=[c.name for c in CATALOG],
                                      extra=("document+t5", "per_head_mask+relative_bias")))
def test_catalog_default_tiles(name):
    _check(BY_NAME[name], SHAPES["gqa_unequal"], jnp.float32)


_LOW = [(n, d) for n in ("causal+soft_cap", "prefix_lm+relative_bias", "fully_masked_rows", "document+t5")
        for d in ("bf16", "f16")]


@pytest.mark.parametrize("name,dtype", sweep(_LOW, [_LOW[0], _LOW[3]], ids=[f"{n}-{d}" for n, d in _LOW]))
def test_catalog_low_precision(name, dtype):
    _check(BY_NAME[name], SHAPES["gqa_unequal"], {"bf16": jnp.bfloat16, "f16": jnp.float16}[dtype], SMALL_TILES)


@pytest.mark.slow
def test_long_sequence_smoke():
    """S=4096 causal with soft-cap, forward and backward, against the reference on a slice."""
    B, S, H, D = 1, 4096, 2, 16
    q, k, v, do = inputs((B, S, S, H, H, D, D), jnp.float32, seed=3)
    bm = flexjax.create_block_mask(flexjax.masks.causal, None, None, S, S)
    sm = flexjax.mods.soft_cap(5.0)

    def loss(q, k, v, backend):
        return jnp.sum(flexjax.flex_attention(q, k, v, sm, bm, backend=backend) * do)

    g_xla = jax.jit(jax.grad(loss, (0, 1, 2)), static_argnums=3)(q, k, v, "xla")
    g_ref = jax.jit(jax.grad(loss, (0, 1, 2)), static_argnums=3)(q, k, v, "reference")
    for a, b in zip(g_xla, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4, rtol=1e-3)


def test_bad_kernel_options():
    q, k, v, _ = inputs(SHAPES["mha"], jnp.float32)
    bm = flexjax.create_block_mask(flexjax.masks.causal, None, None, 192, 192, block_size=64)
    with pytest.raises(ValueError, match="block_q.*multiple of the BlockMask's block"):
        flexjax.flex_attention(q, k, v, block_mask=bm, backend="xla", kernel_options={"block_q": 96})
    with pytest.raises(ValueError, match="'num_warps' is taken by backend 'pallas' and 'triton', not by backend='xla'"):
        flexjax.flex_attention(q, k, v, block_mask=bm, backend="xla", kernel_options={"num_warps": 4})


def test_default_backend_on_cpu_is_xla():
    from flexjax.backends import platform_backends

    assert platform_backends("cpu")[-1] == "xla"
    assert platform_backends("cpu")[0] == "xla"


@pytest.mark.parametrize("S, window, block", [(128, 32, 32), pytest.param(256, 64, 64, marks=pytest.mark.slow),
                                              (300, 40, 64), pytest.param(1024, 100, 128, marks=pytest.mark.slow)])
def test_band_forward_small_blocks(S, window, block):
    """Band-like masks take the band forward; its q tiles must match the mask's blocks."""
    q, k, v = jax.random.normal(jax.random.PRNGKey(0), (3, 1, S, 2, 16))
    bm = flexjax.create_block_mask(flexjax.masks.sliding_window(window), None, None, S, S, block_size=block)
    got = flexjax.flex_attention(q, k, v, block_mask=bm, backend="xla")
    want = flexjax.flex_attention(q, k, v, block_mask=bm, backend="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
