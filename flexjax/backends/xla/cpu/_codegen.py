"""C++ for a mod: one function that rewrites a transposed score tile in place.

The CPU kernel (``kernel.cc``) holds a score tile as ``s[c * ld + r]``: kv position
``kv0 + c``, query row ``q0 + r``. A generated function walks the tile's kv positions and,
for each, its query rows 16 at a time (GCC vector extensions, one lane per query row).
Every node of the mod's jaxpr becomes one C++ statement. Values that depend only on
``b``, ``h``, ``kv_idx`` and captured scalars are *uniform* over the lanes: they are
computed as scalars once per kv position, outside the lane loop. The others (anything
reading ``score`` or ``q_idx``) are 16-lane vectors. Captured arrays are read at clamped
indices, as XLA's ``dynamic_slice`` and ``gather`` do.

- score mods: ``s = score_mod(s, b, h, q_idx, kv_idx)`` in float32;
- mask mods: ``s = mask_mod(b, h, q_idx, kv_idx) ? s : -inf``.

A primitive or dtype without a translation raises ``NotImplementedError`` naming it; the
xla backend then runs its own loops instead (the same result, without this kernel).
"""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from ...._jaxpr import open_jaxpr
from ...._modcompiler import refusing
from ...._modir import (
    READS,
    TANH_SMALL,
    VALUE_IDENTITY,
    Lit,
    flatten,
    inline_call,
    int_pow_plan,
    read_indices,
    read_problem,
    tanh_series,
)
from ...._trace import StaticMod

_ARITH = {"add": "+", "add_any": "+", "sub": "-", "mul": "*"}
_CMP = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_BITS = {"and": "&", "or": "|", "xor": "^"}
# Unary float functions: (scalar C++ function, vector helper or None for a lane loop).
_UNARY = {"exp": ("fj_exp", "fj_vexp"), "log": ("logf", None), "tanh": ("fj_tanh", "fj_vtanh"),
          "logistic": ("fj_logistic", "fj_vlogistic"), "log1p": ("log1pf", None), "expm1": ("expm1f", None),
          "sin": ("sinf", None), "cos": ("cosf", None), "erf": ("erff", None), "sqrt": ("sqrtf", None),
          "floor": ("floorf", None), "ceil": ("ceilf", None), "exp2": ("exp2f", None),
          "rsqrt": ("fj_rsqrt", None), "abs": ("fabsf", None), "log2": ("log2f", None)}  # log2: JAX 0.11+

_C_SCALAR = {"float32": "float", "int32": "int32_t", "uint32": "uint32_t", "bool": "bool"}
_C_VECTOR = {"float32": "v16", "int32": "vi16", "uint32": "vu16", "bool": "vi16"}
_C_POINTER = {"float32": "const float*", "int32": "const int32_t*", "uint32": "const uint32_t*",
              "bool": "const uint8_t*"}

