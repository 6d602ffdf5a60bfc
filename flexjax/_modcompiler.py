"""The mod compiler of every kernel backend: splits a traced mod into an XLA prologue and a kernel part.

The pallas backend evaluates the kernel part with JAX ops inside its Pallas kernels
(``CompiledMod.evaluate``); the triton backend generates Triton source from the same
nodes (``backends/triton/_codegen.py``). Both read the same prologue.

A mod's jaxpr has scalar semantics. Kernels evaluate it on tiles: ``score (tq, tk)``,
``q_idx (tq, 1)``, ``kv_idx (1, tk)``, scalars ``b`` and ``h``. Reads of captured arrays
are the hard part, and the compiler sorts them by what their indices depend on:

- a read whose indices depend only on ``b``, ``h`` and ``q_idx`` (document ids, ALiBi
  slopes, per-position tables) is *hoisted*: the prologue evaluates it, and everything
  computed from it, for every (b, h, q) in XLA, and the kernel loads a ``(tq, 1)`` row
  block of the result. The same holds for ``kv_idx`` with ``(1, tk)`` column blocks.
  Gradients to such arrays flow back through the prologue's own VJP.
- for target "tpu", a read whose indices depend only on ``b``, ``h`` and the diagonal
  ``kv_idx - q_idx`` (``table[h, kv_idx - q_idx + S - 1]``, T5's ``table[h,
  bucket(kv_idx - q_idx)]``) is hoisted too, as a *diagonal* value: the prologue
  evaluates it for every (b, h, kv_idx - q_idx), and the kernel builds its (tq, tk) tile
  (a Toeplitz block of one contiguous slice) without a gather. The compiler finds the
  diagonal by tracking which integer values are affine in ``q_idx`` and ``kv_idx``:
  ``a * q_idx + c * kv_idx + (terms in b, h)`` with ``c == -a`` is a function of
  ``kv_idx - q_idx``, and so is anything computed from such values alone.
- any other read (``table[h, kv_idx * q_idx]``, or on other targets the diagonal reads
  too) stays in the kernel and becomes a load from the array's ref with clamped indices;
  Mosaic TPU cannot gather, so there it raises.

Every primitive left in the kernel part, and in its VJP, is checked against the
target's Pallas lowering rules (targets "cuda" and "tpu"), so an unsupported mod fails
here with the primitive's name instead of deep inside Triton or Mosaic. Target "triton"
is checked by the Triton code generator itself, which raises on the first primitive it
has no translation for, before any kernel is built.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._jaxpr import collect_prims, sub_jaxprs
from ._modir import READS, SHAPE_ONLY, Lit, Node, _size1, bind, flatten, read_indices, read_problem
from ._trace import StaticMod
from .backends._contract import guarded

# Primitives the DESIGN lists as broken inside Triton kernels even where a rule exists.
_TRITON_GAPS = frozenset({"erf", "round", "sort", "cumsum", "cumlogsumexp", "cummax", "cummin"})
_MOSAIC_GAPS = frozenset({"sort", "cumsum", "cumlogsumexp", "cummax", "cummin"})
# Wrappers that Pallas inlines on every target.
_PLUMBING = frozenset({"jit", "pjit", "stop_gradient"})


def _horner(x, *coeffs):
    """``coeffs[0] + x * (coeffs[1] + ...)``: ``polynomial`` (JAX 0.12's erf gradient) as JAX's own lowering
    computes it, for the Pallas lowerings, which have no rule for the primitive."""
    acc = coeffs[-1]
    for c in reversed(coeffs[:-1]):
        acc = acc * x + c
    return acc


# Primitives the mod compiler evaluates as other primitives, where the Pallas lowerings lack them.
_EXPANDED = {"polynomial": _horner}

TARGETS = ("interpret", "cuda", "tpu", "triton", "mosaic_gpu")
# The backend that compiles for each target (named in error messages).
_BACKEND = {"interpret": "pallas", "cuda": "pallas", "tpu": "pallas", "triton": "triton", "mosaic_gpu": "mosaic_gpu"}

_ARG_TAGS = {"score": "score", "b": "b", "h": "h", "q_idx": "q", "kv_idx": "kv"}


@dataclasses.dataclass(frozen=True)
class CompiledMod:
    """A mod split into an XLA prologue and a kernel part.

    Attributes:
      mod: the traced mod.
      target: "interpret", "cuda" or "tpu" (the pallas backend's), "triton" or "mosaic_gpu" (``_BACKEND``
        maps each to the IR's backend).
      nodes: the flattened nodes, in order.
      args: var ids of the mod's arguments (score first for a score_mod).
      consts: var ids of the captured arrays.
      out: the output atom.
      side: per node index, "q" / "kv" / "r" (hoisted: rows, columns, diagonals), "k"
        (kernel), or "dead": kernel-side but not needed by the kernel's output (the
        prologue may still evaluate it for a hoisted value).
      rows: var ids of hoisted values the kernel reads as (tq, 1) row blocks.
      cols: var ids of hoisted values read as (1, tk) column blocks.
      arrays: var ids of arrays the kernel gathers from (captured or computed from them).
      row_uses, col_uses: per hoisted value, whether it depends on (b, h).
      avals: the abstract value of every var id.
      diags: var ids of hoisted values that depend on ``kv_idx - q_idx`` (target "tpu"
        only), read as (tq, tk) tiles.
      diag_uses: per diagonal value, whether it depends on (b, h).
      baked: var id -> value of the arrays a nested call's body closes over; the prologue
        reads them as it reads the captured arrays (they take no gradient).
      row_reads_q: per hoisted row, whether it depends on ``q_idx``; one that does not (a
        captured scalar, or arithmetic on captured scalars and b, h) is one value per (b, h),
        which a kernel may load once instead of as a (tq, 1) block.
    """

    mod: StaticMod
    target: str
    nodes: tuple
    args: tuple
    consts: tuple
    out: Any
    side: tuple
    rows: tuple
    cols: tuple
    arrays: tuple
    row_uses: tuple
    col_uses: tuple
    avals: dict
    diags: tuple = ()
    diag_uses: tuple = ()
    baked: dict = dataclasses.field(default_factory=dict)
    row_reads_q: tuple = ()

    @property
    def name(self) -> str:
        return self.mod.name

    def storage_dtype(self, var: int):
        """dtype in which the prologue hands hoisted value ``var`` to the kernel."""
        dtype = self.avals[var].dtype
        return jnp.int32 if dtype == jnp.bool_ else dtype

    def diag_storage_dtype(self, var: int):
        """dtype in which the prologue hands diagonal value ``var`` to the kernel: 32-bit.

        The kernel shifts diagonal slices with strided lane rotations, which Mosaic
        does on 32-bit vectors; booleans and narrow types are widened.
        """
        dtype = jnp.dtype(self.avals[var].dtype)
        if dtype == jnp.bool_ or (jnp.issubdtype(dtype, jnp.integer) and dtype.itemsize < 4):
            return jnp.dtype(jnp.int32)
        if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
            return jnp.dtype(jnp.float32)
        return dtype

    def reads(self) -> tuple:
        """The kernel part's array reads (dynamic_slice / gather nodes), in order."""
        return tuple(node for node, s in zip(self.nodes, self.side)
                     if s == "k" and node.prim.name in READS)

    # -- prologue (XLA) ---------------------------------------------------------------------
    def _eval_scalar(self, env: dict, wanted: tuple):
        """Evaluates the nodes ``wanted`` needs, with scalar semantics, into ``env``."""
        producer = {o: n for n, node in enumerate(self.nodes) for o in node.outs}
        needed, stack = set(), [w for w in wanted if w not in env]
        while stack:
            n = producer[stack.pop()]
            if n not in needed:
                needed.add(n)
                stack.extend(x for x in self.nodes[n].ins if not isinstance(x, Lit) and x not in env)
        for n in sorted(needed):
            node = self.nodes[n]
            vals = [x.val if isinstance(x, Lit) else env[x] for x in node.ins]
            out = bind(node, vals)
            env.update(zip(node.outs, out if node.prim.multiple_results else [out]))
        return tuple(env[w] for w in wanted)

    def prologue(self, consts, batch: int, heads: int, q_len: int, kv_len: int, sq: int, skv: int):
        """Evaluates the hoisted values and gathered arrays in XLA.

        Returns ``(rows, cols, arrays)``: rows ``(B', H', sq)``, cols ``(B', H', skv)`` with
        B' (H') 1 where the value does not depend on b (h), and the arrays the kernel
        gathers from. Indices past the true lengths are clamped, as mods never see them.
        """
        base = {**dict(zip(self.consts, consts)), **{v: jnp.asarray(x) for v, x in self.baked.items()}}
        names = ("score", "b", "h", "q_idx", "kv_idx") if self.mod.kind == "score" else ("b", "h", "q_idx", "kv_idx")
        arg_of = dict(zip(names, self.args))

        def grid(wanted, uses, pos_name, length, n):
            out = []
            for w, (ub, uh) in zip(wanted, uses):
                b = jnp.arange(batch, dtype=jnp.int32)[:, None, None] if ub else jnp.zeros((1, 1, 1), jnp.int32)
                h = jnp.arange(heads, dtype=jnp.int32)[None, :, None] if uh else jnp.zeros((1, 1, 1), jnp.int32)
                p = jnp.minimum(jnp.arange(n, dtype=jnp.int32), length - 1)[None, None, :]

                def scalar_fn(b, h, p, w=w):
                    env = dict(base)
                    env[arg_of["b"]], env[arg_of["h"]], env[arg_of[pos_name]] = b, h, p
                    (val,) = self._eval_scalar(env, (w,))
                    return jnp.reshape(val, ())

                val = jnp.vectorize(scalar_fn)(b, h, p)
                # Kernels cannot load booleans on every target: store them as int32.
                out.append(val.astype(jnp.int32) if val.dtype == jnp.bool_ else val)
            return tuple(out)

        rows = grid(self.rows, self.row_uses, "q_idx", q_len, sq)
        cols = grid(self.cols, self.col_uses, "kv_idx", kv_len, skv)
        arrays = []
        for a in self.arrays:
            if a in base:
                arrays.append(base[a])
            else:
                (val,) = self._eval_scalar(dict(base), (a,))
                arrays.append(val)
        return rows, cols, tuple(arrays)

    def diagonals(self, consts, batch: int, heads: int, q_len: int, kv_len: int, offset: int, size: int):
        """Evaluates the diagonal values in XLA.

        Returns one ``(B', H', size)`` array per ``self.diags`` (B' / H' 1 where the value
        does not depend on b / h), in ``diag_storage_dtype``: entry ``p`` holds the value at
        ``kv_idx - q_idx = p - offset``. Differences past the true lengths are clamped into
        ``[-(q_len - 1), kv_len - 1]`` and evaluated at ``q_idx = max(-d, 0)``, ``kv_idx =
        max(d, 0)``, so the mod sees in-range indices only.
        """
        base = {**dict(zip(self.consts, consts)), **{v: jnp.asarray(x) for v, x in self.baked.items()}}
        names = ("score", "b", "h", "q_idx", "kv_idx") if self.mod.kind == "score" else ("b", "h", "q_idx", "kv_idx")
        arg_of = dict(zip(names, self.args))
        out = []
        for w, (ub, uh) in zip(self.diags, self.diag_uses):
            b = jnp.arange(batch, dtype=jnp.int32)[:, None, None] if ub else jnp.zeros((1, 1, 1), jnp.int32)
            h = jnp.arange(heads, dtype=jnp.int32)[None, :, None] if uh else jnp.zeros((1, 1, 1), jnp.int32)
            d = jnp.clip(jnp.arange(size, dtype=jnp.int32) - offset, -(q_len - 1), kv_len - 1)[None, None, :]

            def scalar_fn(b, h, d, w=w):
                env = dict(base)
                env[arg_of["b"]], env[arg_of["h"]] = b, h
                env[arg_of["q_idx"]], env[arg_of["kv_idx"]] = jnp.maximum(-d, 0), jnp.maximum(d, 0)
                (val,) = self._eval_scalar(env, (w,))
                return jnp.reshape(val, ())

            out.append(jnp.vectorize(scalar_fn)(b, h, d).astype(self.diag_storage_dtype(w)))
        return tuple(out)

    # -- kernel part ------------------------------------------------------------------------
    def evaluate(self, score, b, h, q_idx, kv_idx, rows, cols, load: Callable):
        """The mod on a tile, inside a kernel (or any JAX code).

        Args:
          score: f32 tile (score_mods only; None for mask_mods).
          b, h: int32 scalars.
          q_idx, kv_idx: int32 tiles, already clamped into range.
          rows, cols: tiles of the hoisted values, one per ``self.rows`` / ``self.cols``;
            ``rows`` continues with one (tq, tk) tile per ``self.diags`` (in
            ``diag_storage_dtype``), so tile code that passes rows through carries them.
          load: ``load(k, indices) -> tile`` reads ``self.arrays[k]`` at clamped int32
            index tiles (one per array dimension).

        Returns:
          The mod's value, broadcast to the tile shape of its arguments.
        """
        env: dict[int, Any] = {}
        vals = (b, h, q_idx, kv_idx) if score is None else (score, b, h, q_idx, kv_idx)
        env.update(zip(self.args, vals))
        n = len(self.rows)
        for ids, vals in ((self.rows, rows[:n]), (self.cols, cols)):
            for v, x in zip(ids, vals):
                env[v] = x != 0 if self.avals[v].dtype == jnp.bool_ else x
        for v, x in zip(self.diags, rows[n:]):
            dtype = self.avals[v].dtype
            env[v] = x != 0 if dtype == jnp.bool_ else x.astype(dtype)
        arrays = {a: k for k, a in enumerate(self.arrays)}
        for node, side in zip(self.nodes, self.side):
            if side != "k":
                continue
            outs = _eval_node(node, env, arrays, load, self.name, self.target)
            env.update(zip(node.outs, outs))
        out = self.out.val if isinstance(self.out, Lit) else env[self.out]
        shape = jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(kv_idx), jnp.shape(score) if score is not None else ())
        return jnp.broadcast_to(out, shape)


