"""Traces score_mod / mask_mod callables into jaxprs whose captured arrays are explicit."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

_F32 = jax.ShapeDtypeStruct((), jnp.float32)
_I32 = jax.ShapeDtypeStruct((), jnp.int32)

#: Names of the mod arguments, in order, for error messages.
SCORE_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_ARGS = ("b", "h", "q_idx", "kv_idx")


def mod_name(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _positional_arity(fn: Callable) -> int | None:
    """Number of positional parameters, or None when it cannot be known (*args)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    n = 0
    for p in sig.parameters.values():
        if p.kind == p.VAR_POSITIONAL:
            return None
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty:
            n += 1
    return n


@dataclasses.dataclass(frozen=True, eq=False)
class TracedMod:
    """A score_mod or mask_mod traced once at scalar shapes.

    Attributes:
      kind: "score" or "mask".
      fn: the user's callable (kept for its name and for identity).
      jaxpr: the traced jaxpr; its constvars are the captured arrays.
      consts: the captured arrays (concrete or tracers), in constvar order.
      uses: which of the mod's arguments the jaxpr reads, by name; a mod that never
        reads ``b`` or ``h`` can be evaluated once and broadcast.
    """

    kind: str
    fn: Callable
    jaxpr: Any
    consts: tuple
    uses: frozenset

    @property
    def name(self) -> str:
        return mod_name(self.fn)

    def static(self) -> StaticMod:
        """The hashable part (no arrays), for jit static arguments and pytree aux data."""
        return StaticMod(self.kind, self.fn, self.jaxpr, self.uses, len(self.consts))


@dataclasses.dataclass(frozen=True, eq=False)
class StaticMod:
    """A TracedMod without its captured arrays.

    Two StaticMods are equal when their jaxprs print the same: re-tracing the same mod
    (or an equal one, e.g. ``sliding_window(256)`` built twice) then hits jit caches
    instead of recompiling.
    """

    kind: str
    fn: Callable
    jaxpr: Any
    uses: frozenset
    num_consts: int
    key: str = dataclasses.field(default="", compare=False)

    def __post_init__(self):
        object.__setattr__(self, "key", f"{self.kind}:{self.jaxpr}")

    def __eq__(self, other):
        return isinstance(other, StaticMod) and self.key == other.key

    def __hash__(self):
        return hash(self.key)

    @property
    def name(self) -> str:
        return mod_name(self.fn)

    def __call__(self, consts: Sequence[jax.Array], *args):
        """Evaluate on broadcasting arguments; returns the broadcast shape of ``args``.

        ``b`` and ``h`` are int32 arrays broadcastable against the indices; arguments
        that the mod never reads may be passed as scalars.
        """
        if len(consts) != self.num_consts:
            raise ValueError(
                f"{self.name}: expected {self.num_consts} captured arrays, got {len(consts)}"
            )
        consts = list(consts)

        def scalar_fn(*scalars):
            (out,) = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(self.jaxpr, ()))(*consts, *scalars)
            return out

        # jnp.vectorize vmaps only over the axes where an argument is not of size 1, so
        # q_idx (bq, 1) and kv_idx (1, bk) are never materialized at (bq, bk) for it.
        return jnp.vectorize(scalar_fn)(*args)


def _constvar_jaxpr(closed) -> tuple[Any, tuple]:
    """Turns a ClosedJaxpr's consts into leading invars and returns (jaxpr, consts)."""
    jaxpr = closed.jaxpr
    consts = tuple(
        c if isinstance(c, jax.Array) or isinstance(c, jax.core.Tracer) else jnp.asarray(np.asarray(c))
        for c in closed.consts
    )
    open_jaxpr = jaxpr.replace(constvars=[], invars=list(jaxpr.constvars) + list(jaxpr.invars))
    return open_jaxpr, consts


def _used_args(jaxpr, names: Sequence[str], num_consts: int) -> frozenset:
    used_vars = set()
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not isinstance(v, jex_core.Literal):
                used_vars.add(v)
    for v in jaxpr.outvars:
        if not isinstance(v, jex_core.Literal):
            used_vars.add(v)
    arg_vars = jaxpr.invars[num_consts:]
    return frozenset(n for n, v in zip(names, arg_vars) if v in used_vars)


def trace_mod(fn: Callable, kind: str, *, arg_name: str) -> TracedMod:
    """Traces ``fn`` as a score_mod (kind="score") or mask_mod (kind="mask").

    Raises:
      TypeError: ``fn`` is not callable, takes the wrong number of arguments, or
        returns the wrong shape or dtype.
    """
    expected = SCORE_ARGS if kind == "score" else MASK_ARGS
    if not callable(fn):
        raise TypeError(f"{arg_name} must be a callable {arg_name}({', '.join(expected)}), got {type(fn).__name__}")
    arity = _positional_arity(fn)
    if arity is not None and arity != len(expected):
        raise TypeError(
            f"{arg_name} {mod_name(fn)!r} takes {arity} positional arguments but a {arg_name} "
            f"takes {len(expected)}: {arg_name}({', '.join(expected)}). "
            + (
                "Did you pass a mask_mod as score_mod? Use block_mask=create_block_mask(mask_mod, ...)."
                if kind == "score" and arity == 4
                else "Did you pass a score_mod as mask_mod?"
                if kind == "mask" and arity == 5
                else "Fix its signature."
            )
        )
    avals = ((_F32,) if kind == "score" else ()) + (_I32,) * 4
    try:
        closed = jax.make_jaxpr(fn)(*avals)
    except jax.errors.ConcretizationTypeError as e:
        raise TypeError(
            f"{arg_name} {mod_name(fn)!r} uses Python control flow on its arguments; "
            f"use jnp.where instead of if/else (mods are traced once). Original error: {e}"
        ) from e
    out_avals = closed.out_avals
    if len(out_avals) != 1:
        raise TypeError(f"{arg_name} {mod_name(fn)!r} must return one array, got {len(out_avals)} outputs")
    (out,) = out_avals
    if out.shape != ():
        raise TypeError(
            f"{arg_name} {mod_name(fn)!r} must keep scalar semantics (one value per "
            f"(b, h, q_idx, kv_idx)) but returned shape {out.shape} for scalar inputs; "
            "do not reshape, reduce or broadcast its inputs"
        )
    if kind == "mask" and out.dtype != jnp.bool_:
        raise TypeError(
            f"mask_mod {mod_name(fn)!r} must return a boolean (True = attend), got {out.dtype}; "
            "return a comparison such as q_idx >= kv_idx"
        )
    if kind == "score" and not jnp.issubdtype(out.dtype, jnp.floating):
        raise TypeError(f"score_mod {mod_name(fn)!r} must return a floating score, got {out.dtype}")
    if kind == "score" and out.dtype != jnp.float32:
        closed = jax.make_jaxpr(lambda *a: fn(*a).astype(jnp.float32))(*avals)
    jaxpr, consts = _constvar_jaxpr(closed)
    uses = _used_args(jaxpr, expected, len(consts))
    return TracedMod(kind, fn, jaxpr, consts, uses)