PRELUDE = r"""
#include "vec.h"  // v16 / vi16 / vu16, fj_ld, fj_st, fj_f, fj_i, fj_u, fj_vexp
static inline vi16 fj_b(bool x) { return fj_i(x ? -1 : 0); }
static inline float fj_exp(float x) { return expf(x); }
// _modir.TANH_SERIES below |x| < TANH_SMALL; beyond, (1 - t) / (1 + t) with t = exp(-2|x|).
static inline v16 fj_vtanh(v16 x) {
  v16 x2 = x * x;
  v16 small = TANH_SERIES_F;
  v16 ax = x < 0.0f ? -x : x;
  v16 t = fj_vexp(-2.0f * ax);
  v16 big = (1.0f - t) / (1.0f + t);
  v16 r = ax < TANH_SMALL_F ? small : (x < 0.0f ? -big : big);
  return x != x ? x : r;
}
static inline float fj_tanh(float x) { return tanhf(x); }
static inline v16 fj_vlogistic(v16 x) { return 1.0f / (1.0f + fj_vexp(-x)); }
static inline float fj_logistic(float x) { return 1.0f / (1.0f + expf(-x)); }
static inline float fj_rsqrt(float x) { return 1.0f / sqrtf(x); }
template <class T, class F> static inline T fj_bits(F x) { T r; std::memcpy(&r, &x, sizeof(r)); return r; }
static inline float fj_max(float a, float b) { return a != a ? a : (b != b ? b : (a > b ? a : b)); }
static inline float fj_min(float a, float b) { return a != a ? a : (b != b ? b : (a < b ? a : b)); }
static inline v16 fj_vmax(v16 a, v16 b) { return a != a ? a : (b != b ? b : (a > b ? a : b)); }
static inline v16 fj_vmin(v16 a, v16 b) { return a != a ? a : (b != b ? b : (a < b ? a : b)); }
static inline int32_t fj_f2i(float x) {
  return x != x ? 0 : (x >= 2147483648.0f ? INT_MAX : (x < -2147483648.0f ? INT_MIN : (int32_t)x));
}
static inline vi16 fj_vf2i(v16 x) {
  v16 c = x != x ? fj_f(0.0f) : x;
  c = c > 2147483520.0f ? fj_f(2147483520.0f) : c;
  c = c < -2147483648.0f ? fj_f(-2147483648.0f) : c;
  vi16 r = __builtin_convertvector(c, vi16);
  return x >= 2147483648.0f ? fj_i(INT_MAX) : r;
}
static inline int32_t fj_idiv(int32_t a, int32_t b) {
  return b == 0 ? -1 : ((a == INT_MIN && b == -1) ? INT_MIN : a / b);
}
static inline int32_t fj_irem(int32_t a, int32_t b) {
  return b == 0 ? a : ((a == INT_MIN && b == -1) ? 0 : a % b);
}
static inline uint32_t fj_udiv(uint32_t a, uint32_t b) { return b == 0 ? 0xFFFFFFFFu : a / b; }
static inline uint32_t fj_urem(uint32_t a, uint32_t b) { return b == 0 ? a : a % b; }
""".replace("TANH_SERIES_F", tanh_series("x", "x2", "f")).replace("TANH_SMALL_F", f"{TANH_SMALL!r}f")


@dataclasses.dataclass(frozen=True)
class GeneratedMod:
    """C++ source of one mod's tile function.

    Attributes:
      source: a translation unit (``PRELUDE`` included) that defines ``symbol``.
      symbol: the ``extern "C"`` function's name.
      key: a digest of the source.
    """

    source: str
    symbol: str
    key: str


class _Val:
    """A C++ expression: its text, whether it is a 16-lane vector, its dtype name."""

    __slots__ = ("text", "vec", "dtype")

    def __init__(self, text, vec, dtype):
        self.text, self.vec, self.dtype = text, vec, dtype


def _dtype_name(aval_or_dtype) -> str:
    dtype = getattr(aval_or_dtype, "dtype", aval_or_dtype)
    return jnp.dtype(dtype).name


class _Emitter:
    def __init__(self, mod: StaticMod):
        self.mod = mod
        self.outer: list[str] = []  # once per kv position
        self.inner: list[str] = []  # once per 16 query rows
        self.count = 0

    def unsupported(self, what: str):
        return NotImplementedError(f"the cpu kernel has no C++ translation for {what} in mod {self.mod.name!r}")

    def check_dtype(self, name: str):
        if name not in _C_SCALAR:
            raise self.unsupported(f"dtype {name}")
        return name

    def assign(self, text: str, vec: bool, dtype: str) -> _Val:
        self.check_dtype(dtype)
        name = f"t{self.count}"
        self.count += 1
        ctype = _C_VECTOR[dtype] if vec else _C_SCALAR[dtype]
        (self.inner if vec else self.outer).append(f"{ctype} {name} = {text};")
        return _Val(name, vec, dtype)

    def literal(self, val) -> _Val:
        arr = np.asarray(val)
        name = self.check_dtype(arr.dtype.name)
        x = arr.reshape(())
        if name == "bool":
            return _Val("true" if bool(x) else "false", False, name)
        if name == "float32":
            f = float(x)
            text = "NAN" if np.isnan(f) else ("INFINITY" if f == np.inf else ("(-INFINITY)" if f == -np.inf
                                                                              else f"{f!r}f"))
            return _Val(text, False, name)
        if name == "uint32":
            return _Val(f"((uint32_t){int(x)}u)", False, name)
        return _Val(f"((int32_t){int(x)})", False, name)

    def vec(self, v: _Val) -> str:
        """``v`` as a vector expression (scalars broadcast)."""
        if v.vec:
            return v.text
        return {"float32": "fj_f", "int32": "fj_i", "uint32": "fj_u", "bool": "fj_b"}[v.dtype] + f"({v.text})"