def _value(x, env):
    return jnp.asarray(x.val) if isinstance(x, Lit) else env[x]


def _broadcast(vals):
    shape = jnp.broadcast_shapes(*(jnp.shape(v) for v in vals))
    return [v if jnp.shape(v) == shape else jnp.broadcast_to(v, shape) for v in vals]


def _clamp_index(i, n):
    return jnp.clip(jnp.asarray(i).astype(jnp.int32), 0, n - 1)


def _eval_node(node: Node, env, arrays, load, mod_name, target: str = "interpret"):
    name = node.prim.name
    if name in READS:
        # XLA clamps the starts so the one-element slice stays inside the array.
        shape = node.in_avals[0].shape
        raw, fill = read_indices(node, lambda x: _value(x, env), 0)
        raw = [jnp.asarray(i).astype(jnp.int32) for i in raw]
        val = load(arrays[node.ins[0]], _broadcast([_clamp_index(i, n) for i, n in zip(raw, shape)]))
        if fill is not None:
            inside = functools.reduce(jnp.logical_and, [(i >= 0) & (i < n) for i, n in zip(raw, shape)])
            val = jnp.where(inside, val, jnp.asarray(fill, node.out_avals[0].dtype))
        return [val]
    if name == "custom_jvp_call":
        # Traced for scalars: vmapped over the tile, which keeps its JVP rule.
        return [jnp.vectorize(lambda *a: bind(node, a)[0])(*(_value(x, env) for x in node.ins))]
    ins = [_value(x, env) for x in node.ins]
    if name == "concatenate":
        return [[c for v in ins for c in (v if isinstance(v, list) else [v])]]
    if name in SHAPE_ONLY:
        return [ins[0]]
    if any(isinstance(v, list) for v in ins):
        n = max(len(v) for v in ins if isinstance(v, list))
        comps = [[v[i] if isinstance(v, list) else v for v in ins] for i in range(n)]
        return [[bind(node, _broadcast(c)) for c in comps]]
    if name in _EXPANDED:
        return [_EXPANDED[name](*_broadcast(ins))]
    if target == "tpu" and name == "select_n" and node.out_avals[0].dtype == jnp.bool_:
        # Mosaic rejects selects between boolean vectors ("Invalid input layout"): select int32.
        pred, *cases = _broadcast(ins)
        return [node.prim.bind(pred, *(c.astype(jnp.int32) for c in cases), **node.params) != 0]
    out = bind(node, _broadcast(ins))
    return out if node.prim.multiple_results else [out]


