"""Sinks, fused dropout, max_scores and forward-mode AD (issue 14) against dense reimplementations.

The dense side is written here in plain jnp (not the reference backend), so ``jax.jvp`` and
``jax.grad`` of it are JAX's own derivatives, independent of flexjax's custom_jvp.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from targets import TARGETS, marks_of, params

import flexjax
from flexjax import masks

B, S, HQ, HKV, D = 2, 80, 4, 2, 16
SLOW = os.environ.get("FLEXJAX_HYPOTHESIS") == "all"  # set by `make test-all`
BLOCK = 32
PALLAS = {"backend": "pallas"}


def _inputs(seed=0, s=S):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, s, HQ, D), jnp.float32)
    k = jax.random.normal(ks[1], (B, s, HKV, D), jnp.float32)
    v = jax.random.normal(ks[2], (B, s, HKV, D), jnp.float32)
    table = 0.3 * jax.random.normal(ks[3], (HQ, 2 * s), jnp.float32)
    return q, k, v, table


def _bias(table, s=S):
    def relative(score, b, h, q_idx, kv_idx):
        return score + table[h, kv_idx - q_idx + s]

    return relative


def _prefix_causal(b, h, q_idx, kv_idx):
    # Row 0..9 of batch 1 see no key at all: fully masked rows.
    return (q_idx >= kv_idx) & ((b == 0) | (q_idx >= 10))


def _dense(q, k, v, table, *, sinks=None, keep=None, rate=0.0, mask_mod=_prefix_causal):
    """out, lse, max_scores by dense jnp math."""
    g = HQ // HKV
    kf, vf = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kf, precision="highest") / np.sqrt(D)
    qi, ki = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
    s = s + table[jnp.arange(HQ)[:, None, None], ki - qi + q.shape[1]][None]
    ok = mask_mod(jnp.arange(B)[:, None, None, None], jnp.arange(HQ)[None, :, None, None], qi, ki)
    s = jnp.where(ok, s, -jnp.inf)
    max_scores = s.max(-1)
    logits = s
    if sinks is not None:
        per_head = sinks.reshape(HQ, -1)
        extra = jnp.broadcast_to(per_head[None, :, None, :], s.shape[:3] + per_head.shape[1:])
        logits = jnp.concatenate([s, extra], axis=-1)
    m = jax.lax.stop_gradient(jnp.max(logits, -1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(logits - m)
    l = e.sum(-1, keepdims=True)
    p = (e / jnp.where(l > 0, l, 1.0))[..., : k.shape[1]]
    if keep is not None:
        p = jnp.where(keep, p / (1 - rate), 0.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, vf, precision="highest")
    lse = jnp.where(l[..., 0] > 0, m[..., 0] + jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1.0)), -jnp.inf)
    return out, lse, max_scores


@functools.cache
def _block_mask(s=S, block=BLOCK):
    # Cached across tests, and first called inside a jit by some of them: built as constants
    # so no trace's values outlive it.
    with jax.ensure_compile_time_eval():
        return flexjax.create_block_mask(_prefix_causal, B, None, s, s, block_size=block)


def _flex(q, k, v, table, backend_kw, **kw):
    """flex_attention with the relative bias and prefix-causal mask, under jit (op-by-op eager
    dispatch of the blockwise loops costs several times the compile)."""
    kw = {**backend_kw, **kw}
    arrays = {n: x for n, x in kw.items() if hasattr(x, "shape")}
    static = tuple(sorted((n, tuple(sorted(x.items())) if isinstance(x, dict) else x)
                          for n, x in kw.items() if n not in arrays))
    return _jit_flex(q, k, v, table, _block_mask(q.shape[1]), arrays, static)


@functools.partial(jax.jit, static_argnames="static")
def _jit_flex(q, k, v, table, block_mask, arrays, static):
    kw = {n: dict(x) if n == "kernel_options" else x for n, x in static}
    return flexjax.flex_attention(q, k, v, _bias(table, q.shape[1]), block_mask, **kw, **arrays)


def _close(a, b, tol=2e-5):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


# The registry's targets that run these checks (tests/targets.py: ``training``); the interpreted pallas
# target in make test-all (make test's budget), triton's under its marker (make test-compile).
TRAINING = params(select=lambda t: t.training, slow=lambda t: t.training_cost == "interpreted")


# -- sinks -------------------------------------------------------------------------------

# (make test's budget: xla-one_sink in make test-extra, the others in make test-all.)
@pytest.mark.parametrize("backend_kw, n_sinks", [
    pytest.param({"backend": "xla"}, None, id="xla-one_sink", marks=pytest.mark.ci_extra),
    pytest.param(PALLAS, 2, id="pallas-two_sinks", marks=pytest.mark.slow),
    pytest.param({"backend": "xla"}, 2, id="xla-two_sinks", marks=pytest.mark.slow),
    pytest.param(PALLAS, None, id="pallas-one_sink", marks=pytest.mark.slow),
    *[pytest.param(t.kw(), None, id=f"{t.id}-one_sink", marks=marks_of(t)) for t in TARGETS
      if t.training and t.training_cost == "compiled"],
])
def test_sinks_forward_and_grads(backend_kw, n_sinks):
    q, k, v, table = _inputs()
    sinks = jnp.array([0.5, -1.0, 2.0, 0.0]) if n_sinks is None else jnp.arange(8.0).reshape(4, 2) / 4 - 1

    def loss(f, q, k, v, table, sinks):
        out, lse = f(q, k, v, table, sinks)
        return (out ** 2).sum() + (jnp.where(jnp.isfinite(lse), lse, 0.0) * 0.1).sum()

    flex = lambda q, k, v, t, s: _flex(q, k, v, t, backend_kw, sinks=s, return_lse=True)  # noqa: E731
    dense = jax.jit(lambda q, k, v, t, s: _dense(q, k, v, t, sinks=s)[:2])
    (out, lse), (out_r, lse_r) = flex(q, k, v, table, sinks), dense(q, k, v, table, sinks)
    _close(out, out_r)
    _close(lse, lse_r)
    # Batch 1's first rows see no key: output 0, lse = logsumexp(sinks).
    np.testing.assert_array_equal(np.asarray(out[1, :10]), 0.0)
    _close(lse[1, :, 0], jax.nn.logsumexp(sinks.reshape(HQ, -1), axis=-1))
    grads = jax.grad(functools.partial(loss, flex), argnums=(0, 1, 2, 3, 4))(q, k, v, table, sinks)
    grads_r = jax.jit(jax.grad(functools.partial(loss, dense), argnums=(0, 1, 2, 3, 4)))(q, k, v, table, sinks)
    for g, g_r in zip(grads, grads_r):
        _close(g, g_r, 1e-4)


def test_sinks_bad_shape_names_the_argument():
    q, k, v, table = _inputs()
    with pytest.raises(ValueError, match="sinks must have shape"):
        flexjax.flex_attention(q, k, v, sinks=jnp.zeros((3,)))
    with pytest.raises(TypeError, match="sinks must be a float array"):
        flexjax.flex_attention(q, k, v, sinks=jnp.zeros((HQ,), jnp.int32))


# -- dropout -----------------------------------------------------------------------------

def test_dropout_mask_keep_rate_and_keys():
    m = np.asarray(flexjax.dropout_mask(jax.random.key(0), 0.25, 2, 3, 256, 512))
    assert m.shape == (2, 3, 256, 512) and m.dtype == bool
    n = m.size
    # Binomial: 5 standard deviations.
    assert abs(m.mean() - 0.75) < 5 * np.sqrt(0.75 * 0.25 / n)
    for axis in (2, 3):
        means = m.mean(axis=axis)
        assert np.abs(means - 0.75).max() < 5 * np.sqrt(0.75 * 0.25 / m.shape[axis])
    other = np.asarray(flexjax.dropout_mask(jax.random.key(1), 0.25, 2, 3, 256, 512))
    # Independent masks agree on 0.75^2 + 0.25^2 of the pairs.
    assert abs((m == other).mean() - 0.625) < 0.01
    assert (m[0] != m[1]).any() and (m[:, 0] != m[:, 1]).any()


# make test-all (make test's budget); conformance.py's test_dropout_matches_dense[xla-causal] runs by default.
@pytest.mark.parametrize("rate", [pytest.param(0.1, marks=pytest.mark.slow), pytest.param(0.5, marks=pytest.mark.slow)])
def test_dropout_matches_dense_with_its_mask(rate):
    q, k, v, table = _inputs(1)
    rng = jax.random.key(7)
    keep = flexjax.dropout_mask(rng, rate, B, HQ, S, S)

    def loss(f, q, k, v, table):
        return (f(q, k, v, table) ** 2).sum()

    flex = lambda q, k, v, t: _flex(q, k, v, t, {"backend": "xla"}, dropout_rate=rate, dropout_rng=rng)  # noqa: E731
    dense = jax.jit(lambda q, k, v, t: _dense(q, k, v, t, keep=keep, rate=rate)[0])
    out = flex(q, k, v, table)
    assert np.isfinite(np.asarray(out)).all()
    _close(out, dense(q, k, v, table))
    out_lse = _flex(q, k, v, table, {"backend": "xla"}, dropout_rate=rate, dropout_rng=rng, return_lse=True)[1]
    _close(out_lse, jax.jit(_dense)(q, k, v, table)[1])  # lse of the undropped probabilities
    grads = jax.grad(functools.partial(loss, flex), argnums=(0, 1, 2, 3))(q, k, v, table)
    grads_r = jax.jit(jax.grad(functools.partial(loss, dense), argnums=(0, 1, 2, 3)))(q, k, v, table)
    for g, g_r in zip(grads, grads_r):
        assert np.isfinite(np.asarray(g)).all()
        _close(g, g_r, 1e-4)


@pytest.mark.ci_extra  # (make test-extra since make test reached 4:55; cheaper siblings run there)
def test_dropout_is_the_same_for_every_tile_and_backend():
    q, k, v, table = _inputs(2)
    rng = jax.random.key(3)
    run = lambda **kw: _flex(q, k, v, table, kw, dropout_rate=0.3, dropout_rng=rng)  # noqa: E731
    base = run(backend="xla")
    _close(run(backend="xla", kernel_options={"block_q": 64, "block_kv": 64}), base)
    _close(run(backend="reference"), base)
    _close(run(backend="pallas"), base)


@pytest.mark.ci_extra  # (make test's budget)
def test_dropout_rate_zero_is_bitwise_the_plain_path_and_keys_differ():
    q, k, v, table = _inputs(3)
    plain = _flex(q, k, v, table, {"backend": "xla"})
    zero = _flex(q, k, v, table, {"backend": "xla"}, dropout_rate=0.0, dropout_rng=jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(zero))
    a = _flex(q, k, v, table, {"backend": "xla"}, dropout_rate=0.2, dropout_rng=jax.random.key(1))
    b = _flex(q, k, v, table, {"backend": "xla"}, dropout_rate=0.2, dropout_rng=jax.random.key(2))
    assert not np.allclose(np.asarray(a), np.asarray(b))
    # Under jit with a traced key: the same result, and no recompilation per key.
    f = jax.jit(lambda key: _flex(q, k, v, table, {"backend": "xla"}, dropout_rate=0.2, dropout_rng=key))
    _close(f(jax.random.key(1)), a)
    f(jax.random.key(5))
    assert f._cache_size() == 1


def test_dropout_argument_errors():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="dropout_rng"):
        flexjax.flex_attention(q, k, v, dropout_rate=0.1)
    with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\)"):
        flexjax.flex_attention(q, k, v, dropout_rate=1.0, dropout_rng=jax.random.key(0))
    with pytest.raises(TypeError, match="dropout_rng must be a JAX PRNG key"):
        flexjax.flex_attention(q, k, v, dropout_rate=0.1, dropout_rng=jnp.zeros((3, 2)))


# -- auxiliary outputs -------------------------------------------------------------------

# (make test checks pallas' lse aux in test_paged.py's test_sinks_and_aux_lse[pallas].)
@pytest.mark.parametrize("target", TRAINING)
def test_max_scores_and_lse_aux(target):
    backend_kw = target.kw()
    q, k, v, table = _inputs(4)
    out, aux = _flex(q, k, v, table, backend_kw, return_aux=flexjax.AuxRequest(lse=True, max_scores=True))
    out_r, lse_r, max_r = _dense(q, k, v, table)
    _close(out, out_r)
    _close(aux.lse, lse_r)
    _close(aux.max_scores, max_r)
    assert aux.max_scores.dtype == jnp.float32 and aux.max_scores.shape == (B, HQ, S)
    assert np.isneginf(np.asarray(aux.max_scores[1, :, :10])).all()
    _, only_max = _flex(q, k, v, table, backend_kw, return_aux=flexjax.AuxRequest(max_scores=True))
    assert only_max.lse is None
    _close(only_max.max_scores, max_r)


def test_return_aux_errors():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="not both"):
        flexjax.flex_attention(q, k, v, return_lse=True, return_aux=flexjax.AuxRequest(lse=True))
    with pytest.raises(TypeError, match="AuxRequest"):
        flexjax.flex_attention(q, k, v, return_aux={"lse": True})


# -- forward-mode AD ---------------------------------------------------------------------

@pytest.mark.parametrize("target", TRAINING)
def test_jvp_matches_dense(target):
    backend_kw = target.kw()
    q, k, v, table = _inputs(5)
    sinks = jnp.array([0.1, -0.5, 1.0, 0.3])
    primals = (q, k, v, table, sinks)
    tangents = tuple(jax.random.normal(key, x.shape) for key, x in zip(jax.random.split(jax.random.key(9), 5), primals))
    flex = lambda q, k, v, t, s: _flex(q, k, v, t, backend_kw, sinks=s, return_lse=True)  # noqa: E731
    dense = jax.jit(lambda q, k, v, t, s: _dense(q, k, v, t, sinks=s)[:2])
    (out, lse), (t_out, t_lse) = jax.jvp(flex, primals, tangents)
    (out_r, lse_r), (t_out_r, t_lse_r) = jax.jvp(dense, primals, tangents)
    _close(out, out_r)
    _close(t_out, t_out_r, 1e-4)
    finite = np.isfinite(np.asarray(lse_r))
    _close(np.asarray(t_lse)[finite], np.asarray(t_lse_r)[finite], 1e-4)
    # One input at a time (the others' tangents are symbolic zeros), through linearize: q and
    # the table here, every input under `make test-all`.
    for n in range(5) if SLOW else (0, 3):
        f1 = lambda x: flex(*primals[:n], x, *primals[n + 1:])[0]  # noqa: E731
        d1 = lambda x: dense(*primals[:n], x, *primals[n + 1:])[0]  # noqa: E731
        _, lin = jax.linearize(f1, primals[n])
        _close(lin(tangents[n]), jax.jvp(d1, (primals[n],), (tangents[n],))[1], 1e-4)


def _dropout_case():
    """q, the table, and (q, table) -> out with dropout 0.2: flexjax's and the dense one."""
    q, k, v, table = _inputs(6)
    rng = jax.random.key(11)
    keep = flexjax.dropout_mask(rng, 0.2, B, HQ, S, S)
    flex = lambda q, t: _flex(q, k, v, t, {"backend": "xla"}, dropout_rate=0.2, dropout_rng=rng)  # noqa: E731
    dense = jax.jit(lambda q, t: _dense(q, k, v, t, keep=keep, rate=0.2)[0])
    return q, table, flex, dense


