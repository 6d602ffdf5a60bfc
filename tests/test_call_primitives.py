"""Mods wrapped in call primitives (jit, checkpoint, remat, custom_jvp, custom_vjp): every jaxpr
walker enters them the same way (``flexjax/_jaxpr.py``), so a wrapper changes nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from targets import budgeted

import flexjax
from flexjax import _analysis, _jaxpr, _modcompiler
from flexjax._trace import trace_mod
from flexjax.backends.triton import _codegen as triton_codegen
from flexjax.backends.xla.cpu import _codegen as cpu_codegen
from flexjax.sharding import _attention as sharded


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@jax.custom_jvp
def _ge(q_idx, kv_idx):
    return q_idx >= kv_idx


_ge.defjvp(lambda primals, tangents: (_ge(*primals), jnp.zeros((), jax.dtypes.float0)))


@jax.custom_vjp
def _ge_vjp(q_idx, kv_idx):
    return q_idx >= kv_idx


_ge_vjp.defvjp(lambda q, k: (_ge_vjp(q, k), None), lambda res, g: (None, None))


def _named(fn, name):
    fn.__name__ = name
    return fn


WRAPPERS = {
    "plain": lambda f: f,
    "jit": jax.jit,
    "checkpoint": jax.checkpoint,
    "remat_policy": lambda f: jax.remat(f, policy=jax.checkpoint_policies.nothing_saveable),
    "nested": lambda f: jax.checkpoint(jax.jit(jax.checkpoint(f))),
}
MASKS = {name: _named(wrap(_causal), f"causal_{name}") for name, wrap in WRAPPERS.items()}
MASKS["custom_jvp"] = _named(lambda b, h, q_idx, kv_idx: _ge(q_idx, kv_idx), "causal_custom_jvp")
MASKS["custom_vjp"] = _named(lambda b, h, q_idx, kv_idx: _ge_vjp(q_idx, kv_idx), "causal_custom_vjp")


@pytest.mark.parametrize("name", list(MASKS))
def test_liveness_enters_calls(name):
    """A wrapped causal mask reads q_idx and kv_idx only, so B = H = None is allowed."""
    traced = trace_mod(MASKS[name], "mask", arg_name="mask_mod")
    assert traced.uses == frozenset({"q_idx", "kv_idx"})
    bm = flexjax.create_block_mask(MASKS[name], None, None, 256, 256, block_size=64)
    ref = flexjax.create_block_mask(_causal, None, None, 256, 256, block_size=64)
    np.testing.assert_array_equal(bm.to_dense(), ref.to_dense())


def test_dead_reads_inside_calls_do_not_count():
    def reads_b_dead(b, h, q_idx, kv_idx):
        unused = jax.jit(lambda b: b * 2)(b)  # noqa: F841
        return jax.checkpoint(lambda q, k, b: (q >= k) | (b < 0) & False)(q_idx, kv_idx, b)

    assert trace_mod(reads_b_dead, "mask", arg_name="mask_mod").uses <= frozenset({"b", "q_idx", "kv_idx"})
    assert "h" not in trace_mod(reads_b_dead, "mask", arg_name="mask_mod").uses


@pytest.mark.parametrize("name", list(MASKS))
def test_analysis_enters_calls(name):
    """The interval analysis decides the same tiles through a wrapper as without one (no
    tile left to pair-by-pair evaluation that the plain mask decides)."""
    lo = jnp.arange(0, 1024, 64, dtype=jnp.int32)
    q_lo, kv_lo = lo[:, None], lo[None, :]
    zero = jnp.int32(0)

    def classify(mask_mod):
        traced = trace_mod(mask_mod, "mask", arg_name="mask_mod")
        return _analysis.classify(traced.static(), traced.consts, zero, zero, q_lo, q_lo + 63, kv_lo, kv_lo + 63)

    full, empty = classify(MASKS[name])
    ref_full, ref_empty = classify(_causal)
    np.testing.assert_array_equal(full, ref_full)
    np.testing.assert_array_equal(empty, ref_empty)
    assert int(full.sum()) + int(empty.sum()) == 16 * 16 - 16  # only the diagonal tiles are partial


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in ("nested", "custom_vjp") else pytest.mark.slow)
                                  for n in MASKS])
def test_code_generators_take_wrapped_mods(name):
    traced = trace_mod(MASKS[name], "mask", arg_name="mask_mod")
    for target in _modcompiler.TARGETS:
        cm = _modcompiler.compile_mod(traced.static(), target)
        if target == "triton":
            triton_codegen.generate(cm, prefix="mask")
    cpu_codegen.generate(traced.static(), ())


def test_sharding_inliner_enters_transparent_calls():
    """jit and checkpoint bodies are evaluated in place (they would switch meshes inside a
    shard_map); custom_jvp stays a call, re-traced, so its rule is kept."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return jax.checkpoint(lambda s: jax.nn.relu(jax.jit(jnp.tanh)(s)))(score) + jnp.where(q_idx > kv_idx, 1.0, 0.0)

    traced = trace_mod(score_mod, "score", arg_name="score_mod").static()
    args = [jax.ShapeDtypeStruct((), jnp.float32)] + [jax.ShapeDtypeStruct((), jnp.int32)] * 4
    jaxpr = jax.make_jaxpr(lambda *a: sharded._call(traced, (), *a))(*args).jaxpr
    prims = {e.primitive.name for e in jaxpr.eqns}
    assert not prims & _jaxpr.TRANSPARENT_CALLS, prims
    assert "custom_jvp_call" in prims
    vals = (jnp.float32(0.3), jnp.int32(0), jnp.int32(0), jnp.int32(3), jnp.int32(1))
    np.testing.assert_allclose(sharded._call(traced, (), *vals), score_mod(*vals), rtol=1e-6)


