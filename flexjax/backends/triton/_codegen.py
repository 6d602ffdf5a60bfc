"""Triton source for a compiled mod: the kernel part as a ``@triton.jit`` function, and its VJP.

The mod compiler (``flexjax._modcompiler``) has already split the mod into an XLA
prologue and a kernel part of first-order nodes with scalar semantics. Every node
becomes one elementwise Triton statement on tiles: ``score`` [BM, BN], ``q_idx``
[BM, 1], ``kv_idx`` [1, BN], hoisted rows [BM, 1] and columns [1, BN], scalars ``b`` and
``h``; Triton broadcasts them as NumPy does. Reads of captured arrays become
``tl.load`` from the array's flat pointer at clamped indices (the same clamping as
XLA's ``dynamic_slice`` and ``gather``).

The backward function is generated from a jaxpr of ``jax.vjp`` of the kernel part, traced
at scalar shapes with the loaded array values as inputs: it recomputes the forward part
(for the loads and their flat indices), then the VJP, and returns dS and the gradients of
the float rows, columns and array reads as [BM, BN] tiles.

Signatures (``GeneratedMod.fwd`` / ``.bwd`` name them):

- score forward: ``fwd(score, b, h, q_idx, kv_idx, row_0.., col_0.., arr_0..)`` -> float32 tile
- mask forward: ``fwd(b, h, q_idx, kv_idx, row_0.., col_0.., arr_0..)`` -> int1 tile
- score backward: ``bwd(score, b, h, q_idx, kv_idx, row_0.., col_0.., arr_0.., dout)`` ->
  ``(dscore, drow.., dcol.., idx_0, d_0, idx_1, d_1, ..)``, one (flat int32 index, float32
  gradient) pair per float read (``GeneratedMod.grad_reads``).

Bool rows, columns and arrays arrive stored as int32 (the prologue's storage dtype).
Every primitive without a translation raises ``NotImplementedError`` naming it and the mod,
before any kernel is built. Only ``tl`` functions that Triton's interpreter also runs are
emitted (tanh, log1p and expm1 are written out), so the interpreter checks the very code a
GPU compiles.
"""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from ..._jaxpr import open_jaxpr
from ..._modcompiler import CompiledMod, refusing
from ..._modir import (
    READS,
    TANH_SMALL,
    VALUE_IDENTITY,
    Flattener,
    Lit,
    inline_call,
    int_pow_plan,
    read_indices,
    read_problem,
    tanh_series,
)

_TL_DTYPES = {
    "float32": "tl.float32", "float16": "tl.float16", "bfloat16": "tl.bfloat16", "float64": "tl.float64",
    "int32": "tl.int32", "int64": "tl.int64", "int16": "tl.int16", "int8": "tl.int8",
    "uint32": "tl.uint32", "uint16": "tl.uint16", "uint8": "tl.uint8", "bool": "tl.int1",
}

_BINARY = {"add": "+", "add_any": "+", "sub": "-", "mul": "*", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==",
           "ne": "!=", "and": "&", "or": "|", "xor": "^", "shift_left": "<<", "shift_right_arithmetic": ">>"}
_UNARY_TL = {"exp": "tl.exp", "exp2": "tl.exp2", "log": "tl.log", "sin": "tl.sin", "cos": "tl.cos",
             "floor": "tl.floor", "ceil": "tl.ceil", "erf": "tl.erf", "abs": "tl.abs", "sqrt": "tl.sqrt_rn",
             "log2": "tl.log2"}  # log2: a primitive of its own from JAX 0.11
# Functions written out in tl ops (``_HELPERS``), accurate to a few float32 ulp.
_UNARY_HELPER = {"tanh": "tanh", "log1p": "log1p", "expm1": "expm1", "logistic": "logistic"}