def _deps(nodes, const_ids, arg_tags):
    """Per var id, the set of tags it depends on: b, h, q, kv, score, and arr (an array)."""
    deps = {c: frozenset({"arr"}) for c in const_ids}
    deps.update(arg_tags)
    for node in nodes:
        d = frozenset().union(*(deps.get(x, frozenset()) for x in node.ins if not isinstance(x, Lit)))
        for o, aval in zip(node.outs, node.out_avals):
            deps[o] = d | ({"arr"} if not _size1(aval) else frozenset())
    return deps


# Tags of the positional arguments; "r" marks a value that reads them only through kv_idx - q_idx.
_POSITIONS = frozenset({"q", "kv", "r"})
# Tag of values computed from a captured-array read along the diagonal (only these are hoisted
# as diagonals: ALiBi's slope[h] * (kv_idx - q_idx) stays a row value times the kernel's indices).
_DIAGONAL_READ = "rread"
# Primitives that keep an integer value the same affine function of q_idx and kv_idx.
_AFFINE_RENAMES = frozenset({"squeeze", "reshape", "broadcast_in_dim", "expand_dims", "copy", "copy_p",
                             "convert_element_type"})
_COMPARISONS = frozenset({"lt", "le", "gt", "ge", "eq", "ne"})


def _affine(node: Node, coef_of):
    """(a, c) when the node's integer output is a*q_idx + c*kv_idx + (terms in b, h, arrays), else None."""
    if node.prim.multiple_results or not jnp.issubdtype(node.out_avals[0].dtype, jnp.integer):
        return None
    coefs = [coef_of(x) for x in node.ins]
    name = node.prim.name
    if name in ("add", "sub") and None not in coefs:
        (a1, c1), (a2, c2) = coefs
        return (a1 + a2, c1 + c2) if name == "add" else (a1 - a2, c1 - c2)
    if name == "neg" and coefs[0] is not None:
        return (-coefs[0][0], -coefs[0][1])
    if name == "mul" and None not in coefs:
        for x, other in ((node.ins[0], coefs[1]), (node.ins[1], coefs[0])):
            if isinstance(x, Lit) and np.ndim(x.val) == 0:
                m = int(x.val)
                return (m * other[0], m * other[1])
    if name in _AFFINE_RENAMES and len(node.ins) == 1 and coefs[0] is not None:
        return coefs[0]
    return None