def _lanes(em: _Emitter, lane_expr: str, dtype: str) -> _Val:
    """A vector computed lane by lane: ``lane_expr`` is lane ``_l``'s scalar value (bools as -1 / 0)."""
    name = f"t{em.count}"
    em.count += 1
    em.inner.append(f"{_C_VECTOR[dtype]} {name}; for (int _l = 0; _l < 16; ++_l) {name}[_l] = {lane_expr};")
    return _Val(name, True, dtype)


def _lane_loop(em: _Emitter, fn: str, args: list[str], dtype: str) -> _Val:
    """A vector computed lane by lane with a scalar function."""
    return _lanes(em, f"{fn}({', '.join(f'{a}[_l]' for a in args)})", dtype)


class _Ctx:
    """What a rule reads about one application: the output dtype, whether it is a vector, the
    first operand's float-ness, and the operands' texts (as vectors when the result is one)."""

    __slots__ = ("em", "node", "ins", "out", "vec", "fl")

    def __init__(self, em: _Emitter, node, ins: list[_Val]):
        self.em, self.node, self.ins = em, node, ins
        self.out = em.check_dtype(_dtype_name(node.out_avals[0]))
        self.vec = any(v.vec for v in ins)
        self.fl = ins[0].dtype == "float32" if ins else False

    def args(self) -> list[str]:
        return [self.em.vec(v) if self.vec else v.text for v in self.ins]

    def assign(self, text: str) -> _Val:
        return self.em.assign(text, self.vec, self.out)

    def call(self, fn: str, args: list[str]) -> _Val:
        """``fn(args)``: one call on scalars, a lane loop on vectors."""
        return _lane_loop(self.em, fn, args, self.out) if self.vec else self.assign(f"{fn}({', '.join(args)})")


def _op(em: _Emitter, node, ins: list[_Val]) -> _Val:
    rule = _RULES.get(node.prim.name)
    if rule is None:
        raise em.unsupported(f"primitive {node.prim.name!r}")
    return rule(_Ctx(em, node, ins))


# -- the translation table: primitive -> rule(ctx) -> _Val -------------------------------------

def _arith(op):
    def rule(c: _Ctx):
        a, b = c.args()
        if c.out == "bool":
            raise c.em.unsupported(f"primitive {c.node.prim.name!r} on booleans")
        return c.assign(f"({a} {op} {b})")
    return rule


def _cmp(op):
    def rule(c: _Ctx):
        a, b = c.args()
        if c.ins[0].dtype == "bool" and not c.vec:
            return c.assign(f"((int)({a}) {op} (int)({b}))")
        return c.assign(f"({a} {op} {b})")
    return rule


def _bits(op):
    def rule(c: _Ctx):
        a, b = c.args()
        return c.assign(f"({a} {op} {b})")
    return rule


def _unary(name):
    scalar_fn, vec_fn = _UNARY[name]

    def rule(c: _Ctx):
        if name == "abs" and not c.fl:
            (a,) = c.args()
            return c.assign(f"(({a} < 0) ? -{a} : {a})")
        if not c.fl:
            raise c.em.unsupported(f"primitive {name!r} on {c.ins[0].dtype}")
        (a,) = c.args()
        if c.vec and vec_fn is not None:
            return c.assign(f"{vec_fn}({a})")
        return c.call(scalar_fn, [a])
    return rule


def _not(c: _Ctx):
    (a,) = c.args()
    return c.assign(f"(!{a})" if c.out == "bool" and not c.vec else f"(~{a})")


