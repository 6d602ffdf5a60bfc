"""The conformance suite: what every backend must do, run once per backend against the dense reference.

Each backend (and each of its templates that runs on a CPU host) is a ``Target`` with
capability flags in the registry (``tests/targets.py``); every test here is parametrised over it
and skips what a target declares it cannot do. Per-backend files (test_xla.py, test_pallas.py, test_triton_*.py)
keep only what is specific to one backend (its tiles, templates, heuristics, limits).

pytest collects this file directly (``python_files`` in pyproject.toml). The triton target
needs Triton and torch (its interpreter): it runs under ``make test-compile`` (marker
``triton``) and is skipped by ``make test``. A new backend adds one ``Target`` line to tests/targets.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from catalog import SHAPES, check_case, loss_and_grads, run_case
from checks import RTOL, assert_close
from targets import params as _params

import flexjax
from flexjax.backends import available_backends, get_backend
from flexjax.backends._contract import Backend

# -- the contract ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", available_backends())
def test_backend_implements_the_protocol(name):
    backend = get_backend(name)
    assert isinstance(backend, Backend), f"{name} lacks part of backends._contract.Backend"
    assert not hasattr(backend, "row_stats") and not hasattr(backend, "unsupported_reason")


@pytest.mark.parametrize("target", _params())
def test_plan_answers_without_raising(target):
    """plan answers a Plan or a sentence for any call, a crashing mod included; invalid option
    values are validate_options' ValueError, which plan raises."""
    from flexjax._spec import prepare
    from flexjax.backends._contract import Plan

    def crashing(score, b, h, q_idx, kv_idx):
        return score + jnp.linalg.inv(jnp.eye(2) * q_idx)[0, 0]  # not a primitive any generator takes

    backend = get_backend(target.backend)
    q = jax.ShapeDtypeStruct((1, 32, 2, target.head_dim or 16), target.dtype)
    call = prepare(q, 32, crashing, None, scale=0.25, kernel_options=target.options, backend=target.backend)
    got = backend.plan(call, q, q, q)
    assert isinstance(got, (str, Plan))
    if target.options_checked:
        bad = call._replace(spec=dataclasses.replace(call.spec, kernel_options=(("block_q", -3),)))
        with pytest.raises(ValueError, match="block_q"):
            backend.validate_options(bad.spec)
        with pytest.raises(ValueError, match="block_q"):
            backend.plan(bad, q, q, q)


@pytest.mark.parametrize("target", _params())
def test_explain_names_what_runs(target):
    q, k, v, _ = target.inputs(target.shape)
    bm = flexjax.create_block_mask(flexjax.masks.causal, None, None, q.shape[1], k.shape[1], block_size=64)
    report = flexjax.explain(q, k, v, flexjax.mods.soft_cap(20.0), bm, **target.kw())
    assert report.backend == target.backend
    assert report.forward and report.backward
    assert target.backend in str(report)


# -- numerics against the reference ----------------------------------------------------------

def _against_reference(name, attention, q, k, v, do, params, target, rtol=None):
    """The target's (out, lse, gradients) against the reference's, as ``check_case`` compares: float32 with
    float32; 16-bit with the reference on the same rounded inputs in float32 (the truth), allowing the error
    the reference makes in the inputs' dtype."""
    got = loss_and_grads(attention, q, k, v, do, params, **target.kw())
    same = loss_and_grads(attention, q, k, v, do, params, backend="reference")
    truth = same if target.dtype == jnp.float32 else loss_and_grads(
        attention, *(x.astype(jnp.float32) for x in (q, k, v, do)), params, backend="reference")
    assert_close(name, got, truth, same, target.dtype, rtol)


@pytest.mark.parametrize("target,name", _params(values=lambda t: [(c, c) for c in t.cases]))
def test_catalog(target, name):
    """out, lse and the gradients of q, k, v and the captured arrays, in the target's dtype (float32 for all
    but a 16-bit-only backend)."""
    check_case(target.backend, name, target.shape, target.dtype, target.options, 64)


@pytest.mark.parametrize("target,case", _params(values=lambda t: [((d, c), f"{jnp.dtype(d).name}-{c}")
                                                                  for d in t.dtypes for c in t.low_cases]))
def test_low_precision(target, case):
    dtype, name = case
    check_case(target.backend, name, target.shape, dtype, target.options, 64)


@pytest.mark.parametrize("target,shape", _params(select=lambda t: t.backend != "reference",
                                                 values=lambda t: [("mha", "mha"), ("mqa_ragged", "mqa")]))
def test_heads(target, shape):
    """MHA and MQA with ragged lengths (GQA is the default shape)."""
    check_case(target.backend, "causal+soft_cap", target.shape_of(SHAPES[shape]), target.dtype, target.options, 64)