_HELPERS = {
    # _modir.TANH_SERIES below |x| < 0.3; beyond, (1 - t) / (1 + t) with t = exp(-2|x|).
    "tanh": f'''
@triton.jit
def {{p}}_tanh(x):
    x2 = x * x
    small = {tanh_series("x", "x2")}
    t = tl.exp(-2.0 * tl.abs(x))
    big = (1.0 - t) / (1.0 + t)
    return tl.where(tl.abs(x) < {TANH_SMALL}, small, tl.where(x < 0, -big, big))
''',
    # Goldberg's log1p and Kahan's expm1: exact where 1 + x (exp(x)) rounds to 1, relative
    # error of a few ulp elsewhere.
    "log1p": '''
@triton.jit
def {p}_log1p(x):
    u = 1.0 + x
    d = tl.where(u == 1.0, 1.0, u - 1.0)
    r = tl.where(u == 1.0, x, tl.log(u) * (x / d))
    return tl.where(u == float("inf"), u, r)
''',
    "expm1": '''
@triton.jit
def {p}_expm1(x):
    u = tl.exp(x)
    lu = tl.where((u == 1.0) | (u == 0.0), 1.0, tl.log(u))
    r = tl.where(u == 1.0, x, (u - 1.0) * (x / lu))
    return tl.where(u == float("inf"), u, tl.where(u - 1.0 == -1.0, -1.0, r))
''',
    "logistic": '''
@triton.jit
def {p}_logistic(x):
    return 1.0 / (1.0 + tl.exp(-x))
''',
}


@dataclasses.dataclass(frozen=True)
class GeneratedMod:
    """Triton source of one compiled mod.

    Attributes:
      source: module-level ``@triton.jit`` functions; the module must ``import triton`` and
        ``import triton.language as tl``.
      fwd, bwd: names of the forward and (score mods only, else None) backward functions.
      rows, cols, arrays: how many row tiles, column tiles and array pointers they take.
      row_float, col_float: which rows / columns are float (the backward returns their gradients).
      row_scalar: which rows do not depend on q_idx: the kernels load them as one scalar per
        (b, h) program, not as a [TQ, 1] tile (a captured scalar would take a register per row).
      grad_reads: per float read whose gradient the backward returns, the array it reads.
      key: a digest of the source, for the caller's caches and kernel names.
    """

    source: str
    fwd: str
    bwd: str | None
    rows: int
    cols: int
    arrays: int
    row_float: tuple
    col_float: tuple
    grad_reads: tuple
    key: str
    row_scalar: tuple = ()


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def _tl(dtype) -> str:
    name = jnp.dtype(dtype).name
    if name not in _TL_DTYPES:
        raise NotImplementedError(f"the triton backend has no Triton type for dtype {name}")
    return _TL_DTYPES[name]


def _literal(val: np.ndarray) -> str:
    """A typed 0-d tensor holding ``val``."""
    val = np.asarray(val).reshape(())
    if val.dtype == np.bool_:
        return f"tl.full([], {int(bool(val))}, tl.int1)"
    if np.issubdtype(val.dtype, np.floating) or val.dtype.name == "bfloat16":
        x = float(val)
        text = 'float("nan")' if np.isnan(x) else ('float("inf")' if x == np.inf else
                                                   ('-float("inf")' if x == -np.inf else repr(x)))
        return f"tl.full([], {text}, {_tl(val.dtype)})"
    return f"tl.full([], {int(val)}, {_tl(val.dtype)})"


class _Emitter:
    """Writes one function body: one statement per node, values named v0, v1, ..."""

    def __init__(self, mod_name: str, prefix: str, where: str = ""):
        self.lines: list[str] = []
        self.count = 0
        self.mod_name, self.prefix, self.where = mod_name, prefix, where
        self.helpers: set[str] = set()

    def assign(self, expr: str) -> str:
        name = f"v{self.count}"
        self.count += 1
        self.lines.append(f"    {name} = {expr}")
        return name

    def value(self, x, env):
        if isinstance(x, Lit):
            if np.asarray(x.val).size != 1:
                # An index vector given as a literal (gather of constant indices).
                return [_literal(v) for v in np.asarray(x.val).reshape(-1)]
            return _literal(x.val)
        return env[x]

    def unsupported(self, prim: str):
        return NotImplementedError(
            f"the triton backend has no Triton translation for primitive {prim!r} in mod {self.mod_name!r}"
            f"{self.where}; rewrite the mod without it or use backend='pallas' or 'xla'")

    def node(self, node, env, load=None):
        """Emits ``node``; returns its output expressions (a list per output for index vectors)."""
        name = node.prim.name
        if name in READS:
            if load is None:
                raise self.unsupported(name)
            return [load(node, env)]
        ins = [self.value(x, env) for x in node.ins]
        if name == "custom_jvp_call":
            # Its body, inlined (the VJP was traced through its own rule already).
            sub_nodes, sub_ins, outs = inline_call(node, self.mod_name, "triton")
            sub_env = dict(zip(sub_ins, ins))
            for n in sub_nodes:
                sub_env.update(zip(n.outs, self.node(n, sub_env)))
            return [self.value(o, sub_env) for o in outs]
        if name == "concatenate":
            return [[c for v in ins for c in (v if isinstance(v, list) else [v])]]
        if name in VALUE_IDENTITY:
            return [ins[0]]
        if any(isinstance(v, list) for v in ins):
            n = max(len(v) for v in ins if isinstance(v, list))
            return [[self._op(node, [v[i] if isinstance(v, list) else v for v in ins]) for i in range(n)]]
        return [self._op(node, ins)]

    def _op(self, node, ins) -> str:
        rule = _RULES.get(node.prim.name)
        if rule is None:
            raise self.unsupported(node.prim.name)
        return rule(self, node, ins)

    def int_pow(self, x: str, y: int, fl: bool) -> str:
        """``x ** y`` by repeated squaring (``_modir.int_pow_plan``)."""
        if y < 0 and not fl:
            raise self.unsupported("integer_pow")
        out = int_pow_plan(y, x, lambda a, b: self.assign(f"({a} * {b})"), f"({x} * 0 + 1)")
        if y < 0:
            return f"(1.0 / {out})"
        return f"({out} + 0)" if out == x else out