def _div(c: _Ctx):
    a, b = c.args()
    if c.fl:
        return c.assign(f"({a} / {b})")
    return c.call("fj_udiv" if c.out == "uint32" else "fj_idiv", [a, b])


def _rem(c: _Ctx):
    return c.call("fmodf" if c.fl else ("fj_urem" if c.out == "uint32" else "fj_irem"), c.args())


def _max_min(c: _Ctx):
    a, b = c.args()
    is_max = c.node.prim.name == "max"
    if c.out == "bool":
        return c.assign(f"({a} {'|' if is_max else '&'} {b})")
    if c.fl:
        fn = ("fj_vmax" if c.vec else "fj_max") if is_max else ("fj_vmin" if c.vec else "fj_min")
        return c.assign(f"{fn}({a}, {b})")
    return c.assign(f"(({a} {'>' if is_max else '<'} {b}) ? {a} : {b})")


def _clamp(c: _Ctx):
    lo, x, hi = c.args()
    if _dtype_name(c.node.in_avals[1]) == "float32":
        return c.assign(f"{'fj_vmin' if c.vec else 'fj_min'}({'fj_vmax' if c.vec else 'fj_max'}({x}, {lo}), {hi})")
    t = c.assign(f"(({x} < {lo}) ? {lo} : {x})")
    return c.assign(f"(({t.text} > {hi}) ? {hi} : {t.text})")


def _sign(c: _Ctx):
    (a,) = c.args()
    if c.fl:
        one, neg = ("fj_f(1.0f)", "fj_f(-1.0f)") if c.vec else ("1.0f", "-1.0f")
        return c.assign(f"(({a} > 0.0f) ? {one} : (({a} < 0.0f) ? {neg} : {a}))")
    if c.vec:
        return c.assign(f"(({a} > 0) ? fj_i(1) : (({a} < 0) ? fj_i(-1) : fj_i(0)))")
    return c.assign(f"(({a} > 0) ? 1 : (({a} < 0) ? -1 : 0))")


def _is_finite(c: _Ctx):
    (a,) = c.args()
    if c.vec:
        return c.assign(f"(({a} == {a}) & ({a} != INFINITY) & ({a} != -INFINITY))")
    return c.assign(f"std::isfinite({a})")


def _pow(c: _Ctx):
    if not c.fl or c.ins[1].dtype != "float32":
        raise c.em.unsupported("primitive 'pow' on integers")
    return c.call("powf", c.args())


def _one_minus_square(c: _Ctx):
    """``1 - x * x`` (JAX 0.11+ differentiates tanh with it), as JAX lowers it: ``(1 + x) * (1 - x)``."""
    if c.out == "bool":
        raise c.em.unsupported("primitive 'one_minus_square' on booleans")
    (a,) = c.args()
    one = c.em.literal(np.asarray(1, dtype=c.out))
    one = c.em.vec(one) if c.vec else one.text
    return c.assign(f"(({one} + {a}) * ({one} - {a}))")


def _polynomial(c: _Ctx):
    """``c0 + x * (c1 + x * (... + x * cN))`` (JAX 0.12+), Horner's rule as JAX lowers it."""
    if c.out == "bool":
        raise c.em.unsupported("primitive 'polynomial' on booleans")
    x, *coeffs = c.args()
    acc = c.assign(coeffs[-1])
    for k in reversed(coeffs[:-1]):
        acc = c.assign(f"({acc.text} * {x} + {k})")
    return acc


def _bitcast(c: _Ctx):
    """Reinterprets the bits of a 32-bit value (JAX 0.12's erf gradient splits x^2 with it)."""
    (a,) = c.args()
    src, out = c.ins[0].dtype, c.out
    if "bool" in (src, out):
        raise c.em.unsupported("primitive 'bitcast_convert_type' on booleans")
    if src == out:
        return c.ins[0]
    if c.vec:
        return c.assign(f"(({_C_VECTOR[out]})({a}))")
    return c.assign(f"fj_bits<{_C_SCALAR[out]}>({a})")


