"""Fused dropout in the pallas kernels (interpret mode on CPU) against a dense reimplementation.

The dense truth is softmax over the allowed keys, times ``dropout_mask`` / (1 - rate), times
V, differentiated by ``jax.vjp``; the kernels regenerate the same mask tile by tile from the
(b, h, q, kv) hash. Each case checks out, lse, dq, dk, dv and the gradient of a captured
bias table, through the backend's forward_with_residuals / backward (the contract that
flex_attention calls). The GPU template runs by default, the TPU template through
``kernel_options={"target": "tpu", "interpret": True}``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import assert_close
from test_pallas_lowering import MOSAIC_CALL, TRITON_CALL

import flexjax
from flexjax import masks, mods
from flexjax._api import AttentionSpec
from flexjax._dropout import dropout_mask, seed_words
from flexjax._trace import trace_mod
from flexjax.backends import pallas
from flexjax.backends._common import allowed, apply_score_mod
from flexjax.backends._contract import Residuals

TPU_INTERPRET = {"target": "tpu", "interpret": True}
# (B, Sq, Skv, Hq, Hkv, D): GQA, lengths that are not multiples of the block.
SHAPE = (1, 100, 150, 4, 2, 32)
RATE = 0.3
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def case(name, shape=SHAPE, block_size=64, dtype=jnp.float32, seed=0):
    """(spec builder, q, k, v, dO, dlse, score_consts, mask_consts, lists) of a named case.

    "causal": the causal mask alone; "causal+relative_bias": with a learnable table.
    """
    B, Sq, Skv, Hq, Hkv, D = shape
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = jax.random.normal(ks[0], (B, Sq, Hq, D), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, Skv, Hkv, D), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (B, Skv, Hkv, D), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (B, Sq, Hq, D), jnp.float32).astype(dtype)
    dlse = 0.1 * jax.random.normal(ks[4], (B, Hq, Sq), jnp.float32)
    bm = flexjax.create_block_mask(masks.causal, None, None, Sq, Skv, block_size=block_size)
    score, score_consts = None, ()
    if name == "causal+relative_bias":
        table = 0.5 * jax.random.normal(ks[5], (Hq, 2 * max(Sq, Skv) - 1), jnp.float32)
        traced = trace_mod(mods.relative_bias(table), "score", arg_name="score_mod", score_dtype=jnp.float32)
        score, score_consts = traced.static(), tuple(traced.consts)

    def spec(rate, kernel_options=None):
        return AttentionSpec(score=score, mask=bm.mask, scale=1.0 / math.sqrt(D), q_len=Sq, kv_len=Skv,
                             block_size=bm.block_size, kernel_options=tuple(sorted((kernel_options or {}).items())),
                             kv_band=bm.kv_band, dropout_rate=rate)

    lists = bm.tile_lists()
    return spec, q, k, v, do, dlse, score_consts, tuple(bm.mask_consts), lists


def run(backend, spec, q, k, v, do, dlse, score_consts, mask_consts, lists, seed):
    """(out, lse, (dq, dk, dv, d_score_consts)) of ``backend`` with dropout seed ``seed``."""
    grad_consts = tuple(jnp.issubdtype(c.dtype, jnp.inexact) for c in score_consts)

    @jax.jit
    def f(q, k, v, do, dlse, score_consts, mask_consts, lists, seed):
        out, lse, res = backend.forward_with_residuals(spec, q, k, v, score_consts, mask_consts, lists,
                                                       dropout_seed=seed)
        dq, dk, dv, dsc = backend.backward(spec, q, k, v, out, lse, do, dlse, score_consts, mask_consts, lists,
                                           grad_consts, res, dropout_seed=seed)
        return out, lse, (dq, dk, dv, tuple(d for d in dsc if d is not None))

    return f(q, k, v, do, dlse, score_consts, mask_consts, lists, seed)


def dense(spec, q, k, v, do, dlse, score_consts, mask_consts, keep):
    """The truth, float32: out = (softmax(s) * keep / (1 - rate)) V, lse of the undropped row, and
    the vjp with cotangents (dO, dlse)."""
    B, Sq, Hq, _ = q.shape
    G = Hq // k.shape[2]
    rate = spec.dropout_rate
    hi = jax.lax.Precision.HIGHEST
    b = jnp.arange(B, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(Hq, dtype=jnp.int32)[None, :, None, None]
    qi = jnp.arange(Sq, dtype=jnp.int32)[:, None]
    ki = jnp.arange(k.shape[1], dtype=jnp.int32)[None, :]

    def f(q, k, v, score_consts):
        kf, vf = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kf, precision=hi) * spec.scale
        s = apply_score_mod(spec, score_consts, s, b, h, qi, ki)
        s = jnp.where(allowed(spec, mask_consts, b, h, qi, ki, True, True), s, -jnp.inf)
        m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
        p = jnp.exp(s - m)
        l = p.sum(-1, keepdims=True)
        pd = p / l * jnp.where(keep, 1.0 / (1.0 - rate), 0.0) if rate else p / l
        return jnp.einsum("bhqk,bkhd->bqhd", pd, vf, precision=hi), (m + jnp.log(l))[..., 0]

    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    (out, lse), vjp = jax.vjp(f, f32(q), f32(k), f32(v), score_consts)
    dq, dk, dv, dsc = vjp((f32(do), dlse))
    return out, lse, (dq, dk, dv, tuple(dsc))


def key_and_mask(spec, q, k, key=0):
    B, Sq, Hq, _ = q.shape
    rng = jax.random.key(key)
    return seed_words(rng), dropout_mask(rng, spec.dropout_rate, B, Hq, Sq, k.shape[1])


def check(backend, name, kernel_options=None, shape=SHAPE, block_size=64, dtype=jnp.float32, rate=RATE):
    """``backend`` on case ``name`` with dropout against ``dense``; returns the backend's results."""
    make, q, k, v, do, dlse, sc, mc, lists = case(name, shape, block_size, dtype)
    spec = make(rate, kernel_options)
    seed, keep = key_and_mask(spec, q, k)
    got = run(backend, spec, q, k, v, do, dlse, sc, mc, lists, seed)
    truth = dense(spec, q, k, v, do, dlse, sc, mc, keep)
    ref = truth
    if dtype != jnp.float32:
        # The same math on the rounded inputs and in the inputs' dtype: the error budget.
        ref = jax.tree.map(lambda x: x.astype(dtype).astype(jnp.float32), truth)
    assert_close(f"{name}/dropout", got, truth, ref, dtype)
    return got