@pytest.mark.slow  # make test-all: make test's budget (test_jvp_matches_dense checks the tangent pass, without dropout)
def test_jvp_with_dropout_under_jit_and_vmap():
    q, table, flex, dense = _dropout_case()
    tq, tt = jax.random.normal(jax.random.key(1), q.shape), jax.random.normal(jax.random.key(2), table.shape)
    _close(jax.jit(lambda a, b: jax.jvp(flex, (a, b), (tq, tt))[1])(q, table),
           jax.jvp(dense, (q, table), (tq, tt))[1], 1e-4)
    # vmap over a batch of tangents (jacfwd-style).
    tqs = jnp.stack([tq, -2 * tq])
    batched = jax.vmap(lambda t: jax.jvp(lambda a: flex(a, table), (q,), (t,))[1])(tqs)
    _close(batched[1], -2 * batched[0], 1e-4)


@pytest.mark.slow
def test_grad_under_jit_and_vmap_with_dropout():
    """jax.grad is the hand-written backward, under jit and vmap (per-example gradients)."""
    q, table, flex, dense = _dropout_case()
    g = jax.jit(jax.grad(lambda a: (flex(a, table) ** 2).sum()))(q)
    _close(g, jax.grad(lambda a: (dense(a, table) ** 2).sum())(q), 1e-4)
    per_example = jax.vmap(jax.grad(lambda a, t: (flex(a, t) ** 2).sum()), in_axes=(0, None))(q[None], table)
    _close(per_example[0], g, 1e-4)


# -- sharding ----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_sinks_with_batch_sharded_inputs_and_clear_errors_for_the_rest():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    q, k, v, table = _inputs(8)
    sinks = jnp.array([0.5, -1.0, 2.0, 0.0])
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))  # noqa: E731
    qs, ks, vs = put(q), put(k), put(v)
    bm = flexjax.create_block_mask(masks.causal, None, None, S, S, block_size=BLOCK)
    with jax.set_mesh(mesh):
        out = jax.jit(lambda a, b, c: flexjax.flex_attention(a, b, c, block_mask=bm, sinks=sinks))(qs, ks, vs)
        with pytest.raises(NotImplementedError, match="dropout_rate > 0 is not supported for sharded"):
            flexjax.flex_attention(qs, ks, vs, block_mask=bm, dropout_rate=0.1, dropout_rng=jax.random.key(0))
    _close(out, flexjax.flex_attention(q, k, v, block_mask=bm, sinks=sinks))
