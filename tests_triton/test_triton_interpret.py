"""The triton backend against the dense reference, its kernels run by Triton's interpreter on CPU.

Shapes are small (the interpreter runs every tile op in NumPy) with GQA, unequal lengths
that are not multiples of the block, and Dv != D, so padding, head-dim padding and edge
tiles are always on the path. Gradients cover q, k, v, lse (the loss adds lse) and the
score_mod's captured arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from catalog import CATALOG, check_case, inputs, loss_and_grads, run_case
from checks import assert_close

import flexjax
from flexjax.backends import triton as triton_backend
from flexjax.backends.triton import _launch

# (B, Sq, Skv, Hq, Hkv, D, Dv)
SHAPES = {
    "gqa_ragged": (1, 130, 200, 4, 2, 16, 8),
    "mha": (2, 128, 128, 2, 2, 16, 16),
    "mqa_ragged": (1, 100, 70, 2, 1, 8, 16),
}


def _check(name, shape="gqa_ragged", dtype=jnp.float32, kernel_options=None, block_size=64):
    return check_case("triton", name, SHAPES[shape], dtype, kernel_options, block_size)


@pytest.mark.parametrize("name", [c.name for c in CATALOG])
def test_catalog_float32(name):
    _check(name)


@pytest.mark.parametrize("name", [c.name for c in CATALOG])
def test_catalog_float16(name):
    _check(name, dtype=jnp.float16)


@pytest.mark.parametrize("name,shape", [("causal+soft_cap", "mha"), ("document+t5", "mqa_ragged"),
                                        ("per_head_mask+relative_bias", "mha")])
def test_catalog_heads(name, shape):
    _check(name, shape)


BF16_OK = _launch.interpreter_bf16_dot_ok()


@pytest.mark.skipif(not BF16_OK, reason="Triton's interpreter computes bfloat16 tl.dot wrong (Triton 3.6: a 16x16 "
                                        "dot off by 2.6e10), so the backend refuses bfloat16 there; it runs on GPU")
def test_catalog_bfloat16():
    _check("causal+soft_cap", dtype=jnp.bfloat16)


@pytest.mark.skipif(BF16_OK, reason="this Triton's interpreter computes bfloat16 dots right")
def test_bfloat16_is_refused_in_the_interpreter():
    q, k, v, _ = inputs(SHAPES["mha"], jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="interpreter .* computes bfloat16"):
        flexjax.flex_attention(q, k, v, backend="triton")


@pytest.mark.parametrize("options,block_size", [
    ({"block_q": 32, "block_kv": 16, "bwd_block_q": 16, "bwd_block_kv": 32}, 64),  # tiles split the mask blocks
    ({"block_q": 64, "block_kv": 64, "bwd_block_q": 32, "bwd_block_kv": 64}, 32),  # tiles regroup them
], ids=["split", "regroup"])
def test_tile_options(options, block_size):
    _check("sliding_window+alibi", kernel_options=options, block_size=block_size)


def test_deterministic():
    a = run_case("triton", "prefix_lm+relative_bias", SHAPES["gqa_ragged"])
    b = run_case("triton", "prefix_lm+relative_bias", SHAPES["gqa_ragged"])
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_fully_masked_rows_are_zero_with_finite_grads():
    out, lse, grads = _check("fully_masked_rows", "mha")
    assert np.all(np.asarray(out[:, :10]) == 0)
    assert np.all(np.isneginf(np.asarray(lse[:, :, :10])))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_huge_scores():
    """Rows of scores near -1e6 (the backward recomputes P from each row's max and sum)."""
    shape = SHAPES["mha"]
    q, k, v, do = inputs(shape, jnp.float32)

    def attention(q, k, v, params, **kw):
        return flexjax.flex_attention(q, k, v, lambda s, b, h, qi, ki: s - 1e6 + qi, return_lse=True, **kw)

    got = loss_and_grads(attention, q, k, v, do, {}, backend="triton")
    ref = loss_and_grads(attention, q, k, v, do, {}, backend="reference")
    assert_close("huge", got, ref, ref, jnp.float32)


def test_captured_row_and_column_grads():
    """Float hoisted rows (per head, per (b, q)) and columns (per (h, kv)) get their gradients."""
    shape = SHAPES["gqa_ragged"]
    B, Sq, Skv, Hq = shape[:4]
    q, k, v, do = inputs(shape, jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    params = {"slope": 1.0 + 0.1 * jax.random.normal(keys[0], (Hq,)),
              "bias_q": jax.random.normal(keys[1], (B, Sq)), "bias_kv": jax.random.normal(keys[2], (Hq, Skv))}
    bm = flexjax.create_block_mask(flexjax.masks.causal, None, None, Sq, Skv, block_size=64)

    def attention(q, k, v, p, **kw):
        def biased(score, b, h, q_idx, kv_idx):
            return score * p["slope"][h] + p["bias_q"][b, q_idx] + jnp.tanh(p["bias_kv"][h, kv_idx])

        return flexjax.flex_attention(q, k, v, biased, bm, return_lse=True, **kw)

    got = loss_and_grads(attention, q, k, v, do, params, backend="triton")
    ref = loss_and_grads(attention, q, k, v, do, params, backend="reference")
    assert_close("rows_cols", got, ref, ref, jnp.float32)


def test_bool_table_mask():
    """A mask_mod reading a captured bool array at (q_idx, kv_idx): an in-kernel load from int32 storage."""
    shape = SHAPES["mqa_ragged"]
    Sq, Skv = shape[1:3]
    q, k, v, do = inputs(shape, jnp.float32)
    table = jax.random.bernoulli(jax.random.PRNGKey(5), 0.7, (Sq, Skv))

    def allowed(b, h, q_idx, kv_idx):
        return table[q_idx, kv_idx]

    bm = flexjax.create_block_mask(allowed, None, None, Sq, Skv, block_size=32)

    def attention(q, k, v, params, **kw):
        return flexjax.flex_attention(q, k, v, block_mask=bm, return_lse=True, **kw)

    got = loss_and_grads(attention, q, k, v, do, {}, backend="triton")
    ref = loss_and_grads(attention, q, k, v, do, {}, backend="reference")
    assert_close("bool_table", got, ref, ref, jnp.float32)


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
    np.testing.assert_allclose(attention("triton")(q, k, v, ids), attention("reference")(q, k, v, ids),
                               atol=2e-5, rtol=2e-5)


def test_untranslatable_mod_is_named():
    q, k, v, _ = inputs(SHAPES["mha"], jnp.float32)

    def uses_round(score, b, h, q_idx, kv_idx):
        return jnp.round(score)

    with pytest.raises(NotImplementedError, match=r"'round'.*uses_round"):
        flexjax.flex_attention(q, k, v, uses_round, backend="triton")


def test_kernel_options_are_checked():
    q, k, v, _ = inputs(SHAPES["mha"], jnp.float32)
    bm = flexjax.create_block_mask(flexjax.masks.causal, None, None, 128, 128, block_size=64)

    def call(options, block_mask=bm):
        return flexjax.flex_attention(q, k, v, block_mask=block_mask, backend="triton", kernel_options=options)

    with pytest.raises(ValueError, match="block_q.*divide the BlockMask's block"):
        call({"block_q": 48})
    with pytest.raises(ValueError, match="block_kv.*multiple of 16"):
        call({"block_kv": 8})
    with pytest.raises(ValueError, match="target"):
        call({"target": "tpu"})
    with pytest.raises(ValueError, match="compute_capability"):
        call({"compute_capability": 75})
    with pytest.raises(ValueError, match="autotune"):
        call({"autotune": "yes"})
    with pytest.raises(NotImplementedError, match="autotune.*GPU"):
        call({"autotune": True})
    with pytest.raises(NotImplementedError, match=r"interpret'\]=False needs GPU kernels"):
        call({"interpret": False})
    odd = flexjax.create_block_mask(flexjax.masks.causal, None, None, 128, 128, block_size=48)
    with pytest.raises(ValueError, match="block_q.*multiple of 16"):
        call({"block_q": 24}, odd)


def test_heuristics():
    o = triton_backend.heuristics(90, (128, 128), 64, jnp.bfloat16)
    assert (o.block_q, o.block_kv, o.num_warps, o.num_stages) == (128, 64, 4, 3)
    o = triton_backend.heuristics(90, (128, 128), 128, jnp.bfloat16)
    assert (o.block_q, o.block_kv, o.num_warps, o.num_stages) == (128, 64, 8, 3)
    o = triton_backend.heuristics(90, (128, 128), 128, jnp.float32)
    assert (o.block_q, o.block_kv) == (32, 64)
    o = triton_backend.heuristics(80, (128, 128), 64, jnp.float16)
    assert (o.block_q, o.block_kv, o.num_stages, o.bwd_num_stages) == (128, 64, 2, 2)
    # A smaller power-of-two block is regrouped into the table's tile.
    o = triton_backend.heuristics(90, (64, 16), 64, jnp.bfloat16)
    assert (o.block_q, o.block_kv, o.bwd_block_q, o.bwd_block_kv) == (128, 64, 32, 64)
    # Blocks that are not powers of two: regrouped within the tile, walked in power-of-two kernel tiles.
    o = triton_backend.heuristics(90, (48, 80), 64, jnp.bfloat16)
    assert (o.block_q, o.block_kv, o.bwd_block_q, o.bwd_block_kv) == (96, 80, 48, 80)
    assert [triton_backend._kernel_tile(t) for t in (96, 80, 48, 192)] == [32, 16, 16, 64]
    o = triton_backend.heuristics(90, (24, 40), 64, jnp.bfloat16)
    assert (o.block_q, o.block_kv) == (96, 80)


@pytest.mark.parametrize("block_size,options", [
    ((48, 80), None),  # the BlockMask's own blocks, walked in 16-row power-of-two tiles
    ((64, 64), {"block_q": 192, "block_kv": 128, "bwd_block_q": 192, "bwd_block_kv": 64}),  # a 192 tile
    ((48, 48), {"block_q": 96, "block_kv": 16, "bwd_block_q": 16, "bwd_block_kv": 144}),
], ids=["block_48x80", "tile_192", "mixed"])
def test_any_multiple_of_16(block_size, options):
    """Blocks and tiles that are multiples of 16 but not powers of two (issue 28): served exactly."""
    shape = (1, 200, 230, 2, 1, 16, 16)
    q, k, v, do = inputs(shape, jnp.float32)
    bm = flexjax.create_block_mask(flexjax.masks.sliding_window(70), None, None, 200, 230, block_size=block_size)
    table = 0.3 * jax.random.normal(jax.random.PRNGKey(2), (2, 2 * 230 - 1))

    def attention(q, k, v, params, **kw):
        return flexjax.flex_attention(q, k, v, flexjax.mods.relative_bias(params["table"]), bm, return_lse=True,
                                      **kw)

    got = loss_and_grads(attention, q, k, v, do, {"table": table}, backend="triton", kernel_options=options)
    ref = loss_and_grads(attention, q, k, v, do, {"table": table}, backend="reference")
    assert_close(f"blocks{block_size}", got, ref, ref, jnp.float32)


def test_grids_stay_within_cuda_limits(monkeypatch):
    """B * H above 65535 (a batch of 4096 with 32 heads): every grid dimension but the first
    stays within CUDA's 65535 (issue 29's 3-D grid)."""
    from flexjax.backends.triton import _kernels

    grids = []

    def fake_call(source, name, params, args, out_shapes, grid, consts, run, **kw):
        grids.append(tuple(grid))
        return [jnp.zeros(s.shape, s.dtype) for s in out_shapes]

    monkeypatch.setattr(_kernels, "_call", fake_call)
    B, S, H = 4096, 16, 32
    q = jax.ShapeDtypeStruct((B, S, H, 16), jnp.float16)
    bm = flexjax.create_block_mask(flexjax.masks.causal, None, None, S, S, block_size=16)

    def loss(q, k, v):
        return flexjax.flex_attention(q, k, v, block_mask=bm, backend="triton",
                                      kernel_options={"target": "cuda"}).astype(jnp.float32).sum()

    jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, q, q)
    assert {g[1:] for g in grids} == {(H, B)}, grids  # the forward, dQ (heads H) and dK/dV (kv heads H)
    assert all(max(g[1:]) <= 65535 < g[1] * g[2] for g in grids), grids


def test_arrays_closed_over_inside_calls():
    """jit / checkpoint helpers with tables of their own (the mod compiler bakes them in)."""
    from test_call_primitives import _bias_in_calls, _mask_in_call

    shape = (1, 40, 40, 2, 2, 16, 16)
    q, k, v, do = inputs(shape, jnp.float32)
    bm = flexjax.create_block_mask(_mask_in_call, None, None, 40, 40, block_size=16)

    def attention(q, k, v, params, **kw):
        return flexjax.flex_attention(q, k, v, _bias_in_calls, bm, return_lse=True, **kw)

    got = loss_and_grads(attention, q, k, v, do, {}, backend="triton")
    ref = loss_and_grads(attention, q, k, v, do, {}, backend="reference")
    assert_close("nested_consts", got, ref, ref, jnp.float32)
