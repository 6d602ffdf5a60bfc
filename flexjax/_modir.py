"""The flat mod IR that the mod compiler and the kernel code generators consume.

``flatten(mod)`` turns a traced mod's jaxpr into one list of first-order ``Node``s, built
once per (mod, backend, bake) and cached:

- call primitives (``_jaxpr.CALL_BODY``: jit, checkpoint / remat2, closed_call, custom_jvp /
  custom_vjp calls) are inlined, except an elementwise ``custom_jvp_call`` on scalars, kept
  as one node so that differentiating the kernel part uses the function's own JVP rule;
- shape-only primitives on one-element values (``SHAPE_ONLY``: a mod has scalar semantics)
  are erased, their output being their input, unless ``erase=False`` (for consumers that
  bind the nodes as JAX primitives again, where shapes must agree);
- arrays that a nested call's body closes over become literals (one element) or, with
  ``bake``, vars whose values ``ModIR.baked`` holds.

One-element reads of captured arrays (``dynamic_slice``, ``gather`` with one index per
dimension, clamped or FILL_OR_DROP) carry one normalised form, ``Node.read`` (``Read``:
array, one index operand per dimension, fill), read through ``read_indices``, the one
place that also knows the primitives' params. Who consumes the IR: ``_modcompiler.compile_mod`` (the prologue hoister
and the pallas evaluation), ``backends/triton/_codegen.py`` and ``backends/xla/cpu/_codegen.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from ._jaxpr import CALL_BODY, body_of, call_body, collect_prims, open_jaxpr
from ._trace import StaticMod

# Primitives that only rename, reshape or reduce a value; on a one-element value (a mod has
# scalar semantics) each is the identity. ``stop_gradient`` is an identity too, but only for
# values: code that differentiates nodes must keep it (``VALUE_IDENTITY`` adds it).
SHAPE_ONLY = frozenset({"squeeze", "reshape", "broadcast_in_dim", "expand_dims", "copy", "copy_p", "reduce_sum",
                        "reduce_max", "reduce_min", "reduce_and", "reduce_or", "transpose", "optimization_barrier"})
VALUE_IDENTITY = SHAPE_ONLY | {"stop_gradient"}
READS = frozenset({"dynamic_slice", "gather"})


class Lit:
    """A literal operand."""

    __slots__ = ("val",)

    def __init__(self, val):
        self.val = val


@dataclasses.dataclass(frozen=True)
class Node:
    """One first-order primitive application; operands are var ids or Lit.

    ``read``: for a one-element read of an array (``dynamic_slice``, ``gather``), the same
    read in one normalised form (``Read``), whatever primitive and params JAX chose.
    """

    prim: Any
    params: dict
    ins: tuple
    outs: tuple[int, ...]
    in_avals: tuple
    out_avals: tuple
    read: Read | None = None


class Read(NamedTuple):
    """A one-element read ``array[index]``: ``index`` holds one operand per dimension of the
    array (None: index 0, a dimension the gather does not index), unclamped; ``fill`` is None
    for a clamped read (XLA clamps the start into the array), else the value read where an
    index is out of range (a FILL_OR_DROP gather; NaN or 0 when JAX leaves it unset)."""

    array: Any
    index: tuple
    fill: Any = None


def _size1(aval) -> bool:
    return int(np.prod(aval.shape)) == 1


class Flattener:
    """Inlines call primitives so the mod becomes one flat list of nodes.

    A call's body may close over arrays of its own (a ``jax.jit``-ed helper that reads a
    table): one-element ones become literals; with ``bake`` larger ones become vars whose
    values ``baked`` holds (constants the prologue hands the kernel like captured arrays),
    else they are refused.

    ``inline``: None inlines every call of ``CALL_BODY`` but an elementwise ``custom_jvp_call``
    (the kernels'); a set inlines the calls it names whose body opens and keeps the others
    as nodes (``TRANSPARENT_CALLS`` keeps derivatives exactly as JAX defines them).
    ``erase``: erase shape-only primitives on one-element values (off where shapes matter,
    as when the nodes are bound again as JAX primitives).
    """

    def __init__(self, mod_name: str, backend: str = "pallas", bake: bool = False,
                 inline: frozenset | None = None, erase: bool = True):
        self.inline, self.erase = inline, erase
        self.backend = backend
        self.nodes: list[Node] = []
        self.avals: dict[int, Any] = {}
        self.count = 0
        self.mod_name = mod_name
        self.bake = bake
        self.baked: dict[int, np.ndarray] = {}
        self.vectors: dict[int, tuple] = {}  # var id -> its components, for concatenated index vectors

    def new(self, aval) -> int:
        self.count += 1
        self.avals[self.count] = aval
        return self.count

    def atom(self, env, v):
        if isinstance(v, jex_core.Literal):
            return Lit(np.asarray(v.val, dtype=v.aval.dtype))
        return env[v]

    def run(self, jaxpr, args, invars=None) -> list:
        env = dict(zip(jaxpr.invars if invars is None else invars, args))
        for eqn in jaxpr.eqns:
            ins = [self.atom(env, v) for v in eqn.invars]
            name = eqn.primitive.name
            if self.inline is None:
                # Kept whole, so that differentiating the kernel part uses the function's own
                # JVP rule (jax.nn.relu's is 0 at 0; its inlined max(x, 0) would give 0.5).
                keep = name == "custom_jvp_call" and _elementwise_call(eqn)
            else:
                keep = name not in self.inline or call_body(eqn) is None
            if keep:
                outs = [self.new(v.aval) for v in eqn.outvars]
                self.nodes.append(Node(eqn.primitive, dict(eqn.params), tuple(ins), tuple(outs),
                                       tuple(v.aval for v in eqn.invars),
                                       tuple(v.aval for v in eqn.outvars)))
            elif (self.erase and name in SHAPE_ONLY and _size1(eqn.invars[0].aval)
                  and _size1(eqn.outvars[0].aval)):
                outs = [ins[0]]
            elif name in CALL_BODY:
                body = call_body(eqn)
                if body is None:
                    raise NotImplementedError(
                        f"the {self.backend} backend cannot inline primitive {name!r} in mod {self.mod_name!r}")
                sub, consts = body
                outs = self.run(sub, [self._const(c) for c in consts] + ins, [*sub.constvars, *sub.invars])
            else:
                outs = [self.new(v.aval) for v in eqn.outvars]
                node = Node(eqn.primitive, dict(eqn.params), tuple(ins), tuple(outs),
                            tuple(v.aval for v in eqn.invars), tuple(v.aval for v in eqn.outvars))
                if name == "concatenate" and all(_size1(v.aval) for v in eqn.invars):
                    self.vectors[outs[0]] = tuple(ins)
                elif name in READS and read_problem(node) is None:
                    node = dataclasses.replace(node, read=self._read(node))
                self.nodes.append(node)
            for v, o in zip(eqn.outvars, outs):
                env[v] = o
        return [self.atom(env, v) for v in jaxpr.outvars]

    def _read(self, node: Node) -> Read | None:
        """``node``'s one-element read, normalised (None where its index vector's components
        are not known one by one: the consumers then decode the gather's params)."""
        if node.prim.name == "dynamic_slice":
            return Read(node.ins[0], tuple(node.ins[1:]))
        x = node.ins[1]
        if isinstance(x, Lit):
            comps = tuple(Lit(v) for v in np.asarray(x.val).reshape(-1))
        elif x in self.vectors:
            comps = self.vectors[x]
        elif _size1(node.in_avals[1]):
            comps = (x,)
        else:
            return None
        return Read(node.ins[0], tuple(_per_dimension(node, comps, None)), _gather_fill(node))

    def _const(self, c):
        arr = np.asarray(c)
        if arr.size == 1:
            return Lit(arr.reshape(()))
        if not self.bake:
            raise NotImplementedError(
                f"mod {self.mod_name!r} closes over an array inside a nested call (jit, checkpoint, custom_jvp ...), "
                f"which the {self.backend} backend cannot read here; close over it in the mod itself")
        var = self.new(jax.core.ShapedArray(arr.shape, arr.dtype))
        self.baked[var] = arr
        return var


def inline_call(node: Node, mod_name: str, backend: str):
    """A kept call node (``custom_jvp_call``) flattened: ``(nodes, body_ins, body_outs)``.

    Code generators whose target has no autodiff emit the body in place; ``body_ins``
    take the node's operands.
    """
    body = body_of(node.prim.name, node.params, len(node.ins), len(node.outs))
    if body is None:
        raise NotImplementedError(
            f"the {backend} backend cannot inline primitive {node.prim.name!r} in mod {mod_name!r}")
    sub, consts = body
    fl = Flattener(mod_name, backend)
    sub_ins = [fl.new(v.aval) for v in sub.invars]
    outs = fl.run(sub, [fl._const(c) for c in consts] + sub_ins, [*sub.constvars, *sub.invars])
    return fl.nodes, sub_ins, outs


def _elementwise_call(eqn) -> bool:
    """A call on scalars whose body reads no captured array (so the analysis needs no look inside)."""
    if len(eqn.outvars) != 1 or any(not _size1(v.aval) for v in (*eqn.invars, *eqn.outvars)):
        return False
    sub, consts = open_jaxpr(eqn.params["call_jaxpr"])
    if any(np.size(c) != 1 for c in consts):
        return False
    return not ({"dynamic_slice", "gather", "dynamic_update_slice", "scatter", "scatter-add"}
                & collect_prims(sub))


def bind(node: Node, vals):
    """Applies ``node``'s primitive to ``vals``, as ``jax.core.eval_jaxpr`` does (call primitives
    get their sub-functions back from their params; JAX 0.10 and 0.11 alike)."""
    return node.prim.bind(*vals, **node.prim.get_bind_params(node.params))


@dataclasses.dataclass(frozen=True)
class ModIR:
    """A mod as first-order nodes.

    Attributes:
      name: the mod's name (error messages).
      nodes: the nodes in order; operands are var ids (ints) or ``Lit``.
      consts, args: var ids of the captured arrays and of the mod's arguments (``score``
        first for a score_mod, then ``b, h, q_idx, kv_idx``).
      out: the output operand (a var id or a ``Lit``).
      avals: var id -> aval.
      baked: var id -> value of arrays nested calls close over (with ``bake``).
    """

    name: str
    nodes: tuple
    consts: tuple
    args: tuple
    out: Any
    avals: dict
    baked: dict


@functools.lru_cache(maxsize=512)
def flatten(mod: StaticMod, backend: str = "pallas", bake: bool = False, inline: frozenset | None = None,
            erase: bool = True) -> ModIR:
    """``mod`` as a ``ModIR``; cached (``backend`` only names the backend in refusals; ``bake``,
    ``inline`` and ``erase`` as ``Flattener``'s).

    Raises:
      NotImplementedError: a call primitive whose body cannot be opened, or (without
        ``bake``) an array a nested call closes over.
    """
    jaxpr = mod.jaxpr
    fl = Flattener(mod.name, backend, bake=bake, inline=inline, erase=erase)
    ins = [fl.new(v.aval) for v in jaxpr.invars]
    (out,) = fl.run(jaxpr, ins)
    return ModIR(mod.name, tuple(fl.nodes), tuple(ins[: mod.num_consts]), tuple(ins[mod.num_consts:]), out,
                 dict(fl.avals), dict(fl.baked))


def read_problem(node: Node) -> str | None:
    """Why a read node is not a one-element read (None when it is one)."""
    if node.prim.name == "dynamic_slice" and any(sz != 1 for sz in node.params["slice_sizes"]):
        return "slices more than one element of a captured array (primitive 'dynamic_slice')"
    if node.prim.name == "gather":
        dn = node.params["dimension_numbers"]
        nd = len(node.in_avals[0].shape)
        if dn.offset_dims or sorted(dn.collapsed_slice_dims) != list(range(nd)) or dn.operand_batching_dims:
            return "uses a gather that is not a one-element read (primitive 'gather')"
    return None


def read_indices(node: Node, value_of, zero):
    """A one-element read's per-dimension indices and fill value: ``(raw, fill)``.

    ``value_of(operand)`` gives an operand's value in the caller's terms (an index vector is
    a list of its components); ``raw`` has one index per dimension of the array (``zero``
    for dimensions the gather does not index), unclamped; ``fill`` is None for a clamped
    read, else the FILL_OR_DROP value for out-of-range indices (NaN / 0 when unset). Reads
    the normalised ``node.read`` where the IR has it, else decodes the primitive's params.
    """
    if node.read is not None:
        return [zero if i is None else value_of(i) for i in node.read.index], node.read.fill
    if node.prim.name == "dynamic_slice":
        return [value_of(s) for s in node.ins[1:]], None
    comps = value_of(node.ins[1])
    return _per_dimension(node, comps if isinstance(comps, list) else [comps], zero), _gather_fill(node)


def _per_dimension(node: Node, comps, zero) -> list:
    """A gather's index components placed on the array's dimensions (``zero`` elsewhere)."""
    raw = [zero] * len(node.in_avals[0].shape)
    for c, d in zip(comps, node.params["dimension_numbers"].start_index_map):
        raw[d] = c
    return raw


def _gather_fill(node: Node):
    """None for a clamped gather, else its FILL_OR_DROP value (NaN / 0 where JAX leaves it unset)."""
    if node.params["mode"] != lax.GatherScatterMode.FILL_OR_DROP:
        return None
    fill = node.params["fill_value"]
    if fill is None:
        fill = np.nan if np.issubdtype(np.dtype(node.out_avals[0].dtype), np.inexact) else 0
    return fill


# -- what the code generators share ------------------------------------------------------------

def int_pow_plan(y: int, x, mul, one):
    """``x ** |y|`` by repeated squaring; ``mul(a, b)`` emits one product and returns it.

    ``one`` is returned for ``y == 0``; the caller inverts for a negative ``y``.
    """
    if y == 0:
        return one
    acc, base, n = None, x, abs(y)
    while n:
        if n & 1:
            acc = base if acc is None else mul(acc, base)
        n >>= 1
        if n:
            base = mul(base, base)
    return acc


# tanh for |x| < 0.3 (the generated kernels' own tanh): the odd Taylor series to x^13 (next term
# 2e-11 relative); beyond, (1 - t) / (1 + t) with t = exp(-2|x|) <= 0.55, a few ulp at most.
TANH_SERIES = (1.0, -0.3333333333333333, 0.13333333333333333, -0.05396825396825397, 0.021869488536155203,
               -0.008863235529902197, 0.003592128036572481)
TANH_SMALL = 0.3


def tanh_series(x: str, x2: str, suffix: str = "") -> str:
    """The series as source text: ``x * (c0 + x2 * (c1 + ...))``, literals ending in ``suffix`` (C++: "f")."""
    expr = f"{TANH_SERIES[-1]!r}{suffix}"
    for c in reversed(TANH_SERIES[:-1]):
        expr = f"({c!r}{suffix} + {x2} * {expr})"
    return f"{x} * {expr}"
