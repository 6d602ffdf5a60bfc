"""Interval abstract evaluation of a mask_mod (its ``_modir.ModIR``): which tiles are all-true or all-false.

Over a tile, ``q_idx`` and ``kv_idx`` range over known intervals (``b`` and ``h`` are
single values), so the mask_mod's program can be run on intervals instead of points.
Every value is abstracted per tile: a number by an interval ``[lo, hi]`` and a flag
``ok`` (False: no bound known), a boolean by two flags "all true" / "all false". Each
rule is sound: what it claims holds for every pair of the tile; what it cannot prove is
left unknown, so a primitive without a rule makes its tiles unknown, never wrong. The
builder (``_block_mask.py``) evaluates those tiles exactly.

Captured arrays read with ``dynamic_slice`` at interval indices (``ids[q_idx]``,
``lengths[b]``) answer with the exact min/max of the array over the index range, from a
sparse table (O(1) range min/max queries) built once per array.

Soundness notes: floating-point ``+ - * /`` and conversions round monotonically, so
evaluating the endpoints with the same operation bounds every result; bounds are only
claimed for finite operands (no NaN can then appear inside). Integer ops wrap on
overflow, so their bounds are only claimed when a floating-point estimate of every
endpoint is well inside the dtype's range.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ._modir import Lit, flatten, inline_call


@dataclasses.dataclass
class Num:
    """A number in ``[lo, hi]`` over each tile where ``ok``; unknown elsewhere."""

    lo: Any
    hi: Any
    ok: Any


@dataclasses.dataclass
class Bool:
    """A boolean: ``t`` where it is true on every pair of the tile, ``f`` where false on every pair."""

    t: Any
    f: Any


@dataclasses.dataclass
class Arr:
    """A non-scalar captured array (read with dynamic_slice); range tables built on first read."""

    value: Any
    tables: Any = None


class _Top:
    """Nothing known."""


TOP = _Top()


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _est_dtype():
    return jnp.float64 if jax.config.jax_enable_x64 else jnp.float32


def _fits(dtype, *ests):
    """Whether float estimates of integer endpoints are safely inside ``dtype``'s range."""
    info = jnp.iinfo(dtype)
    # float32 estimates of 32-bit values are off by up to 2**8; keep a wide margin.
    margin = max(1.0, float(info.max) * 2.0**-16)
    ok = True
    for e in ests:
        ok = ok & (e >= float(info.min) + margin) & (e <= float(info.max) - margin)
    return ok


def _finite(*xs):
    ok = True
    for x in xs:
        ok = ok & jnp.isfinite(x)
    return ok


def _const(value) -> Any:
    """Abstract value of a concrete or traced constant (a literal or captured array)."""
    value = jnp.asarray(value)
    if value.ndim == 0:
        if value.dtype == jnp.bool_:
            return Bool(value, ~value)
        return Num(value, value, True)
    return Arr(value)


def _num(x) -> Any:
    """``x`` as a Num (booleans become 0/1 int32), or TOP."""
    if isinstance(x, Num):
        return x
    if isinstance(x, Bool):
        return Num(jnp.where(x.t, 1, 0).astype(jnp.int32), jnp.where(x.f, 0, 1).astype(jnp.int32), True)
    return TOP


def _bool(x) -> Any:
    return x if isinstance(x, Bool) else TOP


def _unknown_bool():
    return Bool(jnp.bool_(False), jnp.bool_(False))


# -- arithmetic ---------------------------------------------------------------------------

def _arith(dtype, lo, hi, ok, int_ests, float_ins):
    if _is_float(dtype):
        return Num(lo, hi, ok & _finite(*float_ins))
    return Num(lo, hi, ok & _fits(dtype, *int_ests))


def _est(x):
    return x.astype(_est_dtype())


def _add(eqn, a, b):
    a, b = _num(a), _num(b)
    if a is TOP or b is TOP:
        return TOP
    dt = eqn.out_avals[0].dtype
    return _arith(dt, a.lo + b.lo, a.hi + b.hi, a.ok & b.ok, (_est(a.lo) + _est(b.lo), _est(a.hi) + _est(b.hi)),
                  (a.lo, a.hi, b.lo, b.hi))


