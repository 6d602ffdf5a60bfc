"""BlockMask.from_kv_blocks: PyTorch's kv block lists as a BlockMask, against a dense float64 attention.

The implied mask: a pair attends iff its block is listed full, or listed partial and the mask_mod
allows it (every pair without one); positions past the lengths never attend; a row with no block
gives 0. Checked on the reference, xla and pallas (interpreter) backends, forward and gradients;
under jit with traced lists (one compile for every index set); through the paged path and a
decode step; and the errors of lists that cannot be right, eagerly and when a jitted call runs.
"""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import assert_close, dense_f64
from targets import budgeted

import flexjax
from flexjax import BlockMask, masks, paged
from flexjax._block_mask_type import EMPTY, FULL, PARTIAL

# -- lists and the dense truth ------------------------------------------------------------------

def _lists(seed, B, H, nq, nkv, W, Wf=None, empty_row=None):
    """Random lists with duplicates, garbage past each row's count (out of range too: it is ignored) and
    blocks listed both partial and full; ``empty_row``: a q block with no block at all."""
    rng = np.random.default_rng(seed)

    def one(width):
        n = rng.integers(0, min(width, nkv) + 1, (B, H, nq)).astype(np.int32)
        idx = rng.integers(0, nkv, (B, H, nq, width)).astype(np.int32)
        past = np.arange(width) >= n[..., None]
        idx = np.where(past, rng.choice(np.array([-7, nkv, 999], np.int32), idx.shape), idx)
        if empty_row is not None:
            n[:, :, empty_row] = 0
        return n, idx

    n, idx = one(W)
    if Wf is None:
        return n, idx, None, None
    fn, fidx = one(Wf)
    return n, idx, fn, fidx


def _tiles(n, idx, nq, nkv):
    """bool (B, H, nQ, nKV): the blocks a list pair names (NumPy)."""
    out = np.zeros(idx.shape[:2] + (nq, nkv), bool)
    for b, h, i in np.ndindex(*n.shape):
        out[b, h, i, idx[b, h, i, :n[b, h, i]]] = True
    return out