# -- the translation table: primitive -> rule(emitter, node, operand expressions) -> expression --

def _fl(node) -> bool:
    """Whether the node's first operand is a float."""
    return _is_float(node.in_avals[0].dtype if node.in_avals else node.out_avals[0].dtype)


def _binary(op):
    return lambda em, node, ins: em.assign(f"({ins[0]} {op} {ins[1]})")


def _unary_tl(fn):
    def rule(em, node, ins):
        if fn != "tl.abs" and not _fl(node):
            raise em.unsupported(node.prim.name)
        return em.assign(f"{fn}({ins[0]})")
    return rule


def _unary_helper(helper):
    def rule(em, node, ins):
        em.helpers.add(helper)
        return em.assign(f"{em.prefix}_{helper}({ins[0]})")
    return rule


def _max_min(em, node, ins):
    name, dtype = node.prim.name, node.out_avals[0].dtype
    if dtype == jnp.bool_:
        return em.assign(f"({ins[0]} {'|' if name == 'max' else '&'} {ins[1]})")
    nan = ", propagate_nan=tl.PropagateNan.ALL" if _fl(node) else ""
    return em.assign(f"{'tl.maximum' if name == 'max' else 'tl.minimum'}({ins[0]}, {ins[1]}{nan})")


def _clamp(em, node, ins):
    lo, x, hi = ins
    nan = ", propagate_nan=tl.PropagateNan.ALL" if _is_float(node.in_avals[1].dtype) else ""
    return em.assign(f"tl.minimum(tl.maximum({x}, {lo}{nan}), {hi}{nan})")


def _sign(em, node, ins):
    one, zero = ("1.0", "0.0") if _fl(node) else ("1", "0")
    t = _tl(node.out_avals[0].dtype)
    return em.assign(f"tl.where({ins[0]} > {zero}, tl.full([], {one}, {t}), "
                     f"tl.where({ins[0]} < {zero}, tl.full([], -{one}, {t}), {ins[0]}))")


def _select_n(em, node, ins):
    pred, *cases = ins
    if node.in_avals[0].dtype == jnp.bool_:
        return em.assign(f"tl.where({pred}, {cases[1]}, {cases[0]})")
    expr = cases[-1]
    for i in range(len(cases) - 2, -1, -1):
        expr = f"tl.where({pred} == {i}, {cases[i]}, {expr})"
    return em.assign(expr)


def _convert(em, node, ins):
    dtype = node.out_avals[0].dtype
    if dtype == jnp.bool_:
        return em.assign(f"({ins[0]} != 0)")
    return em.assign(f"{ins[0]}.to({_tl(dtype)})")


def _pow(em, node, ins):
    if not _fl(node) or not _is_float(node.in_avals[1].dtype):
        raise em.unsupported("pow")
    x, y = ins
    # x ** y for x > 0; x == 0 gives 0, 1 or inf; x < 0 an integer power with its sign, or NaN.
    mag = em.assign(f"tl.exp2({y} * tl.log2(tl.abs({x})))")
    odd = em.assign(f"(tl.floor({y} * 0.5) * 2.0 != {y})")
    whole = em.assign(f"(tl.floor({y}) == {y})")
    return em.assign(f"tl.where({x} < 0, tl.where({whole}, tl.where({odd}, -{mag}, {mag}), float(\"nan\")), {mag})")


