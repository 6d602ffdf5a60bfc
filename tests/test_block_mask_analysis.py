"""BlockMasks built by interval analysis are identical to full enumeration; compact lists."""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flexjax
from flexjax import _block_mask, masks
from flexjax._analysis import classify
from flexjax._trace import trace_mod

B, H = 2, 2


# A leaf is (name, needs, build): build(arrays) -> mask_mod, where ``arrays`` holds the
# captured arrays by name, so the same mask can be built from traced arrays inside jit.
@st.composite
def leaves(draw, S):
    kind = draw(st.sampled_from(["causal", "window", "prefix", "docs", "pad", "head_offset", "dilated",
                                 "chunked", "float_band", "abs_band", "offset"]))
    if kind == "causal":
        return {}, lambda a: masks.causal
    if kind == "window":
        left, right = draw(st.integers(0, S)), draw(st.integers(0, S // 2))
        return {}, lambda a: masks.sliding_window(left, right)
    if kind == "prefix":
        return {"prefix": jnp.asarray(draw(st.lists(st.integers(0, S), min_size=B, max_size=B)), jnp.int32)}, \
            lambda a: masks.prefix_lm(a["prefix"])
    if kind == "docs":
        ids = np.asarray(draw(st.lists(st.integers(0, 4), min_size=S, max_size=S)), np.int32)
        if draw(st.booleans()):
            ids = np.sort(ids)
        ids = np.stack([ids, np.roll(ids, draw(st.integers(0, S)))]) if draw(st.booleans()) else ids
        return {"ids": jnp.asarray(ids)}, lambda a: masks.document(a["ids"])
    if kind == "pad":
        lengths = draw(st.lists(st.integers(0, S), min_size=B, max_size=B))
        return {"lengths": jnp.asarray(lengths, jnp.int32)}, lambda a: masks.padding(a["lengths"])
    if kind == "head_offset":
        offs = jnp.asarray(draw(st.lists(st.integers(-S // 2, S // 2), min_size=H, max_size=H)), jnp.int32)
        return {"offs": offs}, lambda a: (lambda b, h, q, kv: kv <= q + a["offs"][h])
    if kind == "dilated":
        stride = draw(st.integers(1, 5))
        return {}, lambda a: masks.dilated(stride)
    if kind == "chunked":
        chunk = draw(st.integers(1, S))
        return {}, lambda a: masks.chunked_causal(chunk)
    if kind == "float_band":
        scale = draw(st.sampled_from([0.25, 0.5, 1.0, 2.0]))
        shift = float(draw(st.integers(-S // 4, S // 4)))
        return {}, lambda a: (lambda b, h, q, kv: q.astype(jnp.float32) * scale + shift >= kv.astype(jnp.float32))
    if kind == "abs_band":
        w = draw(st.integers(0, S // 2))
        return {}, lambda a: (lambda b, h, q, kv: jnp.abs(jnp.minimum(q, S) - jnp.maximum(kv, 0)) <= w)
    offset = draw(st.integers(-S // 2, S // 2))
    return {}, lambda a: masks.causal_with_offset(offset)


@st.composite
def compositions(draw, S, depth=2):
    if depth == 0 or draw(st.integers(0, 2)) == 0:
        return draw(leaves(S))
    op = draw(st.sampled_from(["and", "or", "not", "xor", "where"]))
    (a1, f1), (a2, f2) = draw(compositions(S, depth - 1)), draw(compositions(S, depth - 1))
    arrays = {**{f"l{k}": v for k, v in a1.items()}, **{f"r{k}": v for k, v in a2.items()}}

    def sub(a, side):
        return {k[1:]: v for k, v in a.items() if k[0] == side}

    def build(a):
        m1, m2 = f1(sub(a, "l")), f2(sub(a, "r"))
        if op == "and":
            return flexjax.and_masks(m1, m2)
        if op == "or":
            return flexjax.or_masks(m1, m2)
        if op == "not":
            return lambda b, h, q, kv: ~m1(b, h, q, kv)
        if op == "xor":
            return lambda b, h, q, kv: m1(b, h, q, kv) ^ m2(b, h, q, kv)
        return lambda b, h, q, kv: jnp.where(q % 2 == 0, m1(b, h, q, kv), m2(b, h, q, kv))

    return arrays, build


def _dense_states(mm, q_len, kv_len, bs):
    """(B, H, nQ, nKV) states from the dense mask: enumeration of every pair, in NumPy."""
    bq, bkv = (bs, bs) if isinstance(bs, int) else bs
    dense = np.asarray(flexjax.create_mask(mm, B, H, q_len, kv_len))
    nq, nkv = -(-q_len // bq), -(-kv_len // bkv)
    pad = np.zeros((B, H, nq * bq, nkv * bkv), bool)
    pad[..., :q_len, :kv_len] = dense
    t = pad.reshape(B, H, nq, bq, nkv, bkv)
    return np.where(t.all((3, 5)), 2, np.where(t.any((3, 5)), 1, 0))


def _same(a, b):
    np.testing.assert_array_equal(np.asarray(a.block_states()), np.asarray(b.block_states()))
    for x, y in zip(a.tree_flatten()[0][:8:2], b.tree_flatten()[0][:8:2]):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# Builder paths by grid size: one compiled call (small grids), host-side assembly with
# block-level analysis, super tiles refined into blocks, and the index lists written on
# the device. Shrinking the thresholds runs each path on small masks.
PATHS = {"one_call": {}, "blocks": {"_SMALL_GRID": 0},
         "super_tiles": {"_SMALL_GRID": 0, "_ANALYSIS_TILES": 8},
         "device_lists": {"_SMALL_GRID": 0, "_ANALYSIS_TILES": 8, "_DEVICE_LIST_ELEMENTS": 0}}


# Two examples in make test-extra (each builds and enumerates several masks); the
# `all` profile of `make test-all` keeps its 50.
@pytest.mark.ci_extra  # (make test-extra: 3-9 s; cheaper siblings run in make test)
@settings(deadline=None, max_examples=50 if os.environ.get("FLEXJAX_HYPOTHESIS") == "all" else 2)
@given(data=st.data(), S=st.sampled_from([96, 200]), bs=st.sampled_from([16, (16, 32)]),
       path=st.sampled_from(sorted(PATHS)))
def test_analysis_matches_enumeration(data, S, bs, path):
    arrays, build = data.draw(compositions(S))
    q_len, kv_len = S, S - 9
    want = _dense_states(build(arrays), q_len, kv_len, bs)
    with contextlib.ExitStack() as stack:
        for attr, value in PATHS[path].items():
            stack.enter_context(mock.patch.object(_block_mask, attr, value))
        got = flexjax.create_block_mask(build(arrays), B, H, q_len, kv_len, block_size=bs)
    np.testing.assert_array_equal(np.asarray(got.block_states()), want)
    # Under jit the captured arrays are traced: the analysis runs on tracers.
    jitted = jax.jit(lambda a: flexjax.create_block_mask(build(a), B, H, q_len, kv_len, block_size=bs))(arrays)
    _same(jitted, got)


def test_interval_reads_decide_document_and_padding_tiles():
    ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), 32)
    for mm, want_unknown in ((masks.document(ids), 0), (masks.padding(jnp.asarray([40, 128])), 1)):
        traced = trace_mod(mm, "mask", arg_name="mask_mod")
        qb, kb = jnp.arange(4)[:, None] * 32, jnp.arange(4)[None, :] * 32
        t, f = jax.jit(classify, static_argnums=0)(traced.static(), traced.consts, jnp.arange(2)[:, None, None],
                                                   jnp.int32(0), qb, qb + 31, kb, kb + 31)
        # Documents: every tile decided; padding: only the tile holding position 40 of batch 0.
        assert int((~t & ~f).sum()) == want_unknown * 4
        assert not (t & f).any()


def test_unknown_primitive_falls_back_to_enumeration():
    def odd(b, h, q, kv):
        return jnp.sin(q.astype(jnp.float32)) > jnp.cos(kv.astype(jnp.float32))

    _same(flexjax.create_block_mask(odd, 1, 1, 100, 80, block_size=16),
          flexjax.create_block_mask(odd, 1, 1, 100, 80, block_size=16, analyse=False))


@pytest.mark.ci_extra  # (make test-extra: 3-9 s; cheaper siblings run in make test)
def test_compact_lists_and_max_blocks_per_row():
    bm = flexjax.create_block_mask(masks.sliding_window(64), None, None, 1024, 1024, block_size=32)
    # Each q block sees a partial, a full and a partial tile: lists of width 2 and 1, not 32.
    assert bm.kv_indices.shape == (1, 1, 32, 2) and bm.full_kv_indices.shape == (1, 1, 32, 1)
    assert bm.q_indices.shape == (1, 1, 32, 2) and bm.num_blocks == (32, 32)
    full = flexjax.create_block_mask(masks.sliding_window(64), None, None, 1024, 1024, block_size=32, analyse=False)
    _same(bm, full)
    assert bm.to_dense().shape == (1, 1, 32, 32) and abs(bm.sparsity() - full.sparsity()) < 1e-9
    with pytest.raises(ValueError, match="max_blocks_per_row=2 is too small"):
        flexjax.create_block_mask(masks.sliding_window(64), None, None, 1024, 1024, block_size=32,
                                  max_blocks_per_row=2)
    ids = jnp.repeat(jnp.arange(8, dtype=jnp.int32), 128)

    def build(ids, width):
        return flexjax.create_block_mask(masks.document(ids), None, None, 1024, 1024, block_size=32,
                                         max_blocks_per_row=width)

    jitted = jax.jit(build, static_argnums=1)(ids, 4)
    assert jitted.kv_indices.shape == (1, 1, 32, 4)
    _same(jitted, build(ids, None))
    with pytest.raises(jax.errors.JaxRuntimeError, match="max_blocks_per_row=2 is too small"):
        jax.block_until_ready(jax.jit(build, static_argnums=1)(ids, 2).kv_indices)


def test_sliding_window_at_one_million_holds_linear_index_data():
    S = 1 << 20
    bm = flexjax.create_block_mask(masks.sliding_window(4096), None, None, S, S)
    assert bm.kv_indices.shape == (1, 1, 8192, 2) and bm.full_kv_indices.shape == (1, 1, 8192, 31)
    assert bm.q_indices.shape == (1, 1, 8192, 2) and bm.full_q_indices.shape == (1, 1, 8192, 31)
    assert 99.0 < bm.sparsity() < 99.7
    assert "BlockMask(shape=(1, 1, 1048576, 1048576)" in bm.to_string(grid_size=(8, 16))


@pytest.mark.slow
def test_compact_lists_through_the_backends():
    q = jax.random.normal(jax.random.key(0), (1, 256, 2, 16))
    bm = flexjax.create_block_mask(masks.sliding_window(40), None, None, 256, 256, block_size=32)
    assert bm.kv_indices.shape[-1] < 8
    ref = flexjax.flex_attention(q, q, q, block_mask=bm, backend="reference")
    # The band forward (mask blocks) and the loops over coarse (64, 64) tiles.
    for opts in (None, {"block_q": 64, "block_kv": 64}):
        out = flexjax.flex_attention(q, q, q, block_mask=bm, backend="xla", kernel_options=opts)
        np.testing.assert_allclose(out, ref, atol=2e-5)
