"""The catalog of named (mask_mod, score_mod) pairs every backend is checked on."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flexjax
from flexjax import masks, mods


@dataclasses.dataclass(frozen=True)
class Case:
    """mask(B, H, Sq, Skv) -> mask_mod or None; score(params, H, Sq, Skv) -> score_mod or None;
    params(H, Sq, Skv) -> dict of float arrays the score_mod closes over (grads reach them)."""

    name: str
    mask: Callable | None = None
    score: Callable | None = None
    params: Callable = lambda H, Sq, Skv: {}
    per_head_mask: bool = False


def _doc_ids(B, S):
    rng = np.random.default_rng(S)
    ids = []
    for _ in range(B):
        cuts = np.sort(rng.choice(np.arange(1, S), size=3, replace=False))
        ids.append(np.searchsorted(cuts, np.arange(S), side="right"))
    return jnp.asarray(np.stack(ids), jnp.int32)


def _rel_table(H, Sq, Skv):
    S = max(Sq, Skv)
    return {"table": 0.3 * jax.random.normal(jax.random.PRNGKey(7), (H, 2 * S - 1))}


def _t5_table(H, Sq, Skv):
    return {"table": 0.3 * jax.random.normal(jax.random.PRNGKey(8), (H, 16))}


def _neg_inf_far(score, b, h, q_idx, kv_idx):
    """A score_mod returning -inf: keys more than 40 positions away are scored out."""
    return jnp.where(jnp.abs(q_idx - kv_idx) > 40, -jnp.inf, score)


def _late_rows(b, h, q_idx, kv_idx):
    """Rows q < 10 attend nowhere (fully masked rows)."""
    return (q_idx >= 10) & (kv_idx <= q_idx)


def _head_dependent(b, h, q_idx, kv_idx):
    """Even heads causal, odd heads a window of 24 (and batch 1 shifted): per-(b, h) lists."""
    return jnp.where(h % 2 == 0, q_idx >= kv_idx, jnp.abs(q_idx - kv_idx - b) <= 24)


def _scalar_params(H, Sq, Skv):
    return {"temp": jnp.float32(0.7), "table": _rel_table(H, Sq, Skv)["table"]}


def _scalar_score(p, Sq, Skv):
    """Captured 0-d arrays in the score (a float temperature) and in an index (an int32 offset)."""
    temp, table, off = p["temp"], p["table"], jnp.int32(max(Sq, Skv) - 1)

    def captured_scalars(score, b, h, q_idx, kv_idx):
        return score * temp + table[h, q_idx - kv_idx + off]

    return captured_scalars


def _scalar_mask(div, lim, rate, width):
    """A causal band written with captured 0-d arrays: ints (q - kv < lim * div) and floats
    (rate * (q - kv) < width). (An in-kernel floor division by a captured divisor, tested in
    test_captured_scalars.py, spills the pallas GPU forward at its 128x64 16-bit tiles.)"""
    div, lim, rate, width = jnp.int32(div), jnp.int32(lim), jnp.float32(rate), jnp.float32(width)

    def banded_by_scalars(b, h, q_idx, kv_idx):
        near = rate * (q_idx - kv_idx).astype(jnp.float32) < width
        return (kv_idx <= q_idx) & (q_idx - kv_idx < lim * div) & near

    return banded_by_scalars


CATALOG = [
    Case("full"),
    Case("causal", mask=lambda B, H, Sq, Skv: masks.causal),
    Case("causal+soft_cap", mask=lambda B, H, Sq, Skv: masks.causal, score=lambda p, H, Sq, Skv: mods.soft_cap(2.0)),
    Case("sliding_window+alibi", mask=lambda B, H, Sq, Skv: masks.sliding_window(48),
         score=lambda p, H, Sq, Skv: mods.alibi(H)),
    Case("prefix_lm+relative_bias", mask=lambda B, H, Sq, Skv: masks.prefix_lm(37),
         score=lambda p, H, Sq, Skv: mods.relative_bias(p["table"]), params=_rel_table),
    Case("document+t5", mask=lambda B, H, Sq, Skv: masks.document(_doc_ids(B, Sq), _doc_ids(B, Skv)),
         score=lambda p, H, Sq, Skv: mods.t5_relative_bucket_bias(p["table"], 16, 64), params=_t5_table),
    Case("padding", mask=lambda B, H, Sq, Skv: masks.padding(jnp.asarray([Skv - 33, Skv // 3][:B], jnp.int32))),
    Case("chunked_causal", mask=lambda B, H, Sq, Skv: masks.chunked_causal(50)),
    # Queries after a per-batch KV cache (lengths Skv and Skv - 40): reads b.
    Case("causal_bottom_right_cache", mask=lambda B, H, Sq, Skv: masks.causal_bottom_right(
        Sq, jnp.asarray([Skv, Skv - 40][:B], jnp.int32))),
    Case("fully_masked_rows", mask=lambda B, H, Sq, Skv: _late_rows),
    Case("neg_inf_score", mask=lambda B, H, Sq, Skv: masks.causal, score=lambda p, H, Sq, Skv: _neg_inf_far),
    Case("per_head_mask+relative_bias", mask=lambda B, H, Sq, Skv: _head_dependent,
         score=lambda p, H, Sq, Skv: mods.relative_bias(p["table"]), params=_rel_table, per_head_mask=True),
    # Captured 0-d arrays in the score, in an index and in the mask_mod (issue 28).
    Case("captured_scalars", mask=lambda B, H, Sq, Skv: _scalar_mask(4, 12, 0.5, 20.0),
         score=lambda p, H, Sq, Skv: _scalar_score(p, Sq, Skv), params=_scalar_params),
    # Batch 0 has no valid key: with B == 1 the mask reads one captured 0-d length.
    Case("padding_zero_length", mask=lambda B, H, Sq, Skv: masks.padding(jnp.asarray([0, Skv // 3][:B], jnp.int32))),
]

BY_NAME = {c.name: c for c in CATALOG}

# (B, Sq, Skv, Hq, Hkv, D, Dv)
SHAPES = {
    "mha": (2, 192, 192, 4, 4, 16, 16),
    "gqa_unequal": (2, 130, 250, 4, 2, 16, 8),
    "mqa_ragged": (1, 201, 97, 4, 1, 8, 16),
}


def inputs(shape, dtype, seed=0):
    B, Sq, Skv, Hq, Hkv, D, Dv = shape
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(k1, (B, Sq, Hq, D), jnp.float32).astype(dtype)
    k = jax.random.normal(k2, (B, Skv, Hkv, D), jnp.float32).astype(dtype)
    v = jax.random.normal(k3, (B, Skv, Hkv, Dv), jnp.float32).astype(dtype)
    do = jax.random.normal(k4, (B, Sq, Hq, Dv), jnp.float32).astype(dtype)
    return q, k, v, do


def build(case: Case, shape, block_size=64):
    """(block_mask, params, attention(q, k, v, params, **kw) -> (out, lse))."""
    B, Sq, Skv, Hq, Hkv, D, Dv = shape
    mask_mod = case.mask(B, Hq, Sq, Skv) if case.mask else None
    if case.per_head_mask:
        bm = flexjax.create_block_mask(mask_mod, B, Hq, Sq, Skv, block_size=block_size)
    else:
        uses_b = case.name in ("padding", "padding_zero_length", "document+t5", "causal_bottom_right_cache")
        bm = flexjax.create_block_mask(mask_mod, B if uses_b else None, None, Sq, Skv, block_size=block_size)
    params = case.params(Hq, Sq, Skv)

    def attention(q, k, v, params, **kw):
        score_mod = case.score(params, Hq, Sq, Skv) if case.score else None
        return flexjax.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True, **kw)

    return bm, params, attention


def loss_and_grads(attention, q, k, v, do, params, **kw):
    """Forward (out, lse) and grads of <out, do> + sum(finite lse) wrt q, k, v, params."""

    def loss(q, k, v, params):
        out, lse = attention(q, k, v, params, **kw)
        l = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))
        l = l + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
        return l, (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, params)
    return out, lse, grads


def sweep(values, default, ids=None, extra=()):
    """pytest params over ``values``; those not in ``default`` are marked slow (``make test-all``),
    those in ``extra`` (default ones too costly for make test) ci_extra (``make test-extra``).

    Keeps the default suite within its time budget while the full grid still runs.
    """
    ids = ids or [None] * len(values)
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), id=i,
                         marks=pytest.mark.slow if v not in default else pytest.mark.ci_extra if v in extra else ())
            for v, i in zip(values, ids)]


def rotating_shapes():
    """(case name, shape name) pairs: every case once, the shapes taken in turn (the default grid)."""
    names = list(SHAPES)
    return [(c.name, names[n % len(names)]) for n, c in enumerate(CATALOG)]


def run_case(backend, name, shape, dtype=jnp.float32, kernel_options=None, block_size=64):
    """(out, lse, grads) of catalog entry ``name`` on ``backend`` (``loss_and_grads``)."""
    _, params, attention = build(BY_NAME[name], shape, block_size)
    q, k, v, do = inputs(shape, dtype)
    kw = {"backend": backend, **({"kernel_options": kernel_options} if kernel_options else {})}
    return loss_and_grads(attention, q, k, v, do, params, **kw)


def check_case(backend, name, shape, dtype=jnp.float32, kernel_options=None, block_size=64):
    """``backend`` on catalog entry ``name`` against the reference: out, lse and every gradient.

    Float32 compares with the float32 reference. Other dtypes compare with the float32
    reference on the same rounded inputs (the truth), allowing the error the same-dtype
    reference makes (tests/checks.py). Returns the backend's (out, lse, grads).
    """
    from checks import assert_close

    _, params, attention = build(BY_NAME[name], shape, block_size)
    q, k, v, do = inputs(shape, dtype)
    got = run_case(backend, name, shape, dtype, kernel_options, block_size)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    truth = loss_and_grads(attention, *f32, params, backend="reference")
    ref = truth if dtype == jnp.float32 else loss_and_grads(attention, q, k, v, do, params, backend="reference")
    assert_close(f"{name}/{jnp.dtype(dtype).name}", got, truth, ref, dtype)
    return got