def _positions(coef) -> frozenset:
    a, c = coef
    if a == 0 and c == 0:
        return frozenset()
    if a == -c:
        return frozenset({"r"})
    return frozenset(({"q"} if a else set()) | ({"kv"} if c else set()))


def _diagonal_deps(nodes, const_ids, arg_tags, q_var, kv_var):
    """``_deps`` with the tag "r" for values that depend on q_idx and kv_idx only through kv_idx - q_idx.

    Integer values affine in the positions carry their coefficients (``kv_idx - q_idx + 7``
    is (-1, 1)); a comparison of two affine values depends on their difference; any other
    primitive depends on the positions its operands depend on, so ``bucket(kv_idx - q_idx)``
    keeps "r" while ``(kv_idx - q_idx) * q_idx`` has "r" and "q" (not diagonal). Reads whose
    indices have "r" (and no other position) tag their results, and what is computed from
    them, with ``_DIAGONAL_READ``.
    """
    deps = {c: frozenset({"arr"}) for c in const_ids}
    deps.update(arg_tags)
    coef = {q_var: (1, 0), kv_var: (0, 1)}

    def coef_of(x):
        if isinstance(x, Lit):
            return (0, 0)
        if x in coef:
            return coef[x]
        return None if deps.get(x, frozenset()) & _POSITIONS else (0, 0)

    for node in nodes:
        d = frozenset().union(*(deps.get(x, frozenset()) for x in node.ins if not isinstance(x, Lit)))
        c = _affine(node, coef_of)
        coefs = [coef_of(x) for x in node.ins]
        if c is not None:
            pos = _positions(c)
        elif node.prim.name in _COMPARISONS and len(coefs) == 2 and None not in coefs:
            pos = _positions((coefs[0][0] - coefs[1][0], coefs[0][1] - coefs[1][1]))
        else:
            pos = d & _POSITIONS
        index = frozenset().union(*(deps.get(x, frozenset()) for x in node.ins[1:] if not isinstance(x, Lit)))
        diagonal_read = node.prim.name in READS and index & _POSITIONS == {"r"}
        tag = frozenset({_DIAGONAL_READ}) if diagonal_read else frozenset()
        for o, aval in zip(node.outs, node.out_avals):
            deps[o] = (d - _POSITIONS) | pos | tag | ({"arr"} if not _size1(aval) else frozenset())
            if c is not None:
                coef[o] = c
    return deps


