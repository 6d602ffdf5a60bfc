"""The call primitives every jaxpr walker enters, and how to open their bodies on JAX 0.10 and 0.11.

A mod's jaxpr may wrap its work in calls: ``jax.jit`` (``jit``, ``pjit`` before JAX 0.7),
``jax.checkpoint`` / ``jax.remat`` (``remat2``; ``remat`` / ``checkpoint`` in older
releases), ``closed_call`` / ``core_call``, and ``jax.custom_jvp`` / ``jax.custom_vjp``
functions (``custom_jvp_call``, ``custom_vjp_call``; ``custom_vjp_call_jaxpr`` before).
Each runs its body once on its operands, so a walker may treat the body as if it were
written in place. Loops (``scan``, ``while``) and ``cond`` also carry sub-jaxprs but are
not calls. Every walker (the liveness pass of ``_trace``, the interval analysis, the mod
compiler and its code generators, the sharding inliner) uses this one table.
"""

from __future__ import annotations

from typing import Any

from jax.extend import core as jex_core

#: Call primitive name -> the parameter that holds its body.
CALL_BODY = {
    "jit": "jaxpr", "pjit": "jaxpr",
    "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "remat2": "jaxpr", "remat": "jaxpr", "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
}

#: Calls whose body may be inlined without changing derivatives (the custom_* ones carry their
#: own differentiation rule, which inlining would drop).
TRANSPARENT_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "remat2", "remat", "checkpoint"})


def open_jaxpr(sub) -> tuple[Any, tuple]:
    """``(jaxpr, consts)``: a sub-jaxpr and the values of its constvars.

    JAX 0.10 wraps a Jaxpr in a ClosedJaxpr that holds the consts (``remat2`` holds a bare
    Jaxpr). JAX 0.11 has one Jaxpr class that carries its consts (``ClosedJaxpr`` is an
    alias of it, and ``.jaxpr`` a legacy accessor returning itself), so the class no longer
    tells closed from open.
    """
    if isinstance(sub, jex_core.Jaxpr):
        return sub, tuple(getattr(sub, "consts", ()))
    return sub.jaxpr, tuple(sub.consts)


def call_body(eqn) -> tuple[Any, tuple] | None:
    """``(jaxpr, consts)`` of a call equation's body, or None when ``eqn`` is not a call.

    The body's ``[*constvars, *invars]`` take ``[*consts, *eqn.invars]``, and its outvars
    are the equation's outvars. None also when the parameters do not have that form (a
    walker then treats the equation as an opaque primitive).
    """
    return body_of(eqn.primitive.name, eqn.params, len(eqn.invars), len(eqn.outvars))


def body_of(name: str, params: dict, num_ins: int, num_outs: int) -> tuple[Any, tuple] | None:
    """``call_body`` from a primitive's name, params and operand / result counts."""
    key = CALL_BODY.get(name)
    sub = params.get(key) if key is not None else None
    if sub is None:
        return None
    jaxpr, consts = open_jaxpr(sub)
    if len(jaxpr.constvars) != len(consts) or len(jaxpr.invars) != num_ins or len(jaxpr.outvars) != num_outs:
        return None
    return jaxpr, consts


def sub_jaxprs(params):
    """The jaxprs among an equation's params (cond's branches come as a tuple)."""
    for v in params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(x, (jex_core.ClosedJaxpr, jex_core.Jaxpr)):
                yield open_jaxpr(x)[0]


def collect_prims(jaxpr, acc: set | None = None) -> set:
    """The names of every primitive in ``jaxpr`` and its sub-jaxprs."""
    acc = set() if acc is None else acc
    for eqn in jaxpr.eqns:
        acc.add(eqn.primitive.name)
        for sub in sub_jaxprs(eqn.params):
            collect_prims(sub, acc)
    return acc


def live_invars(jaxpr, live_outs: list[bool]) -> list[bool]:
    """Which of ``[*jaxpr.constvars, *jaxpr.invars]`` the live outputs depend on.

    Mods are pure, so an equation none of whose outputs is live is dead. Calls are
    entered (a ``jax.checkpoint``-ed mask reads only what its body reads); any other
    equation reads all its operands when one of its outputs is live.
    """
    live = {v for v, keep in zip(jaxpr.outvars, live_outs) if keep and not isinstance(v, jex_core.Literal)}
    for eqn in reversed(jaxpr.eqns):
        outs = [v in live for v in eqn.outvars]
        if not any(outs):
            continue
        body = call_body(eqn)
        if body is None:
            reads = [True] * len(eqn.invars)
        else:
            sub, consts = body
            reads = live_invars(sub, outs)[len(consts):]
        live.update(v for v, r in zip(eqn.invars, reads) if r and not isinstance(v, jex_core.Literal))
    return [v in live for v in (*jaxpr.constvars, *jaxpr.invars)]