def _polynomial(em, node, ins):
    """``c0 + x * (c1 + x * (... + x * cN))`` (JAX 0.12+), Horner's rule as JAX lowers it."""
    if node.out_avals[0].dtype == jnp.bool_:
        raise em.unsupported("polynomial")
    x, *coeffs = ins
    acc = em.assign(coeffs[-1])
    for k in reversed(coeffs[:-1]):
        acc = em.assign(f"({acc} * {x} + {k})")
    return acc


def _bitcast(em, node, ins):
    """Reinterprets a value's bits (JAX 0.12's erf gradient splits x^2 with it)."""
    src, out = node.in_avals[0].dtype, node.out_avals[0].dtype
    if jnp.bool_ in (src, out) or jnp.dtype(src).itemsize != jnp.dtype(out).itemsize:
        raise em.unsupported("bitcast_convert_type")
    return em.assign(f"{ins[0]}.to({_tl(out)}, bitcast=True)")


def _shift_right_logical(em, node, ins):
    t = _tl(node.out_avals[0].dtype)
    ut = t.replace("tl.int", "tl.uint")
    return em.assign(f"({ins[0]}.to({ut}, bitcast=True) >> {ins[1]}.to({ut}, bitcast=True)).to({t}, bitcast=True)")


_RULES = {
    **{name: _binary(op) for name, op in _BINARY.items()},
    **{name: _unary_tl(fn) for name, fn in _UNARY_TL.items()},
    **{name: _unary_helper(h) for name, h in _UNARY_HELPER.items()},
    "div": lambda em, node, ins: em.assign(f"({ins[0]} / {ins[1]})" if _fl(node) else f"({ins[0]} // {ins[1]})"),
    # Triton's % is C's fmod / srem, as lax.rem (the sign of the dividend).
    "rem": lambda em, node, ins: em.assign(f"({ins[0]} % {ins[1]})"),
    "neg": lambda em, node, ins: em.assign(f"(-{ins[0]})"),
    "not": lambda em, node, ins: em.assign(f"({ins[0]} == 0)" if node.out_avals[0].dtype == jnp.bool_
                                           else f"(~{ins[0]})"),
    "max": _max_min,
    "min": _max_min,
    "clamp": _clamp,
    "sign": _sign,
    "select_n": _select_n,
    "convert_element_type": _convert,
    "integer_pow": lambda em, node, ins: em.assign(em.int_pow(ins[0], node.params["y"], _fl(node))),
    "square": lambda em, node, ins: em.assign(em.int_pow(ins[0], 2, _fl(node))),
    # 1 - x * x (JAX 0.11+ differentiates tanh with it), as JAX lowers it: (1 + x) * (1 - x).
    "one_minus_square": lambda em, node, ins: em.assign(
        f"(({'1.0' if _fl(node) else '1'} + {ins[0]}) * ({'1.0' if _fl(node) else '1'} - {ins[0]}))"),
    "polynomial": _polynomial,  # JAX 0.12+
    "bitcast_convert_type": _bitcast,
    "pow": _pow,
    "rsqrt": lambda em, node, ins: em.assign(f"(1.0 / tl.sqrt_rn({ins[0]}))"),
    "is_finite": lambda em, node, ins: em.assign(f"(tl.abs({ins[0]}) < float(\"inf\"))"),
    "shift_right_logical": _shift_right_logical,
}
# What a mod may use: the table, the identities, one-element reads, index vectors and kept calls.
SUPPORTED_PRIMITIVES = frozenset(set(_RULES) | VALUE_IDENTITY | READS | {"concatenate", "custom_jvp_call"})


def _read_loader(em: _Emitter, cm: CompiledMod, arrays: dict, record: list):
    """``load(node, env)`` for the forward part: a ``tl.load`` at clamped flat indices."""

    def clamp(i, n):
        return em.assign(f"tl.minimum(tl.maximum({i}.to(tl.int32), 0), {n - 1})")

    def load(node, env):
        operand = node.ins[0]
        shape = node.in_avals[0].shape
        k = arrays[operand]
        problem = read_problem(node)
        if problem is not None:
            raise NotImplementedError(f"mod {cm.name!r} {problem}")
        raw, fill = read_indices(node, lambda x: em.value(x, env), "0")
        if fill is not None:
            inside = " & ".join(f"({r} >= 0) & ({r} < {n})" for r, n in zip(raw, shape))
            fill = (em.assign(f"({inside})"), fill)
        idx = [clamp(r, n) for r, n in zip(raw, shape)]
        flat = idx[0]
        for i, n in zip(idx[1:], shape[1:]):
            flat = em.assign(f"({flat} * {n} + {i})")
        val = em.assign(f"tl.load(a{k} + {flat})")
        out_dtype = node.out_avals[0].dtype
        if out_dtype == jnp.bool_:
            val = em.assign(f"({val} != 0)")
        if fill is not None:
            inside, fv = fill
            val = em.assign(f"tl.where({inside}, {val}, {_literal(np.asarray(fv, out_dtype))})")
        record.append((k, flat, val, out_dtype))
        return val

    return load


