"""A linear map with a hand-written transpose, as a primitive that jit, vmap and AD all take.

``linear_apply(fn, fn_t, res, lin)`` is ``fn(*res, *lin)``, linear in ``lin``; JAX
transposes it with ``fn_t(*res, *cts)`` instead of differentiating ``fn``. flex_attention's
``custom_jvp`` returns its tangent through it, so ``jax.jvp`` runs the tangent kernel and
``jax.grad`` (linearize, then transpose) runs the hand-written backward.
``jax.custom_derivatives.linear_call`` does the same but has no batching rule, so it fails
under ``jax.vmap``; ``jax.custom_transpose`` is not public in JAX 0.10.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

linear_p = jex_core.Primitive("flexjax_linear")
linear_p.multiple_results = True


def linear_apply(fn: Callable, fn_t: Callable, res: tuple, lin: tuple, out_avals: tuple) -> list:
    """``fn(*res, *lin)`` (a list of arrays), transposed by ``fn_t(*res, *cts)``.

    Args:
      fn: linear in its trailing ``len(lin)`` arguments; returns a tuple of arrays.
      fn_t: its transpose: from the residuals and one cotangent per output, one
        cotangent per ``lin`` argument.
      res, lin: flat tuples of arrays.
      out_avals: ``jax.core.ShapedArray`` of each output.
    """
    return linear_p.bind(*res, *lin, fn=fn, fn_t=fn_t, num_res=len(res), out_avals=tuple(out_avals))


def _impl(*args, fn, fn_t, num_res, out_avals):
    del fn_t, num_res, out_avals
    return list(fn(*args))


def _abstract_eval(*args, fn, fn_t, num_res, out_avals):
    del args, fn, fn_t, num_res
    return list(out_avals)


def _jvp(primals, tangents, *, fn, fn_t, num_res, out_avals):
    if any(type(t) is not ad.Zero for t in tangents[:num_res]):
        raise NotImplementedError(
            "flexjax: differentiating flex_attention's tangent again with respect to its primal inputs "
            "(forward-over-forward or forward-over-reverse AD) is not supported")
    params = dict(fn=fn, fn_t=fn_t, num_res=num_res, out_avals=out_avals)
    out = linear_p.bind(*primals, **params)
    lin_t = [ad.instantiate_zeros(t) for t in tangents[num_res:]]
    return out, linear_p.bind(*primals[:num_res], *lin_t, **params)


def _transpose(cts, *args, fn, fn_t, num_res, out_avals):
    res, lin = args[:num_res], args[num_res:]
    if any(ad.is_undefined_primal(r) for r in res):
        raise NotImplementedError("flexjax: transposing flex_attention's tangent with respect to a primal input")
    cts = [jnp.zeros(a.shape, a.dtype) if type(ct) is ad.Zero else ct for ct, a in zip(cts, out_avals)]
    cts_lin = fn_t(*res, *cts)
    # A linear argument that is known (not being transposed) contributes a constant; it
    # gets no cotangent.
    return [None] * num_res + [c if ad.is_undefined_primal(x) else None for c, x in zip(cts_lin, lin)]


def _batch(args, dims, *, fn, fn_t, num_res, out_avals):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    args = [jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
            for a, d in zip(args, dims)]
    out = linear_p.bind(*args, fn=jax.vmap(fn), fn_t=jax.vmap(fn_t), num_res=num_res,
                        out_avals=tuple(a.update(shape=(size, *a.shape)) for a in out_avals))
    return out, [0] * len(out)


linear_p.def_impl(_impl)
linear_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[linear_p] = _jvp
ad.primitive_transposes[linear_p] = _transpose
batching.primitive_batchers[linear_p] = _batch
mlir.register_lowering(linear_p, mlir.lower_fun(_impl, multiple_results=True))