def _shift(c: _Ctx):
    a, b = c.args()
    name = c.node.prim.name
    if name == "shift_right_logical" and c.out == "int32":
        cast, back = ("(vu16)", "(vi16)") if c.vec else ("(uint32_t)", "(int32_t)")
        return c.assign(f"{back}({cast}({a}) >> {cast}({b}))")
    return c.assign(f"({a} {'<<' if name == 'shift_left' else '>>'} {b})")


def _select_n(c: _Ctx):
    pred, *cases = c.ins
    if not c.vec:
        texts, p = [x.text for x in cases], pred.text
    else:
        texts, p = [c.em.vec(x) for x in cases], c.em.vec(pred)
    if pred.dtype == "bool":
        return c.assign(f"({p} ? {texts[1]} : {texts[0]})")
    expr = texts[-1]
    for i in range(len(texts) - 2, -1, -1):
        expr = f"(({p} == {i}) ? {texts[i]} : {expr})"
    return c.assign(expr)


def _convert(c: _Ctx):
    (a,) = c.args()
    src, out, vec = c.ins[0].dtype, c.out, c.vec
    if src == out:
        return c.ins[0]
    if out == "bool":
        return c.assign(f"({a} != 0)")
    if src == "bool":
        one = {"float32": "1.0f", "int32": "1", "uint32": "1u"}[out]
        zero = {"float32": "0.0f", "int32": "0", "uint32": "0u"}[out]
        if vec:
            return c.assign(f"({a} ? {c.em.vec(_Val(one, False, out))} : {c.em.vec(_Val(zero, False, out))})")
        return c.assign(f"({a} ? {one} : {zero})")
    if src == "float32" and out == "int32":
        return c.assign(f"{'fj_vf2i' if vec else 'fj_f2i'}({a})")
    if src == "float32" and out == "uint32":
        raise c.em.unsupported("a float to uint32 conversion")
    if vec:
        return c.assign(f"__builtin_convertvector({a}, {_C_VECTOR[out]})")
    return c.assign(f"(({_C_SCALAR[out]})({a}))")


_RULES = {
    **{name: _arith(op) for name, op in _ARITH.items()},
    **{name: _cmp(op) for name, op in _CMP.items()},
    **{name: _bits(op) for name, op in _BITS.items()},
    **{name: _unary(name) for name in _UNARY},
    "not": _not,
    "neg": lambda c: c.assign(f"(-{c.args()[0]})"),
    "div": _div,
    "rem": _rem,
    "max": _max_min,
    "min": _max_min,
    "clamp": _clamp,
    "sign": _sign,
    "is_finite": _is_finite,
    "integer_pow": lambda c: _int_pow(c.em, c.ins[0], c.node.params["y"], c.vec, c.out),
    "square": lambda c: _int_pow(c.em, c.ins[0], 2, c.vec, c.out),
    "one_minus_square": _one_minus_square,  # JAX 0.11+
    "polynomial": _polynomial,  # JAX 0.12+
    "bitcast_convert_type": _bitcast,
    "pow": _pow,
    "shift_left": _shift,
    "shift_right_arithmetic": _shift,
    "shift_right_logical": _shift,
    "select_n": _select_n,
    "convert_element_type": _convert,
}
# What a mod may use in the C++ kernel: the table, the identities, one-element reads, index
# vectors and kept calls (their bodies are emitted in place).
SUPPORTED_PRIMITIVES = frozenset(set(_RULES) | VALUE_IDENTITY | READS | {"concatenate", "custom_jvp_call"})


def _int_pow(em, x: _Val, y: int, vec: bool, out: str) -> _Val:
    if y == 0:
        return em.literal(np.asarray(1, dtype=out))
    acc = int_pow_plan(y, x, lambda a, b: em.assign(f"({a.text} * {b.text})", vec, out), None)
    if y < 0:
        if out != "float32":
            raise em.unsupported("a negative integer_pow of an integer")
        return em.assign(f"(1.0f / {acc.text})", vec, out)
    return acc