def _sides(nodes, deps):
    side = []
    for node in nodes:
        d = frozenset().union(*(deps[o] for o in node.outs))
        if "arr" in d and d <= {"arr", "b", "h", "q"}:
            side.append("q")
        elif "arr" in d and d <= {"arr", "b", "h", "kv"}:
            side.append("kv")
        elif "arr" in d and _DIAGONAL_READ in d and d <= {"arr", "b", "h", "r", _DIAGONAL_READ}:
            side.append("r")
        else:
            side.append("k")
    return side


def _kernel_liveness(nodes, side, out) -> list:
    """``side`` with kernel nodes ("k") that the output does not need marked "dead".

    The kernel reads hoisted values, not what they were computed from: the index
    arithmetic of a read hoisted as a diagonal, say, is the prologue's alone, so the
    kernel neither runs it nor loads the values it reads.
    """
    live = set() if isinstance(out, Lit) else {out}
    keep = [False] * len(nodes)
    for n in range(len(nodes) - 1, -1, -1):
        if side[n] == "k" and any(o in live for o in nodes[n].outs):
            keep[n] = True
            live.update(x for x in nodes[n].ins if not isinstance(x, Lit))
    return [s if s != "k" or k else "dead" for s, k in zip(side, keep)]


def _lowering_rules(target: str):
    if target == "cuda":
        from jax._src.pallas.triton import lowering as triton_lowering

        return {p.name for p in triton_lowering.triton_lowering_rules}, _TRITON_GAPS
    if target == "tpu":
        from jax._src.pallas.mosaic import lowering as mosaic_lowering

        (tensor_core,) = [k for k in mosaic_lowering.lowering_rules if k.name == "TC"]
        return {p.name for p in mosaic_lowering.lowering_rules[tensor_core]}, _MOSAIC_GAPS
    if target == "mosaic_gpu":
        from jax._src.pallas.mosaic_gpu import core as gpu_core
        from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering

        # add_any (a cotangent sum in a mod's gradient): the kernels bind it as lax.add.
        rules = {p.name for p in mgpu_lowering.mosaic_lowering_rules[gpu_core.LANExWG_SEMANTICS]}
        return rules | {"add_any"}, frozenset()
    return None, frozenset()


