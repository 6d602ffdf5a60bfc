"""Partial and full tile lists have their own widths; every builder path and backend agrees."""

from __future__ import annotations

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flexjax
from flexjax import _block_mask, _block_mask_type, masks

LISTS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
         "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def _lists(bm):
    return [np.asarray(getattr(bm, name)) for name in LISTS]


def _assert_same_tiles(got, want):
    """Same states, counts, and entries up to each row's count; padding entries are valid blocks."""
    np.testing.assert_array_equal(np.asarray(got.to_dense()), np.asarray(want.to_dense()))
    np.testing.assert_array_equal(np.asarray(got.block_states()), np.asarray(want.block_states()))
    nq, nkv = got.num_blocks
    for k, (g, w) in enumerate(zip(_lists(got), _lists(want))):
        if k % 2 == 0:
            np.testing.assert_array_equal(g, w)
            continue
        n = _lists(got)[k - 1][..., None]
        np.testing.assert_array_equal(g[np.arange(g.shape[-1]) < n], w[np.arange(w.shape[-1]) < n])
        assert 0 <= g.min() and g.max() < (nkv if k < 4 else nq)
        assert np.all((np.diff(g, axis=-1) > 0) | (np.arange(1, g.shape[-1]) >= n))


def _patched(**values):
    stack = contextlib.ExitStack()
    for attr, value in values.items():
        stack.enter_context(mock.patch.object(_block_mask, attr, value))
    return stack


def test_causal_partial_and_full_lists_have_their_own_widths():
    bm = flexjax.create_block_mask(masks.causal, None, None, 2048, 2048)
    assert bm.kv_indices.shape == (1, 1, 16, 1) and bm.full_kv_indices.shape == (1, 1, 16, 15)
    assert bm.q_indices.shape == (1, 1, 16, 1) and bm.full_q_indices.shape == (1, 1, 16, 15)
    _assert_same_tiles(bm, flexjax.create_block_mask(masks.causal, None, None, 2048, 2048, analyse=False))
    # Assembled from super tiles on the host, and written on the device.
    with _patched(_SMALL_GRID=0, _ANALYSIS_TILES=8):
        _assert_same_tiles(flexjax.create_block_mask(masks.causal, None, None, 2048, 2048), bm)
    with _patched(_SMALL_GRID=0, _ANALYSIS_TILES=8, _DEVICE_LIST_ELEMENTS=0):
        _assert_same_tiles(flexjax.create_block_mask(masks.causal, None, None, 2048, 2048), bm)


MASKS = ("causal", "window", "documents", "stripes", "per_head", "prefix")