def _bcast(expr: str, dtype) -> str:
    """``expr`` broadcast to the [BM, BN] tile ``_zi`` (an int32 zero tile)."""
    if dtype == jnp.bool_:
        return f"(({expr}) | (_zi != 0))"
    return f"(({expr}) + _zi.to({_tl(dtype)}))"


def _forward_body(cm: CompiledMod, em: _Emitter, record: list) -> dict:
    """Emits the kernel part; returns the env (var id -> expression)."""
    env: dict = {}
    names = ("b", "h", "q_idx", "kv_idx") if cm.mod.kind == "mask" else ("score", "b", "h", "q_idx", "kv_idx")
    env.update(zip(cm.args, names))
    for k, v in enumerate(cm.rows):
        env[v] = f"(r{k} != 0)" if cm.avals[v].dtype == jnp.bool_ else f"r{k}"
    for k, v in enumerate(cm.cols):
        env[v] = f"(c{k} != 0)" if cm.avals[v].dtype == jnp.bool_ else f"c{k}"
    arrays = {a: k for k, a in enumerate(cm.arrays)}
    load = _read_loader(em, cm, arrays, record)
    for node, side in zip(cm.nodes, cm.side):
        if side != "k":
            continue
        outs = em.node(node, env, load)
        env.update(zip(node.outs, outs))
    return env


def _params(cm: CompiledMod) -> list[str]:
    lead = ["b", "h", "q_idx", "kv_idx"] if cm.mod.kind == "mask" else ["score", "b", "h", "q_idx", "kv_idx"]
    return (lead + [f"r{k}" for k in range(len(cm.rows))] + [f"c{k}" for k in range(len(cm.cols))]
            + [f"a{k}" for k in range(len(cm.arrays))])


def _vjp_nodes(cm: CompiledMod, read_dtypes):
    """Flat nodes of the kernel part's VJP, traced at scalar shapes.

    Inputs (in order): score, b, h, q_idx, kv_idx, rows, cols, loaded values, cotangent.
    Outputs: d score, d float rows, d float cols, d float reads.
    """
    row_dt = [cm.storage_dtype(r) for r in cm.rows]
    col_dt = [cm.storage_dtype(c) for c in cm.cols]

    def g(score, b, h, q, kv, rows, cols, loaded, ct):
        fr = [i for i, d in enumerate(row_dt) if _is_float(d)]
        fc = [i for i, d in enumerate(col_dt) if _is_float(d)]
        fl = [i for i, d in enumerate(read_dtypes) if _is_float(d)]

        def f(s, rf, cf, lf):
            rs, cs, ls = list(rows), list(cols), list(loaded)
            for i, x in zip(fr, rf):
                rs[i] = x
            for i, x in zip(fc, cf):
                cs[i] = x
            for i, x in zip(fl, lf):
                ls[i] = x
            it = iter(ls)
            return cm.evaluate(s, b, h, q, kv, tuple(rs), tuple(cs), lambda k, idx: next(it))

        _, vjp = jax.vjp(f, score, [rows[i] for i in fr], [cols[i] for i in fc], [loaded[i] for i in fl])
        return vjp(ct)

    scal = lambda d: jax.ShapeDtypeStruct((), d)  # noqa: E731
    i32 = scal(jnp.int32)
    score_dt = cm.avals[cm.args[0]].dtype
    closed = jax.make_jaxpr(g)(scal(score_dt), i32, i32, i32, i32, [scal(d) for d in row_dt],
                               [scal(d) for d in col_dt], [scal(d) for d in read_dtypes], scal(score_dt))
    jaxpr, consts = open_jaxpr(closed)
    fl = Flattener(cm.name, "triton")
    ins = [fl.new(v.aval) for v in jaxpr.invars]
    const_ins = [fl._const(c) for c in consts]
    outs = fl.run(jaxpr, const_ins + ins, [*jaxpr.constvars, *jaxpr.invars])
    return fl.nodes, ins, outs, fl.avals