def _check_prims(prims, target: str, mod_name: str, where: str):
    rules, gaps = _lowering_rules(target)
    if rules is None:
        return
    lowering = {"cuda": "Triton (GPU)", "tpu": "Mosaic (TPU)", "mosaic_gpu": "Mosaic GPU"}[target]
    for p in sorted(prims):
        if p in gaps or (p not in rules and p not in _PLUMBING and p not in _EXPANDED):
            raise NotImplementedError(
                f"mod {mod_name!r} uses primitive {p!r}{where}, which the {_BACKEND[target]} backend cannot lower "
                f"for {lowering}; rewrite the mod without it or use backend='xla'")


def _check_accuracy(jaxpr, target: str, mod_name: str, where: str):
    """Mosaic (TPU) and Mosaic GPU lower no primitive with an ``accuracy`` setting (JAX 0.12's erf gradient
    asks for exp at ``HIGHEST``): refuse such a mod rather than fail while lowering or run it less exactly."""
    if target not in ("tpu", "mosaic_gpu"):
        return
    for eqn in jaxpr.eqns:
        if eqn.params.get("accuracy") is not None:
            lowering = {"tpu": "Mosaic (TPU)", "mosaic_gpu": "Mosaic GPU"}[target]
            raise NotImplementedError(
                f"mod {mod_name!r} uses primitive {eqn.primitive.name!r} with accuracy={eqn.params['accuracy']}"
                f"{where}, which the {_BACKEND[target]} backend cannot lower for {lowering}; use backend='xla'"
                + (" or 'triton'" if target == "mosaic_gpu" else ""))
        for sub in sub_jaxprs(eqn.params):
            _check_accuracy(sub, target, mod_name, where)