def _implied(lists, mask_mod, B, H, q_len, kv_len, bq, bkv):
    """bool (B, H, Q_LEN, KV_LEN): the mask the lists stand for, with PyTorch's semantics."""
    n, idx, fn, fidx = lists
    nq, nkv = -(-q_len // bq), -(-kv_len // bkv)
    part = np.broadcast_to(_tiles(n, idx, nq, nkv), (B, H, nq, nkv))
    full = np.zeros_like(part) if fn is None else np.broadcast_to(_tiles(fn, fidx, nq, nkv), (B, H, nq, nkv))
    expand = lambda t: np.repeat(np.repeat(t, bq, 2), bkv, 3)[:, :, :q_len, :kv_len]  # noqa: E731
    allowed = np.ones((B, H, q_len, kv_len), bool)
    if mask_mod is not None:
        b, h = np.arange(B)[:, None, None, None], np.arange(H)[None, :, None, None]
        q, kv = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
        allowed = np.broadcast_to(np.asarray(mask_mod(b, h, q, kv)), allowed.shape)
    return expand(full) | (expand(part) & allowed)


def _qkv(B, Sq, Skv, H, D=16, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(ks[0], (B, Sq, H, D)), jax.random.normal(ks[1], (B, Skv, H, D)),
            jax.random.normal(ks[2], (B, Skv, H, D)), jax.random.normal(ks[3], (B, Sq, H, D)))


def _out_and_grads(bm, q, k, v, do, backend, kernel_options=None):
    def f(q, k, v):
        return flexjax.flex_attention(q, k, v, block_mask=bm, backend=backend, kernel_options=kernel_options)

    @jax.jit
    def run(q, k, v, do):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(do)

    return run(q, k, v, do)


def _reads_h(b, h, q_idx, kv_idx):
    return jnp.where(h == 0, q_idx >= kv_idx, (q_idx + kv_idx) % 3 != 0)


# (name, B, H, Q_LEN, KV_LEN, block_size, mask_mod, (B, H) of the lists, partial W, full Wf)
CASES = {
    "partial_only": (1, 2, 96, 128, 32, None, (1, 2), 3, None),
    "causal_full_padded": (1, 2, 90, 110, 32, masks.causal, (1, 2), 3, 2),
    "broadcast_no_mod_padded": (2, 2, 70, 100, (16, 32), None, (1, 1), 4, 2),
    "per_head_mod_rect": (2, 2, 64, 80, (32, 16), _reads_h, (2, 2), 3, 3),
}


def _case(name, seed=0):
    B, H, Q, KV, block, mask_mod, (Bl, Hl), W, Wf = CASES[name]
    bq, bkv = (block, block) if isinstance(block, int) else block
    nq, nkv = -(-Q // bq), -(-KV // bkv)
    lists = _lists(seed, Bl, Hl, nq, nkv, W, Wf, empty_row=1)
    bm = BlockMask.from_kv_blocks(*lists, block, mask_mod, (Q, KV))
    allowed = _implied(lists, mask_mod, B, H, Q, KV, bq, bkv)
    return bm, allowed, _qkv(B, Q, KV, H, seed=seed)


@functools.cache
def _truth(name):
    bm, allowed, (q, k, v, do) = _case(name)
    return dense_f64(q, k, v, do, allowed), _out_and_grads(bm, q, k, v, do, "reference")


_TRITON = pytest.param("triton", marks=[pytest.mark.triton, pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
    reason="needs triton and torch")])


# make test runs every case on xla and one on each interpreted kernel; make test-extra the rest.
@pytest.mark.parametrize("name,backend", [
    pytest.param(n, b, id=f"{n}-{b}", marks=() if b == "xla" or n == "causal_full_padded" else pytest.mark.ci_extra)
    for b in ("reference", "xla", "pallas") for n in CASES] + [pytest.param(n, "triton", id=f"{n}-triton",
                                                                           marks=_TRITON.marks) for n in CASES])
def test_matches_dense_attention_with_the_implied_mask(name, backend):
    bm, allowed, (q, k, v, do) = _case(name)
    truth, ref = _truth(name)
    got = _out_and_grads(bm, q, k, v, do, backend)
    assert_close(f"{name}/{backend}", got, truth, truth if backend == "reference" else ref, jnp.float32)
    empty = ~allowed.any(-1)  # (B, H, Sq): the rows no block reaches
    assert empty[:, :, 32:64].all() if name == "per_head_mod_rect" else empty.any()
    np.testing.assert_array_equal(np.asarray(got[0]).transpose(0, 2, 1, 3)[empty], 0.0)


# Compute tiles of several blocks (``regroup``): a tile holding a skipped block and a listed one is
# partial, and the mask alone must say which of its pairs attend.
_COARSE = {"block_q": 64, "block_kv": 64, "bwd_block_q": 64, "bwd_block_kv": 64}


@pytest.mark.parametrize("target", budgeted(lambda t: t.dtype == jnp.float32 and t.tiles, default=("xla",),
                                            extra=("pallas",)))
def test_tiles_coarser_than_the_blocks(target):
    bm, allowed, (q, k, v, do) = _case("causal_full_padded", seed=1)
    truth = dense_f64(q, k, v, do, allowed)
    got = _out_and_grads(bm, q, k, v, do, target.backend, {**(target.options or {}), **_COARSE})
    assert_close(f"coarse/{target.id}", got, truth, truth, jnp.float32)


def test_states_duplicates_and_overlap():
    """A block listed twice counts once; listed partial and full it is full; entries past a count are
    ignored (out of range too); a full block with padding is kept whole (partial tile, every valid pair)."""
    n = np.array([[[3, 1]]], np.int32)
    idx = np.array([[[[2, 2, 0, 99], [1, -5, -5, -5]]]], np.int32)
    fn = np.array([[[1, 2]]], np.int32)
    fidx = np.array([[[[0, 3], [1, 3]]]], np.int32)
    bm = BlockMask.from_kv_blocks(n, idx, fn, fidx, 16, masks.causal, (32, 56))
    states = np.asarray(bm.block_states())[0, 0]
    # Row 1's block 3 is full but holds padding (56 = 3.5 blocks): a partial tile.
    np.testing.assert_array_equal(states, [[FULL, EMPTY, PARTIAL, EMPTY], [EMPTY, FULL, EMPTY, PARTIAL]])
    assert bm.kv_num_blocks.tolist() == [[[1, 1]]] and bm.full_kv_num_blocks.tolist() == [[[1, 1]]]
    assert bm.q_num_blocks.tolist() == [[[0, 0, 1, 1]]] and bm.full_q_num_blocks.tolist() == [[[1, 1, 0, 0]]]
    dense = np.asarray(flexjax.create_mask(bm.mask_mod, 1, 1, 32, 56))[0, 0]
    assert dense[20, 48:].all() and not dense[20, 33:48].any()  # the full padded block: every pair; causal elsewhere
    assert dense[5, :16].all() and not dense[5, 16:32].any() and dense[5, 32:].sum() == 0


def test_round_trip_of_create_block_mask_lists():
    bm = flexjax.create_block_mask(masks.sliding_window(40), None, None, 100, 100, block_size=16)
    back = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                    16, masks.sliding_window(40), (100, 100))
    np.testing.assert_array_equal(np.asarray(back.block_states()), np.asarray(bm.block_states()))
    assert back.kv_band is None and back.mask.name == f"from_kv_blocks({bm.mask.name})"