# (every float32 target; xla in make test-all: make test's budget)
@pytest.mark.parametrize("target", budgeted(lambda t: t.backend != "reference" and t.dtype == jnp.float32,
                                            default=("pallas", "pallas_tpu")))
def test_checkpointed_mods_match_the_reference(target):
    """A checkpointed mask_mod and score_mod, forward and backward."""
    S = 96
    key = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(kk, (1, S, 2, 16)) for kk in key)
    bm = flexjax.create_block_mask(MASKS["checkpoint"], None, None, S, S, block_size=32)
    slope = jnp.asarray([0.5, -0.25])

    def loss(q, k, v, slope, backend, options):
        def score_mod(s, b, h, q_idx, kv_idx):
            return jax.checkpoint(lambda s: s + slope[h] * (kv_idx - q_idx))(s)

        out = flexjax.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, backend=backend,
                                     kernel_options=options)
        return jnp.sum(out * out)

    got = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, slope, target.backend, target.options)
    want = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, slope, "reference", None)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


_TABLE = jnp.linspace(-1.0, 1.0, 64)
_IDS = jnp.linspace(0.0, 1.0, 40)


@jax.jit
def _jitted_bias(q_idx, kv_idx):
    return _TABLE[jnp.clip(q_idx - kv_idx + 31, 0, 63)]


@jax.checkpoint
def _checkpointed_row(q_idx):
    return _IDS[q_idx]


def _bias_in_calls(score, b, h, q_idx, kv_idx):
    """Helpers in jit / checkpoint that close over tables of their own (nested consts)."""
    return score + _jitted_bias(q_idx, kv_idx) + _checkpointed_row(q_idx)


def _mask_in_call(b, h, q_idx, kv_idx):
    return jax.jit(lambda q, k: _IDS[q] >= _IDS[k])(q_idx, kv_idx)


@pytest.mark.parametrize("backend,options", [pytest.param("xla", None, marks=pytest.mark.slow), ("pallas", None),
                                             pytest.param("pallas", {"target": "tpu", "interpret": True},
                                                          marks=pytest.mark.ci_extra)])
def test_arrays_closed_over_inside_calls(backend, options):
    """A nested call's own arrays reach the kernels as constants (they used to be refused)."""
    key = jax.random.split(jax.random.PRNGKey(1), 3)
    q, k, v = (jax.random.normal(kk, (1, 40, 2, 16)) for kk in key)
    bm = flexjax.create_block_mask(_mask_in_call, None, None, 40, 40, block_size=16)

    def loss(q, backend, options):
        out = flexjax.flex_attention(q, k, v, score_mod=_bias_in_calls, block_mask=bm, backend=backend,
                                     kernel_options=options)
        return jnp.sum(out * out)

    got = jax.value_and_grad(loss)(q, backend, options)
    want = jax.value_and_grad(loss)(q, "reference", None)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
