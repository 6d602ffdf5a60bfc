"""The online softmax and the log-sum-exp merges, once, with one convention for empty rows.

Convention: a row's running max starts at -inf and its sum at 0. A row (or a part of one)
that has seen no allowed key has max -inf and sum 0 and contributes nothing; its lse is
-inf and its output 0. Exponentials subtract the max only where it is finite (0
elsewhere), so excluded pairs (score -inf) give exp(-inf) = 0 and no (-inf) - (-inf) =
NaN arises; a row of allowed scores at ``finfo.min`` (HuggingFace-style masking in a
score_mod) still has a finite max and uniform weights, as in the reference.

Users: the xla backend's loops, band and decode path, the pallas kernels' tiles
(``pallas/_tile.softmax_step``), the pallas decode kernel's chunk merge, context-parallel
sharding's ring merge, and attention sinks (``_spec.with_sinks``). The C++ and Triton kernels
follow the same convention in their own languages. ``_contract.Residuals`` keeps a finished
row's (max, sum) in it.
"""

from __future__ import annotations

import jax.numpy as jnp

# Scores of excluded pairs.
MASK_VALUE = -float("inf")


def start(shape, dtype):
    """(max, sum) of rows that have seen no key: -inf and 0."""
    return jnp.full(shape, -jnp.inf, dtype), jnp.zeros(shape, dtype)


def _shift(m):
    """The max to subtract: 0 where it is -inf (a row with no allowed key yet)."""
    return jnp.where(m == -jnp.inf, 0.0, m)


def step(m, l, s, keepdims: bool = False):
    """One online-softmax step over the scores ``s`` (last axis: keys).

    Returns ``(m_new, l_new, p, alpha)``: the new running max and sum, the tile's
    unnormalised probabilities ``exp(s - m_new)`` and the factor ``alpha`` that rescales
    what was accumulated before (``acc * alpha + p @ v``). ``keepdims``: m and l keep the
    reduced axis (as the pallas kernels' (tq, 1) rows).
    """
    m_new = jnp.maximum(m, s.max(axis=-1, keepdims=keepdims))
    m_use = _shift(m_new)
    p = jnp.exp(s - (m_use if keepdims else m_use[..., None]))
    alpha = jnp.exp(m - m_use)
    return m_new, l * alpha + p.sum(axis=-1, keepdims=keepdims), p, alpha


def lse_of(m, l):
    """log-sum-exp from a row's max ``m`` and sum ``l`` of exp(s - m); -inf where no key contributed."""
    alive = l > 0
    return jnp.where(alive, m + jnp.log(jnp.where(alive, l, 1.0)), -jnp.inf)


def merge_parts(m, l, acc, axis: int):
    """Merges partial softmaxes of the same rows stacked along ``axis`` (flash-decoding's chunks).

    ``m``, ``l``: each part's max and sum (a part with sum 0 contributes nothing, whatever its
    max); ``acc``: each part's unnormalised ``sum exp(s - m) v``, with one more trailing axis.
    Returns the merged ``(m, l, acc)`` (acc still unnormalised: divide by l where l > 0).
    """
    alive = l > 0
    m_all = jnp.where(alive, m, -jnp.inf).max(axis)
    w = jnp.where(alive, jnp.exp(m - jnp.expand_dims(_shift(m_all), axis)), 0.0)
    return m_all, (l * w).sum(axis), (acc * w[..., None]).sum(axis)


def merge_normalized(out1, lse1, out2, lse2, rows):
    """Softmax-merges two normalised partial attentions of the same queries through their lse.

    ``out*``: outputs (lse -inf: a part with no key, output 0); ``rows(w)`` maps a per-row
    weight (lse's shape) onto the outputs' layout. Returns ``(out, lse)``, both in lse's dtype
    (float32, float64 under x64); a row with no key in either part keeps output 0 and lse -inf.
    """
    dt = jnp.result_type(lse1, lse2)
    m = _shift(jnp.maximum(lse1, lse2))
    w1, w2 = jnp.exp(lse1 - m), jnp.exp(lse2 - m)
    total = w1 + w2
    safe = jnp.where(total > 0, total, 1.0)
    out = out1.astype(dt) * rows(w1 / safe) + out2.astype(dt) * rows(w2 / safe)
    return out, jnp.where(total > 0, m + jnp.log(safe), -jnp.inf)
