"""No silent wrong answers: broadcast masks that read b/h, torch layout, very negative rows,
float64, kernel_options and mod errors (each case once failed or misbehaved silently)."""

from __future__ import annotations

import catalog
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flexjax
from flexjax import flex_attention, masks, mods


def _qkv(B=2, S=64, H=2, D=8, dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return tuple(jax.random.normal(k, (B, S, H, D), dtype) for k in ks)


def _per_batch_ids(S=64):
    return jnp.asarray(np.stack([np.arange(S) // 16, np.arange(S) // 40]), jnp.int32)


# -- 1. broadcasting over an axis the mask_mod reads --------------------------------------

def _reads_h(b, h, q_idx, kv_idx):
    return jnp.where(h == 0, q_idx >= kv_idx, q_idx <= kv_idx)


def test_create_block_mask_refuses_none_for_an_axis_the_mask_reads():
    with pytest.raises(ValueError, match=r"mask_mod 'document' reads b, so B=None would use batch 0's mask for every "
                                         r"batch element; pass B=<batch size>"):
        flexjax.create_block_mask(masks.document(_per_batch_ids()), None, None, 64, 64, block_size=16)
    with pytest.raises(ValueError, match=r"'_reads_h' reads h, so H=None.*pass H=<number of query heads>"):
        flexjax.create_block_mask(_reads_h, 2, None, 64, 64, block_size=16)
    # With the sizes given it builds; masks that do not read b/h still broadcast.
    flexjax.create_block_mask(masks.document(_per_batch_ids()), 2, None, 64, 64, block_size=16)
    flexjax.create_block_mask(_reads_h, None, 2, 64, 64, block_size=16)
    flexjax.create_block_mask(masks.causal, None, None, 64, 64, block_size=16)


def test_dead_reads_of_b_do_not_count():
    def unused_offset(b, h, q_idx, kv_idx):
        _ = b + 3  # computed, never used
        return q_idx >= kv_idx

    bm = flexjax.create_block_mask(unused_offset, None, None, 64, 64, block_size=16)
    assert bm.shape[:2] == (1, 1)


def test_flex_attention_refuses_a_b1_mask_that_reads_b_for_a_larger_batch():
    q, k, v = _qkv()
    ids = _per_batch_ids()
    bm = flexjax.create_block_mask(masks.document(ids), 1, None, 64, 64, block_size=16)
    with pytest.raises(ValueError, match=r"built with B=1.*reads b.*query has batch size 2.*B=2"):
        flex_attention(q, k, v, block_mask=bm)
    bm_h = flexjax.create_block_mask(_reads_h, None, 1, 64, 64, block_size=16)
    with pytest.raises(ValueError, match=r"built with H=1.*reads h.*number of query heads 2.*H=2"):
        flex_attention(q, k, v, block_mask=bm_h)
    good = flexjax.create_block_mask(masks.document(ids), 2, None, 64, 64, block_size=16)
    np.testing.assert_allclose(np.asarray(flex_attention(q, k, v, block_mask=good)),
                               np.asarray(flex_attention(q, k, v, block_mask=good, backend="reference")), atol=2e-5)


def test_library_document_with_shared_ids_broadcasts():
    ids = jnp.asarray(np.arange(64) // 16, jnp.int32)
    bm = flexjax.create_block_mask(masks.document(ids), None, None, 64, 64, block_size=16)
    q, k, v = _qkv()
    want = flex_attention(q, k, v, block_mask=bm, backend="reference")
    np.testing.assert_allclose(np.asarray(flex_attention(q, k, v, block_mask=bm)), np.asarray(want), atol=2e-5)


# -- 2. PyTorch's (batch, heads, seq, head_dim) layout ------------------------------------

def test_torch_layout_hint_in_the_length_error():
    B, H, S, D = 2, 4, 64, 8
    q = jnp.ones((B, H, S, D))  # torch layout: seq and heads swapped
    bm = flexjax.create_block_mask(masks.causal, None, None, S, S, block_size=16)
    with pytest.raises(ValueError, match=r"Q_LEN=64.*\(batch, seq, heads, head_dim\).*jnp\.swapaxes\(x, 1, 2\)"):
        flex_attention(q, q, q, block_mask=bm)
    # A plain length mismatch does not mention the layout.
    with pytest.raises(ValueError, match=r"built for Q_LEN=32") as e:
        flex_attention(jnp.ones((B, S, H, D)), jnp.ones((B, S, H, D)), jnp.ones((B, S, H, D)),
                       block_mask=flexjax.create_block_mask(masks.causal, None, None, 32, 64, block_size=16))
    assert "swapaxes" not in str(e.value)


# -- 3a. rows whose scores are all very negative but finite -------------------------------

_FMIN = float(jnp.finfo(jnp.float32).min)
_ROWS = [(value, path) for path in ("band", "loops") for value in (_FMIN, -1e38, -1e30)]


@pytest.mark.parametrize("value,path", catalog.sweep(_ROWS, [_ROWS[0], _ROWS[5]], ids=[f"{p}{v:g}" for v, p in _ROWS]))
def test_very_negative_rows_attend_uniformly(value, path):
    options = {"band": None, "loops": {"block_q": 32, "block_kv": 16}}[path]
    q, k, v = _qkv(B=1)
    do = jax.random.normal(jax.random.PRNGKey(9), q.shape)

    def hf_style(score, b, h, q_idx, kv_idx):
        return jnp.where(q_idx < 20, value, score)  # rows 0..19 "masked" the HuggingFace way

    bm = flexjax.create_block_mask(masks.causal, None, None, 64, 64, block_size=16)

    def run(backend, kernel_options=None):
        def loss(q, k, v):
            out, lse = flex_attention(q, k, v, hf_style, bm, return_lse=True, backend=backend,
                                      kernel_options=kernel_options)
            return jnp.sum(out * do), (out, lse)

        (_, (out, lse)), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
        return out, lse, grads

    out, lse, grads = run("xla", options)
    want_out, want_lse, want_grads = run("reference")
    # Row i < 20 averages v[0..i] (causal): not 0, and lse = value + log(i + 1).
    np.testing.assert_allclose(np.asarray(out[0, 5, 0]), np.asarray(v[0, :6, 0].mean(0)), atol=1e-5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-6)
    assert np.isfinite(np.asarray(lse)).all()
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4)


# -- 6. float64 ---------------------------------------------------------------------------

def _dense_f64(q, k, v, table, S):
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    i = np.arange(S)
    s = s + table[:, i[None, :] - i[:, None] + S - 1][None]
    s = np.where(i[:, None] >= i[None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)


def test_float64_reference_is_float64():
    with jax.enable_x64(True):
        q, k, v = _qkv(B=1, S=48, dtype=jnp.float64)
        table = 0.3 * jax.random.normal(jax.random.PRNGKey(4), (2, 95), jnp.float64)
        bm = flexjax.create_block_mask(masks.causal, None, None, 48, 48, block_size=16)
        out, lse = flex_attention(q, k, v, mods.relative_bias(table), bm, return_lse=True, backend="reference")
        assert out.dtype == jnp.float64 and lse.dtype == jnp.float64
        want = _dense_f64(*(np.asarray(x) for x in (q, k, v, table)), 48)
        assert np.abs(np.asarray(out) - want).max() < 1e-12


_F64_DEFAULT = ("document+t5",)


# (document+t5 in make test-extra since make test reached 4:55; the rest of the catalog in make test-all.)
@pytest.mark.parametrize("case", catalog.sweep([c.name for c in catalog.CATALOG], _F64_DEFAULT,
                                               ids=[c.name for c in catalog.CATALOG], extra=_F64_DEFAULT))
def test_float64_xla_matches_reference_on_the_catalog(case):
    shape = (2, 80, 72, 2, 1, 8, 8)  # GQA, Sq != Skv, lengths not multiples of the block
    with jax.enable_x64(True):
        q, k, v, do = catalog.inputs(shape, jnp.float64)
        _, params, attention = catalog.build(catalog.BY_NAME[case], shape, block_size=16)
        params = jax.tree.map(lambda x: x.astype(jnp.float64), params)
        got = catalog.loss_and_grads(attention, q, k, v, do, params, backend="xla")
        want = catalog.loss_and_grads(attention, q, k, v, do, params, backend="reference")
        assert got[0].dtype == jnp.float64
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            g, w = np.asarray(g), np.asarray(w)
            same = (g == w) | (np.isinf(g) & np.isinf(w))
            assert np.abs(np.where(same, 0.0, g) - np.where(same, 0.0, w)).max() < 1e-12


def test_pallas_refuses_float64():
    with jax.enable_x64(True):
        q, k, v = _qkv(B=1, S=32, dtype=jnp.float64)
        with pytest.raises(NotImplementedError, match="pallas backend takes float32, bfloat16 or float16"):
            flex_attention(q, k, v, backend="pallas")


# -- 9. kernel_options keys ---------------------------------------------------------------

def test_kernel_options_typo_names_every_backends_keys():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"unknown kernel_options key 'blok_q'.*reference: \(none\).*"
                                         r"xla: block_q, block_kv.*pallas: target, interpret"):
        flex_attention(q, k, v, kernel_options={"blok_q": 32})
    with pytest.raises(ValueError,
                       match=r"'num_warps' is taken by backend 'pallas' and 'triton', not by backend='xla'"):
        flex_attention(q, k, v, backend="xla", kernel_options={"num_warps": 4})
    with pytest.raises(ValueError, match=r"'interpret' is taken by backend 'pallas', 'triton' and 'mosaic_gpu', "
                                         r"not by backend=None"):
        flex_attention(q, k, v, kernel_options={"interpret": True})


# -- 10. mods that cannot keep scalar semantics -------------------------------------------

def test_numpy_table_indexed_by_a_traced_index():
    table = np.linspace(0, 1, 64, dtype=np.float32)
    q, k, v = _qkv()

    def numpy_bias(score, b, h, q_idx, kv_idx):
        return score + table[q_idx]

    with pytest.raises(TypeError, match=r"score_mod 'numpy_bias'.*numpy array.*jnp\.asarray"):
        flex_attention(q, k, v, score_mod=numpy_bias)
    ids = np.arange(64) // 16
    with pytest.raises(TypeError, match=r"mask_mod .*numpy array.*jnp\.asarray"):
        flexjax.create_block_mask(lambda b, h, qi, kv: ids[qi] == ids[kv], None, None, 64, 64)


def test_reduction_over_an_axis_in_a_mod():
    def reduces(b, h, q_idx, kv_idx):
        return jnp.any(q_idx >= kv_idx, axis=-1)

    with pytest.raises(TypeError, match=r"mask_mod 'reduces'.*scalar semantics.*axis"):
        flexjax.create_block_mask(reduces, None, None, 64, 64)


_PALLAS_ROWS = [(v, t) for v in (-1e30, _FMIN) for t in ("gpu", "tpu")]


@pytest.mark.parametrize("value,template", catalog.sweep(_PALLAS_ROWS, [_PALLAS_ROWS[0], _PALLAS_ROWS[3]],
                                                         ids=[f"{t}{v:g}" for v, t in _PALLAS_ROWS]))
def test_pallas_backward_of_very_negative_rows(value, template):
    """The pallas backward recomputes P of such rows from their max and sum, not from lse."""
    q, k, v = _qkv(B=1)
    do = jax.random.normal(jax.random.PRNGKey(9), q.shape)
    bm = flexjax.create_block_mask(masks.causal, None, None, 64, 64, block_size=16)

    def hf_style(score, b, h, q_idx, kv_idx):
        return jnp.where(q_idx < 20, value, score)

    def grads(backend):
        options = {"target": "tpu", "interpret": True} if backend == "pallas" and template == "tpu" else None
        loss = lambda q, k, v: jnp.sum(  # noqa: E731
            flex_attention(q, k, v, hf_style, bm, backend=backend, kernel_options=options) * do)
        return jax.grad(loss, (0, 1, 2))(q, k, v)

    for g, w in zip(grads("pallas"), grads("reference")):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4)
