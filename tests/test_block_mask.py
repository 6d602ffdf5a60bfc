"""BlockMask construction and invariants, against dense masks computed in NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flexjax
from flexjax import masks
from flexjax._block_mask import EMPTY, FULL, PARTIAL


def _np_states(dense, bq, bkv):
    """(B, H, nQ, nKV) states of a dense (B, H, Sq, Skv) mask; padding counts as masked."""
    B, H, Sq, Skv = dense.shape
    nq, nkv = -(-Sq // bq), -(-Skv // bkv)
    pad = np.zeros((B, H, nq * bq, nkv * bkv), bool)
    pad[..., :Sq, :Skv] = dense
    t = pad.reshape(B, H, nq, bq, nkv, bkv)
    return np.where(t.all((3, 5)), FULL, np.where(t.any((3, 5)), PARTIAL, EMPTY))


def _check_lists(bm, states):
    """Every list agrees with ``states``: ascending, and transposes consistent."""
    kv_n, kv_i, fkv_n, fkv_i, q_n, q_i, fq_n, fq_i = (np.asarray(x) for x in bm.tree_flatten()[0][:8])
    B, H, nq, nkv = states.shape
    for b in range(B):
        for h in range(H):
            for i in range(nq):
                part = kv_i[b, h, i, : kv_n[b, h, i]]
                full = fkv_i[b, h, i, : fkv_n[b, h, i]]
                assert list(part) == sorted(part) and list(full) == sorted(full)
                assert set(part) == set(np.flatnonzero(states[b, h, i] == PARTIAL))
                assert set(full) == set(np.flatnonzero(states[b, h, i] == FULL))
            for j in range(nkv):
                part = q_i[b, h, j, : q_n[b, h, j]]
                full = fq_i[b, h, j, : fq_n[b, h, j]]
                assert list(part) == sorted(part) and list(full) == sorted(full)
                assert set(part) == set(np.flatnonzero(states[b, h, :, j] == PARTIAL))
                assert set(full) == set(np.flatnonzero(states[b, h, :, j] == FULL))


MASKS = {
    "causal": lambda B: masks.causal,
    "sliding": lambda B: masks.sliding_window(13, 5),
    "prefix": lambda B: masks.prefix_lm(jnp.arange(1, B + 1) * 11),
    "document": lambda B: masks.document(jnp.asarray(np.arange(B * 97).reshape(B, 97) // 23 % 5, jnp.int32)),
    "chunked": lambda B: masks.chunked_causal(19),
    "combo": lambda B: flexjax.or_masks(masks.sliding_window(4), flexjax.and_masks(masks.causal, masks.dilated(7))),
}


@pytest.mark.slow  # random compositions of these masks meet the dense mask in test_block_mask_analysis.py
@settings(deadline=None)  # examples per run: the profile in conftest.py
@given(
    name=st.sampled_from(sorted(MASKS)),
    B=st.integers(1, 2),
    sq=st.integers(1, 97),
    skv=st.integers(1, 97),
    bq=st.sampled_from([8, 16, 32]),
    bkv=st.sampled_from([8, 16, 32]),
)
def test_block_mask_matches_dense(name, B, sq, skv, bq, bkv):
    mm = MASKS[name](B)
    bm = flexjax.create_block_mask(mm, B, 2, sq, skv, block_size=(bq, bkv))
    dense = np.asarray(flexjax.create_mask(mm, B, 2, sq, skv))
    states = _np_states(dense, bq, bkv)
    np.testing.assert_array_equal(np.asarray(bm.block_states()), states)
    np.testing.assert_array_equal(np.asarray(bm.to_dense()), (states != EMPTY).astype(np.int32))
    _check_lists(bm, states)
    # Full tiles are a subset of the non-empty ones, and never overlap partial ones.
    assert not ((states == FULL) & (states == PARTIAL)).any()
    # jit construction (ids traced) agrees with eager; its lists are nKV (nQ) wide.
    bm_jit = jax.jit(lambda: flexjax.create_block_mask(mm, B, 2, sq, skv, block_size=(bq, bkv)))()
    np.testing.assert_array_equal(np.asarray(bm_jit.block_states()), states)
    for a, b in zip(bm.tree_flatten()[0][:8:2], bm_jit.tree_flatten()[0][:8:2]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_create_mask_dense_values():
    m = np.asarray(flexjax.create_mask(masks.causal, None, None, 5, 7))
    assert m.shape == (1, 1, 5, 7)
    np.testing.assert_array_equal(m[0, 0], np.tril(np.ones((5, 7), bool)))


def test_built_inside_jit_with_traced_ids():
    ids = jnp.asarray(np.arange(256) // 64, jnp.int32)

    @jax.jit
    def f(ids):
        return flexjax.create_block_mask(masks.document(ids), None, None, 256, 256, block_size=64)

    bm = f(ids)
    assert isinstance(bm, flexjax.BlockMask)
    np.testing.assert_array_equal(np.asarray(bm.to_dense())[0, 0], np.eye(4, dtype=np.int32))
    # The BlockMask crosses jit boundaries as a pytree.
    g = jax.jit(lambda bm: bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum())
    assert int(g(bm)) == 4


def test_views_and_repr():
    bm = flexjax.create_block_mask(masks.causal, 2, 3, 512, 512)
    assert bm.shape == (1 if False else 2, 3, 512, 512)
    assert bm.block_size == (128, 128)
    assert abs(bm.sparsity() - 100 * 6 / 16) < 1e-9
    r = repr(bm)
    assert "sparsity=37.50%" in r and "causal" in r
    s = bm.to_string()
    assert "█" in s and "░" in s
    assert bm[1].shape == (1, 3, 512, 512)
    assert bm[:, 1:].shape == (2, 2, 512, 512)
    assert bm[0, 2].to_dense().shape == (1, 1, 4, 4)
    big = flexjax.create_block_mask(masks.causal, None, None, 16384, 16384)
    assert "each cell covers" in big.to_string()


def test_broadcast_none_and_block_size_pair():
    bm = flexjax.create_block_mask(masks.sliding_window(64), None, None, 1000, 700, block_size=(64, 32))
    assert bm.shape == (1, 1, 1000, 700)
    assert bm.num_blocks == (16, 22)


def test_mask_mod_without_b_h_builds_once():
    """A mask that ignores b and h is evaluated once and broadcast over (B, H)."""
    bm = flexjax.create_block_mask(masks.causal, 4, 8, 256, 256, block_size=64)
    states = np.asarray(bm.block_states())
    assert (states == states[:1, :1]).all()


@pytest.mark.parametrize(
    "args, match",
    [
        ((masks.causal, 0, None, 8, 8), "B must be a positive int"),
        ((masks.causal, None, 2.5, 8, 8), "H must be a positive int"),
        ((masks.causal, None, None, -1, 8), "Q_LEN must be a positive int"),
        ((masks.causal, None, None, 8, 0), "KV_LEN must be a positive int"),
    ],
)
def test_bad_dims(args, match):
    with pytest.raises(ValueError, match=match):
        flexjax.create_block_mask(*args)


@pytest.mark.parametrize("bs", [0, -4, (16, 0), (1, 2, 3), 2.0])
def test_bad_block_size(bs):
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        flexjax.create_block_mask(masks.causal, None, None, 8, 8, block_size=bs)


def test_mask_mod_must_return_bool():
    with pytest.raises(TypeError, match="must return a boolean"):
        flexjax.create_block_mask(lambda b, h, q, kv: q - kv, None, None, 8, 8)


def test_mask_mod_arity():
    with pytest.raises(TypeError, match="takes 5 positional arguments.*score_mod as mask_mod"):
        flexjax.create_block_mask(lambda s, b, h, q, kv: q >= kv, None, None, 8, 8)


def test_combinators():
    assert flexjax.and_masks(masks.causal, masks.sliding_window(2)).__name__.startswith("and_masks(causal")
    m = np.asarray(flexjax.create_mask(flexjax.or_masks(masks.causal, flexjax.noop_mask), None, None, 4, 4))
    assert m.all()
    with pytest.raises(ValueError, match="at least one"):
        flexjax.and_masks()
    with pytest.raises(TypeError, match="mask_mod callables"):
        flexjax.or_masks(3)


def test_block_mask_over_read_axes_keeps_only_the_axes_the_mod_reads():
    """Per batch element only where the mask_mod reads b; broadcast over h it does not read."""
    from flexjax._block_mask import block_mask_over_read_axes

    lengths = jnp.array([40, 100], jnp.int32)

    def padded(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    bm = block_mask_over_read_axes(padded, 2, 8, 128, 128, block_size=32)
    ref = flexjax.create_block_mask(padded, 2, None, 128, 128, block_size=32)
    assert bm.tile_lists().kv_num.shape[:2] == (2, 1)
    for a, b in zip(bm.tile_lists(), ref.tile_lists()):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert block_mask_over_read_axes(flexjax.masks.causal, 2, 8, 128, 128).tile_lists().kv_num.shape[:2] == (1, 1)


def test_builders_run_eagerly_inside_an_abstract_mesh():
    """Lowering for a GPU or TPU from a CPU host happens inside use_abstract_mesh, whose axes are Explicit by
    default from JAX 0.11 (where eager ops fail): the BlockMask builders step out of it and give what they
    give outside it."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,),
                        abstract_device=AbstractDevice("TPU v5 lite", 1, "tpu"))
    lengths = jnp.array([100, 37])

    def build():
        return (flexjax.create_block_mask(flexjax.masks.sliding_window(40), None, None, 256, 256, block_size=64),
                flexjax.create_block_mask(flexjax.masks.padding(lengths), 2, None, 256, 256, block_size=64),
                flexjax.create_block_mask(None, 2, 2, 200, 256, block_size=64),
                flexjax.create_mask(flexjax.masks.causal, None, None, 64, 64))

    want = build()
    with jax.sharding.use_abstract_mesh(mesh):
        got = build()
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
