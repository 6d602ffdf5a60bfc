"""The JVP rule every attention entry point shares: jax.grad runs the backend's backward, jax.jvp a tangent pass.

``flex_attention`` and ``paged.flex_attention`` are each one ``custom_jvp`` whose rule is
``attention_jvp``. Its tangent goes through ``linear_apply`` (``_linear.py``): a linear
map whose transpose is the backend's hand-written backward. ``jax.jvp`` evaluates the map
(the xla backend's blockwise ``tangent``); ``jax.grad`` linearizes and transposes it, so
only the backward runs, on the residuals the forward saved. Only perturbed inputs are
linear arguments, so the backward skips gradients nobody asked for.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from ._linear import linear_apply
from .backends import get_backend
from .backends import xla as xla_backend


def _linear_tangents(t_qkv, t_consts, score_consts):
    """Which tangents are live (not symbolic zeros; captured arrays only if float), those
    tangents in order (the linear map's arguments), and ``split``, which maps them back to
    (tq, tk, tv, per-constant tuple) with None for the dead ones."""
    live = lambda t: not isinstance(t, jax.custom_derivatives.SymbolicZero)  # noqa: E731
    has_qkv = tuple(live(t) for t in t_qkv)
    has_c = tuple(live(t) and bool(jnp.issubdtype(c.dtype, jnp.inexact)) for t, c in zip(t_consts, score_consts))
    lin = tuple(t for t, h in zip(t_qkv, has_qkv) if h) + tuple(t for t, h in zip(t_consts, has_c) if h)

    def split(lin_args):
        it = iter(lin_args)
        tq, tk, tv = (next(it) if h else None for h in has_qkv)
        return tq, tk, tv, tuple(next(it) if h else None for h in has_c)

    return has_qkv, has_c, lin, split


def _same(x, extra):
    return x


def _same_grad(d, like, extra):
    return d


def attention_jvp(plan, spec, primals, tangents, forward: Callable, *, seed_of: Callable = lambda extra: None,
                  logical: Callable = _same, from_logical: Callable = _same_grad, logical_v: Callable | None = None,
                  backward: Callable | None = None):
    """The JVP of ``(out, lse, row_max) = attention(q, k, v, score_consts, mask_consts, lists, extra)``.

    Args:
      plan: the call's ``_contract.Plan`` (its backend's ``backward`` runs it).
      spec: the call's ``AttentionSpec``.
      primals: ``(q, k, v, score_consts, mask_consts, lists, extra)``; ``extra`` is what the
        entry point adds (the dropout seed, a page table).
      tangents: the matching tangents (symbolic zeros where not perturbed).
      forward: ``forward(q, k, v, score_consts, mask_consts, lists, extra) -> (out, lse,
        Residuals)``.
      seed_of: the dropout seed in ``extra`` (None: no dropout).
      logical: ``logical(x, extra)``: k / v (or their tangents) as the contiguous
        ``(B, KV_LEN, Hkv, .)`` arrays the backward and tangent pass read (a paged cache
        gathered through its table).
      from_logical: ``from_logical(d, like, extra)``: a gradient of the logical k / v back in
        the layout of ``like`` (pages scattered back).
      logical_v: ``logical`` for v where it differs from k's (a quantized pool's own scales).
      backward: ``backward(spec, q, k, v, out, lse, dout, dlse, score_consts, mask_consts,
        lists, grad_consts, extra) -> (dq, dk, dv, dscore)`` in k / v's own layout (a paged
        cache's pools: no logical cache is formed); None: the plan's backend's ``backward`` on ``logical``.
    """
    logical_k, logical_v = logical, logical_v or logical
    q, k, v, score_consts, mask_consts, lists, extra = primals
    t_q, t_k, t_v, t_consts = tangents[:4]
    out, lse, residuals = forward(q, k, v, score_consts, mask_consts, lists, extra)
    row_max = residuals.row_max
    has_qkv, has_c, lin, split = _linear_tangents((t_q, t_k, t_v), t_consts, score_consts)
    zeros = (jnp.zeros(out.shape, out.dtype), jnp.zeros(lse.shape, lse.dtype), jnp.zeros_like(row_max))
    if not lin:
        return (out, lse, row_max), zeros
    res = (q, k, v, out, lse, score_consts, mask_consts, lists, extra, residuals)
    res_flat, res_tree = jax.tree.flatten(res)

    def unflatten(flat):
        return jax.tree.unflatten(res_tree, flat)

    def tangent_map(*args):
        q_, k_, v_, out_, _, sc, mc, ls, ex, resid = unflatten(args[:len(res_flat)])
        tq, tk, tv, tc = split(args[len(res_flat):])
        tk = None if tk is None else logical_k(tk, ex)
        tv = None if tv is None else logical_v(tv, ex)
        t_out, t_lse = xla_backend.tangent(spec, q_, logical_k(k_, ex), logical_v(v_, ex), out_, resid, sc, mc, ls,
                                           tq, tk, tv, tc, dropout_seed=seed_of(ex))
        return t_out.astype(out_.dtype), t_lse.astype(lse.dtype)

    def transpose_map(*args):
        q_, k_, v_, out_, lse_, sc, mc, ls, ex, resid = unflatten(args[:len(res_flat)])
        dout, dlse = args[len(res_flat):]
        if backward is not None:
            dq, dk, dv, dscore = backward(spec, q_, k_, v_, out_, lse_, dout, dlse, sc, mc, ls, has_c, ex)
            cts = tuple(g.astype(x.dtype) for g, x, h in zip((dq, dk, dv), (q_, k_, v_), has_qkv) if h)
            return cts + tuple(d.astype(c.dtype) for d, c, h in zip(dscore, sc, has_c) if h)
        dq, dk, dv, dscore = get_backend(plan.backend).backward(
            spec, q_, logical_k(k_, ex), logical_v(v_, ex), out_, lse_, dout, dlse, sc, mc, ls, has_c, resid,
            dropout_seed=seed_of(ex), plan=plan)
        grads = (dq, from_logical(dk, k_, ex), from_logical(dv, v_, ex))
        cts = tuple(g.astype(x.dtype) for g, x, h in zip(grads, (q_, k_, v_), has_qkv) if h)
        return cts + tuple(d.astype(c.dtype) for d, c, h in zip(dscore, sc, has_c) if h)

    out_avals = (jax.core.ShapedArray(out.shape, out.dtype), jax.core.ShapedArray(lse.shape, lse.dtype))
    t_out, t_lse = linear_apply(tangent_map, transpose_map, tuple(res_flat), lin, out_avals)
    return (out, lse, row_max), (t_out, t_lse, zeros[2])