def refusing(backend: str, mod_name: str, what: str = "compile"):
    """``_contract.guarded``'s rule around compiling a mod for a backend: a failure other than a refusal is
    a flexjax bug, raised as a refusal naming the mod (``backend=None`` moves on; backend='xla' serves)."""
    return guarded(f"the {backend} backend", f"{what} mod {mod_name!r}")


@functools.lru_cache(maxsize=256)
def compile_mod(mod: StaticMod, target: str) -> CompiledMod:
    """Splits ``mod`` for ``target`` and checks that the kernel part lowers there.

    Raises:
      NotImplementedError: naming the primitive (or array read) and the mod that the
        target cannot take; any other failure is reported as one (``refusing``).
      ValueError: ``target`` is not one of ``TARGETS``.
    """
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    with refusing(_BACKEND[target], mod.name):
        return _compile_mod(mod, target)


# Targets whose kernels cannot gather: what a read left in the kernel is told (after the primitive).
_NO_GATHER = {
    "tpu": (" other than through kv_idx - q_idx; Mosaic TPU cannot gather inside a kernel. Arrays indexed only by "
            "b, h and q_idx, only by b, h and kv_idx, or only by b, h and an affine function of kv_idx - q_idx are "
            "supported; use backend='xla' for this mod"),
    "mosaic_gpu": (", a gather inside the kernel, which the mosaic_gpu kernels do not do. Arrays indexed only by "
                   "b, h and q_idx, or only by b, h and kv_idx, are supported; backend='triton' serves this mod"),
}


