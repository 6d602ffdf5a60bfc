"""flex_attention's contract: semantics, the reference backend, transforms and input errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import flexjax
from flexjax import flex_attention, masks, mods


def _qkv(B=2, Sq=24, Skv=24, Hq=4, Hkv=4, D=8, Dv=8, dtype=jnp.float32, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(k1, (B, Sq, Hq, D), dtype), jax.random.normal(k2, (B, Skv, Hkv, D), dtype),
            jax.random.normal(k3, (B, Skv, Hkv, Dv), dtype))


@pytest.mark.parametrize("backend", ["reference", "xla"])
@pytest.mark.parametrize("Hkv", [4, 2, 1])
def test_matches_jax_dot_product_attention(backend, Hkv):
    q, k, v = _qkv(Sq=40, Skv=56, Hkv=Hkv)
    mm = masks.sliding_window(9, 3)
    bm = flexjax.create_block_mask(mm, None, None, 40, 56, block_size=16)
    dense = flexjax.create_mask(mm, None, None, 40, 56)
    want = jax.nn.dot_product_attention(q, k, v, mask=dense, implementation="xla")
    got = flex_attention(q, k, v, block_mask=bm, backend=backend)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def test_scale_and_lse_semantics():
    q, k, v = _qkv(B=1, Sq=5, Skv=7, Hq=2, Hkv=2, D=3, Dv=3)
    out, lse = flex_attention(q, k, v, scale=0.3, return_lse=True, backend="reference")
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.3
    np.testing.assert_allclose(np.asarray(lse), np.asarray(jax.nn.logsumexp(s, -1)), atol=1e-5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)),
                               atol=1e-5)
    assert lse.dtype == jnp.float32 and lse.shape == (1, 2, 5)
    default = flex_attention(q, k, v, backend="xla")
    explicit = flex_attention(q, k, v, scale=1 / np.sqrt(3), backend="xla")
    np.testing.assert_allclose(np.asarray(default), np.asarray(explicit), atol=1e-6)


@pytest.mark.parametrize("backend", [pytest.param("reference", marks=pytest.mark.slow), "xla"])
def test_fully_masked_rows(backend):
    q, k, v = _qkv(Sq=20, Skv=20)
    bm = flexjax.create_block_mask(lambda b, h, qi, kv: (qi >= 8) & (kv <= qi), None, None, 20, 20, block_size=8)
    out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True, backend=backend)
    assert (np.asarray(out[:, :8]) == 0).all()
    assert np.isneginf(np.asarray(lse[:, :, :8])).all()
    g = jax.grad(lambda q, k, v: flex_attention(q, k, v, block_mask=bm, backend=backend).sum(), (0, 1, 2))(q, k, v)
    assert all(np.isfinite(np.asarray(x)).all() for x in g)


# xla in make test-extra (make test's budget); the other tests with captured tables run in make test.
@pytest.mark.parametrize("backend", [pytest.param("reference", marks=pytest.mark.slow),
                                     pytest.param("xla", marks=pytest.mark.ci_extra)])
def test_check_grads_with_captured_table(backend):
    q, k, v = _qkv(B=1, Sq=12, Skv=12, Hq=2, Hkv=1, D=4, Dv=3)
    table = 0.5 * jax.random.normal(jax.random.PRNGKey(3), (2, 23))
    bm = flexjax.create_block_mask(masks.causal, None, None, 12, 12, block_size=4)

    def f(q, k, v, table):
        out, lse = flex_attention(q, k, v, mods.relative_bias(table), bm, return_lse=True, backend=backend,
                                  kernel_options={"block_q": 8, "block_kv": 4} if backend == "xla" else None)
        return out.sum() * 0.1 + jnp.tanh(out).sum() + 0.1 * lse.sum()

    check_grads(f, (q, k, v, table), order=1, modes=["rev"], atol=2e-2, rtol=2e-2, eps=1e-2)


def test_jit_grad_vmap_and_traced_captures():
    q, k, v = _qkv(B=1, Sq=32, Skv=32, Hq=2, Hkv=2, D=8, Dv=8)
    slopes = jnp.asarray([0.5, 0.25])
    bm = flexjax.create_block_mask(masks.causal, None, None, 32, 32, block_size=16)

    @jax.jit
    def loss(q, k, v, slopes):
        return flex_attention(q, k, v, mods.alibi_from_slopes(slopes), bm).sum()

    g = jax.grad(loss, 3)(q, k, v, slopes)
    g_ref = jax.grad(lambda *a: flex_attention(a[0], a[1], a[2], mods.alibi_from_slopes(a[3]), bm,
                                               backend="reference").sum(), 3)(q, k, v, slopes)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), atol=1e-4)
    stacked = jnp.stack([q, 2 * q])
    out = jax.vmap(lambda q: flex_attention(q, k, v, block_mask=bm))(stacked)
    np.testing.assert_allclose(np.asarray(out[1]), np.asarray(flex_attention(2 * q, k, v, block_mask=bm)), atol=1e-5)


def test_block_mask_built_in_jit_used_in_jit():
    q, k, v = _qkv(B=2, Sq=64, Skv=64)
    ids = jnp.asarray(np.stack([np.arange(64) // 16, np.arange(64) // 32]), jnp.int32)

    @jax.jit
    def f(q, k, v, ids):
        bm = flexjax.create_block_mask(masks.document(ids), 2, None, 64, 64, block_size=16)
        return flex_attention(q, k, v, block_mask=bm)

    want = flex_attention(q, k, v, block_mask=flexjax.create_block_mask(masks.document(ids), 2, None, 64, 64,
                                                                        block_size=16), backend="reference")
    np.testing.assert_allclose(np.asarray(f(q, k, v, ids)), np.asarray(want), atol=1e-5)


def test_output_dtype_follows_query():
    for dt in (jnp.bfloat16, jnp.float16):
        q, k, v = _qkv(dtype=dt)
        out, lse = flex_attention(q, k, v, return_lse=True)
        assert out.dtype == dt and lse.dtype == jnp.float32


# -- errors ------------------------------------------------------------------------------------

def _err(exc, match, *args, **kw):
    with pytest.raises(exc, match=match):
        flex_attention(*args, **kw)


def test_errors_shapes():
    q, k, v = _qkv()
    _err(ValueError, "query must have rank 4", q[0], k, v)
    _err(ValueError, "key must have rank 4", q, k[0], v)
    _err(ValueError, "batch sizes differ", q, k[:1], v[:1])
    _err(ValueError, "key head_dim 4 must equal query head_dim 8", q, k[..., :4], v)
    _err(ValueError, "value must have the key's seq and heads", q, k, v[:, :10])
    q3, k3, v3 = _qkv(Hq=6, Hkv=4)
    _err(ValueError, r"query heads \(6\) must be a multiple of key/value heads \(4\)", q3, k3, v3)
    _err(TypeError, "must share a dtype", q, k.astype(jnp.bfloat16), v)
    _err(TypeError, "query must be float32, bfloat16, float16", q.astype(jnp.int32), k, v)
    _err(TypeError, "query must be a JAX array", [1, 2], k, v)


def test_errors_block_mask():
    q, k, v = _qkv()
    _err(ValueError, r"built for Q_LEN=32, KV_LEN=24 but query has 24 tokens.*create_block_mask",
         q, k, v, block_mask=flexjax.create_block_mask(masks.causal, None, None, 32, 24))
    _err(ValueError, "built for B=3 but query has batch 2",
         q, k, v, block_mask=flexjax.create_block_mask(masks.causal, 3, None, 24, 24))
    _err(ValueError, "built for H=2 but query has 4 heads",
         q, k, v, block_mask=flexjax.create_block_mask(masks.causal, None, 2, 24, 24))
    _err(TypeError, "block_mask must be a BlockMask", q, k, v, block_mask=np.ones((24, 24), bool))


def test_errors_mods_and_options():
    q, k, v = _qkv()
    _err(TypeError, "score_mod 'f' must keep scalar semantics", q, k, v, score_mod=_shape_changing)
    _err(TypeError, "takes 4 positional arguments.*Did you pass a mask_mod as score_mod", q, k, v,
         score_mod=masks.causal)
    _err(TypeError, "must return a floating score", q, k, v, score_mod=lambda s, b, h, qi, kv: qi)
    _err(TypeError, "use jnp.where instead of if/else", q, k, v, score_mod=_python_if)
    _err(TypeError, "scale must be a Python float", q, k, v, scale=jnp.ones(2))
    _err(ValueError, "backend must be one of", q, k, v, backend="cuda")
    _err(TypeError, "kernel_options must be a dict", q, k, v, kernel_options=[1])
    _err(ValueError, "'block_q' is taken by backend 'xla', 'pallas', 'triton' and 'mosaic_gpu', not by "
         "backend='reference'", q, k, v, backend="reference", kernel_options={"block_q": 1})


def _shape_changing(score, b, h, q_idx, kv_idx):
    return jnp.stack([score, score])


_shape_changing.__name__ = "f"


def _python_if(score, b, h, q_idx, kv_idx):
    if q_idx > kv_idx:
        return score
    return -score


@pytest.mark.parametrize("backend", [pytest.param("reference", marks=pytest.mark.slow), "xla"])
def test_grads_with_and_without_captured_table_differentiated(backend):
    """The backward skips gradients of captured arrays nobody differentiates; the rest stay exact."""
    q, k, v = _qkv(B=1, Sq=40, Skv=40, Hq=2, Hkv=2, D=8, Dv=8)
    table = 0.5 * jax.random.normal(jax.random.PRNGKey(5), (2, 79))
    bm = flexjax.create_block_mask(masks.causal, None, None, 40, 40, block_size=16)

    def loss(q, table, backend):
        return jnp.sum(jnp.tanh(flex_attention(q, k, v, mods.relative_bias(table), bm, backend=backend)))

    dq_only = jax.grad(loss)(q, table, backend)
    dq, dtable = jax.grad(loss, (0, 1))(q, table, backend)
    want_dq, want_dtable = jax.grad(loss, (0, 1))(q, table, "reference")
    np.testing.assert_allclose(np.asarray(dq_only), np.asarray(want_dq), atol=2e-5)
    np.testing.assert_allclose(np.asarray(dq), np.asarray(want_dq), atol=2e-5)
    np.testing.assert_allclose(np.asarray(dtable), np.asarray(want_dtable), atol=2e-5)


def test_explain_reports_fallbacks_and_the_log_says_the_same(caplog):
    """explain() names the backend and the implementation of each pass, with the reason each
    one tried before was passed over; the DEBUG log of a real call says the same."""
    import logging

    q = jnp.zeros((1, 128, 4, 16))
    kv = jnp.zeros((1, 128, 2, 16))
    bm = flexjax.create_block_mask(flexjax.masks.causal, None, None, 128, 128, block_size=64)
    table = jnp.zeros((4, 255))
    report = flexjax.explain(q, kv, kv, flexjax.mods.relative_bias(table), bm, backend="xla",
                             kernel_options={"cpu_kernel": False})
    assert (report.backend, report.forward, report.backward) == ("xla", "band", "loops")
    assert dict(report.skipped_forward)["cpu_kernel"] == "kernel_options cpu_kernel=False"
    assert "decode" in dict(report.skipped_forward)
    assert "skipped backward 'cpu_kernel'" in str(report)
    with caplog.at_level(logging.DEBUG, logger="flexjax"):
        jax.grad(lambda t: flexjax.flex_attention(q, kv, kv, flexjax.mods.relative_bias(t), bm, backend="xla",
                                                  kernel_options={"cpu_kernel": False}).sum())(table)
    assert any("xla forward runs 'band'" in r.getMessage() for r in caplog.records)
    assert any("xla backward runs 'loops'" in r.getMessage() and "cpu_kernel=False" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(ValueError, match="not by backend='reference'"):
        flexjax.explain(q, kv, kv, backend="reference", kernel_options={"block_q": 64})


def test_gqa_in_pytorch_layout_is_refused_without_a_block_mask():
    """GQA / MQA inputs in PyTorch's (B, H, S, D) layout read, as (B, S, H, D), as 8 queries against 2 keys
    in 64 heads: refused with the layout hint, naming the shapes; a block_mask for those lengths says they
    are meant."""
    import jax
    import jax.numpy as jnp
    import pytest

    import flexjax

    q = jnp.zeros((1, 8, 64, 16))   # PyTorch: 8 query heads, 64 tokens
    kv = jnp.zeros((1, 2, 64, 16))  # PyTorch: 2 kv heads
    for call in (flexjax.flex_attention, flexjax.explain, jax.jit(flexjax.flex_attention)):
        with pytest.raises(ValueError, match=r"PyTorch's \(batch, heads, seq, head_dim\).*jnp.swapaxes"):
            call(q, kv, kv)
    mqa = jnp.zeros((1, 1, 64, 16))
    with pytest.raises(ValueError, match="swapaxes"):
        flexjax.flex_attention(q, mqa, mqa)
    bm = flexjax.create_block_mask(flexjax.noop_mask, None, None, 8, 2, block_size=(8, 2))
    assert flexjax.flex_attention(q, kv, kv, block_mask=bm).shape == (1, 8, 64, 16)
    # The same shapes in flexjax's layout: 64 tokens, 8 query heads on 2 kv heads.
    assert flexjax.flex_attention(q.swapaxes(1, 2), kv.swapaxes(1, 2), kv.swapaxes(1, 2)).shape == (1, 64, 8, 16)


def test_debug_checks_raise_on_reads_past_a_captured_table():
    """A relative-bias table too short for the positions read is clamped by JAX, silently; under
    flexjax.debug_checks() the call raises, eagerly and when a jitted call runs, and a table that covers
    every position (or one read only at pairs the mask_mod drops) passes."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import pytest

    import flexjax
    from flexjax import masks

    S = 32
    q = jax.random.normal(jax.random.key(0), (1, S, 2, 16))
    short, full = jnp.zeros(S), jnp.arange(2 * S, dtype=jnp.float32) * 0.01

    def bias(table):
        return lambda s, b, h, qi, kv: s + table[qi - kv + S]  # reads S - 31 .. S + 31

    causal_bm = flexjax.create_block_mask(masks.causal, None, None, S, S, block_size=16)
    silent = flexjax.flex_attention(q, q, q, bias(short))  # outside debug mode: clamped, no error
    assert np.isfinite(np.asarray(silent)).all()
    with flexjax.debug_checks():
        with pytest.raises(IndexError, match="score_mod.*past its end"):
            flexjax.flex_attention(q, q, q, bias(short))
        with pytest.raises(IndexError, match="score_mod.*past its end"):
            flexjax.explain(q, q, q, bias(short))
        with pytest.raises(Exception, match="past its end"):
            jax.jit(lambda q, t: flexjax.flex_attention(q, q, q, bias(t)))(q, short).block_until_ready()
        out = jax.jit(lambda q, t: flexjax.flex_attention(q, q, q, bias(t)))(q, full)
        np.testing.assert_allclose(out, flexjax.flex_attention(q, q, q, bias(full)), atol=1e-6)
        # Causal: only qi >= kv is read (indices S .. 2S - 1); S + 1 entries cover qi == kv only.
        table = jnp.zeros(S + 1)
        with pytest.raises(IndexError):
            flexjax.flex_attention(q, q, q, bias(table), causal_bm)
        ok = jnp.zeros(2 * S)  # covers every allowed pair of the causal call
        flexjax.flex_attention(q, q, q, bias(ok), causal_bm)
        # A mask_mod reading past its table.
        docs = jnp.zeros(S // 2, jnp.int32)
        with pytest.raises(IndexError, match="mask_mod"):
            bm = flexjax.create_block_mask(lambda b, h, qi, kv: docs[qi] == docs[kv], None, None, S, S,
                                           block_size=16)
            flexjax.flex_attention(q, q, q, block_mask=bm)
    with flexjax.debug_checks(False):
        flexjax.flex_attention(q, q, q, bias(short))
