"""Diagonal values on TPU: table reads along kv_idx - q_idx without an in-kernel gather.

The mod compiler hoists, for target "tpu", values that depend on the positions only
through ``kv_idx - q_idx`` and read a captured array (relative bias, T5 buckets); the TPU
template builds each tile from one slice of a per-(b, h) vector with a strided lane
rotation and sums the tile gradient back along its diagonals. The kernels run here in
interpret mode against the dense reference (forward, lse, dq, dk, dv and the table
gradient); ``tests_compile/compile_suite.py --targets tpu`` compiles them for TPU v5e.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from catalog import SHAPES, inputs, loss_and_grads
from checks import assert_close
from test_pallas import TPU_INTERPRET, _check

import flexjax
from flexjax import mods
from flexjax._modcompiler import compile_mod
from flexjax._trace import trace_mod

H, S = 4, 16
TABLE = jnp.zeros((H, 2 * S - 1))


def _compiled(fn, target="tpu", kind="score"):
    return compile_mod(trace_mod(fn, kind, arg_name=f"{kind}_mod").static(), target)


def _named(fn, name):
    fn.__name__ = name
    return fn


# score_mods whose table index is a function of kv_idx - q_idx (and b, h).
DIAGONAL = {
    "relative_bias": mods.relative_bias(TABLE),
    "t5": mods.t5_relative_bucket_bias(jnp.zeros((H, 16)), 16, 64),
    "q_minus_kv": lambda s, b, h, q, kv: s + TABLE[h, q - kv + S - 1],
    "shifted_q": lambda s, b, h, q, kv: s + TABLE[h, (q + 3) - kv],
    "scaled": lambda s, b, h, q, kv: s + TABLE[h, 2 * (kv - q) + S - 1],
    "compared": lambda s, b, h, q, kv: s + TABLE[h, jnp.where(q >= kv, q - kv, 0)],
    "per_batch": lambda s, b, h, q, kv: s + TABLE[b, kv - q + S - 1],
}
# Table reads that are not functions of kv_idx - q_idx: still gathers, refused on TPU.
NOT_DIAGONAL = {
    "sum": lambda s, b, h, q, kv: s + TABLE[h, q + kv],
    "product": lambda s, b, h, q, kv: s + TABLE[h, (kv - q) * q],
}


@pytest.mark.parametrize("name", list(DIAGONAL))
def test_diagonal_reads_are_hoisted_for_tpu(name):
    c = _compiled(_named(DIAGONAL[name], name))
    assert len(c.diags) == 1 and not c.arrays and not c.reads()
    assert c.diag_uses == ((name == "per_batch", name != "per_batch"),)


@pytest.mark.parametrize("name", list(NOT_DIAGONAL))
def test_other_reads_still_raise_for_tpu(name):
    with pytest.raises(NotImplementedError, match="Mosaic TPU cannot gather"):
        _compiled(_named(NOT_DIAGONAL[name], name))


@pytest.mark.parametrize("target", ["interpret", "cuda"])
def test_other_targets_keep_their_gathers(target):
    c = _compiled(mods.relative_bias(TABLE), target)
    assert not c.diags and len(c.arrays) == 1 and len(c.reads()) == 1


def test_diagonal_and_row_reads_combine():
    c = _compiled(lambda s, b, h, q, kv: s + TABLE[h, kv - q] * TABLE[h, q])
    assert len(c.diags) == 1 and len(c.rows) == 1 and not c.arrays


def test_alibi_stays_a_row_value():
    """slope[h] * (kv_idx - q_idx) reads no table along the diagonal: a row times the kernel's indices."""
    c = _compiled(mods.alibi(H))
    assert len(c.rows) == 1 and not c.diags


def test_narrow_diagonals_are_stored_in_32_bits():
    table = TABLE.astype(jnp.bfloat16)
    c = _compiled(lambda s, b, h, q, kv: (s.astype(jnp.bfloat16) + table[h, kv - q + S - 1]).astype(s.dtype))
    (d,) = c.diags
    assert c.avals[d].dtype == jnp.bfloat16 and c.diag_storage_dtype(d) == jnp.float32


