"""flexjax.sparse: top-k block selection from gate scores (MoBA, NSA) against NumPy references.

The selection is checked against a NumPy stable argsort, the gates against straightforward
per-query NumPy loops, and attention over the chosen blocks against a dense float64 NumPy
attention (forward and gradients) with the implied mask: a pair attends iff its block was
chosen and, where the block is partial, the mask_mod allows it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import dense_f64
from targets import budgeted

import flexjax
from flexjax import masks, sparse
from flexjax._block_mask_type import EMPTY, FULL, PARTIAL

# -- NumPy references ---------------------------------------------------------------------------

def np_topk(scores, k):
    """bool (..., nKV): each row's k largest (stable argsort: ties to the lower index), -inf/NaN never."""
    s = np.asarray(scores, np.float64)
    s = np.where(np.isnan(s), -np.inf, s)
    order = np.argsort(-s, axis=-1, kind="stable")[..., :k]
    chosen = np.zeros(s.shape, bool)
    np.put_along_axis(chosen, order, True, axis=-1)
    return chosen & (s > -np.inf)


def np_block_rules(s, Sq, Skv, bq, bkv, causal, include_self):
    nq, nkv = s.shape[-2:]
    s = s.copy()
    for i in range(nq):
        first, last = i * bq, min((i + 1) * bq, Sq) - 1
        for j in range(nkv):
            start, end = j * bkv, min((j + 1) * bkv, Skv) - 1
            if causal and start > last:
                s[..., i, j] = -np.inf
            if include_self and start <= last and end >= first:
                s[..., i, j] = np.inf
    return s