@pytest.mark.parametrize("target,tiles", _params(select=lambda t: bool(t.tiles),
                                                 values=lambda t: [(o, n) for n, o in t.tiles.items() if o]))
def test_tile_options(target, tiles):
    """Compute tiles that split the BlockMask's blocks and tiles that regroup them."""
    options = {**(target.options or {}), **tiles}
    check_case(target.backend, "sliding_window+alibi", target.shape, target.dtype, options, 64)


@pytest.mark.parametrize("target", _params())
def test_fully_masked_rows_are_zero_with_finite_grads(target):
    out, lse, grads = check_case(target.backend, "fully_masked_rows", target.shape_of(SHAPES["mha"]), target.dtype,
                                 target.options)
    assert np.all(np.asarray(out[:, :10]) == 0)
    assert np.all(np.isneginf(np.asarray(lse[:, :, :10])))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("target", _params(select=lambda t: t.backend != "reference",
                                           slow=lambda t: t.id == "pallas_tpu"))
def test_deterministic(target):
    """The same call twice gives the same bits (no atomics in any backward)."""
    name = "prefix_lm+relative_bias" if target.gathers else "sliding_window+alibi"
    shape = target.shape_of(SHAPES["mqa_ragged"])
    a = run_case(target.backend, name, shape, target.dtype, kernel_options=target.options)
    b = run_case(target.backend, name, shape, target.dtype, kernel_options=target.options)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("target", _params())
def test_huge_scores(target):
    """Rows of scores near -1e6: the backward recomputes P from each row's max and sum."""
    q, k, v, do = target.inputs((1, 40, 40, 2, 2, 16, 16))

    def attention(q, k, v, params, **kw):
        return flexjax.flex_attention(q, k, v, lambda s, b, h, qi, ki: s - 1e6 + qi, return_lse=True, **kw)

    _against_reference("huge", attention, q, k, v, do, {}, target)


@pytest.mark.parametrize("target", _params(select=lambda t: t.captured_grads))
def test_captured_row_and_column_grads(target):
    """Float captured arrays read per head, per (b, q) and per (h, kv) get their gradients."""
    q, k, v, do = target.inputs((1, 70, 100, 4, 2, 16, 8))
    B, Sq, Hq = q.shape[:3]
    Skv = k.shape[1]
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    params = {"slope": 1.0 + 0.1 * jax.random.normal(keys[0], (Hq,)),
              "bias_q": jax.random.normal(keys[1], (B, Sq)), "bias_kv": jax.random.normal(keys[2], (Hq, Skv))}
    bm = flexjax.create_block_mask(flexjax.masks.causal, None, None, Sq, Skv, block_size=32)

    def attention(q, k, v, p, **kw):
        def biased(score, b, h, q_idx, kv_idx):
            return score * p["slope"][h] + p["bias_q"][b, q_idx] + jnp.tanh(p["bias_kv"][h, kv_idx])

        return flexjax.flex_attention(q, k, v, biased, bm, return_lse=True, **kw)

    # (16-bit kernels: a per-row gradient sums dS over every key and head, which the kernels form from 16-bit
    # MMAs and the reference in float32; mosaic_gpu's bias_q gradient measured 0.022 off at 70 x 100 and 0.036
    # at 70 x 80 (4 heads, values under 1), against bfloat16's 0.02 budget: 0.05 here)
    _against_reference("rows_cols", attention, q, k, v, do, params, target,
                       None if target.dtype == jnp.float32 else 5e-2)


@pytest.mark.parametrize("target", _params(select=lambda t: t.gathers))
def test_bool_table_mask(target):
    """A mask_mod reading a captured bool array at (q_idx, kv_idx)."""
    q, k, v, do = target.inputs((1, 70, 50, 2, 1, 8, 16))
    Sq, Skv = q.shape[1], k.shape[1]
    table = jax.random.bernoulli(jax.random.PRNGKey(5), 0.7, (Sq, Skv))
    bm = flexjax.create_block_mask(lambda b, h, q_idx, kv_idx: table[q_idx, kv_idx], None, None, Sq, Skv,
                                   block_size=32)

    def attention(q, k, v, params, **kw):
        return flexjax.flex_attention(q, k, v, block_mask=bm, return_lse=True, **kw)

    _against_reference("bool_table", attention, q, k, v, do, {}, target)