@pytest.mark.slow
def test_dropout_mha_shape():
    check(pallas, "causal+relative_bias", shape=(2, 64, 64, 2, 2, 16), block_size=32)


@pytest.mark.slow  # `make test-all`; test_training_features checks rate 0 bitwise through flex_attention
def test_rate_zero_is_the_plain_kernel():
    """Rate 0 ignores the seed and traces no hash: bitwise the kernels without dropout."""
    make, q, k, v, do, dlse, sc, mc, lists = case("causal+relative_bias")
    seed, _ = key_and_mask(make(RATE), q, k)
    plain = run(pallas, make(0.0), q, k, v, do, dlse, sc, mc, lists, None)
    seeded = run(pallas, make(0.0), q, k, v, do, dlse, sc, mc, lists, seed)
    for x, y in zip(jax.tree.leaves(plain), jax.tree.leaves(seeded)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    jaxpr = str(jax.make_jaxpr(lambda q: pallas.forward_with_residuals(make(0.0), q, k, v, sc, mc, lists, seed))(q))
    assert "u32" not in jaxpr


@pytest.mark.ci_extra  # (make test-extra: 3-9 s; cheaper siblings run in make test)
def test_residuals():
    """The forward's Residuals are the undropped rows' max and sum: max + log(sum) is lse; an
    empty row (sum 0) has max -inf, and the backward's recompute stats are 0 there."""
    make, q, k, v, do, dlse, sc, mc, lists = case("causal+relative_bias")
    spec = make(RATE)
    seed, _ = key_and_mask(spec, q, k)
    out, lse, res = pallas.forward_with_residuals(spec, q, k, v, sc, mc, lists, dropout_seed=seed)
    assert isinstance(res, Residuals)
    np.testing.assert_allclose(np.asarray(res.row_max + jnp.log(res.row_sum)), np.asarray(lse), rtol=1e-6,
                               atol=1e-6)
    empty = Residuals.from_running(jnp.zeros((1, 1, 2)), jnp.asarray([[[0.0, 2.0]]]))
    np.testing.assert_array_equal(np.asarray(empty.row_max), [[[-np.inf, 0.0]]])
    np.testing.assert_allclose(np.asarray(empty.lse()), [[[-np.inf, np.log(2.0)]]], rtol=1e-6)
    row_max, log_sum = empty.recompute_stats()
    np.testing.assert_array_equal(np.asarray(row_max), [[[0.0, 0.0]]])
    np.testing.assert_allclose(np.asarray(log_sum), [[[0.0, np.log(2.0)]]])


# -- lowering --------------------------------------------------------------------------------

def _abstract_mesh(platform):
    kind = "NVIDIA H100 80GB HBM3" if platform == "cuda" else "TPU v5 lite"
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=1, platform=platform)
    return jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,), abstract_device=device)


@pytest.mark.parametrize("target", ["cuda", "tpu"])
def test_dropout_lowers(target):
    """Forward and both backward kernels with dropout lower for the GPU (Triton) and TPU (Mosaic)."""
    B, S, Hq, Hkv, D = 1, 256, 4, 2, 64
    make, *_, sc, mc, lists = case("causal+relative_bias", (B, S, S, Hq, Hkv, D), block_size=128)
    spec = make(RATE, {"target": target})
    mesh = _abstract_mesh(target)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) if target == "tpu" else None

    def f(q, k, v, do, seed):
        out, lse, res = pallas.forward_with_residuals(spec, q, k, v, sc, mc, lists, dropout_seed=seed)
        grads = pallas.backward(spec, q, k, v, out, lse, do, jnp.zeros_like(lse), sc, mc, lists,
                                (True,) * len(sc), res, dropout_seed=seed)
        return out, grads

    x = jax.ShapeDtypeStruct((B, S, Hq, D), jnp.bfloat16, sharding=sharding)
    kv = jax.ShapeDtypeStruct((B, S, Hkv, D), jnp.bfloat16, sharding=sharding)
    seed = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=sharding)
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(f).trace(x, kv, kv, x, seed).lower(lowering_platforms=(target,)).as_text()
    assert text.count(MOSAIC_CALL if target == "tpu" else TRITON_CALL) == 3