def np_moba(q, k, bq, bkv, causal=True, include_self=True):
    """Per-query gate q_t . mean(K_j), averaged over each q block's queries."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    B, Sq, Hq, D = q.shape
    Skv, Hkv = k.shape[1:3]
    G = Hq // Hkv
    nq, nkv = -(-Sq // bq), -(-Skv // bkv)
    kbar = np.stack([k[:, j * bkv:(j + 1) * bkv].mean(1) for j in range(nkv)], 1)  # (B, nKV, Hkv, D)
    gate = np.einsum("bthd,bjhd->bhtj", q, np.repeat(kbar, G, axis=2))  # (B, Hq, Sq, nKV)
    s = np.stack([gate[:, :, i * bq:(i + 1) * bq].mean(2) for i in range(nq)], 2)
    return np_block_rules(s, Sq, Skv, bq, bkv, causal, include_self)


def np_nsa(q, k, bq, bkv, l, d, causal=True, include_self=True):
    """NSA's selection scores, one query and one compressed block at a time."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    B, Sq, Hq, D = q.shape
    Skv, Hkv = k.shape[1:3]
    G = Hq // Hkv
    nq, nkv = -(-Sq // bq), -(-Skv // bkv)
    n = (Skv - l) // d + 1 if Skv >= l else 0
    s = np.zeros((B, Hq, nq, nkv))
    for b in range(B):
        for h in range(Hq):
            kcmp = np.stack([k[b, t * d:t * d + l, h // G].mean(0) for t in range(n)]) if n else np.zeros((0, D))
            for i in range(Sq):
                ok = [t for t in range(n) if not causal or t * d + l - 1 <= i]
                if not ok:
                    continue
                logits = np.array([q[b, i, h] @ kcmp[t] / math.sqrt(D) for t in ok])
                p = np.exp(logits - logits.max())
                p /= p.sum()
                for pt, t in zip(p, ok):
                    for j in range(nkv):
                        if t * d <= (j + 1) * bkv - 1 and t * d + l - 1 >= j * bkv:
                            s[b, h, i // bq, j] += pt
    s = s.reshape(B, Hkv, G, nq, nkv).sum(2, keepdims=True).repeat(G, axis=2).reshape(B, Hq, nq, nkv)
    return np_block_rules(s, Sq, Skv, bq, bkv, causal, include_self)


def implied_mask(chosen, partial, mask_mod, Sq, Skv, bq, bkv):
    """(B, H, Sq, Skv): block chosen and, where partial, mask_mod(q, kv)."""
    qi, ki = np.arange(Sq)[:, None], np.arange(Skv)[None, :]
    block = chosen[..., qi // bq, ki // bkv]
    if partial and mask_mod is not None:
        block = block & np.asarray(mask_mod(0, 0, qi, ki))
    return block


def qkv(shape, seed=0):
    B, Sq, Skv, Hq, Hkv, D = shape
    kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(seed), 4)
    return (jax.random.normal(kq, (B, Sq, Hq, D)), jax.random.normal(kk, (B, Skv, Hkv, D)),
            jax.random.normal(kv, (B, Skv, Hkv, D)), jax.random.normal(kd, (B, Sq, Hq, D)))


def states(bm):
    return np.asarray(bm.block_states())


def check_selection(bm, scores, k, partial, full_where=None):
    """The chosen blocks are listed, partial (or full where ``full_where``, a (nQ, nKV) bool, says), the
    others skipped."""
    chosen = np_topk(scores, k)
    st = states(bm)
    np.testing.assert_array_equal(st != EMPTY, chosen)
    full = np.broadcast_to(np.bool_(not partial) if full_where is None else full_where, chosen.shape)
    np.testing.assert_array_equal(st[chosen & full], FULL)
    np.testing.assert_array_equal(st[chosen & ~full], PARTIAL)


def below_diagonal(Sq, Skv, bq, bkv):
    """(nQ, nKV): the blocks where every pair is causal (their last key precedes their first query) and
    that hold no padding (a block past Q_LEN or KV_LEN is partial, so that the padding stays masked)."""
    i, j = np.arange(-(-Sq // bq))[:, None], np.arange(-(-Skv // bkv))[None, :]
    return (np.minimum((j + 1) * bkv, Skv) - 1 <= i * bq) & ((i + 1) * bq <= Sq) & ((j + 1) * bkv <= Skv)


# -- the top-k lists ------------------------------------------------------------------------------

def tie_scores(shape, seed):
    """Small integers (many ties, -0.0 among the zeros), some -inf, a +inf."""
    rng = np.random.default_rng(seed)
    s = rng.integers(-2, 3, size=shape).astype(np.float32)
    s[rng.random(shape) < 0.3] = -np.inf
    s[rng.random(shape) < 0.1] = -0.0
    s[..., 0, -1] = np.inf
    return s


@pytest.mark.parametrize("k", [1, 3, 7])
def test_topk_lists_match_stable_argsort(k):
    s = tie_scores((2, 3, 5, 7), k)
    s[0, 0, 1] = -np.inf  # a row with nothing to choose
    s[0, 1, 2, 3] = np.nan
    count, idx = sparse._topk_lists(jnp.asarray(s), k)
    count, idx = np.asarray(count), np.asarray(idx)
    chosen = np_topk(s, k)
    np.testing.assert_array_equal(count, chosen.sum(-1))
    assert count[0, 0, 1] == 0
    for row in np.ndindex(count.shape):
        got = idx[row][:count[row]]
        np.testing.assert_array_equal(got, np.flatnonzero(chosen[row]))  # ascending, the chosen ones
        assert ((idx[row] >= 0) & (idx[row] < s.shape[-1])).all()


def test_topk_ties_go_to_the_lower_index():
    s = jnp.zeros((1, 1, 2, 8)).at[0, 0, 1, 5].set(-0.0).at[0, 0, 1, 6].set(1.0)
    count, idx = sparse._topk_lists(s, 3)
    np.testing.assert_array_equal(np.asarray(count), [[[3, 3]]])
    np.testing.assert_array_equal(np.asarray(idx)[0, 0], [[0, 1, 2], [0, 1, 6]])


@pytest.mark.parametrize("k", [1, pytest.param(4, marks=pytest.mark.ci_extra)])
def test_topk_block_mask_partial_with_mask_mod_full_without(k):
    s = tie_scores((2, 2, 4, 5), 10 + k)
    check_selection(sparse.topk_block_mask(jnp.asarray(s), k, block_size=32, mask_mod=masks.causal), s, k, True)
    check_selection(sparse.topk_block_mask(s, k, block_size=32), s, k, False)
    # Without a mask_mod, lengths that end inside a block: the blocks holding padding are partial.
    bm = sparse.topk_block_mask(s, k, block_size=32, seq_lengths=(100, 150))
    st, chosen = states(bm), np_topk(s, k)
    np.testing.assert_array_equal(st != EMPTY, chosen)
    edge = np.zeros(chosen.shape, bool)
    edge[..., -1, :] = edge[..., :, -1] = True
    np.testing.assert_array_equal(st[chosen & edge], PARTIAL)
    np.testing.assert_array_equal(st[chosen & ~edge], FULL)


def test_topk_block_mask_under_jit_compiles_once():
    f = jax.jit(lambda s: sparse.topk_block_mask(s, 2, block_size=(32, 64), mask_mod=masks.causal,
                                                 seq_lengths=(120, 300)))
    for seed in range(3):
        s = np.asarray(jax.random.normal(jax.random.PRNGKey(seed), (2, 3, 4, 5)))
        check_selection(f(jnp.asarray(s)), s, 2, True)
    assert f._cache_size() == 1


def test_moba_block_mask_under_jit_compiles_once():
    f = jax.jit(lambda q, k: sparse.moba_block_mask(q, k, 2, block_size=32))
    for seed in range(3):
        q, k, _, _ = qkv((1, 100, 100, 2, 1, 16), seed)
        bm = f(q, k)
        check_selection(bm, sparse.moba_scores(q, k, block_size=32), 2, True, below_diagonal(100, 100, 32, 32))
    assert f._cache_size() == 1


# -- the gates ------------------------------------------------------------------------------------

def assert_scores(got, want):
    got = np.asarray(got)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=2e-5, atol=2e-5 * np.abs(want[fin]).max())


GATE_CASES = [  # (B, Sq, Skv, Hq, Hkv, D), block_size, causal, include_self
    ((2, 96, 96, 4, 2, 16), 32, True, True),
    ((1, 100, 150, 2, 2, 16), (32, 64), True, False),
    ((1, 150, 70, 4, 1, 16), (64, 32), False, True),
    ((1, 64, 64, 2, 1, 16), 32, False, False),
]


@pytest.mark.parametrize("shape,block,causal,include_self", GATE_CASES)
def test_moba_scores_match_numpy(shape, block, causal, include_self):
    q, k, _, _ = qkv(shape)
    bq, bkv = (block, block) if isinstance(block, int) else block
    got = sparse.moba_scores(q, k, block_size=block, causal=causal, include_self=include_self)
    assert_scores(got, np_moba(q, k, bq, bkv, causal, include_self))


@pytest.mark.parametrize("shape,block,causal,include_self,lengths", [
    (*GATE_CASES[0], (None, None)),  # NSA's ratios: l = block_kv / 2, d = l / 2
    (*GATE_CASES[1], (24, 8)),  # compressed blocks straddling two selection blocks
    (*GATE_CASES[2], (40, 24)),  # l > block_kv, d not dividing l
    (*GATE_CASES[0], (16, 16)),  # no overlap between compressed blocks
])
def test_nsa_scores_match_numpy(shape, block, causal, include_self, lengths):
    q, k, _, _ = qkv(shape, seed=1)
    bq, bkv = (block, block) if isinstance(block, int) else block
    l, d = lengths
    got = sparse.nsa_scores(q, k, block_size=block, compress_size=l, stride=d, causal=causal,
                            include_self=include_self)
    l = l or bkv // 2
    d = d or l // 2
    assert_scores(got, np_nsa(q, k, bq, bkv, l, d, causal, include_self))


def test_nsa_scores_shorter_than_one_compressed_block():
    q, k, _, _ = qkv((1, 20, 20, 2, 1, 16))
    got = sparse.nsa_scores(q, k, block_size=16, compress_size=32, stride=8)
    assert_scores(got, np_nsa(q, k, 16, 16, 32, 8))


@pytest.mark.parametrize("gate", ["moba", "nsa"])
def test_causal_gates_never_choose_the_future_and_always_the_diagonal(gate):
    B, S, Hq, Hkv, bs = 2, 256, 4, 2, 32
    q, k, _, _ = qkv((B, S, S, Hq, Hkv, 16), seed=3)
    fn = sparse.moba_scores if gate == "moba" else sparse.nsa_scores
    s = np.asarray(fn(q, k, block_size=bs))
    n = S // bs
    for kk in (1, 3, n):
        chosen = np_topk(s, kk)
        assert not np.triu(chosen, 1).any()  # no kv block after the q block
        assert np.diagonal(chosen, axis1=-2, axis2=-1).all()  # the diagonal block always
        np.testing.assert_array_equal(chosen.sum(-1), np.broadcast_to(np.minimum(kk, np.arange(1, n + 1)), (B, Hq, n)))


def test_nsa_gqa_group_heads_choose_the_same_blocks():
    q, k, _, _ = qkv((1, 192, 192, 6, 2, 16), seed=4)
    s = np.asarray(sparse.nsa_scores(q, k, block_size=32, causal=False, include_self=False))
    chosen = np_topk(s, 2)
    g = chosen.reshape(1, 2, 3, 6, 6)
    assert (g == g[:, :, :1]).all()
    assert (g[:, 0] != g[:, 1]).any()  # the groups themselves differ
    np.testing.assert_array_equal(s.reshape(1, 2, 3, 6, 6), np.repeat(s.reshape(1, 2, 3, 6, 6)[:, :, :1], 3, 2))


# -- attention over the chosen blocks, end to end --------------------------------------------------

def _backends():
    """The registry's float32 targets: xla in make test, the reference and pallas in make test-extra (make test's
    budget), the rest in make test-all or under their marker."""
    return budgeted(lambda t: t.dtype == jnp.float32, default=("xla",), extra=("reference", "pallas"))


E2E = [  # id, (B, Sq, Skv, Hq, Hkv, D), block, k
    ("moba_causal", (2, 140, 140, 4, 2, 16), 32, 2),
    ("moba_ragged_noncausal", (1, 150, 150, 2, 1, 16), 32, 2),
    ("nsa_causal", (1, 128, 192, 4, 2, 16), (32, 32), 2),
]


def build_mask(case, q, k):
    """The BlockMask of a case and what the reference needs: scores, mask_mod, partial."""
    name, shape, block, kk = case
    Sq, Skv = q.shape[1], k.shape[1]
    if name == "moba_causal":
        return sparse.moba_block_mask(q, k, kk, block_size=block)
    if name == "moba_ragged_noncausal":
        return sparse.moba_block_mask(q, k, kk, block_size=block, causal=False)
    s = sparse.nsa_scores(q, k, block_size=block, compress_size=32, stride=16)
    return sparse.topk_block_mask(s, kk, block_size=block, mask_mod=masks.causal, seq_lengths=(Sq, Skv))


def case_scores(case, q, k):
    name, shape, block, kk = case
    if name.startswith("moba"):
        return sparse.moba_scores(q, k, block_size=block, causal=name == "moba_causal"), name == "moba_causal"
    return sparse.nsa_scores(q, k, block_size=block, compress_size=32, stride=16), True


@pytest.mark.parametrize("target", _backends())
@pytest.mark.parametrize("case", E2E, ids=[c[0] for c in E2E])
def test_attention_over_chosen_blocks_matches_dense_float64(case, target):
    name, shape, block, kk = case
    q, k, v, do = qkv(shape, seed=5)
    bq, bkv = (block, block) if isinstance(block, int) else block
    kw, backend = target.kw(), target.id

    @jax.jit
    def run(q, k, v, do):
        def loss(q, k, v):  # the mask is built from q and k inside the differentiated function
            out = flexjax.flex_attention(q, k, v, block_mask=build_mask(case, q, k), **kw)
            return jnp.sum(out * do), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, grads

    out, grads = run(q, k, v, do)
    scores, causal = case_scores(case, q, k)
    chosen = np_topk(np.asarray(scores), kk)
    allowed = implied_mask(chosen, causal, masks.causal, shape[1], shape[2], bq, bkv)
    everywhere = implied_mask(np.ones_like(chosen), causal, masks.causal, shape[1], shape[2], bq, bkv)
    assert (allowed != everywhere).any()  # the selection skips some blocks the mask_mod alone allows
    want_out, want_grads = dense_f64(q, k, v, do, allowed)
    for what, got, want in (("out", out, want_out), *zip(("dq", "dk", "dv"), grads, want_grads)):
        got = np.asarray(got, np.float64)
        tol = 2e-5 * max(1.0, np.abs(want).max())
        assert np.abs(got - want).max() <= tol, f"{name}/{backend}: {what} off by {np.abs(got - want).max():.3g}"


# -- bad inputs -------------------------------------------------------------------------------------

S4 = jnp.zeros((1, 2, 3, 4))
Q, K = jnp.zeros((1, 64, 4, 16)), jnp.zeros((1, 64, 2, 16))


@pytest.mark.parametrize("call,error,match", [
    (lambda: sparse.topk_block_mask(jnp.zeros((2, 3, 4)), 1, block_size=32), ValueError, "scores must have shape"),
    (lambda: sparse.topk_block_mask(jnp.zeros((1, 2, 3, 4), jnp.int32), 1, block_size=32), TypeError,
     "scores must be a float array"),
    (lambda: sparse.topk_block_mask("x", 1, block_size=32), TypeError, "scores"),
    (lambda: sparse.topk_block_mask(S4, 0, block_size=32), ValueError, r"k must be an int in \[1, num_kv_blocks = 4\]"),
    (lambda: sparse.topk_block_mask(S4, 5, block_size=32), ValueError, "k must be"),
    (lambda: sparse.topk_block_mask(S4, 1.5, block_size=32), TypeError, "k must be a Python int"),
    (lambda: sparse.topk_block_mask(S4, True, block_size=32), TypeError, "k must be a Python int"),
    (lambda: sparse.topk_block_mask(S4, 1, block_size=0), ValueError, "block_size"),
    (lambda: sparse.topk_block_mask(S4, 1, block_size=32, seq_lengths=(96, 130)), ValueError,
     r"seq_lengths=\(96, 130\).*scores of shape \(B, H, 3, 4\)"),
    (lambda: sparse.topk_block_mask(S4, 1, block_size=32, seq_lengths=(96,)), ValueError, "seq_lengths must be"),
    (lambda: sparse.topk_block_mask(S4, 1, block_size=32, mask_mod=3), TypeError, "mask_mod"),
    (lambda: sparse.moba_scores(Q[0], K, block_size=32), ValueError, r"query must have shape \(B, Sq, Hq, D\)"),
    (lambda: sparse.moba_scores(Q, K[..., :8], block_size=32), ValueError, "head_dim"),
    (lambda: sparse.moba_scores(Q[:, :, :3], K, block_size=32), ValueError, "multiple of key's heads"),
    (lambda: sparse.moba_scores(Q, K.astype(jnp.int32), block_size=32), TypeError, "key must be a float array"),
    (lambda: sparse.moba_scores(Q, K, block_size=(32, -1)), ValueError, "block_size"),
    (lambda: sparse.moba_scores(Q, K, block_size=32, causal=None), TypeError, "causal must be a bool"),
    (lambda: sparse.nsa_scores(Q, K, block_size=32, compress_size=0), ValueError, "compress_size"),
    (lambda: sparse.nsa_scores(Q, K, block_size=32, stride=2.0), ValueError, "stride"),
    (lambda: sparse.nsa_scores(Q, K, block_size=32, include_self=1), TypeError, "include_self must be a bool"),
    (lambda: sparse.moba_block_mask(Q, K, 3, block_size=32), ValueError, "k must be"),
])
def test_bad_inputs_name_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()
