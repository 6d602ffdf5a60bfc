"""Traces score_mod / mask_mod callables into jaxprs whose captured arrays are explicit."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from ._jaxpr import live_invars

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
        traced = any(isinstance(c, jax.core.Tracer) for c in self.consts)
        return StaticMod(self.kind, self.fn, self.jaxpr, self.uses, len(self.consts), traced)

    def __reduce__(self):
        traced = any(isinstance(c, jax.core.Tracer) for c in self.consts)
        return _pickle_mod(self.kind, self.fn, self.jaxpr, len(self.consts), traced, static=False)


@dataclasses.dataclass(frozen=True, eq=False)
class StaticMod:
    """A TracedMod without its captured arrays.

    Two StaticMods are equal when their jaxprs print the same and the arrays nested calls in
    them close over (a ``jax.jit`` inside the mod: its jaxpr prints their shapes, not their
    values) hold the same values: re-tracing the same mod
    (or an equal one, e.g. ``sliding_window(256)`` built twice) then hits jit caches
    instead of recompiling. ``traced_consts`` says the mod closes over tracers (it was
    traced inside ``jit``), so it cannot be pickled. A pickled StaticMod stores ``fn``
    and is traced again when unpickled.
    """

    kind: str
    fn: Callable
    jaxpr: Any
    uses: frozenset
    num_consts: int
    traced_consts: bool = dataclasses.field(default=False, compare=False)
    key: str = dataclasses.field(default="", compare=False)

    def __post_init__(self):
        object.__setattr__(self, "key", f"{self.kind}:{self.jaxpr}:{_nested_consts_digest(self.jaxpr)}")

    def __eq__(self, other):
        return isinstance(other, StaticMod) and self.key == other.key

    def __hash__(self):
        return hash(self.key)

    @property
    def name(self) -> str:
        return mod_name(self.fn)

    def __reduce__(self):
        return _pickle_mod(self.kind, self.fn, self.jaxpr, self.num_consts, self.traced_consts, static=True)

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


def _nested_consts_digest(jaxpr) -> str:
    """A digest of the values of the arrays closed over by the calls nested in ``jaxpr`` (a ``pjit``'s or
    ``custom_jvp_call``'s ``ClosedJaxpr`` consts, at any depth), which the printed jaxpr shows only as
    shapes; "" when there are none. A traced value (a mod traced inside ``jit``) counts by identity."""
    h = hashlib.sha256()
    seen = [0]

    def walk(jx):
        for eqn in jx.eqns:
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    if isinstance(sub, jex_core.ClosedJaxpr):
                        for c in sub.consts:
                            seen[0] += 1
                            if isinstance(c, jax.core.Tracer):
                                h.update(f"tracer{id(c)}".encode())
                                continue
                            arr = np.asarray(c)
                            h.update(f"{arr.dtype}{arr.shape}".encode())
                            h.update(np.ascontiguousarray(arr).tobytes())
                        walk(sub.jaxpr)
                    elif isinstance(sub, jex_core.Jaxpr):
                        walk(sub)

    walk(jaxpr)
    return h.hexdigest()[:16] if seen[0] else ""


def _pickle_mod(kind: str, fn: Callable, jaxpr, num_consts: int, traced: bool, static: bool) -> tuple:
    """``__reduce__`` of a traced mod: ``fn`` and what tracing it again must reproduce.

    A jaxpr cannot be pickled, so the mod is traced again when unpickled; the avals of
    its captured arrays (the BlockMask's ``mask_consts``) are stored to check that.
    """
    if traced:
        raise TypeError(
            f"cannot pickle {kind}_mod {mod_name(fn)!r}: it closes over arrays traced inside jit, which "
            "exist only while that function traces (e.g. a BlockMask built inside jit and returned from it). "
            "Pickle or export a BlockMask built outside jit from concrete arrays instead")
    avals = [v.aval for v in jaxpr.invars]
    const_avals = tuple((tuple(a.shape), a.dtype) for a in avals[:num_consts])
    score_dtype = avals[num_consts].dtype if kind == "score" else None
    return _unpickle_mod, (kind, fn, const_avals, score_dtype, static)


def _unpickle_mod(kind: str, fn: Callable, const_avals: tuple, score_dtype, static: bool):
    """Traces a pickled mod's ``fn`` again; raises if it captures other arrays than before."""
    kwargs = {} if score_dtype is None else {"score_dtype": score_dtype}
    traced = trace_mod(fn, kind, arg_name=f"{kind}_mod", **kwargs)
    got = tuple((tuple(c.shape), c.dtype) for c in traced.consts)
    if got != const_avals:
        raise ValueError(
            f"unpickling {kind}_mod {traced.name!r}: traced again it captures arrays of (shape, dtype) "
            f"{got}, but it was pickled capturing {const_avals}; a mod must capture the same arrays, in the "
            "same order, every time it is traced")
    return traced.static() if static else traced


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
    """The mod arguments the jaxpr's output depends on (dead reads do not count).

    Mods are pure, so an equation none of whose outputs is live is dead: a mod that
    computes ``b + offset`` and never uses it does not read ``b``. Calls (``jax.jit``,
    ``jax.checkpoint`` ...) are entered, so wrapping a mod in one changes nothing.
    """
    live = live_invars(jaxpr, [True] * len(jaxpr.outvars))[len(jaxpr.constvars) + num_consts:]
    return frozenset(n for n, used in zip(names, live) if used)


def remapped(kind: str, base: Callable | None, *, index: Callable | None = None, also: Callable | None = None,
             name: str) -> Callable | None:
    """The one mod transform every entry point uses to serve a call as another: ``base`` (a mod's
    callable, or None: every pair attends / the score unchanged) read at the indices ``index(b, h,
    q_idx, kv_idx)`` returns (None: the same), and for a mask ANDed with ``also(b, h, q_idx,
    kv_idx)`` (a condition on the call's own indices, e.g. keys within a sequence's length).

    The paged call masks keys past each sequence's length (``also``); a ragged call maps a tile row
    to its sequence and position; a shard maps local indices to global ones; a BlockMask's rows
    taken for queries elsewhere shift ``q_idx``. None where a score_mod has no base (nothing to do).
    """
    index = index or (lambda *idx: idx)
    if kind == "score":
        if base is None:
            return None

        def score_mod(score, b, h, q_idx, kv_idx):
            return base(score, *index(b, h, q_idx, kv_idx))

        score_mod.__name__ = name
        return score_mod

    def mask_mod(b, h, q_idx, kv_idx):
        ok = None if also is None else also(b, h, q_idx, kv_idx)
        if base is not None:
            mine = base(*index(b, h, q_idx, kv_idx))
            ok = mine if ok is None else ok & mine
        return jnp.full(jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(kv_idx)), True) if ok is None else ok

    mask_mod.__name__ = name
    return mask_mod


def trace_mod(fn: Callable, kind: str, *, arg_name: str, score_dtype=jnp.float32) -> TracedMod:
    """Traces ``fn`` as a score_mod (kind="score") or mask_mod (kind="mask").

    A score_mod is traced with a ``score_dtype`` score (float32; float64 for float64
    inputs) and returns that dtype.

    Raises:
      TypeError: ``fn`` is not callable, takes the wrong number of arguments,
        returns the wrong shape or dtype, or cannot be traced with scalar semantics.
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
    score_aval = jax.ShapeDtypeStruct((), score_dtype)
    avals = ((score_aval,) if kind == "score" else ()) + (_I32,) * 4
    name = f"{arg_name} {mod_name(fn)!r}"
    try:
        closed = jax.make_jaxpr(fn)(*avals)
    except jax.errors.ConcretizationTypeError as e:
        raise TypeError(
            f"{name} uses Python control flow on its arguments; "
            f"use jnp.where instead of if/else (mods are traced once). Original error: {e}"
        ) from e
    except (jax.errors.TracerArrayConversionError, jax.errors.TracerIntegerConversionError) as e:
        raise TypeError(
            f"{name} turns a traced argument into a NumPy value, usually by indexing a closed-over "
            "numpy array with q_idx / kv_idx / b / h; wrap the array in jnp.asarray(...) outside the "
            f"mod so flexjax can capture it (mods are traced once, with abstract indices). Original error: {e}"
        ) from e
    except ValueError as e:
        if "out of bounds for array of dimension 0" not in str(e):
            raise
        raise TypeError(
            f"{name} reduces or indexes along an axis, but mods have scalar semantics: each call "
            f"sees one ({', '.join(expected)}) as 0-d arrays, so there is no axis to reduce "
            f"(e.g. jnp.any(x, axis=-1)); write the mod for one pair. Original error: {e}"
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
    if kind == "score" and out.dtype != score_dtype:
        closed = jax.make_jaxpr(lambda *a: fn(*a).astype(score_dtype))(*avals)
    jaxpr, consts = _constvar_jaxpr(closed)
    uses = _used_args(jaxpr, expected, len(consts))
    return TracedMod(kind, fn, jaxpr, consts, uses)
