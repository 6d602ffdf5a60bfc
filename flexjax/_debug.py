"""Debug mode: checks a call's inputs could make too costly to check on every call.

``flexjax.debug_checks()`` (a context manager; or ``FLEXJAX_DEBUG_CHECKS=1`` in the environment) turns on:

- **Reads past a captured array's end.** JAX clamps an index past an array's end (``table[i]`` reads
  ``table[-1]`` for every ``i >= len(table)``), so a mod whose table is shorter than the positions it
  reads gives wrong numbers without an error. In debug mode a dense ``flex_attention`` (and ``explain``)
  evaluates every index a score_mod or mask_mod computes into its captured arrays over all
  ``(b, h, q_idx, kv_idx)`` of the call (for the score_mod, the pairs the mask_mod allows) and raises
  ``IndexError`` naming the mod, eagerly or, under ``jit``, when the step runs. Negative indices count
  from the end, as in NumPy (the wrap happens before the read this checks). The check costs a dense pass
  over the positions: it is for debugging, not for every step.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

_ON = contextvars.ContextVar("flexjax_debug_checks", default=None)


def enabled() -> bool:
    """Whether debug checks are on: inside ``debug_checks()``, else ``FLEXJAX_DEBUG_CHECKS``."""
    on = _ON.get()
    if on is None:
        return os.environ.get("FLEXJAX_DEBUG_CHECKS", "0") not in ("0", "", "false", "False")
    return on


@contextlib.contextmanager
def debug_checks(enabled: bool = True):
    """Within it, flexjax calls run checks too costly for every step (``FLEXJAX_DEBUG_CHECKS=1`` turns them
    on for a whole process; ``debug_checks(False)`` off within).

    Reads past a captured array's end: JAX clamps an index past an array's end, so a mod whose table is
    shorter than the positions it reads gives wrong numbers with no error. Here a dense ``flex_attention``
    or ``explain`` evaluates every index a score_mod or mask_mod computes into its captured arrays, at
    every ``(b, h, q_idx, kv_idx)`` of the call (for the score_mod, at the pairs the mask_mod allows), and
    raises ``IndexError`` naming the mod: at once for concrete arrays, and when the step runs under
    ``jit``. Negative indices count from the end, as in NumPy. The check is a dense pass over the
    positions, for debugging::

        with flexjax.debug_checks():
            out = flexjax.flex_attention(q, k, v, score_mod)
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"debug_checks(enabled) must be a bool, got {type(enabled).__name__}")
    token = _ON.set(enabled)
    try:
        yield
    finally:
        _ON.reset(token)


_CALLS = ("pjit", "jit", "closed_call", "core_call")


def _eval(jaxpr, consts, args):
    """Evaluates ``jaxpr``; returns (outputs, whether any dynamic_slice / gather start index is out of range)."""
    env, bad = {}, []

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "dynamic_slice":
            op, *starts = ins
            for d, (start, size) in enumerate(zip(starts, eqn.params["slice_sizes"])):
                bad.append((start < 0) | (start > op.shape[d] - size))
        elif name == "gather":
            op, idx = ins
            sizes = eqn.params["slice_sizes"]
            for k, d in enumerate(eqn.params["dimension_numbers"].start_index_map):
                start = idx[..., k]
                bad.append(jnp.any((start < 0) | (start > op.shape[d] - sizes[d])))
        sub = eqn.params.get("jaxpr")
        if name in _CALLS and sub is not None:
            outs, inner = _eval(sub.jaxpr, sub.consts, ins)
            bad.append(inner)
        else:
            outs = eqn.primitive.bind(*ins, **eqn.params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, x in zip(eqn.outvars, outs):
            env[v] = x
    any_bad = functools.reduce(jnp.logical_or, bad, jnp.bool_(False))
    return [read(v) for v in jaxpr.outvars], any_bad


def _grid_eval(mod, consts, score, b, h, q, kv):
    """(outputs, out-of-range flags) of ``mod`` at every broadcast position."""
    def scalar(*a):
        (out,), flag = _eval(mod.jaxpr, (), (*consts, *a))  # the captured arrays lead its invars
        return out, flag

    args = ((score,) if mod.kind == "score" else ()) + (b, h, q, kv)
    return jnp.vectorize(scalar)(*args)


def check_reads(spec, score_consts, mask_consts, B: int, H: int) -> jax.Array:
    """An int32 0 to add into the call's inputs; raises (now, or when a jitted call runs) where a mod reads
    one of its captured arrays past its end at a position the call evaluates."""
    from ._factory import fail_on_host

    b = jnp.arange(B, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(H, dtype=jnp.int32)[None, :, None, None]
    q = jnp.arange(spec.q_len, dtype=jnp.int32)[None, None, :, None]
    kv = jnp.arange(spec.kv_len, dtype=jnp.int32)[None, None, None, :]
    token = jnp.int32(0)
    allowed = jnp.bool_(True)
    if spec.mask is not None:
        allowed, bad = _grid_eval(spec.mask, list(mask_consts), None, b, h, q, kv)
        token = token + fail_on_host(~jnp.any(bad), functools.partial(_raise, "mask_mod", spec.mask.name))
    if spec.score is not None:
        _, bad = _grid_eval(spec.score, list(score_consts), jnp.float32(0), b, h, q, kv)
        token = token + fail_on_host(~jnp.any(bad & allowed), functools.partial(_raise, "score_mod", spec.score.name))
    return token


def _raise(arg, name):
    raise IndexError(f"{arg} {str(name)!r} reads one of its captured arrays past its end at some (b, h, q_idx, "
                     "kv_idx) of this call (JAX would clamp the index and give wrong numbers silently): make the "
                     "array cover every position the mod reads (flexjax.debug_checks is on)")
