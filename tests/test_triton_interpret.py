"""The triton backend against the dense reference, its kernels run by Triton's interpreter on CPU.

Shapes are small (the interpreter runs every tile op in NumPy) with GQA, unequal lengths
that are not multiples of the block, and Dv != D, so padding, head-dim padding and edge
tiles are always on the path. Gradients cover q, k, v, lse (the loss adds lse) and the
score_mod's captured arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")
from catalog import check_case, inputs, loss_and_grads  # noqa: E402
from checks import assert_close  # noqa: E402

import flexjax  # noqa: E402
from flexjax.backends import triton as triton_backend  # noqa: E402
from flexjax.backends.triton import _launch  # noqa: E402

pytestmark = pytest.mark.triton  # runs under make test-compile (Triton and torch installed)

# (B, Sq, Skv, Hq, Hkv, D, Dv)
SHAPES = {
    "gqa_ragged": (1, 130, 200, 4, 2, 16, 8),
    "mha": (2, 128, 128, 2, 2, 16, 16),
    "mqa_ragged": (1, 100, 70, 2, 1, 8, 16),
}


def _check(name, shape="gqa_ragged", dtype=jnp.float32, kernel_options=None, block_size=64):
    return check_case("triton", name, SHAPES[shape], dtype, kernel_options, block_size)


BF16_OK = _launch.interpreter_bf16_dot_ok()


@pytest.mark.skipif(BF16_OK, reason="this Triton's interpreter computes bfloat16 dots right")
def test_bfloat16_is_refused_in_the_interpreter():
    q, k, v, _ = inputs(SHAPES["mha"], jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="interpreter .* computes bfloat16"):
        flexjax.flex_attention(q, k, v, backend="triton")


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
    assert (o.block_q, o.block_kv, o.num_warps, o.num_stages) == (128, 64, 8, 3)
    o = triton_backend.heuristics(90, (128, 128), 128, jnp.bfloat16)
    assert (o.block_q, o.block_kv, o.num_warps, o.num_stages) == (128, 64, 8, 3)
    # Warpgroup tiles: 64+ q rows in dQ, 64+ kv rows in dK/dV; larger without a table gather.
    assert (o.bwd_block_q, o.bwd_block_kv, o.dkv_block_q, o.dkv_block_kv) == (64, 16, 16, 64)
    o = triton_backend.heuristics(90, (128, 128), 128, jnp.bfloat16, gathers=False)
    assert (o.bwd_block_q, o.bwd_block_kv, o.dkv_block_q, o.dkv_block_kv) == (128, 64, 32, 128)
    assert (o.bwd_num_stages, o.dkv_num_stages) == (3, 3)
    o = triton_backend.heuristics(90, (128, 128), 128, jnp.float32)
    assert (o.block_q, o.block_kv) == (32, 64)
    o = triton_backend.heuristics(80, (128, 128), 64, jnp.float16)
    assert (o.block_q, o.block_kv, o.num_stages, o.bwd_num_stages) == (128, 64, 2, 2)
    # A smaller power-of-two block is regrouped into the table's tile.
    o = triton_backend.heuristics(90, (64, 16), 64, jnp.bfloat16)
    assert (o.block_q, o.block_kv, o.bwd_block_q, o.bwd_block_kv) == (128, 64, 64, 32)
    # Blocks that are not powers of two: regrouped within the tile, walked in power-of-two kernel tiles.
    o = triton_backend.heuristics(90, (48, 80), 64, jnp.bfloat16)
    assert (o.block_q, o.block_kv, o.bwd_block_q, o.bwd_block_kv) == (96, 80, 48, 80)
    assert [triton_backend._kernel_tile(t) for t in (96, 80, 48, 192)] == [32, 16, 16, 64]
    o = triton_backend.heuristics(90, (24, 40), 64, jnp.bfloat16)
    assert (o.block_q, o.block_kv) == (96, 80)


def test_dkv_options_follow_bwd_options():
    """bwd_* alone sets both backward kernels (as before dkv_* existed); dkv_* sets dK/dV's.
    The dkv_* options are checked as the bwd_* ones, by name."""
    import types

    def resolved(options):
        spec = types.SimpleNamespace(options={"target": "cuda", "compute_capability": 90, **options},
                                     block_size=(128, 128), dropout_rate=0.0, score=None, mask=None)
        o = triton_backend._resolve(spec, 128, jnp.bfloat16)
        return o.bwd_block_q, o.bwd_block_kv, o.dkv_block_q, o.dkv_block_kv, o.dkv_num_warps, o.dkv_num_stages

    assert resolved({}) == (128, 64, 32, 128, 8, 3)  # no mod: TRITON_SM90_NO_GATHER's row
    assert resolved({"bwd_block_q": 32, "bwd_block_kv": 32, "bwd_num_warps": 4}) == (32, 32, 32, 32, 4, 3)
    assert resolved({"bwd_block_q": 32, "dkv_block_kv": 64}) == (32, 64, 32, 64, 8, 3)

    q, k, v, _ = inputs(SHAPES["mha"], jnp.float32)
    bm = flexjax.create_block_mask(flexjax.masks.causal, None, None, 128, 128, block_size=64)
    with pytest.raises(ValueError, match="dkv_block_q.*divide the BlockMask's block"):
        flexjax.flex_attention(q, k, v, block_mask=bm, backend="triton", kernel_options={"dkv_block_q": 48})
    with pytest.raises(ValueError, match="dkv_block_kv.*multiple of 16"):
        flexjax.flex_attention(q, k, v, block_mask=bm, backend="triton", kernel_options={"dkv_block_kv": 8})
    with pytest.raises(ValueError, match="dkv_num_warps.*positive int"):
        flexjax.flex_attention(q, k, v, block_mask=bm, backend="triton", kernel_options={"dkv_num_warps": 0})


def test_table_gather_mods_take_the_gather_row():
    """A mod that reads a captured table inside the kernels takes TRITON_SM90's rows; one that
    reads none (causal + ALiBi's per-head slope is hoisted) the larger no-gather tiles."""
    from flexjax import _api

    q = jnp.zeros((1, 256, 4, 128), jnp.bfloat16)
    bm = flexjax.create_block_mask(flexjax.masks.causal, None, None, 256, 256)
    table = jnp.zeros((4, 511), jnp.float32)

    def tiles(score_mod):
        call = _api._prepare(q, q, score_mod, bm, None, {"target": "cuda", "compute_capability": 90}, "triton", 0.0)
        o = triton_backend._resolve(call.spec, 128, jnp.bfloat16)
        return o.bwd_block_q, o.bwd_block_kv, o.dkv_block_q, o.dkv_block_kv

    assert tiles(None) == (128, 64, 32, 128)
    assert tiles(flexjax.mods.alibi(4)) == (128, 64, 32, 128)
    assert tiles(flexjax.mods.relative_bias(table)) == (64, 16, 16, 64)


@pytest.mark.parametrize("block_size,options", [
    ((48, 80), None),  # the BlockMask's own blocks, walked in 16-row power-of-two tiles
    ((64, 64), {"block_q": 192, "block_kv": 128, "bwd_block_q": 192, "bwd_block_kv": 64}),  # a 192 tile
    ((48, 48), {"block_q": 96, "block_kv": 16, "bwd_block_q": 16, "bwd_block_kv": 144}),
    # dQ and dK/dV on different tiles (the lists and padding take both: 64 x 128 here).
    ((64, 64), {"bwd_block_q": 64, "bwd_block_kv": 16, "dkv_block_q": 16, "dkv_block_kv": 128}),
    ((48, 48), {"bwd_block_q": 96, "bwd_block_kv": 48, "dkv_block_q": 16, "dkv_block_kv": 96}),
], ids=["block_48x80", "tile_192", "mixed", "dq_dkv_tiles", "dq_dkv_tiles_48"])
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