def _clamped_index(em: _Emitter, v: _Val, n: int) -> _Val:
    if v.dtype not in ("int32", "uint32"):
        raise em.unsupported(f"an array index of dtype {v.dtype}")
    if v.dtype == "uint32":
        v = em.assign(f"(({v.text} > {n - 1}u) ? {em.vec(_Val(f'{n - 1}u', False, 'uint32')) if v.vec else f'{n - 1}u'}"
                      f" : {v.text})", v.vec, "uint32")
        return em.assign(f"__builtin_convertvector({v.text}, vi16)" if v.vec else f"((int32_t){v.text})", v.vec,
                         "int32")
    lo = em.assign(f"(({v.text} < 0) ? {em.vec(_Val('0', False, 'int32')) if v.vec else '0'} : {v.text})", v.vec,
                   "int32")
    hi = _Val(str(n - 1), False, "int32")
    return em.assign(f"(({lo.text} > {n - 1}) ? {em.vec(hi) if v.vec else hi.text} : {lo.text})", v.vec, "int32")


def _read(em: _Emitter, node, env, arrays: dict) -> _Val:
    operand = node.ins[0]
    if isinstance(operand, Lit) or operand not in arrays:
        raise em.unsupported(f"a read ({node.prim.name!r}) from a value that is not a captured array")
    shape = node.in_avals[0].shape
    ptr, dtype = arrays[operand]
    out = em.check_dtype(_dtype_name(node.out_avals[0]))
    problem = read_problem(node)
    if problem is not None:
        raise em.unsupported(f"a read that {problem}")
    raw, fv = read_indices(node, lambda x: _value(em, x, env), _Val("0", False, "int32"))
    fill = None
    if fv is not None:
        inside = None
        for r, n in zip(raw, shape):
            t = em.assign(f"(({r.text} >= 0) & ({r.text} < {n}))" if r.vec
                          else f"(({r.text} >= 0) && ({r.text} < {n}))", r.vec, "bool")
            inside = t if inside is None else em.assign(
                f"({em.vec(inside) if t.vec else inside.text} {'&' if t.vec or inside.vec else '&&'} "
                f"{em.vec(t) if inside.vec else t.text})", t.vec or inside.vec, "bool")
        fill = (inside, em.literal(np.asarray(fv, dtype=out)))
    idx = [_clamped_index(em, r, n) for r, n in zip(raw, shape)]
    flat = idx[0]
    for i, n in zip(idx[1:], shape[1:]):
        vec = flat.vec or i.vec
        a = em.vec(flat) if vec else flat.text
        b = em.vec(i) if vec else i.text
        flat = em.assign(f"({a} * {n} + {b})", vec, "int32")
    load = f"{ptr}[{{}}]" if dtype != "bool" else f"({ptr}[{{}}] != 0)"
    if flat.vec:
        lane = load.format(flat.text + "[_l]")
        val = _lanes(em, f"{lane} ? -1 : 0" if out == "bool" else lane, out)
    else:
        val = em.assign(load.format(flat.text), False, out)
    if fill is not None:
        inside, fv = fill
        vec = val.vec or inside.vec
        if vec:
            val = em.assign(f"({em.vec(inside)} ? {em.vec(val)} : {em.vec(fv)})", True, out)
        else:
            val = em.assign(f"({inside.text} ? {val.text} : {fv.text})", False, out)
    return val


def _value(em: _Emitter, x, env):
    if isinstance(x, Lit):
        arr = np.asarray(x.val)
        if arr.size != 1:
            return [em.literal(v) for v in arr.reshape(-1)]
        return em.literal(arr)
    return env[x]


def _emit_nodes(em: _Emitter, nodes, env, arrays):
    for node in nodes:
        name = node.prim.name
        if name in READS:
            env[node.outs[0]] = _read(em, node, env, arrays)
            continue
        if name == "custom_jvp_call":
            sub_nodes, sub_ins, outs = inline_call(node, em.mod.name, "xla")
            sub_env = {i: _value(em, x, env) for i, x in zip(sub_ins, node.ins)}
            _emit_nodes(em, sub_nodes, sub_env, {})
            for o, r in zip(node.outs, outs):
                env[o] = _value(em, r, sub_env)
            continue
        ins = [_value(em, x, env) for x in node.ins]
        if name == "concatenate":
            env[node.outs[0]] = [c for v in ins for c in (v if isinstance(v, list) else [v])]
            continue
        if name in VALUE_IDENTITY:
            env[node.outs[0]] = ins[0]
            continue
        if any(isinstance(v, list) for v in ins):
            n = max(len(v) for v in ins if isinstance(v, list))
            env[node.outs[0]] = [_op(em, node, [v[i] if isinstance(v, list) else v for v in ins]) for i in range(n)]
            continue
        if len(node.outs) != 1:
            raise em.unsupported(f"primitive {name!r} with several results")
        env[node.outs[0]] = _op(em, node, ins)