def _sub(eqn, a, b):
    a, b = _num(a), _num(b)
    if a is TOP or b is TOP:
        return TOP
    dt = eqn.out_avals[0].dtype
    return _arith(dt, a.lo - b.hi, a.hi - b.lo, a.ok & b.ok, (_est(a.lo) - _est(b.hi), _est(a.hi) - _est(b.lo)),
                  (a.lo, a.hi, b.lo, b.hi))


def _corners(op, a, b):
    vals = [op(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    lo, hi = vals[0], vals[0]
    for v in vals[1:]:
        lo, hi = jnp.minimum(lo, v), jnp.maximum(hi, v)
    return lo, hi, vals


def _mul(eqn, a, b):
    a, b = _num(a), _num(b)
    if a is TOP or b is TOP:
        return TOP
    dt = eqn.out_avals[0].dtype
    lo, hi, _ = _corners(jnp.multiply, a, b)
    ests = [_est(x) * _est(y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    return _arith(dt, lo, hi, a.ok & b.ok, ests, (a.lo, a.hi, b.lo, b.hi))


def _div(eqn, a, b):
    a, b = _num(a), _num(b)
    if a is TOP or b is TOP:
        return TOP
    dt = eqn.out_avals[0].dtype
    nonzero = (b.lo > 0) | (b.hi < 0)
    safe_b = Num(jnp.where(nonzero, b.lo, 1).astype(b.lo.dtype), jnp.where(nonzero, b.hi, 1).astype(b.hi.dtype), True)
    # Truncating (integer) and rounded (float) division are monotone in each operand
    # while the divisor keeps its sign, so the extremes are at the corners.
    lo, hi, _ = _corners(jax.lax.div, a, safe_b)
    ok = a.ok & b.ok & nonzero
    if _is_float(dt):
        return Num(lo, hi, ok & _finite(a.lo, a.hi, b.lo, b.hi))
    # INT_MIN / -1 overflows.
    ok = ok & _fits(dt, _est(a.lo), _est(a.hi))
    return Num(lo, hi, ok)


def _rem(eqn, a, b):
    a, b = _num(a), _num(b)
    dt = eqn.out_avals[0].dtype
    if a is TOP or b is TOP or _is_float(dt):
        return TOP
    const = (b.lo == b.hi) & (b.lo != 0)
    c = jnp.abs(jnp.where(const, b.lo, 1))
    # x rem c has the sign of x and |x rem c| <= min(|x|, c - 1).
    lo = jnp.maximum(a.lo, jnp.minimum(-(c - 1), 0))
    hi = jnp.minimum(a.hi, c - 1)
    lo = jnp.where(a.lo >= 0, 0, lo)
    hi = jnp.where(a.hi <= 0, 0, hi)
    # Within one period of c the remainder is monotone.
    same_pos = (a.lo >= 0) & (a.lo // c == a.hi // c)
    lo = jnp.where(same_pos, a.lo % c, lo)
    hi = jnp.where(same_pos, a.hi % c, hi)
    na, nb = -a.hi, -a.lo
    same_neg = (a.hi <= 0) & (na // c == nb // c)
    lo = jnp.where(same_neg, -(nb % c), lo)
    hi = jnp.where(same_neg, -(na % c), hi)
    ok = a.ok & b.ok & const & _fits(dt, _est(a.lo), _est(a.hi))
    return Num(lo.astype(dt), hi.astype(dt), ok)


def _neg(eqn, a):
    a = _num(a)
    if a is TOP:
        return TOP
    dt = eqn.out_avals[0].dtype
    return _arith(dt, -a.hi, -a.lo, a.ok, (-_est(a.hi), -_est(a.lo)), (a.lo, a.hi))


def _abs(eqn, a):
    a = _num(a)
    if a is TOP:
        return TOP
    dt = eqn.out_avals[0].dtype
    lo = jnp.where(a.lo >= 0, a.lo, jnp.where(a.hi <= 0, -a.hi, 0))
    hi = jnp.maximum(jnp.abs(a.lo), jnp.abs(a.hi))
    return _arith(dt, lo.astype(dt), hi, a.ok, (-_est(a.lo), _est(a.hi)), (a.lo, a.hi))


def _monotone(fn):
    def rule(eqn, a):
        a = _num(a)
        if a is TOP:
            return TOP
        return Num(fn(a.lo), fn(a.hi), a.ok)

    return rule


def _max(eqn, a, b):
    a, b = _num(a), _num(b)
    if a is TOP or b is TOP:
        return TOP
    return Num(jnp.maximum(a.lo, b.lo), jnp.maximum(a.hi, b.hi), a.ok & b.ok)


def _min(eqn, a, b):
    a, b = _num(a), _num(b)
    if a is TOP or b is TOP:
        return TOP
    return Num(jnp.minimum(a.lo, b.lo), jnp.minimum(a.hi, b.hi), a.ok & b.ok)


def _clamp(eqn, lo_c, x, hi_c):
    lo_c, x, hi_c = _num(lo_c), _num(x), _num(hi_c)
    if TOP in (lo_c, x, hi_c):
        return TOP
    return Num(jnp.minimum(jnp.maximum(x.lo, lo_c.lo), hi_c.lo), jnp.minimum(jnp.maximum(x.hi, lo_c.hi), hi_c.hi),
               lo_c.ok & x.ok & hi_c.ok)


def _convert(eqn, a):
    new = eqn.params["new_dtype"]
    if new == jnp.bool_:
        a = _num(a)
        if a is TOP:
            return _unknown_bool()
        return Bool(a.ok & ((a.lo > 0) | (a.hi < 0)), a.ok & (a.lo == 0) & (a.hi == 0))
    a = _num(a)
    if a is TOP:
        return TOP
    old = a.lo.dtype
    if _is_float(new):
        ok = a.ok & (_finite(a.lo, a.hi) if _is_float(old) else True)
        return Num(a.lo.astype(new), a.hi.astype(new), ok)
    # To an integer: the value must fit the new dtype (float -> int truncates monotonically).
    ok = a.ok & _fits(new, _est(a.lo), _est(a.hi))
    if _is_float(old):
        ok = ok & _finite(a.lo, a.hi)
    return Num(a.lo.astype(new), a.hi.astype(new), ok)


def _identity(eqn, a, *rest):
    if eqn.out_avals[0].size != 1:
        return TOP
    return a


# -- comparisons and logic -----------------------------------------------------------------

def _compare(kind):
    def rule(eqn, a, b):
        a, b = _num(a), _num(b)
        if a is TOP or b is TOP:
            return _unknown_bool()
        ok = a.ok & b.ok
        if _is_float(a.lo.dtype):
            ok = ok & ~jnp.isnan(a.lo) & ~jnp.isnan(a.hi) & ~jnp.isnan(b.lo) & ~jnp.isnan(b.hi)
        if kind == "lt":
            t, f = a.hi < b.lo, a.lo >= b.hi
        elif kind == "le":
            t, f = a.hi <= b.lo, a.lo > b.hi
        elif kind == "gt":
            t, f = a.lo > b.hi, a.hi <= b.lo
        elif kind == "ge":
            t, f = a.lo >= b.hi, a.hi < b.lo
        else:
            same = (a.lo == a.hi) & (b.lo == b.hi) & (a.lo == b.lo)
            apart = (a.hi < b.lo) | (b.hi < a.lo)
            t, f = (same, apart) if kind == "eq" else (apart, same)
        return Bool(ok & t, ok & f)

    return rule


def _and(eqn, a, b):
    a, b = _bool(a), _bool(b)
    if a is TOP or b is TOP:
        return TOP if eqn.out_avals[0].dtype != jnp.bool_ else _logic_top(a, b, "and")
    return Bool(a.t & b.t, a.f | b.f)


def _or(eqn, a, b):
    a, b = _bool(a), _bool(b)
    if a is TOP or b is TOP:
        return TOP if eqn.out_avals[0].dtype != jnp.bool_ else _logic_top(a, b, "or")
    return Bool(a.t | b.t, a.f & b.f)


def _logic_top(a, b, kind):
    """``and``/``or`` of booleans where one side is unknown: the other can still decide."""
    known = a if b is TOP else b
    if known is TOP:
        return _unknown_bool()
    return Bool(jnp.bool_(False), known.f) if kind == "and" else Bool(known.t, jnp.bool_(False))


def _not(eqn, a):
    if eqn.out_avals[0].dtype != jnp.bool_:
        return TOP
    a = _bool(a)
    return _unknown_bool() if a is TOP else Bool(a.f, a.t)


def _xor(eqn, a, b):
    if eqn.out_avals[0].dtype != jnp.bool_:
        return TOP
    a, b = _bool(a), _bool(b)
    if a is TOP or b is TOP:
        return _unknown_bool()
    return Bool((a.t & b.f) | (a.f & b.t), (a.t & b.t) | (a.f & b.f))


def _select_n(eqn, pred, *cases):
    out_bool = eqn.out_avals[0].dtype == jnp.bool_
    if out_bool:
        cases = [_bool(c) for c in cases]
        if any(c is TOP for c in cases):
            return _unknown_bool()
    else:
        cases = [_num(c) for c in cases]
        if any(c is TOP for c in cases):
            return TOP

    def union(xs):
        if out_bool:
            t, f = xs[0].t, xs[0].f
            for x in xs[1:]:
                t, f = t & x.t, f & x.f
            return Bool(t, f)
        lo, hi, ok = xs[0].lo, xs[0].hi, xs[0].ok
        for x in xs[1:]:
            lo, hi, ok = jnp.minimum(lo, x.lo), jnp.maximum(hi, x.hi), ok & x.ok
        return Num(lo, hi, ok)

    both = union(cases)
    if len(cases) != 2 or not isinstance(pred, Bool):
        return both
    c0, c1 = cases

    def pick(field):
        return jnp.where(pred.t, getattr(c1, field), jnp.where(pred.f, getattr(c0, field), getattr(both, field)))

    if out_bool:
        return Bool(pick("t"), pick("f"))
    return Num(pick("lo"), pick("hi"), pick("ok"))


# -- captured array reads ------------------------------------------------------------------

def _tables(arr: Arr):
    """Sparse tables of min and max along the last axis: (levels, rows, n) each."""
    if arr.tables is None:
        x = arr.value
        if x.dtype == jnp.bool_:
            x = x.astype(jnp.int8)
        n = x.shape[-1]
        rows = x.reshape(-1, n)
        levels = max(1, n.bit_length())

        def level(carry, step):
            lo, hi = carry
            # One loop body for every level: a few small fusions to compile, not 2 per level.
            out = (jnp.minimum(lo, _shifted(lo, step)), jnp.maximum(hi, _shifted(hi, step)))
            return out, carry

        steps = jnp.asarray([1 << i for i in range(levels)], jnp.int32)
        _, (mins, maxs) = jax.lax.scan(level, (rows, rows), steps)
        arr.tables = (mins, maxs, jnp.min(x), jnp.max(x))
    return arr.tables


def _shifted(x, step):
    """x[:, i + step], the last column repeated past the end (``step`` may be traced, <= n)."""
    n = x.shape[1]
    padded = jnp.concatenate([x, jnp.broadcast_to(x[:, -1:], x.shape)], axis=1)
    return jax.lax.dynamic_slice_in_dim(padded, step, n, axis=1)


def _floor_log2(n):
    return (31 - jax.lax.clz(n.astype(jnp.int32))).astype(jnp.int32)


def _dynamic_slice(eqn, operand, *starts):
    if not isinstance(operand, Arr) or any(s != 1 for s in eqn.params["slice_sizes"]):
        return TOP if eqn.out_avals[0].dtype != jnp.bool_ else _unknown_bool()
    shape = operand.value.shape
    tmin, tmax, gmin, gmax = _tables(operand)
    # dynamic_slice clamps each start into [0, dim - 1] (monotone), and so do we.
    ivals, exact = [], True
    for s, d in zip(starts, shape):
        s = _num(s)
        if s is TOP:
            lo, hi, ok = jnp.int32(0), jnp.int32(d - 1), True
        else:
            lo, hi, ok = s.lo, s.hi, s.ok
        lo = jnp.where(ok, jnp.clip(lo, 0, d - 1), 0).astype(jnp.int32)
        hi = jnp.where(ok, jnp.clip(hi, 0, d - 1), d - 1).astype(jnp.int32)
        ivals.append((lo, hi))
    row = jnp.int32(0)
    for (lo, hi), d in zip(ivals[:-1], shape[:-1]):
        exact = exact & (lo == hi)
        row = row * d + lo
    lo, hi = ivals[-1]
    k = _floor_log2(hi - lo + 1)
    right = hi - (jnp.int32(1) << k) + 1
    levels, rows, n = tmin.shape
    # Flat 1-D gathers: XLA:CPU compiles them far faster than 3-D advanced indexing.
    base = (k * rows + row) * n
    flat_min, flat_max = tmin.reshape(-1), tmax.reshape(-1)
    lo_v = jnp.minimum(flat_min[base + lo], flat_min[base + right])
    hi_v = jnp.maximum(flat_max[base + lo], flat_max[base + right])
    # Leading axes read over a range: fall back to the whole array's range (sound).
    lo_v, hi_v = jnp.where(exact, lo_v, gmin), jnp.where(exact, hi_v, gmax)
    if operand.value.dtype == jnp.bool_:
        return Bool(lo_v == 1, hi_v == 0)
    ok = True
    if _is_float(lo_v.dtype):
        ok = ~jnp.isnan(lo_v) & ~jnp.isnan(hi_v)
    return Num(lo_v, hi_v, ok)


_RULES = {
    "add": _add, "sub": _sub, "mul": _mul, "div": _div, "rem": _rem, "neg": _neg, "abs": _abs,
    "max": _max, "min": _min, "clamp": _clamp, "sign": _monotone(jnp.sign),
    "floor": _monotone(jnp.floor), "ceil": _monotone(jnp.ceil),
    "convert_element_type": _convert,
    "squeeze": _identity, "reshape": _identity, "broadcast_in_dim": _identity, "expand_dims": _identity,
    "copy": _identity, "copy_p": _identity,
    "lt": _compare("lt"), "le": _compare("le"), "gt": _compare("gt"), "ge": _compare("ge"),
    "eq": _compare("eq"), "ne": _compare("ne"),
    "and": _and, "or": _or, "not": _not, "xor": _xor, "select_n": _select_n,
    "dynamic_slice": _dynamic_slice,
}


def _top_for(aval):
    return _unknown_bool() if aval.dtype == jnp.bool_ else TOP


def _eval(nodes, env: dict, name: str):
    """Runs ``nodes`` (``_modir.Node``) on abstract values in ``env`` (var id -> value)."""

    def read(x):
        return _const(x.val) if isinstance(x, Lit) else env[x]

    for node in nodes:
        ins = [read(x) for x in node.ins]
        rule = _RULES.get(node.prim.name)
        if node.prim.name == "custom_jvp_call":  # an elementwise call the IR keeps whole
            sub_nodes, sub_ins, sub_outs = inline_call(node, name, "the block-mask analysis")
            sub_env = dict(zip(sub_ins, ins))
            _eval(sub_nodes, sub_env, name)
            outs = [_const(o.val) if isinstance(o, Lit) else sub_env[o] for o in sub_outs]
        elif rule is not None and len(node.outs) == 1:
            outs = [rule(node, *ins)]
        else:
            outs = [_top_for(a) for a in node.out_avals]
        for o, aval, val in zip(node.outs, node.out_avals, outs):
            env[o] = _top_for(aval) if val is TOP else val
    return env


def classify(mask, consts, b, h, q_lo, q_hi, kv_lo, kv_hi):
    """Per tile: (all pairs attend, no pair attends), bool arrays of the arguments' broadcast shape.

    Args:
      mask: the mask_mod's StaticMod (its jaxpr takes the captured arrays first).
      consts: its captured arrays (concrete or traced).
      b, h: int32 batch / head index of each tile (single values per tile).
      q_lo, q_hi, kv_lo, kv_hi: int32 inclusive index ranges of each tile (valid
        positions only: padding is the caller's business).
    """
    shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in (b, h, q_lo, q_hi, kv_lo, kv_hi)))
    args = [Num(b, b, True), Num(h, h, True), Num(q_lo, q_hi, True), Num(kv_lo, kv_hi, True)]
    try:
        ir = flatten(mask, "pallas", bake=True)
    except NotImplementedError:  # a call whose body cannot be opened: nothing is known
        out = None
    else:
        env = {**{v: _const(c) for v, c in zip(ir.consts, consts)}, **{v: _const(c) for v, c in ir.baked.items()},
               **dict(zip(ir.args, args))}
        _eval(ir.nodes, env, mask.name)
        out = _const(ir.out.val) if isinstance(ir.out, Lit) else env[ir.out]
    if not isinstance(out, Bool):
        out = _unknown_bool()
    return jnp.broadcast_to(out.t, shape), jnp.broadcast_to(out.f, shape)
