"""Quantized paged caches: int8 / float8_e4m3fn pools with float32 scales, dequantized as tiles load.

Against flex_attention on the dequantized pool (what the kernels must compute, up to
float32 rounding) and against the float pool (the quantization error, within the bound
docs/decoding.md states: |out - out_float| <= eps_v + max|v| (exp(2 delta) - 1), delta =
scale * max_row ||q||_1 * eps_k, eps the largest element error of the dequantized pools).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flexjax
from flexjax import masks, mods, paged

HQ, HKV, D, PS, MAX_PAGES, NUM_PAGES = 8, 2, 32, 16, 6, 24
LENGTHS = np.array([40, 17, 90], np.int32)


def _setup(sq=1, dtype=jnp.float32, seed=0):
    table = jnp.asarray(paged.page_table_for(LENGTHS, PS, MAX_PAGES, num_pages=NUM_PAGES, seed=seed))
    ks = jax.random.split(jax.random.key(seed), 3)
    k = jax.random.normal(ks[0], (NUM_PAGES, PS, HKV, D))
    v = jax.random.normal(ks[1], (NUM_PAGES, PS, HKV, D))
    q = jax.random.normal(ks[2], (len(LENGTHS), sq, HQ, D)).astype(dtype)
    return table, k, v, q


def _no_cpu_kernel(monkeypatch):
    from flexjax.backends.xla import cpu
    monkeypatch.setattr(cpu, "reason", lambda *a, **k: "switched off by the test")


def _bound(q, k, v, kd, vd, scale):
    """The stated bound (docs/decoding.md) on |out(quantized) - out(float)| for a Lipschitz-1 score_mod."""
    eps_k = float(jnp.abs(kd - k).max())
    eps_v = float(jnp.abs(vd - v).max())
    delta = scale * float(jnp.abs(q.astype(jnp.float32)).sum(-1).max()) * eps_k
    return eps_v + float(jnp.abs(v).max()) * (np.exp(2 * delta) - 1)


@pytest.mark.parametrize("qdtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("per_page", [True, False])
def test_quantize_roundtrip(qdtype, per_page):
    _, k, _, _ = _setup()
    kq, scale = paged.quantize(k, qdtype, per_page=per_page)
    assert kq.dtype == jnp.dtype(qdtype) and scale.dtype == jnp.float32
    assert scale.shape == ((NUM_PAGES, HKV) if per_page else (HKV,))
    err = jnp.abs(paged.dequantize(kq, scale) - k)
    s = scale[:, None, :, None] if per_page else scale[None, None, :, None]
    if qdtype == "int8":
        assert float((err - s / 2).max()) <= 1e-6  # round to nearest: half a step
    else:  # 3 mantissa bits: 2**-4 relative, or half the smallest subnormal step (2**-10 s)
        assert bool(jnp.all(err <= jnp.maximum(2.0 ** -4 * jnp.abs(k), 2.0 ** -10 * s) + 1e-6))


# (make test's budget: the C++ kernel's int8 by default; the others, and
# test_ragged_and_write_and_attend_quantized, in make test-all.)
@pytest.mark.parametrize("qdtype,per_page,path,sq", [
    ("int8", True, "kernel", 1), pytest.param("int8", False, "xla_ops", 1, marks=pytest.mark.slow),
    pytest.param("float8_e4m3fn", True, "kernel", 1, marks=pytest.mark.slow),
    pytest.param("float8_e4m3fn", True, "xla_ops", 4, marks=pytest.mark.slow),
    pytest.param("int8", True, "pallas", 1, marks=pytest.mark.slow),
    pytest.param("int8", True, "kernel", 40, marks=pytest.mark.slow),
    pytest.param("float8_e4m3fn", False, "pallas", 4, marks=pytest.mark.slow),
])
def test_paged_quantized_matches_dequantized(qdtype, per_page, path, sq, monkeypatch):
    """Every path dequantizes on load: equal to flex_attention over the dequantized pool,
    and within the stated bound of the float pool's result (ALiBi + sliding window)."""
    from flexjax.backends.xla import cpu
    if path == "kernel" and not cpu.usable():
        pytest.skip("no AVX-512 CPU or no C++ compiler")
    if path == "xla_ops":
        _no_cpu_kernel(monkeypatch)
    table, k, v, q = _setup(sq)
    kq, ks = paged.quantize(k, qdtype, per_page=per_page)
    vq, vs = paged.quantize(v, qdtype, per_page=per_page)
    kd, vd = paged.dequantize(kq, ks), paged.dequantize(vq, vs)
    score = mods.alibi(HQ)
    mask = flexjax.and_masks(masks.causal_bottom_right(sq, LENGTHS), masks.sliding_window(48))
    bm = flexjax.create_block_mask(mask, len(LENGTHS), None, sq, MAX_PAGES * PS, block_size=(16, 16))
    backend = "pallas" if path == "pallas" else "xla"
    got, lse = paged.flex_attention(q, kq, vq, table, LENGTHS, score, bm, k_scale=ks, v_scale=vs, backend=backend,
                                    return_lse=True)
    want, want_lse = paged.flex_attention(q, kd, vd, table, LENGTHS, score, bm, backend="xla", return_lse=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=2e-5)
    exact = paged.flex_attention(q, k, v, table, LENGTHS, score, bm, backend="xla")
    err = float(jnp.abs(got - exact).max())
    assert err <= _bound(q, k, v, kd, vd, 1 / np.sqrt(D)), err