def test_diagonal_prologue_clamps_into_range():
    """Entry p holds the value at kv_idx - q_idx = p - offset, clamped to the true lengths."""
    table = jnp.arange(2 * S - 1, dtype=jnp.float32)[None]
    c = _compiled(mods.relative_bias(table))
    (vec,) = c.diagonals((table[0],), 1, 1, q_len=5, kv_len=7, offset=10, size=24)
    d = jnp.clip(jnp.arange(24) - 10, -4, 6)
    assert vec.shape == (1, 1, 24)
    assert (vec[0, 0] == d + S - 1).all()


# -- numerics in interpret mode --------------------------------------------------------------

ALIGNED = dict(TPU_INTERPRET, block_q=128, block_kv=128, bwd_block_q=128, bwd_block_kv=128)
MIXED = dict(TPU_INTERPRET, block_q=64, block_kv=128, bwd_block_q=128, bwd_block_kv=64)


# Tiles on lane blocks (static rotations) by default; tq 64, whose slices start inside a lane
# block, in the slow grid below and in test_batch_dependent_diagonal_with_unequal_lengths.
@pytest.mark.parametrize("name,shape,options", [
    # Slow since the default suite passed its budget: T5's diagonal stays in the default set
    # (test_pallas.py's test_catalog_tpu_template[document+t5]).
    pytest.param("prefix_lm+relative_bias", "mha", ALIGNED, marks=pytest.mark.slow),
], ids=["relative_bias-aligned"])
def test_catalog_tiles(name, shape, options):
    _check(name, shape, kernel_options=options)


@pytest.mark.slow
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name", ["prefix_lm+relative_bias", "document+t5", "per_head_mask+relative_bias"])
@pytest.mark.parametrize("options", [TPU_INTERPRET, ALIGNED, MIXED], ids=["block", "aligned", "mixed"])
def test_catalog_tiles_all(name, shape, options):
    _check(name, shape, kernel_options=options)


def _custom(score_mod, mask_mod, params, shape, kernel_options, dtype=jnp.float32, block_size=64):
    B, Sq, Skv, Hq, Hkv, D, Dv = shape
    bm = flexjax.create_block_mask(mask_mod, B, None, Sq, Skv, block_size=block_size)

    def attention(q, k, v, params, **kw):
        return flexjax.flex_attention(q, k, v, score_mod=score_mod(params), block_mask=bm, return_lse=True, **kw)

    q, k, v, do = inputs(shape, dtype)
    got = loss_and_grads(attention, q, k, v, do, params, backend="pallas", kernel_options=kernel_options)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    truth = loss_and_grads(attention, *f32, jax.tree.map(lambda x: x.astype(jnp.float32), params),
                           backend="reference")
    ref = loss_and_grads(attention, q, k, v, do, params, backend="reference")
    assert_close(f"custom/{jnp.dtype(dtype).name}", got, truth, ref, dtype)


@pytest.mark.slow
def test_batch_dependent_diagonal_with_unequal_lengths():
    """A per-batch table read along q_idx - kv_idx, with a mask_mod that reads a diagonal too."""
    shape = (2, 150, 90, 2, 1, 16, 16)
    allowed = (jnp.arange(2 * 150) % 7 != 3)  # a bool table: stored as int32, read back as bool

    def score_mod(p):
        def f(score, b, h, q_idx, kv_idx):
            return score + p["table"][b, jnp.clip(q_idx - kv_idx + 89, 0, 239)] * (h + 1)
        return f

    def mask_mod(b, h, q_idx, kv_idx):
        return allowed[q_idx - kv_idx + 150] | (q_idx == kv_idx)

    params = {"table": 0.5 * jax.random.normal(jax.random.PRNGKey(3), (2, 240))}
    _custom(score_mod, mask_mod, params, shape, TPU_INTERPRET)
