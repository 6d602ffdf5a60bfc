"""AuxRequest(min_scores=True) through the paged and ragged entry points (the dense one, on every backend,
is conformance.py's test_max_and_min_scores): each row's min of the modified, unmasked scores over the
sequence's valid keys, +inf where there is none, against float64 NumPy on the gathered cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flexjax
from flexjax import paged

NUM_PAGES, PAGE, HQ, HKV, D = 12, 16, 4, 2, 16


def _pools(seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    k_pages = jax.random.normal(ks[0], (NUM_PAGES, PAGE, HKV, D), jnp.float32)
    v_pages = jax.random.normal(ks[1], (NUM_PAGES, PAGE, HKV, D), jnp.float32)
    return k_pages, v_pages, ks[2]


def _scores(q, keys, positions, slope):
    """float64 (Hq, n_q, n_kv) modified scores of queries at ``positions`` against ``keys`` (n_kv, Hkv, D)."""
    kd = np.repeat(np.asarray(keys, np.float64), HQ // HKV, axis=1)
    s = np.einsum("qhd,khd->hqk", np.asarray(q, np.float64), kd) / np.sqrt(D)
    return s + slope * (np.arange(kd.shape[0])[None, None, :] - np.asarray(positions)[None, :, None])


def _alibi(slope):
    def mod(score, b, h, q_idx, kv_idx):
        return score + slope * (kv_idx - q_idx)

    return mod


@pytest.mark.ci_extra  # (make test's 5-minute budget: about 4 s here; make test reached 5:12)
def test_paged_min_scores():
    k_pages, v_pages, key = _pools()
    B, max_pages = 2, 4
    table = jnp.asarray([[3, 7, 1, 0], [5, 2, -1, -1]], jnp.int32)
    lengths = jnp.asarray([50, 0], jnp.int32)  # sequence 1 holds no key: +inf
    q = jax.random.normal(key, (B, 1, HQ, D), jnp.float32)
    bm = flexjax.create_block_mask(flexjax.masks.causal_bottom_right(1, lengths), B, None, 1, max_pages * PAGE,
                                   block_size=(16, 16))
    out, aux = paged.flex_attention(q, k_pages, v_pages, table, lengths, _alibi(0.25), bm,
                                    return_aux=flexjax.AuxRequest(max_scores=True, min_scores=True), backend="xla")
    keys = np.asarray(k_pages)[np.asarray(table[0])].reshape(-1, HKV, D)[:50]
    s = _scores(q[0], keys, [0], 0.25)  # (q_idx is 0: the query's index in this call, as flex_attention's)
    np.testing.assert_allclose(np.asarray(aux.min_scores[0]), s.min(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(aux.max_scores[0]), s.max(-1), rtol=1e-5, atol=1e-5)
    assert np.isposinf(np.asarray(aux.min_scores[1])).all() and np.isneginf(np.asarray(aux.max_scores[1])).all()
    assert aux.lse is None and aux.min_scores.shape == (B, HQ, 1)


def test_ragged_min_scores_under_jit():
    """A prefill chunk and a decode step in one ragged call, under jit; padding rows get +inf."""
    k_pages, v_pages, key = _pools(1)
    table = jnp.asarray([[0, 1, 2, 3], [4, 5, 6, 7]], jnp.int32)
    lengths = jnp.asarray([40, 23], jnp.int32)
    cu = jnp.asarray([0, 6, 7], jnp.int32)  # sequence 0: its last 6 tokens; sequence 1: one (decode)
    q = jax.random.normal(key, (9, HQ, D), jnp.float32)  # rows 7, 8: padding

    @jax.jit
    def run(q, lengths, cu):
        return paged.flex_attention_ragged(q, k_pages, v_pages, table, lengths, cu, score_mod=_alibi(-0.5),
                                           return_aux=flexjax.AuxRequest(min_scores=True), backend="xla")

    _, aux = run(q, lengths, cu)
    assert aux.max_scores is None and aux.min_scores.shape == (HQ, 9)
    got = np.asarray(aux.min_scores)
    for seq, rows, n in ((0, range(0, 6), 40), (1, range(6, 7), 23)):
        keys = np.asarray(k_pages)[np.asarray(table[seq])].reshape(-1, HKV, D)[:n]
        positions = [n - len(rows) + r for r in range(len(rows))]
        s = _scores(q[rows.start:rows.stop], keys, positions, -0.5)
        causal = np.arange(n)[None, None, :] <= np.asarray(positions)[None, :, None]
        np.testing.assert_allclose(got[:, rows.start:rows.stop], np.where(causal, s, np.inf).min(-1), rtol=1e-5,
                                   atol=1e-5)
    assert np.isposinf(got[:, 7:]).all()


def test_min_scores_refused_sharded_as_max_scores():
    mesh = jax.make_mesh((1,), ("x",))
    q = jnp.ones((1, 16, 2, 8))
    with pytest.raises(NotImplementedError, match="min_scores"), flexjax.sharding.attention_specs(
            ("x", None, None, None), ("x", None, None, None), mesh=mesh):
        flexjax.flex_attention(q, q, q, return_aux=flexjax.AuxRequest(min_scores=True))
