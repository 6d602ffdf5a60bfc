"""Tolerances: a backend's error against the float32 truth, relative to the reference's own."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Absolute backstops, relative to the largest magnitude of the true value.
RTOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}
# How much worse than the same-dtype reference a kernel may be.
FUDGE = 3.0


def _err(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    both_inf = np.isinf(a) & np.isinf(b) & (np.sign(a) == np.sign(b))
    with np.errstate(invalid="ignore"):
        d = np.where(both_inf, 0.0, np.abs(a - b))
    return float(np.nanmax(np.where(np.isnan(d), np.inf, d))) if d.size else 0.0


def _scale(x):
    x = np.asarray(jnp.asarray(x, jnp.float32))
    x = x[np.isfinite(x)]
    return float(np.abs(x).max()) if x.size else 1.0


def assert_close(name, got, truth, same_dtype_ref, dtype, rtol=None):
    """err(got, truth) <= FUDGE * err(same_dtype_ref, truth) + rtol * scale(truth), ``rtol`` RTOL[dtype] by
    default."""
    for (path, g), t, r in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(truth), jax.tree.leaves(same_dtype_ref)
    ):
        where = name + jax.tree_util.keystr(path)
        assert g.shape == t.shape, f"{where}: shape {g.shape} != {t.shape}"
        assert not np.isnan(np.asarray(jnp.asarray(g, jnp.float32))).any(), f"{where}: NaN"
        tol = FUDGE * _err(r, t) + (RTOL[dtype] if rtol is None else rtol) * max(_scale(t), 1.0)
        err = _err(g, t)
        assert err <= tol, f"{where}: max error {err:.3g} > tolerance {tol:.3g}"


def dense_f64(q, k, v, do, allowed):
    """Dense float64 attention (B, S, H, D layout, GQA) with a bool (B, Hq, Sq, Skv) mask, scale 1/sqrt(D):
    out and the gradients (dq, dk, dv) of <out, do>; a row with no allowed key gives 0."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    B, Sq, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    kf, vf = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    scale = 1.0 / np.sqrt(D)
    s = np.where(allowed, np.einsum("bqhd,bkhd->bhqk", q, kf) * scale, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.where(allowed, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    den = e.sum(-1, keepdims=True)
    p = e / np.where(den > 0, den, 1.0)
    out = np.einsum("bhqk,bkhd->bqhd", p, vf)
    dp = np.einsum("bqhd,bkhd->bhqk", do, vf)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kf) * scale
    dkf = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    dvf = np.einsum("bhqk,bqhd->bkhd", p, do)
    group = lambda x: x.reshape(B, -1, Hkv, G, x.shape[-1]).sum(3)  # noqa: E731
    return out, (dq, group(dkf), group(dvf))
