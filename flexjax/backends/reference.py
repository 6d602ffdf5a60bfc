"""The reference backend: dense float32 (float64 for float64 inputs) attention, the tests' truth."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import _dropout
from ._common import acc_dtype, allowed, apply_score_mod
from ._contract import Implementation, Residuals, always, planner

NAME = "reference"


def validate_options(spec) -> None:
    """The reference backend has no kernel_options to check (any given are refused by ``resolve``)."""


def resolve(spec, q, k, v) -> str | None:
    """No options: the reference backend serves every call without kernel_options."""
    if spec.options:
        return f"the reference backend takes no kernel_options, got {sorted(spec.options)}"
    return None


plan = planner(__name__)


FORWARD = BACKWARD = (Implementation("dense", always),)


def _dense(spec, q, k, v, score_consts, mask_consts, seed=None):
    """out, lse and the rows' ``Residuals``, densely."""
    B, Sq, Hq, _ = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    hi = jax.lax.Precision.HIGHEST
    dt = acc_dtype(q.dtype)
    kf = jnp.repeat(k.astype(dt), g, axis=2)
    vf = jnp.repeat(v.astype(dt), g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(dt), kf, precision=hi) * spec.scale
    b = jnp.arange(B, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(Hq, dtype=jnp.int32)[None, :, None, None]
    qi = jnp.arange(Sq, dtype=jnp.int32)[:, None]
    ki = jnp.arange(Skv, dtype=jnp.int32)[None, :]
    s = apply_score_mod(spec, score_consts, s, b, h, qi, ki)
    ok = allowed(spec, mask_consts, b, h, qi, ki, True, True)
    s = jnp.where(ok, s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(l > 0, l, 1.0)
    if spec.dropout_rate > 0:
        keep = _dropout.keep_mask(seed, b, h, qi, ki, spec.dropout_rate)
        p = jnp.where(keep, p / (1.0 - spec.dropout_rate), 0.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, vf, precision=hi)
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)[..., 0]
    return out.astype(q.dtype), lse, Residuals.from_running(m[..., 0], l[..., 0])


def forward_with_residuals(spec, q, k, v, score_consts, mask_consts, lists, dropout_seed=None, plan=None):
    """out, lse and the rows' ``Residuals`` (the backward differentiates the dense math again); one
    implementation, so the plan has nothing to say."""
    return _dense(spec, q, k, v, score_consts, mask_consts, dropout_seed)


def backward(spec, q, k, v, out, lse, dout, dlse, score_consts, mask_consts, lists, grad_consts, residuals,
             dropout_seed=None, plan=None):
    del residuals, plan
    float_idx = [i for i, want in enumerate(grad_consts) if want]

    def f(q, k, v, float_consts):
        consts = list(score_consts)
        for i, c in zip(float_idx, float_consts):
            consts[i] = c
        return _dense(spec, q, k, v, tuple(consts), mask_consts, dropout_seed)[:2]

    _, vjp = jax.vjp(f, q, k, v, tuple(score_consts[i] for i in float_idx))
    dq, dk, dv, dfloat = vjp((dout, dlse))
    dscore = [None] * len(score_consts)
    for i, d in zip(float_idx, dfloat):
        dscore[i] = d
    return dq, dk, dv, tuple(dscore)