_CACHE: dict = {}


def generate(mod: StaticMod, const_avals: tuple, packed: bool = False) -> GeneratedMod:
    """The C++ tile function of ``mod`` whose captured arrays have ``const_avals``; cached.

    ``packed``: the variant for tiles whose lanes hold several query heads (the kernel's
    decode tiles, GQA heads packed into one tile's rows): ``h`` and ``q_idx`` are read per
    lane from two int32 arrays instead of being a scalar and ``q0 + lane``.

    Raises:
      NotImplementedError: naming the first primitive, dtype or read without a translation.
    """
    key = (mod, tuple((a.shape, _dtype_name(a)) for a in const_avals), packed)

    def make():
        with refusing("xla (C++ kernel)", mod.name, "generate C++ for"):
            return _generate(mod, const_avals, packed)

    return _cached(key, make)


def _cached(key, make) -> GeneratedMod:
    """``make()`` once per key; a NotImplementedError is cached and raised again."""
    if key not in _CACHE:
        try:
            _CACHE[key] = make()
        except NotImplementedError as e:
            _CACHE[key] = e
    got = _CACHE[key]
    if isinstance(got, Exception):
        raise got
    return got


@dataclasses.dataclass(frozen=True)
class _VjpMod:
    """The score_mod's VJP in the score (``kind`` "vjp"), as a jaxpr the generator reads like a mod's."""

    kind: str
    name: str
    jaxpr: object
    num_consts: int
    key: str


def generate_vjp(mod: StaticMod, const_avals: tuple) -> GeneratedMod:
    """C++ for ``d score = vjp(score_mod)(dout)`` on a transposed tile; cached like ``generate``.

    The function takes the unmodified scores ``s`` and the cotangent tile ``ds`` (rewritten
    in place). Gradients of the captured arrays are not produced (the caller checks none
    is wanted).
    """
    key = ("vjp", mod, tuple((a.shape, _dtype_name(a)) for a in const_avals))

    def make():
        n = mod.num_consts

        def f(*args):
            consts, (score, b, h, q, kv, ct) = args[:n], args[n:]
            _, pull = jax.vjp(lambda s_: mod(consts, s_, b, h, q, kv), score)
            return pull(ct)[0]

        scal = jax.ShapeDtypeStruct
        closed = jax.make_jaxpr(f)(*const_avals, scal((), jnp.float32), *(scal((), jnp.int32),) * 4,
                                   scal((), jnp.float32))
        jaxpr, consts = open_jaxpr(closed)
        if consts or jaxpr.constvars:
            raise NotImplementedError(f"the cpu kernel cannot take constants inside the VJP of mod {mod.name!r}")
        return _generate(_VjpMod("vjp", mod.name, jaxpr, n, f"vjp:{mod.key}"), const_avals)

    def guarded():
        with refusing("xla (C++ kernel)", mod.name, "generate the C++ VJP of"):
            return make()

    return _cached(key, guarded)