@pytest.mark.parametrize("target", _params())
def test_traced_block_mask_under_jit(target):
    """A document mask built inside jit from run-time ids."""
    q, k, v, _ = target.inputs((1, 96, 96, 2, 2, 16, 16))
    S = q.shape[1]

    def attention(kw):
        @jax.jit
        def f(q, k, v, ids):
            bm = flexjax.create_block_mask(flexjax.masks.document(ids), None, None, S, S, block_size=32)
            return flexjax.flex_attention(q, k, v, block_mask=bm, **kw)

        return f

    ids = jnp.asarray(np.searchsorted([20, 70], np.arange(S), side="right"), jnp.int32)
    tol = RTOL[target.dtype]
    np.testing.assert_allclose(np.asarray(attention(target.kw())(q, k, v, ids), np.float32),
                               np.asarray(attention({"backend": "reference"})(q, k, v, ids), np.float32),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("target", _params())
def test_max_and_min_scores(target):
    """AuxRequest(max_scores=True, min_scores=True): each row's max / min of the modified, unmasked scores
    (-inf / +inf on rows with no key) against float64 NumPy; min_scores is not differentiated."""
    B, Sq, Skv, Hq, Hkv, D, _ = target.shape_of(SHAPES["mqa_ragged"])
    q, k, v, _ = target.inputs(SHAPES["mqa_ragged"])
    table = jnp.linspace(-2.0, 3.0, Hq * Skv, dtype=jnp.float32).reshape(Hq, Skv)

    def bias(score, b, h, q_idx, kv_idx):
        return score + table[h, kv_idx]

    def late_causal(b, h, q_idx, kv_idx):  # rows 0..9 see no key
        return (q_idx >= kv_idx) & (q_idx >= 10)

    bm = flexjax.create_block_mask(late_causal, None, None, Sq, Skv, block_size=64)
    want_aux = flexjax.AuxRequest(max_scores=True, min_scores=True)
    out, aux = flexjax.flex_attention(q, k, v, bias, bm, return_aux=want_aux, **target.kw())
    qd, kd = np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), Hq // Hkv, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", qd, kd) / np.sqrt(D) + np.asarray(table, np.float64)[None, :, None, :]
    qi, ki = np.arange(Sq)[:, None], np.arange(Skv)[None, :]
    ok = (qi >= ki) & (qi >= 10)
    for got, want in ((aux.max_scores, np.where(ok, s, -np.inf).max(-1)),
                      (aux.min_scores, np.where(ok, s, np.inf).min(-1))):
        assert got.shape == (B, Hq, Sq) and got.dtype == jnp.float32
        # (16-bit inputs: exact products, float32 sums over D terms)
        tol = 1e-5 if target.dtype == jnp.float32 else 1e-3
        np.testing.assert_allclose(np.asarray(got), want, rtol=tol, atol=tol)
    assert np.isposinf(np.asarray(aux.min_scores[:, :, :10])).all()
    assert aux.lse is None
    g = jax.grad(lambda q: flexjax.flex_attention(q, k, v, bias, bm, return_aux=want_aux, **target.kw())[1]
                 .min_scores.clip(-50.0, 50.0).sum())(q)
    assert not np.asarray(g).any()


# -- dropout (the harness of test_dropout_kernels.py: the backend's forward and backward
# against jax.vjp of the dense math with the same keep mask) -----------------------------------

@pytest.mark.ci_extra  # (make test's budget: dropout is test_dropout_kernels.py's and test_training_features.py's)
@pytest.mark.parametrize("target,name", _params(select=lambda t: t.dropout_kernel,
                                                values=lambda t: [(n, n) for n in ("causal", "causal+relative_bias")
                                                                  if t.gathers or n == "causal"],
                                                slow=lambda t: t.backend == "pallas"))
def test_dropout_matches_dense(target, name):
    from test_dropout_kernels import SHAPE, check

    shape = SHAPE if target.head_dim is None else (*SHAPE[:5], target.head_dim)
    check(get_backend(target.backend), name, target.options, shape=shape, dtype=target.dtype)


@pytest.mark.parametrize("target", _params(select=lambda t: bool(t.tiles.get("split")),
                                           slow=lambda t: t.backend == "pallas"))
def test_dropout_tiles_agree(target):
    """Other tiles (splitting the mask's blocks) regenerate the same keep mask: the same out and grads."""
    from test_dropout_kernels import RATE, case, key_and_mask, run

    backend = get_backend(target.backend)
    make, q, k, v, do, dlse, sc, mc, lists = case("causal+relative_bias")
    seed, _ = key_and_mask(make(RATE), q, k)
    a = run(backend, make(RATE, target.options), q, k, v, do, dlse, sc, mc, lists, seed)
    b = run(backend, make(RATE, {**(target.options or {}), **target.tiles["split"]}), q, k, v, do, dlse, sc, mc,
            lists, seed)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