_CACHE: dict = {}


def generate(cm: CompiledMod, prefix: str) -> GeneratedMod:
    """Triton source for ``cm`` (compiled for target "triton"), cached by the mod's key.

    Raises:
      NotImplementedError: naming the first primitive (or read) without a translation.
    """
    key = (cm.mod, cm.target, prefix)
    if key not in _CACHE:
        with refusing("triton", cm.name, "generate Triton source for"):
            _CACHE[key] = _generate(cm, prefix)
    return _CACHE[key]


def _generate(cm: CompiledMod, prefix: str) -> GeneratedMod:
    if not prefix.isidentifier():
        raise ValueError(f"prefix must be a Python identifier, got {prefix!r}")
    kind = cm.mod.kind
    params = _params(cm)
    zi = "    _zi = q_idx * 0 + kv_idx * 0"

    em = _Emitter(cm.name, prefix)
    record: list = []
    env = _forward_body(cm, em, record)
    out = em.value(cm.out, env)
    out_dtype = cm.avals[cm.out].dtype if not isinstance(cm.out, Lit) else np.asarray(cm.out.val).dtype
    if kind == "mask":
        ret = _bcast(out if out_dtype == jnp.bool_ else f"({out} != 0)", jnp.bool_)
    else:
        ret = _bcast(f"{out}.to(tl.float32)", jnp.float32)
    fwd_src = "\n".join([f"@triton.jit\ndef {prefix}_fwd({', '.join(params)}):", zi, *em.lines,
                         f"    return {ret}"])
    sources = [fwd_src]
    helpers = set(em.helpers)

    row_float = tuple(_is_float(cm.storage_dtype(r)) for r in cm.rows)
    col_float = tuple(_is_float(cm.storage_dtype(c)) for c in cm.cols)
    grad_reads: tuple = ()
    bwd_name = None
    if kind == "score":
        bem = _Emitter(cm.name, prefix, " in its gradient")
        brec: list = []
        benv = _forward_body(cm, bem, brec)
        read_dtypes = [d for _, _, _, d in brec]
        nodes, ins, outs, avals = _vjp_nodes(cm, read_dtypes)
        bound = ["score", "b", "h", "q_idx", "kv_idx"]
        bound += [benv[v] for v in cm.rows] + [benv[v] for v in cm.cols]
        # The VJP's inputs are the stored rows/cols (bool as int32) and the loaded values.
        bound[5:5 + len(cm.rows) + len(cm.cols)] = [f"r{k}" for k in range(len(cm.rows))] + [
            f"c{k}" for k in range(len(cm.cols))]
        bound += [val for _, _, val, _ in brec] + ["dout"]
        venv = dict(zip(ins, bound))
        for node in nodes:
            outs_ = bem.node(node, venv)
            venv.update(zip(node.outs, outs_))
        n_fr, n_fc = sum(row_float), sum(col_float)
        out_vals = [bem.value(o, venv) for o in outs]
        rets = [_bcast(f"{out_vals[0]}.to(tl.float32)", jnp.float32)]
        rets += [_bcast(f"{v}.to(tl.float32)", jnp.float32) for v in out_vals[1:1 + n_fr + n_fc]]
        float_reads = [(k, flat) for k, flat, _, d in brec if _is_float(d)]
        for (_, flat), v in zip(float_reads, out_vals[1 + n_fr + n_fc:]):
            rets += [_bcast(flat, jnp.int32), _bcast(f"{v}.to(tl.float32)", jnp.float32)]
        grad_reads = tuple(k for k, _ in float_reads)
        bwd_name = f"{prefix}_bwd"
        sources.append("\n".join([f"@triton.jit\ndef {bwd_name}({', '.join(params + ['dout'])}):", zi,
                                  *bem.lines, f"    return {', '.join(rets)},"]))
        helpers |= bem.helpers
    head = [_HELPERS[h].format(p=prefix).strip("\n") for h in sorted(helpers)]
    source = "\n\n\n".join(head + sources) + "\n"
    return GeneratedMod(source=source, fwd=f"{prefix}_fwd", bwd=bwd_name, rows=len(cm.rows), cols=len(cm.cols),
                        arrays=len(cm.arrays), row_float=row_float, col_float=col_float, grad_reads=grad_reads,
                        key=hashlib.sha256(source.encode()).hexdigest()[:16],
                        row_scalar=tuple(not reads for reads in cm.row_reads_q))