def _generate(mod, const_avals: tuple, packed: bool = False) -> GeneratedMod:
    ir = flatten(mod, "xla")
    out, consts, args = ir.out, ir.consts, ir.args
    em = _Emitter(mod)
    env: dict = {}
    arrays: dict = {}
    decls = []
    for k, (c, aval) in enumerate(zip(consts, const_avals)):
        dtype = _dtype_name(aval)
        if dtype not in _C_POINTER:
            raise em.unsupported(f"a captured array of dtype {dtype}")
        decls.append(f"{_C_POINTER[dtype]} __restrict a{k} = ({_C_POINTER[dtype]})arrays[{k}];")
        arrays[c] = (f"a{k}", dtype)
        if int(np.prod(aval.shape)) == 1:
            env[c] = em.assign(f"a{k}[0] != 0" if dtype == "bool" else f"a{k}[0]", False, dtype)
    names = {"score": ("score", "b", "h", "q_idx", "kv_idx"), "mask": ("b", "h", "q_idx", "kv_idx"),
             "vjp": ("score", "b", "h", "q_idx", "kv_idx", "dout")}[mod.kind]
    for a, n in zip(args, names):
        dtype = _dtype_name(ir.avals[a])
        want = "float32" if n in ("score", "dout") else "int32"
        if dtype != want:
            raise em.unsupported(f"argument {n} of dtype {dtype}")
    arg = dict(zip(names, args))
    env[arg["b"]] = _Val("b", False, "int32")
    env[arg["h"]] = _Val("h", packed, "int32")
    env[arg["kv_idx"]] = _Val("kv_idx", False, "int32")
    env[arg["q_idx"]] = _Val("q_idx", True, "int32")
    if mod.kind in ("score", "vjp"):
        env[arg["score"]] = _Val("score", True, "float32")
    if mod.kind == "vjp":
        env[arg["dout"]] = _Val("dout", True, "float32")
    _emit_nodes(em, ir.nodes, env, arrays)
    res = _value(em, out, env)
    if isinstance(res, list):
        raise em.unsupported("a mod whose result is not one value per position")
    symbol = "fj_" + hashlib.sha256(f"{mod.key}|{const_avals}|{packed}".encode()).hexdigest()[:20]
    if mod.kind == "mask":
        ok = em.vec(res) if res.dtype == "bool" else f"({em.vec(res)} != 0)"
        store = f"fj_st(p, {ok} ? fj_ld(p) : fj_f(-INFINITY));"
    else:
        if res.dtype == "float32":
            result = em.vec(res)
        elif res.dtype == "bool":
            result = f"({em.vec(res)} ? fj_f(1.0f) : fj_f(0.0f))"
        else:
            result = f"__builtin_convertvector({em.vec(res)}, v16)"
        store = f"fj_st(p, {result});"
    # score / mask: rewrite the tile s in place. vjp: ds = vjp(s, ds) (s the unmodified scores).
    head = ("const float* s, float* ds" if mod.kind == "vjp" else "float* s")
    tile = "ds" if mod.kind == "vjp" else "s"
    load = {"score": "      const v16 score = fj_ld(p); (void)score;",
            "vjp": "      const v16 score = fj_ld(s + (int64_t)c * ld + r); (void)score; const v16 dout = fj_ld(p);",
            "mask": ""}[mod.kind]
    if packed:
        rows = "const int32_t* hl, const int32_t* ql"
        lanes = ("      vi16 q_idx, h; std::memcpy(&q_idx, ql + r, sizeof(q_idx)); std::memcpy(&h, hl + r, sizeof(h)); "
                 "(void)q_idx; (void)h;")
    else:
        rows = "int h, int q0"
        lanes = "      const vi16 q_idx = (q0 + r) + iota; (void)q_idx;"
    body = [
        f'extern "C" void {symbol}({head}, int64_t ld, int nc, int nr, int b, {rows}, int kv0, '
        "const void* const* arrays) {",
        *("  " + d for d in decls),
        "  (void)b; (void)arrays;",
        "  vi16 iota; for (int _l = 0; _l < 16; ++_l) iota[_l] = _l;",
        "  for (int c = 0; c < nc; ++c) {",
        "    const int32_t kv_idx = kv0 + c; (void)kv_idx;",
        *("    " + line for line in em.outer),
        "    for (int r = 0; r < nr; r += 16) {",
        f"      float* p = {tile} + (int64_t)c * ld + r;",
        lanes,
        load,
        *("      " + line for line in em.inner),
        f"      {store}",
        "    }",
        "  }",
        "}",
    ]
    source = PRELUDE + "\n".join(line for line in body if line) + "\n"
    return GeneratedMod(source=source, symbol=symbol, key=hashlib.sha256(source.encode()).hexdigest()[:16])