def _masks(S):
    ids = jnp.asarray(np.sort(np.random.RandomState(0).randint(0, 6, S)), jnp.int32)
    return {
        "causal": masks.causal,
        "window": masks.sliding_window(40, 8),
        "documents": flexjax.and_masks(masks.causal, masks.document(ids)),
        "stripes": lambda b, h, q, kv: (kv // 24) % 3 != 0,  # many runs of full tiles per row
        "per_head": lambda b, h, q, kv: kv <= q + 37 * h - 30,
        "prefix": masks.prefix_lm(jnp.asarray([30, 170], jnp.int32)),
    }


# Default: the masks whose lists differ most (runs of full tiles, per-head rows); documents in
# make test-all (make test's budget).
@pytest.mark.parametrize("name", [pytest.param(m, marks=() if m in ("stripes", "per_head")
                                               else pytest.mark.slow) for m in MASKS])
def test_every_builder_path_matches_enumeration(name):
    q_len, kv_len, bs = 200, 233, (16, 8)
    mm = _masks(max(q_len, kv_len))[name]
    want = flexjax.create_block_mask(mm, 2, 3, q_len, kv_len, block_size=bs, analyse=False)
    paths = [{}, {"_SMALL_GRID": 0}, {"_SMALL_GRID": 0, "_ANALYSIS_TILES": 8},
             {"_SMALL_GRID": 0, "_ANALYSIS_TILES": 8, "_DEVICE_LIST_ELEMENTS": 0},
             # Rows of more runs than the device pass takes are written on the host.
             {"_SMALL_GRID": 0, "_DEVICE_LIST_ELEMENTS": 0, "_DEVICE_RUNS": 1}]
    for path in paths:
        with _patched(**path):
            got = flexjax.create_block_mask(mm, 2, 3, q_len, kv_len, block_size=bs)
        _assert_same_tiles(got, want)
        _assert_same_tiles(want, got)
        assert got.kv_band == want.kv_band
        for k in (1, 3, 5, 7):
            assert _lists(got)[k].shape[-1] == max(1, _lists(got)[k - 1].max())


def test_device_and_host_lists_are_identical():
    mm = _masks(256)["stripes"]
    with _patched(_SMALL_GRID=0):
        host = flexjax.create_block_mask(mm, None, None, 256, 256, block_size=16)
    with _patched(_SMALL_GRID=0, _DEVICE_LIST_ELEMENTS=0):
        device = flexjax.create_block_mask(mm, None, None, 256, 256, block_size=16)
    for a, b in zip(_lists(host), _lists(device)):
        np.testing.assert_array_equal(a, b)


def test_large_grids_never_sort_a_state_array():
    def refuse(*args, **kwargs):
        raise AssertionError("an nQ x nKV state array was sorted")

    with mock.patch.object(_block_mask_type, "_np_lists", refuse):  # (where lists_from_states finds it)
        bm = flexjax.create_block_mask(masks.causal, None, None, 1 << 15, 1 << 15)
    assert bm.kv_indices.shape == (1, 1, 256, 1) and bm.full_kv_indices.shape == (1, 1, 256, 255)
    assert abs(bm.sparsity() - 100 * (1 - (256 * 257 / 2) / 256**2)) < 1e-9


def test_max_blocks_per_row_bounds_both_lists():
    bm = flexjax.create_block_mask(masks.causal, None, None, 1024, 1024, block_size=128, max_blocks_per_row=8)
    assert bm.kv_indices.shape[-1] == bm.full_kv_indices.shape[-1] == 8
    _assert_same_tiles(bm, flexjax.create_block_mask(masks.causal, None, None, 1024, 1024, block_size=128))
    with pytest.raises(ValueError, match="max_blocks_per_row=7 is too small"):
        flexjax.create_block_mask(masks.causal, None, None, 1024, 1024, block_size=128, max_blocks_per_row=7)
    jitted = jax.jit(lambda: flexjax.create_block_mask(masks.causal, None, None, 1024, 1024, block_size=128,
                                                       max_blocks_per_row=8))()
    assert jitted.q_indices.shape[-1] == jitted.full_q_indices.shape[-1] == 8
    _assert_same_tiles(jitted, bm)


def test_views_read_counts_and_lists_only():
    bm = flexjax.create_block_mask(masks.causal, None, None, 1000, 1000, block_size=100)
    want = np.tril(np.ones((10, 10), np.int8)) + np.tril(np.ones((10, 10), np.int8), -1)
    np.testing.assert_array_equal(_block_mask.block_states_of(bm, 0, 0), want)
    np.testing.assert_array_equal(np.asarray(bm.block_states())[0, 0], want)
    assert abs(bm.sparsity() - 45.0) < 1e-9
    rows = bm.to_string().splitlines()[2:]
    assert rows[0] == "░░" + " " * 18 + "|" and rows[-1] == "██" * 9 + "░░|"


def _cases():
    # (mask, q_len, kv_len, block_size): causal (partial width 1, full 7), a window with
    # padded edge tiles (partial lists wider than full ones), and documents with GQA.
    return [(masks.causal, 256, 256, 32), (masks.sliding_window(24, 8), 200, 184, 16),
            ("documents", 192, 192, 32)]


@pytest.mark.parametrize("backend,options", [
    ("xla", None), pytest.param("xla", {"block_q": 64, "block_kv": 64}, marks=pytest.mark.slow),
    ("pallas", None), pytest.param("pallas", {"target": "tpu", "interpret": True}, marks=pytest.mark.ci_extra)],
    ids=["xla", "xla_coarse", "pallas_gpu_interpret", "pallas_tpu_interpret"])
# Default suite: the sliding-window case on every backend; `make test-all` runs the other masks.
@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c == 1 else pytest.mark.slow)
                                  for c in range(len(_cases()))])
def test_forward_and_backward_with_own_widths(backend, options, case):
    mm, q_len, kv_len, bs = _cases()[case]
    if mm == "documents":
        mm = _masks(kv_len)["documents"]
    Hq, Hkv = (4, 2) if case == 2 else (2, 2)
    keys = jax.random.split(jax.random.key(case), 4)
    q = jax.random.normal(keys[0], (1, q_len, Hq, 16), jnp.float32)
    k = jax.random.normal(keys[1], (1, kv_len, Hkv, 16), jnp.float32)
    v = jax.random.normal(keys[2], (1, kv_len, Hkv, 16), jnp.float32)
    do = jax.random.normal(keys[3], (1, q_len, Hq, 16), jnp.float32)
    own = flexjax.create_block_mask(mm, None, None, q_len, kv_len, block_size=bs)
    assert own.kv_indices.shape[-1] != own.full_kv_indices.shape[-1]
    nq, nkv = own.num_blocks
    # The enumerated mask with both lists of a direction as wide as the grid (one shared width).
    shared = flexjax.create_block_mask(mm, None, None, q_len, kv_len, block_size=bs, analyse=False,
                                       max_blocks_per_row=max(nq, nkv))
    assert shared.kv_indices.shape[-1] == shared.full_kv_indices.shape[-1] == nkv

    def run(bm, backend, options):
        def loss(q, k, v):
            out = flexjax.flex_attention(q, k, v, block_mask=bm, backend=backend, kernel_options=options)
            return jnp.sum(out * do), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, grads

    want = run(shared, backend, options)
    got = run(own, backend, options)
    ref = run(own, "reference", None)
    for a, b, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(a, r, atol=1e-4, rtol=1e-4)