@pytest.mark.slow  # (make test's budget: test_ragged_gradients covers the paged backward)
def test_quantized_bfloat16_queries_and_grad():
    """bfloat16 queries over an int8 pool; jax.grad reaches the queries (the pools' codes and
    scales get none)."""
    table, k, v, q = _setup(2, jnp.bfloat16)
    kq, ks = paged.quantize(k, "int8")
    vq, vs = paged.quantize(v, "int8")
    kd, vd = paged.dequantize(kq, ks), paged.dequantize(vq, vs)

    def loss(q, kp, vp, **kw):
        o = paged.flex_attention(q, kp, vp, table, LENGTHS, **kw)
        return jnp.sum(o.astype(jnp.float32) ** 2)

    got = jax.grad(loss)(q, kq, vq, k_scale=ks, v_scale=vs)
    want = jax.grad(loss)(q, kd.astype(jnp.bfloat16), vd.astype(jnp.bfloat16))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=0.05, rtol=0.05)


# (make test's budget: test_write_quantized_prefill_spanning_pages writes per-page scales by default.)
@pytest.mark.parametrize("per_page", [pytest.param(True, marks=pytest.mark.slow),
                                      pytest.param(False, marks=pytest.mark.slow)])
def test_write_quantizes(per_page):
    """paged.write quantizes new tokens: per-head scales clip to their range, per-page scales
    grow to hold a larger token (the page's earlier tokens requantized)."""
    table, k, v, _ = _setup()
    kq, ks = paged.quantize(k, "int8", per_page=per_page)
    vq, vs = paged.quantize(v, "int8", per_page=per_page)
    new = 3.0 * jax.random.normal(jax.random.key(5), (len(LENGTHS), 2, HKV, D))  # larger than the pool's
    pos = jnp.asarray(LENGTHS - 2)
    kq2, vq2, ks2, vs2 = paged.write(kq, vq, table, pos, new, new, k_scale=ks, v_scale=vs)
    assert ks2.shape == ks.shape and kq2.dtype == jnp.int8
    written = paged.gather(kq2, table, ks2)
    float_written = paged.gather(paged.write(paged.dequantize(kq, ks), paged.dequantize(vq, vs), table, pos,
                                             new, new)[0], table)
    for b, n in enumerate(LENGTHS):
        got, want = written[b, n - 2:n], float_written[b, n - 2:n]
        if per_page:  # grown scales hold the new tokens to half a step
            page_scale = ks2[table[b, (n - 2) // PS:(n - 1) // PS + 1]].max()
            assert float(jnp.abs(got - want).max()) <= float(page_scale) / 2 + 1e-6
            # The earlier tokens of the page: requantized once, within a step of the float pool.
            earlier = slice(((n - 2) // PS) * PS, n - 2)
            assert float(jnp.abs(written[b, earlier] - float_written[b, earlier]).max()) <= float(page_scale) + 1e-6
        else:  # fixed scales: clipped to +-127 steps
            np.testing.assert_allclose(np.asarray(got), np.asarray(jnp.clip(want, -127 * ks[None, :, None],
                                                                           127 * ks[None, :, None])),
                                       atol=float(ks.max()) / 2 + 1e-6)
    if per_page:
        assert bool(jnp.any(ks2 > ks))


@pytest.mark.slow  # (make test's budget: the int8 kernel path and quantized writes have default tests)
def test_ragged_and_write_and_attend_quantized():
    """The ragged call and the fused write over int8 pools with per-page scales equal the
    same calls on the dequantized pools."""
    table, k, v, _ = _setup()
    kq, ks = paged.quantize(k, "int8")
    vq, vs = paged.quantize(v, "int8")
    q_lens = np.array([5, 1, 1], np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = jax.random.normal(jax.random.key(9), (int(cu[-1]), HQ, D))
    got = paged.flex_attention_ragged(q, kq, vq, table, LENGTHS, cu, k_scale=ks, v_scale=vs)
    want = paged.flex_attention_ragged(q, paged.dequantize(kq, ks), paged.dequantize(vq, vs), table, LENGTHS, cu)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)
    kn = jax.random.normal(jax.random.key(10), (int(cu[-1]), HKV, D))
    out, kq2, vq2, ks2, vs2 = jax.jit(paged.write_and_attend)(q, kn, kn, kq, vq, table, LENGTHS, cu, k_scale=ks,
                                                               v_scale=vs)
    want = paged.flex_attention_ragged(q, paged.dequantize(kq2, ks2), paged.dequantize(vq2, vs2), table, LENGTHS, cu)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-6)


def test_quantized_bad_input():
    table, k, v, q = _setup()
    kq, ks = paged.quantize(k, "int8")
    with pytest.raises(ValueError, match="need k_scale"):
        paged.flex_attention(q, kq, kq, table, LENGTHS)
    with pytest.raises(ValueError, match="pass no scales"):
        paged.flex_attention(q, k, v, table, LENGTHS, k_scale=ks, v_scale=ks)
    with pytest.raises(ValueError, match="k_scale must be"):
        paged.flex_attention(q, kq, kq, table, LENGTHS, k_scale=ks[:3], v_scale=ks)
    with pytest.raises(TypeError, match="must both be quantized"):
        paged.flex_attention(q, kq, v, table, LENGTHS, k_scale=ks, v_scale=ks)
    with pytest.raises(ValueError, match="dtype must be one of"):
        paged.quantize(k, "int4")


@pytest.mark.ci_extra  # (make test's 5-minute budget: 4-8 s here; make test reached 5:05)
def test_write_quantized_prefill_spanning_pages():
    """A prefill written into an int8 pool with per-page scales: 37 tokens from the middle of
    a page on (3 pages), larger than the pool's values: every page written gets a scale that
    holds its tokens, and its earlier tokens are requantized once (within a step)."""
    table, k, v, _ = _setup()
    kq, ks = paged.quantize(k, "int8")
    new = 4.0 * jax.random.normal(jax.random.key(6), (1, 37, HKV, D))
    pos = jnp.asarray([7])
    kq2, _, ks2, _ = jax.jit(lambda *a: paged.write(*a, k_scale=ks, v_scale=ks))(kq, kq, table[:1], pos, new, new)
    got = paged.gather(kq2, table[:1], ks2)[0]
    want = paged.gather(paged.write(paged.dequantize(kq, ks), paged.dequantize(kq, ks), table[:1], pos, new,
                                    new)[0], table[:1])[0]
    pages = table[0, :3]
    for j, p in enumerate(pages):  # each page's scale holds its new tokens
        lo, hi = max(7, 16 * j), min(44, 16 * (j + 1))
        assert float(ks2[p].min()) >= float(jnp.abs(new[0, lo - 7:hi - 7]).max(axis=(0, 2)).min()) / 127 - 1e-6
    step = ks2[pages].max()
    assert float(jnp.abs(got[7:44] - want[7:44]).max()) <= float(step) / 2 + 1e-6
    assert float(jnp.abs(got[:7] - want[:7]).max()) <= float(step) + 1e-6
