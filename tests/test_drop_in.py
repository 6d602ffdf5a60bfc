"""``flexjax.dot_product_attention`` against ``jax.nn.dot_product_attention`` (issue 33, item 1).

Forward and ``jax.grad`` (q, k, v and the bias) agree on every row that has a key; rows
with none are 0 in flexjax (FlexAttention's semantics) and not compared (jax.nn averages
the values there, or zeroes a padded query row).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flexjax

B, T, S, N, K, H = 2, 40, 56, 4, 2, 16


def _inputs(dtype=jnp.float32, unbatched=False):
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    q = jax.random.normal(keys[0], (B, T, N, H), dtype)
    k = jax.random.normal(keys[1], (B, S, K, H), dtype)
    v = jax.random.normal(keys[2], (B, S, K, H), dtype)
    do = jax.random.normal(keys[3], (B, T, N, H), jnp.float32)
    if unbatched:
        q, k, v, do = q[0], k[0], v[0], do[0]
    return q, k, v, do, keys[4], keys[5]


def _allowed(mask, is_causal, window, q_len, kv_len, rows=T, cols=S):
    """The combined boolean mask (B, N, T, S), as jax.nn forms it."""
    qi, ki = jnp.arange(rows)[:, None], jnp.arange(cols)[None, :]
    ok = jnp.ones((B, N, rows, cols), bool)
    if mask is not None:
        ok = ok & mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    if is_causal:
        ok = ok & (qi >= ki)
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        ok = ok & (ki >= qi - left) & (ki <= qi + right)
    if q_len is not None:
        ok = ok & (qi < q_len[:, None, None, None])
    if kv_len is not None:
        ok = ok & (ki < kv_len[:, None, None, None])
    return ok


CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "window_int": {"local_window_size": 5},
    "window_pair_causal": {"local_window_size": (9, 0), "is_causal": True},
    "lengths": {"query_seq_lengths": np.array([30, 40], np.int32),
                "key_value_seq_lengths": np.array([56, 21], np.int32)},
    "bias_per_head": {"bias": (1, N, T, S)},
    "mask_per_batch": {"mask": (B, 1, T, S)},
    "mask_per_head_window": {"mask": (1, N, T, S), "local_window_size": (6, 4)},
    # A 2-D mask (leading axes added, as jax.nn does) with every other argument.
    "everything": {"bias": (B, 1, 1, S), "mask": (T, S), "is_causal": True, "local_window_size": (20, 0),
                   "query_seq_lengths": np.array([40, 25], np.int32),
                   "key_value_seq_lengths": np.array([33, 56], np.int32)},
}


def _arrays(case, bkey, mkey):
    kw = {k: v for k, v in CASES[case].items() if k not in ("bias", "mask")}
    kw = {k: (jnp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    bias = 0.5 * jax.random.normal(bkey, CASES[case]["bias"]) if "bias" in CASES[case] else None
    mask = jax.random.bernoulli(mkey, 0.8, CASES[case]["mask"]) if "mask" in CASES[case] else None
    return bias, mask, kw


def _compare(case, implementation, dtype=jnp.float32, tol=2e-5):
    q, k, v, do, bkey, mkey = _inputs(dtype)
    bias, mask, kw = _arrays(case, bkey, mkey)
    ok = _allowed(mask, kw.get("is_causal", False), kw.get("local_window_size"), kw.get("query_seq_lengths"),
                  kw.get("key_value_seq_lengths"))
    has_key = ok.any(-1).transpose(0, 2, 1)[..., None]  # (B, T, N, 1)

    def loss(fn, q, k, v, bias):
        out = fn(q, k, v, bias, mask, **kw)
        return jnp.sum(jnp.where(has_key, out.astype(jnp.float32) * do, 0.0)), out

    def ours(q, k, v, bias, mask, **kw):
        return flexjax.dot_product_attention(q, k, v, bias, mask, implementation=implementation, **kw)

    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
    (_, got), g_got = jax.value_and_grad(lambda *a: loss(ours, *a), argnums, has_aux=True)(q, k, v, bias)
    (_, ref), g_ref = jax.value_and_grad(lambda *a: loss(jax.nn.dot_product_attention, *a), argnums,
                                         has_aux=True)(q, k, v, bias)
    scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32))))
    keep = lambda x: np.where(has_key, np.asarray(x, np.float32), 0)  # noqa: E731
    np.testing.assert_allclose(keep(got), keep(ref), atol=tol * scale, rtol=0, err_msg=f"{case} out")
    assert not np.any(np.asarray(got)[~np.broadcast_to(np.asarray(has_key), got.shape)]), "rows without a key are 0"
    for name, a, b in zip("qkv" + "b", g_got, g_ref):
        s = float(jnp.max(jnp.abs(b.astype(jnp.float32)))) or 1.0
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol * s, rtol=0,
                                   err_msg=f"{case} d{name}")


# bias_per_head in make test-all (make test's budget); test_matches_jax_nn_on_reference[bias_per_head] runs it.
# everything in make test-extra (make test's budget); the other cases run in make test.
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "bias_per_head"
                                  else pytest.param(c, marks=pytest.mark.ci_extra) if c == "everything" else c
                                  for c in sorted(CASES)])
def test_matches_jax_nn_on_xla(case):
    _compare(case, "xla")


@pytest.mark.parametrize("case", ["everything", "bias_per_head", "lengths"])
def test_matches_jax_nn_on_reference(case):
    _compare(case, "reference")


@pytest.mark.parametrize("case", ["everything", pytest.param("mask_per_head_window", marks=pytest.mark.ci_extra)])
def test_matches_jax_nn_on_pallas_interpreted(case):
    _compare(case, "pallas")


def test_bfloat16_and_automatic_backend():
    _compare("everything", None, jnp.bfloat16, tol=3e-2)


def test_unbatched_inputs_and_residual():
    q, k, v, _, _, _ = _inputs(unbatched=True)
    out, res = flexjax.dot_product_attention(q, k, v, is_causal=True, return_residual=True)
    ref, ref_res = jax.nn.dot_product_attention(q, k, v, is_causal=True, return_residual=True)
    assert out.shape == q.shape and res.shape == (T, N)
    np.testing.assert_allclose(out, ref, atol=2e-5)
    np.testing.assert_allclose(res, ref_res, atol=2e-5)


def test_traced_mask_bias_and_lengths_under_jit():
    q, k, v, _, bkey, mkey = _inputs()
    bias, mask, kw = _arrays("everything", bkey, mkey)
    ok = _allowed(mask, True, kw["local_window_size"], kw["query_seq_lengths"], kw["key_value_seq_lengths"])
    has_key = ok.any(-1).transpose(0, 2, 1)[..., None]

    @jax.jit
    def run(q, k, v, bias, mask, q_len, kv_len):
        return flexjax.dot_product_attention(q, k, v, bias, mask, is_causal=True, local_window_size=(20, 0),
                                             query_seq_lengths=q_len, key_value_seq_lengths=kv_len)

    got = run(q, k, v, bias, mask, kw["query_seq_lengths"], kw["key_value_seq_lengths"])
    ref = jax.nn.dot_product_attention(q, k, v, bias, mask, **kw)
    np.testing.assert_allclose(np.where(has_key, got, 0), np.where(has_key, ref, 0), atol=2e-5)


def test_bad_arguments_name_themselves():
    q, k, v, _, _, _ = _inputs()
    call = flexjax.dot_product_attention
    with pytest.raises(ValueError, match="implementation.*'cudnn'"):
        call(q, k, v, implementation="cudnn")
    with pytest.raises(TypeError, match="mask must be a boolean"):
        call(q, k, v, mask=jnp.ones((T, S), jnp.int32))
    with pytest.raises(ValueError, match=r"bias must broadcast to .*\(2, 4, 40, 56\)"):
        call(q, k, v, bias=jnp.ones((3, T, S)))
    with pytest.raises(ValueError, match=r"query_seq_lengths must be int32 of shape \(batch,\)"):
        call(q, k, v, query_seq_lengths=jnp.ones((3,), jnp.int32))
    with pytest.raises(TypeError, match="local_window_size"):
        call(q, k, v, local_window_size=(1, 2, 3))
    with pytest.raises(ValueError, match="local_window_size must be non-negative"):
        call(q, k, v, local_window_size=-1)
    with pytest.raises(ValueError, match="all be 3-D or all 4-D"):
        call(q[0], k, v)
    with pytest.raises(TypeError, match="is_causal"):
        call(q, k, v, is_causal="yes")


@pytest.mark.triton
@pytest.mark.parametrize("case", ["everything", "bias_per_head"])
def test_matches_jax_nn_on_triton_interpreted(case):
    """Under Triton's interpreter (make test-compile's venv: triton and torch)."""
    pytest.importorskip("triton")
    pytest.importorskip("torch")
    _compare(case, "triton")