def test_widths_depend_on_shapes_only():
    """Two index sets of the same shapes give BlockMasks of one pytree structure and shapes (one jit key)."""
    a = BlockMask.from_kv_blocks(*_lists(0, 1, 2, 4, 6, 3, 2), 16, masks.causal, (60, 90))
    b = BlockMask.from_kv_blocks(*_lists(1, 1, 2, 4, 6, 3, 2), 16, masks.causal, (60, 90))
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb and [x.shape for x in la] == [x.shape for x in lb]
    assert a.kv_indices.shape[-1] == a.full_kv_indices.shape[-1] == 5 and a.q_indices.shape[-1] == 4

    @jax.jit
    def f(bm, q, k, v):
        return flexjax.flex_attention(q, k, v, block_mask=bm, backend="xla")

    q, k, v, _ = _qkv(1, 60, 90, 2)
    f(a, q, k, v)
    f(b, q, k, v)
    assert f._cache_size() == 1


# -- under jit, traced lists ---------------------------------------------------------------------

def test_traced_lists_compile_once():
    Q, KV, bs = 70, 100, 16
    nq, nkv = -(-Q // bs), -(-KV // bs)
    traces = []

    @jax.jit
    def step(n, idx, fn, fidx, q, k, v):
        traces.append(1)
        bm = BlockMask.from_kv_blocks(n, idx, fn, fidx, bs, masks.causal, (Q, KV))
        return flexjax.flex_attention(q, k, v, block_mask=bm, backend="xla")

    q, k, v, do = _qkv(2, Q, KV, 2)
    for seed in range(3):
        lists = _lists(seed, 2, 2, nq, nkv, 4, 3, empty_row=seed)
        got = step(*lists, q, k, v)
        want, _ = dense_f64(q, k, v, do, _implied(lists, masks.causal, 2, 2, Q, KV, bs, bs))
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
    assert len(traces) == 1 and step._cache_size() == 1


def test_traced_lists_gradients():
    Q, KV, bs = 48, 64, 16
    lists = _lists(3, 1, 2, 3, 4, 2, 2)
    q, k, v, do = _qkv(1, Q, KV, 2)

    @jax.jit
    def grads(n, idx, fn, fidx, q, k, v, do):
        bm = BlockMask.from_kv_blocks(n, idx, fn, fidx, bs, masks.causal, (Q, KV))
        out, vjp = jax.vjp(lambda q, k, v: flexjax.flex_attention(q, k, v, block_mask=bm, backend="xla"), q, k, v)
        return out, vjp(do)

    got = grads(*lists, q, k, v, do)
    truth = dense_f64(q, k, v, do, _implied(lists, masks.causal, 1, 2, Q, KV, bs, bs))
    assert_close("traced grads", got, truth, truth, jnp.float32)


# -- the paged path and a decode step ------------------------------------------------------------

def test_paged_decode_with_from_kv_blocks():
    B, H, D, PS, MAXP = 2, 2, 16, 32, 6
    KV = PS * MAXP
    lengths = np.array([150, 37])
    table = jnp.asarray(paged.page_table_for(lengths, PS, MAXP, num_pages=12, seed=1))
    ks = jax.random.split(jax.random.key(2), 4)
    k_pages, v_pages = (jax.random.normal(x, (12, PS, H, D)) for x in ks[:2])
    sq = 4
    q, do = (jax.random.normal(x, (B, sq, H, D)) for x in ks[2:])
    pos = lengths - sq  # the step's queries sit at the end of each sequence

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + jnp.asarray(pos, jnp.int32)[b]

    lists = _lists(4, B, H, 1, MAXP, 3, 2)
    bm = BlockMask.from_kv_blocks(*lists, (16, PS), mask_mod, (sq, KV))
    k, v = paged.gather(k_pages, table), paged.gather(v_pages, table)
    allowed = _implied(lists, mask_mod, B, H, sq, KV, 16, PS) & (np.arange(KV) < lengths[:, None, None, None])

    def loss(q, k_pages, v_pages):
        out = paged.flex_attention(q, k_pages, v_pages, table, jnp.asarray(lengths, jnp.int32), block_mask=bm,
                                   backend="xla")
        return jnp.sum(out * do), out

    (_, out), (dq,) = jax.jit(jax.value_and_grad(loss, argnums=(0,), has_aux=True))(q, k_pages, v_pages)
    want, (want_dq, _, _) = dense_f64(q, k, v, do, allowed)
    assert_close("paged", (out, dq), (want, want_dq), (want, want_dq), jnp.float32)


def test_decode_step_rows_of_a_from_kv_blocks_mask():
    B, H, L, bs = 2, 2, 96, 16
    nb = L // bs
    lists = _lists(5, 1, H, nb, nb, nb, 3)
    bm = BlockMask.from_kv_blocks(*lists, bs, masks.causal)  # default seq_lengths: (6 * 16, W * 16) = (96, 96)
    assert bm.seq_lengths == (L, L)
    implied = _implied(lists, masks.causal, B, H, L, L, bs, bs)

    @functools.partial(jax.jit, static_argnums=4)
    def step(q, k, v, pos, sq):
        step_bm = flexjax.paged.decode_block_mask(bm, pos, sq)
        return flexjax.flex_attention(q, k, v, block_mask=step_bm, backend="xla")

    for sq, pos in ((1, [50, 17]), (4, [46, 14])):  # sq=4: rows straddling two q blocks (their union)
        pos = np.array(pos)
        q, k, v, do = _qkv(B, sq, L, H, seed=3)
        rows = pos[:, None] + np.arange(sq)  # (B, sq)
        allowed = implied[np.arange(B)[:, None, None], np.arange(H)[None, :, None], rows[:, None, :]]
        want, _ = dense_f64(q, k, v, do, allowed)
        np.testing.assert_allclose(np.asarray(step(q, k, v, jnp.asarray(pos, jnp.int32), sq)), want, atol=2e-5)


# -- errors -----------------------------------------------------------------------------------

def _good(nq=3, W=4):
    n = np.array([[[2, 1, 0]]], np.int32)[..., :nq]
    idx = np.zeros((1, 1, nq, W), np.int32)
    idx[0, 0, 0, :2] = [1, 3]
    return n, idx


def _bad_values():
    n, idx = _good()
    out_of_range = idx.copy()
    out_of_range[0, 0, 0, 1] = 7
    negative = idx.copy()
    negative[0, 0, 0, 0] = -1
    return {
        "index past nKV": ((n, out_of_range),
                           r"kv_indices\[0, 0, 0, 1\] = 7 is outside \[0, 4\).*q block 0 .* lists 2"),
        "negative index": ((n, negative), r"kv_indices\[0, 0, 0, 0\] = -1 is outside \[0, 4\)"),
        "negative count": ((np.array([[[2, -1, 0]]], np.int32), idx), r"kv_num_blocks\[0, 0, 1\] = -1 is negative"),
        "count past the width": ((np.array([[[2, 1, 5]]], np.int32), idx),
                                 r"kv_num_blocks\[0, 0, 2\] = 5 is past the width W=4 of kv_indices"),
        "full index": ((n, idx, np.array([[[0, 1, 0]]], np.int32), np.full((1, 1, 3, 1), 4, np.int32)),
                       r"full_kv_indices\[0, 0, 1, 0\] = 4 is outside \[0, 4\)"),
    }


@pytest.mark.parametrize("case", list(_bad_values()))
def test_bad_lists_are_refused_eagerly(case):
    lists, message = _bad_values()[case]
    with pytest.raises(ValueError, match=message):
        BlockMask.from_kv_blocks(*lists, block_size=16, seq_lengths=(48, 64))


@pytest.mark.parametrize("case", list(_bad_values()))
def test_bad_lists_are_refused_under_jit(case):
    lists, message = _bad_values()[case]
    q = jnp.ones((1, 48, 1, 16))
    k = jnp.ones((1, 64, 1, 16))

    @jax.jit
    def f(*lists):
        bm = BlockMask.from_kv_blocks(*lists, block_size=16, seq_lengths=(48, 64))
        return flexjax.flex_attention(q, k, k, block_mask=bm, backend="xla")

    with pytest.raises(Exception, match=message):
        jax.block_until_ready(f(*lists))
    jax.block_until_ready(f(*_good()) if len(lists) == 2 else f(*_good(), lists[2], np.zeros_like(lists[3])))


def test_count_past_the_kv_blocks():
    n, idx = _good(W=6)
    n[0, 0, 2] = 5
    with pytest.raises(ValueError, match=r"kv_num_blocks\[0, 0, 2\] = 5 is past the number of kv blocks, 4"):
        BlockMask.from_kv_blocks(n, idx, block_size=16, seq_lengths=(48, 64))


def test_runtime_checks_can_be_switched_off():
    (n, idx), _ = _bad_values()["index past nKV"]
    previous = paged.set_runtime_checks(False)
    try:
        bm = jax.jit(lambda n, idx: BlockMask.from_kv_blocks(n, idx, None, None, 16, None, (48, 64)))(n, idx)
        assert np.asarray(bm.kv_num_blocks)[0, 0, 0] == 1  # the bad entry is dropped
    finally:
        paged.set_runtime_checks(previous)


def test_bad_arguments():
    n, idx = _good()
    with pytest.raises(ValueError, match=r"kv_indices must have shape \(B, H, num_q_blocks, W\), got shape \(3, 4\)"):
        BlockMask.from_kv_blocks(n, idx[0, 0], block_size=16)
    with pytest.raises(ValueError, match=r"kv_num_blocks must have shape \(B, H, num_q_blocks\), got shape \(3,\)"):
        BlockMask.from_kv_blocks(n[0, 0], idx, block_size=16)
    with pytest.raises(ValueError, match=r"kv_num_blocks must have shape \(B, H, num_q_blocks\) = \(1, 1, 3\)"):
        BlockMask.from_kv_blocks(np.zeros((2, 1, 3), np.int32), idx, block_size=16)
    with pytest.raises(ValueError, match=r"3 q-block rows but Q_LEN=70 .* makes 5: expected shapes \(B, H, 5\)"):
        BlockMask.from_kv_blocks(n, idx, block_size=16, seq_lengths=(70, 64))
    with pytest.raises(ValueError, match=r"full_kv_indices \(2, 1, 3, 1\) must match kv_indices \(3, 1, 3, 4\)"):
        BlockMask.from_kv_blocks(np.zeros((3, 1, 3), np.int32), np.zeros((3, 1, 3, 4), np.int32),
                                 np.zeros((2, 1, 3), np.int32), np.zeros((2, 1, 3, 1), np.int32), block_size=16)
    with pytest.raises(ValueError, match=r"full_kv_indices \(1, 1, 2, 1\) must match.*expected shape \(1 or 1, 1 or 1, "
                                         r"3, Wf\)"):
        BlockMask.from_kv_blocks(n, idx, np.zeros((1, 1, 2), np.int32), np.zeros((1, 1, 2, 1), np.int32), block_size=16)
    with pytest.raises(ValueError, match="full_kv_indices is given but full_kv_num_blocks is None"):
        BlockMask.from_kv_blocks(n, idx, None, idx, block_size=16)
    with pytest.raises(ValueError, match="full_kv_num_blocks is given but full_kv_indices is None"):
        BlockMask.from_kv_blocks(n, idx, n, None, block_size=16)
    with pytest.raises(ValueError, match=r"block_size=16 or BLOCK_SIZE=32 .*not both"):
        BlockMask.from_kv_blocks(n, idx, block_size=16, BLOCK_SIZE=32)
    with pytest.raises(ValueError, match="BLOCK_SIZE must be a positive int or a pair"):
        BlockMask.from_kv_blocks(n, idx, BLOCK_SIZE=(16, 0))
    with pytest.raises(ValueError, match=r"seq_lengths must be a pair \(Q_LEN, KV_LEN\)"):
        BlockMask.from_kv_blocks(n, idx, block_size=16, seq_lengths=48)
    with pytest.raises(TypeError, match="kv_indices must be an int or an integer array"):
        BlockMask.from_kv_blocks(n, idx.astype(np.float32), block_size=16)
    with pytest.raises(TypeError, match="mask_mod"):
        BlockMask.from_kv_blocks(n, idx, block_size=16, mask_mod=lambda q_idx, kv_idx: q_idx >= kv_idx)


def test_block_size_keyword_and_default_lengths():
    n, idx = _good(W=5)
    bm = BlockMask.from_kv_blocks(n, idx, BLOCK_SIZE=16)
    assert bm.block_size == (16, 16) and bm.seq_lengths == (48, 80) and bm.shape == (1, 1, 48, 80)
    bm = BlockMask.from_kv_blocks(n, idx, None, None, BLOCK_SIZE=(8, 32))
    assert bm.block_size == (8, 32) and bm.seq_lengths == (24, 160)
    bm = BlockMask.from_kv_blocks(n, idx)  # PyTorch's default block, 128
    assert bm.block_size == (128, 128) and bm.seq_lengths == (384, 640)
    bm = BlockMask.from_kv_blocks(n, idx, None, None, 16, seq_lengths=(40, 70))
    assert bm.seq_lengths == (40, 70) and bm.num_blocks == (3, 5)


# -- PyTorch's own from_kv_blocks ---------------------------------------------------------------

@pytest.mark.triton  # make test-compile's venv has torch (never a runtime dependency)
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_matches_pytorch_compiled_flex_attention():
    """Lists without duplicates (PyTorch visits a block listed twice twice), in any order, with an empty
    row and full blocks holding padding: PyTorch's compiled CPU flex_attention gives the same output."""
    import torch
    from torch.nn.attention import flex_attention as tfa

    B, H, Q, KV, bs, D = 1, 2, 90, 110, 32, 16
    nq, nkv = -(-Q // bs), -(-KV // bs)
    rng = np.random.default_rng(5)
    kinds = rng.integers(0, 3, (B, H, nq, nkv))  # 0 skipped, 1 partial, 2 full
    kinds[:, :, 1] = 0

    def lists_of(member):  # PyTorch's lists are nKV wide (its transpose reads the width as nKV)
        num = member.sum(-1).astype(np.int32)
        idx = np.argsort(~member, axis=-1, kind="stable").astype(np.int32)
        for b, h, i in np.ndindex(*num.shape):
            idx[b, h, i, :num[b, h, i]] = rng.permutation(idx[b, h, i, :num[b, h, i]])
        return num, idx

    lists = (*lists_of(kinds == 1), *lists_of(kinds == 2))
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((B, Q, H, D), (B, KV, H, D), (B, KV, H, D)))
    t_bm = tfa.BlockMask.from_kv_blocks(*(torch.from_numpy(x) for x in lists), BLOCK_SIZE=bs,
                                        mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, seq_lengths=(Q, KV))
    tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3))) for x in (q, k, v))
    with torch.no_grad():
        want = torch.compile(tfa.flex_attention)(tq, tk, tv, block_mask=t_bm).numpy().transpose(0, 2, 1, 3)
    bm = BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=bs, mask_mod=masks.causal, seq_lengths=(Q, KV))
    for backend in ("xla", "reference"):
        got = flexjax.flex_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), block_mask=bm, backend=backend)
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, err_msg=backend)