def _compile_mod(mod: StaticMod, target: str) -> CompiledMod:
    # Shapes kept (erase=False): the prologue binds the hoisted nodes as JAX primitives again.
    ir = flatten(mod, _BACKEND[target], bake=True, erase=False)
    out, consts, args = ir.out, ir.consts, ir.args
    names = ("score", "b", "h", "q_idx", "kv_idx") if mod.kind == "score" else ("b", "h", "q_idx", "kv_idx")
    arg_tags = {a: frozenset({_ARG_TAGS[n]}) for a, n in zip(args, names)}
    nodes = ir.nodes
    if target == "tpu":
        # Mosaic cannot gather: reads along the diagonal kv_idx - q_idx are hoisted instead.
        deps = _diagonal_deps(nodes, (*consts, *ir.baked), arg_tags, args[names.index("q_idx")],
                              args[names.index("kv_idx")])
    else:
        deps = _deps(nodes, (*consts, *ir.baked), arg_tags)
    side = _kernel_liveness(nodes, _sides(nodes, deps), out)

    # Hoisted values the kernel reads, and arrays it gathers from.
    produced = {o: s for node, s in zip(nodes, side) for o in node.outs}
    rows, cols, diags, arrays = [], [], [], []
    hoisted_by_side = {"q": rows, "kv": cols, "r": diags}
    for node, s in zip(nodes, side):
        if s != "k":
            continue
        is_read = node.prim.name in READS
        for pos, x in enumerate(node.ins):
            if isinstance(x, Lit):
                continue
            src = produced.get(x, "arg" if x in args else "const")
            if src == "k" or src == "arg":
                continue
            aval = ir.avals[x]
            if is_read and pos == 0 and deps[x] <= {"arr"}:
                if x not in arrays:
                    arrays.append(x)
            elif _size1(aval) and "arr" in deps[x]:
                # A captured scalar (src "const") is hoisted as a row that reads no position.
                hoisted = hoisted_by_side["q" if src == "const" else src]
                if x not in hoisted:
                    hoisted.append(x)
            else:
                raise NotImplementedError(
                    f"mod {mod.name!r} computes with a whole captured array of shape {aval.shape} "
                    f"(primitive {node.prim.name!r}); the {_BACKEND[target]} backend reads captured arrays one element "
                    "per position: index them in one step, e.g. table[h, kv_idx - q_idx]")
    out_src = "k" if isinstance(out, Lit) or out in args else produced.get(out, "q")
    if out_src != "k":
        hoisted = hoisted_by_side[out_src]
        if out not in hoisted:
            hoisted.append(out)
    for node, s in zip(nodes, side):
        if s == "k" and node.prim.name in READS and target in _NO_GATHER:
            raise NotImplementedError(
                f"mod {mod.name!r} reads a captured array with indices that depend on both q_idx and kv_idx "
                f"(primitive {node.prim.name!r}){_NO_GATHER[target]}")
        problem = read_problem(node) if s == "k" and node.prim.name in READS else None
        if problem is not None:
            raise NotImplementedError(f"mod {mod.name!r} {problem}; index the captured array with one integer per "
                                      "dimension, one element per position")

    def uses(v):
        return ("b" in deps[v], "h" in deps[v])

    compiled = CompiledMod(mod=mod, target=target, nodes=nodes, args=args, consts=consts, out=out,
                           side=tuple(side), rows=tuple(rows), cols=tuple(cols), arrays=tuple(arrays),
                           row_uses=tuple(uses(r) for r in rows), col_uses=tuple(uses(c) for c in cols),
                           avals=dict(ir.avals), diags=tuple(diags), diag_uses=tuple(uses(d) for d in diags),
                           baked=dict(ir.baked), row_reads_q=tuple("q" in deps[r] for r in rows))
    _check_kernel_part(compiled)
    return compiled


def _check_kernel_part(c: CompiledMod):
    """Traces the kernel part and its VJP at small tile shapes and checks every primitive."""
    if c.target in ("interpret", "triton"):
        return
    tq, tk = 8, 128
    reads = c.reads()

    def f(score, rows, cols, loaded):
        it = iter(loaded)
        q = lax.broadcasted_iota(jnp.int32, (tq, 1), 0)
        kv = lax.broadcasted_iota(jnp.int32, (1, tk), 1)
        return c.evaluate(score, jnp.int32(0), jnp.int32(0), q, kv, rows, cols, lambda k, idx: next(it))

    rows = tuple(jnp.zeros((tq, 1), c.storage_dtype(r)) for r in c.rows)
    rows += tuple(jnp.zeros((tq, tk), c.diag_storage_dtype(d)) for d in c.diags)
    cols = tuple(jnp.zeros((1, tk), c.storage_dtype(v)) for v in c.cols)
    loaded = tuple(jnp.zeros((tq, tk), node.out_avals[0].dtype) for node in reads)
    score = jnp.zeros((tq, tk), jnp.float32) if c.mod.kind == "score" else None
    jaxpr = jax.make_jaxpr(f)(score, rows, cols, loaded).jaxpr
    _check_prims(collect_prims(jaxpr), c.target, c.name, "")
    _check_accuracy(jaxpr, c.target, c.name, "")
    if c.mod.kind == "score":
        def g(score, rows, cols, loaded):
            _, vjp = jax.vjp(f, score, rows, cols, loaded)
            return vjp(jnp.ones((tq, tk), jnp.float32))

        jaxpr = jax.make_jaxpr(g)(score, rows, cols, loaded).jaxpr
        _check_prims(collect_prims(jaxpr), c.target, c.name, " in its gradient")
        _check_accuracy(jaxpr, c.target, c.name, " in its gradient")
