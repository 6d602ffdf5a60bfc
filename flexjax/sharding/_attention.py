"""Sharded flex_attention: one shard_map; over a context axis, k/v all-gathered or passed around a ring.

The shardings come from the active ``attention_specs``, or, without them, from the
Explicit-axis sharding types of q/k/v along batch and heads (no communication then).
Each shard runs flexjax's own flex_attention on its local queries. Its mods and its
BlockMask are the user's, with local indices mapped back to global batch, head and
(original, unpermuted) sequence positions; its BlockMask holds only the tiles of the
global one that touch its queries. Ring attention (Liu et al., https://arxiv.org/abs/2310.01889)
merges the partial results of each k/v block through their log-sum-exp.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .._api import flex_attention as _flex_attention
from .._api import register_sharded_dispatch
from .._block_mask_type import EMPTY, BlockMask
from .._jaxpr import TRANSPARENT_CALLS
from .._modir import Flattener, Lit, flatten
from .._spec import check_block_mask, check_layout, check_qkv, prepare, zero_cotangent
from .._trace import StaticMod, remapped, trace_mod
from ..backends import _softmax
from ._layout import block_order, positions
from ._specs import AttentionSpecs, active_specs, axes_of, make_specs


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static about one sharded call; hashable (a custom_vjp nondiff argument).

    Attributes:
      seq_axes, batch_axes, head_axes: the mesh axes sharding q's seq, batch and heads.
      n: context shards. permuted: layout is permute_tokens order. ring: k/v sharded.
      q_len, kv_len: global sequence lengths; q_local, kv_local: per shard.
      batch_local, heads_local: q's per-shard batch and heads.
      kv_head_slice: k/v heads each shard takes from whole k/v heads, or 0 (k/v heads
        are sharded like q's, or not sharded at all).
      group: q heads per k/v head.
      score, mask: the user's traced mods (None when absent).
      block_size: the BlockMask's tile, or None without a BlockMask.
      kv_band: the BlockMask's kv_band when n == 1 (each shard then gets its rows of the
        global index lists, whose band is at most the global one), else None.
      scale, backend, kernel_options: passed to every per-shard flex_attention.
    """

    seq_axes: tuple
    batch_axes: tuple
    head_axes: tuple
    n: int
    permuted: bool
    ring: bool
    q_len: int
    kv_len: int
    q_local: int
    kv_local: int
    batch_local: int
    heads_local: int
    kv_head_slice: int
    group: int
    score: StaticMod | None
    mask: StaticMod | None
    block_size: tuple | None
    kv_band: int | None
    scale: float | None
    backend: str | None
    kernel_options: tuple

    @property
    def kv_blocks_local(self) -> int:
        return self.kv_local // self.block_size[1]


def _axis_name(axes: tuple):
    return axes[0] if len(axes) == 1 else axes


def _index(axes: tuple):
    """This shard's (linearized, major first) index along ``axes``; 0 when unsharded."""
    return jax.lax.axis_index(_axis_name(axes)) if axes else 0


def _shift(x, offset):
    return x if isinstance(offset, int) and offset == 0 else x + offset


# -- mods inside shard_map ----------------------------------------------------------------

_SHARDING_PRIMITIVES = ("reshard", "sharding_constraint", "mesh_cast")


def _evaluate(nodes, env: dict, outs) -> list:
    """Binds the IR's nodes in the current trace context (``env``: var id -> value).

    Each equation of a jaxpr (and each nested ``jit``) remembers the mesh it was traced
    under, and ``jax.core.eval_jaxpr`` switches back to it: a mod traced under
    ``jax.set_mesh`` with Explicit axes then fails on the Manual-axis values inside
    ``shard_map``. So the mod runs from its ``_modir`` IR with the calls that do not change
    derivatives (``jit``, ``jax.checkpoint`` ..., ``_jaxpr.TRANSPARENT_CALLS``) inlined;
    the sub-jaxprs of the calls it keeps (custom_jvp, cond, ...) are re-traced the same way.
    """

    def read(x):
        return x.val if isinstance(x, Lit) else env[x]

    for node in nodes:
        invals = [read(x) for x in node.ins]
        if node.prim.name in _SHARDING_PRIMITIVES:
            # Placement on the outer mesh (e.g. a constant built under jax.set_mesh);
            # inside the shard every value is local.
            results = invals
        else:
            params = {k: _retrace(v) for k, v in node.params.items()}
            results = node.prim.bind(*invals, **node.prim.get_bind_params(params))
            results = results if node.prim.multiple_results else [results]
        env.update(zip(node.outs, results, strict=True))
    return [read(o) for o in outs]


def _evaluate_jaxpr(jaxpr, args, name: str = "a mod's call"):
    fl = Flattener(name, "sharding", bake=True, inline=TRANSPARENT_CALLS, erase=False)
    invars = [*jaxpr.constvars, *jaxpr.invars]
    ins = [fl.new(v.aval) for v in invars]
    outs = fl.run(jaxpr, ins, invars)
    return _evaluate(fl.nodes, {**dict(zip(ins, args, strict=True)), **fl.baked}, outs)


def _retrace(param):
    if isinstance(param, (tuple, list)):
        return type(param)(_retrace(p) for p in param)
    if not isinstance(param, jex_core.ClosedJaxpr):
        return param
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
             for v in param.jaxpr.invars]
    return jax.make_jaxpr(lambda *a: _evaluate_jaxpr(param.jaxpr, [*param.consts, *a]))(*avals)


def _call(mod: StaticMod, consts, *args):
    """A traced mod applied to scalar arguments, in the current trace context."""
    ir = flatten(mod, "sharding", bake=True, inline=TRANSPARENT_CALLS, erase=False)
    env = {**dict(zip((*ir.consts, *ir.args), (*consts, *args), strict=True)), **ir.baked}
    (out,) = _evaluate(ir.nodes, env, [ir.out])
    return out


# -- one shard, one k/v block -------------------------------------------------------------

def _local_attention(plan: _Plan, q, k, v, score_consts, mask_consts, tiles, src):
    """flex_attention of this shard's queries against the k/v of layout block ``src``.

    ``tiles``: with one context shard (n == 1), this shard's (batch, head) rows of the
    BlockMask's 8 index lists; else its rows of the global tile states, in layout order,
    int8 (Bm, Hm, nQ_local, nKV). ``src``: 0 for all-gathered k/v, the owning shard in a
    ring. Returns ``(out, lse)`` for the local queries.
    """
    b_off = _index(plan.batch_axes) * plan.batch_local
    h_off = _index(plan.head_axes) * plan.heads_local
    q_start = _index(plan.seq_axes) * plan.q_local
    kv_start = src * plan.kv_local
    kv_n = plan.n if (plan.ring or plan.permuted) else 1

    def global_index(b, h, q_idx, kv_idx):
        return (_shift(b, b_off), _shift(h, h_off),
                positions(q_idx, q_start, plan.q_len, plan.n, plan.permuted),
                positions(kv_idx, kv_start, plan.kv_len, kv_n, plan.permuted))

    score_mod = remapped("score", None if plan.score is None else functools.partial(_call, plan.score, score_consts),
                         index=global_index, name=getattr(plan.score, "name", ""))
    block_mask = None
    if plan.block_size is not None:
        if plan.ring:
            nkv = plan.kv_blocks_local
            tiles = jax.lax.dynamic_slice_in_dim(tiles, src * nkv, nkv, axis=3)
        mask, consts = None, ()
        if plan.mask is not None:
            mask_mod = remapped("mask", functools.partial(_call, plan.mask, mask_consts), index=global_index,
                                name=plan.mask.name)
            traced = trace_mod(mask_mod, "mask", arg_name="mask_mod")
            mask, consts = traced.static(), traced.consts
        if plan.n == 1:
            block_mask = BlockMask(*tiles, consts, seq_lengths=(plan.q_len, plan.kv_len),
                                   block_size=plan.block_size, mask=mask, kv_band=plan.kv_band)
        else:
            block_mask = BlockMask.from_states(tiles, consts, seq_lengths=(plan.q_local, plan.kv_local),
                                               block_size=plan.block_size, mask=mask)
    return _flex_attention(q, k, v, score_mod, block_mask, scale=plan.scale, return_lse=True,
                           backend=plan.backend, kernel_options=dict(plan.kernel_options) or None)


def _has_tiles(plan: _Plan, states, src):
    nkv = plan.kv_blocks_local
    return (jax.lax.dynamic_slice_in_dim(states, src * nkv, nkv, axis=3) != EMPTY).any()


# -- ring ---------------------------------------------------------------------------------

def _rows(w):
    """(B, H, S) per-row weights as (B, S, H, 1), to scale outputs."""
    return jnp.swapaxes(w, 1, 2)[..., None]


def _merge(out, lse, o, l):
    """Softmax-merges two partial attentions of the same queries through their lse."""
    return _softmax.merge_normalized(out, lse, o, l, _rows)


def _ring_perm(n: int):
    return [(j, (j + 1) % n) for j in range(n)]


def _ring_forward(plan: _Plan, q, k, v, score_consts, mask_consts, states):
    i = _index(plan.seq_axes)
    axis = _axis_name(plan.seq_axes)
    perm = _ring_perm(plan.n)
    B, Sq, H, _ = q.shape
    Dv = v.shape[-1]

    def attend(kv, t):
        src = (i - t) % plan.n
        run = functools.partial(_local_attention, plan, q, kv[0], kv[1], score_consts, mask_consts, states, src)
        if plan.block_size is None:
            return run()
        # A k/v block with no tile for these queries is skipped outright.
        empty = (jnp.zeros((B, Sq, H, Dv), q.dtype), jnp.full((B, H, Sq), -jnp.inf, jnp.float32))
        return jax.lax.cond(_has_tiles(plan, states, src), run, lambda: empty)

    def step(t, carry):
        out, lse, kv = carry
        # Send the block on before using it, so the transfer can overlap the compute.
        nxt = jax.lax.ppermute(kv, axis, perm)
        out, lse = _merge(out, lse, *attend(kv, t))
        return out, lse, nxt

    init = (jnp.zeros((B, Sq, H, Dv), jnp.float32), jnp.full((B, H, Sq), -jnp.inf, jnp.float32), (k, v))
    out, lse, kv = jax.lax.fori_loop(0, plan.n - 1, step, init)
    out, lse = _merge(out, lse, *attend(kv, plan.n - 1))
    return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(plan, q, k, v, score_consts, mask_consts, states):
    return _ring_forward(plan, q, k, v, score_consts, mask_consts, states)


def _ring_fwd(plan, q, k, v, score_consts, mask_consts, states):
    out, lse = _ring_forward(plan, q, k, v, score_consts, mask_consts, states)
    # Only the local k/v block is kept: the backward passes the blocks around again.
    return (out, lse), (q, k, v, score_consts, mask_consts, states, out, lse)


def _ring_bwd(plan, res, cts):
    """Gradients of the whole ring, one k/v block at a time, dK/dV travelling with K/V.

    Block t's share of the gradient is the vjp of its own flex_attention (recomputed)
    at cotangents ``dout_t = w_t dO`` and ``dlse_t = w_t (dlse + rowsum(dO (o_t - O)))``,
    where ``w_t = exp(lse_t - lse)`` is its weight in the merged output ``O``.
    """
    q, k, v, score_consts, mask_consts, states, out, lse = res
    dout, dlse = cts
    i = _index(plan.seq_axes)
    axis = _axis_name(plan.seq_axes)
    perm = _ring_perm(plan.n)
    dout32, out32 = dout.astype(jnp.float32), out.astype(jnp.float32)
    dlse = dlse.astype(jnp.float32)
    lse_safe = jnp.where(lse == -jnp.inf, 0.0, lse)
    float_idx = [j for j, c in enumerate(score_consts) if jnp.issubdtype(c.dtype, jnp.inexact)]
    float_consts = tuple(score_consts[j] for j in float_idx)

    def with_float(consts_f):
        consts = list(score_consts)
        for j, c in zip(float_idx, consts_f, strict=True):
            consts[j] = c
        return tuple(consts)

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731

    def contribution(kv, t):
        src = (i - t) % plan.n

        def run():
            def attend(q_, k_, v_, consts_f):
                return _local_attention(plan, q_, k_, v_, with_float(consts_f), mask_consts, states, src)

            (o_t, l_t), vjp = jax.vjp(attend, q, kv[0], kv[1], float_consts)
            w = jnp.exp(l_t - lse_safe)
            do_t = (dout32 * _rows(w)).astype(o_t.dtype)
            dl_t = w * (dlse + jnp.einsum("bqhd,bqhd->bhq", dout32, o_t.astype(jnp.float32) - out32))
            grads = vjp((do_t, dl_t))
            return jax.tree.map(lambda g: g.astype(jnp.float32), grads)

        if plan.block_size is None:
            return run()
        empty = (zeros(q), zeros(kv[0]), zeros(kv[1]), tuple(zeros(c) for c in float_consts))
        return jax.lax.cond(_has_tiles(plan, states, src), run, lambda: empty)

    def add(acc, g):
        return jax.tree.map(jnp.add, acc, g)

    def step(t, carry):
        dq, dconsts, kv, dkv = carry
        gq, gk, gv, gc = contribution(kv, t)
        dkv = add(dkv, (gk, gv))
        kv, dkv = jax.lax.ppermute((kv, dkv), axis, perm)
        return add(dq, gq), add(dconsts, gc), kv, dkv

    init = (zeros(q), tuple(zeros(c) for c in float_consts), (k, v), (zeros(k), zeros(v)))
    dq, dconsts, kv, dkv = jax.lax.fori_loop(0, plan.n - 1, step, init)
    gq, gk, gv, gc = contribution(kv, plan.n - 1)
    dq, dconsts = add(dq, gq), add(dconsts, gc)
    # The last block's dK/dV (and with it every block's) goes home in one more hop.
    dk, dv = jax.lax.ppermute(add(dkv, (gk, gv)), axis, perm)
    dscore = [zero_cotangent(c) for c in score_consts]
    for j, d in zip(float_idx, dconsts, strict=True):
        dscore[j] = d.astype(score_consts[j].dtype)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), tuple(dscore),
            jax.tree.map(zero_cotangent, mask_consts), jax.tree.map(zero_cotangent, states))


_ring.defvjp(_ring_fwd, _ring_bwd)


# -- the shard_map ------------------------------------------------------------------------

def _layout_states(block_mask: BlockMask, n: int, permuted: bool, ring: bool):
    """Tile states (Bm, Hm, nQ, nKV) with rows and columns in layout order.

    Checks that each shard's chunks are whole BlockMask tiles, so a shard's tiles are
    exactly tiles of the global BlockMask.
    """
    (bq, bkv), (q_len, kv_len) = block_mask.block_size, block_mask.seq_lengths
    q_chunk = q_len // (2 * n if permuted else n)
    kv_parts = 2 * n if permuted else (n if ring else 1)
    kv_chunk = kv_len // kv_parts
    for what, chunk, block, size in (("query", q_chunk, bq, "block_q"), ("key", kv_chunk, bkv, "block_kv")):
        if chunk % block:
            raise ValueError(
                f"each context shard holds {what} chunks of {chunk} tokens, which the BlockMask's "
                f"{size}={block} does not divide; rebuild it with create_block_mask(..., "
                f"block_size=...) using a divisor of {chunk} (e.g. {math.gcd(chunk, block)})")
    states = block_mask.block_states()
    if n > 1 and permuted:
        states = states[:, :, block_order(q_len, bq, n, True)]
        states = states[:, :, :, block_order(kv_len, bkv, n, True)]
    return states


def _place(x, spec: P, mesh):
    """Reshards ``x`` to ``spec`` where the mesh has Explicit axes (shard_map needs it)."""
    if not any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return x
    return jax.reshard(x, NamedSharding(mesh, spec))


def _divides(count: int, parts: int, what: str, spec_name: str):
    if count % parts:
        raise ValueError(f"{what} ({count}) must be a multiple of the {parts} shards {spec_name} asks for")


def sharded_flex_attention(specs: AttentionSpecs, query, key, value, score_mod=None, block_mask=None, *,
                           scale=None, return_lse=False, backend=None, kernel_options=None) -> Any:
    """flex_attention over the mesh as ``specs`` say (global shapes in, global shapes out)."""
    check_qkv(query, key, value)
    B, Sq, Hq, _ = query.shape
    Skv, Hkv = key.shape[1], key.shape[2]
    mesh = specs.resolve_mesh()
    sizes = specs.axis_sizes(mesh)
    b_e, s_e, h_e, _ = specs.query
    kv_s, kv_h = specs.kv[1], specs.kv[2]
    size = lambda e: math.prod(sizes[a] for a in axes_of(e))  # noqa: E731
    nb, n, nh = size(b_e), size(s_e), size(h_e)
    ring = kv_s is not None and n > 1
    permuted = specs.permuted and n > 1
    seq_parts = 2 * n if permuted else n
    per = " (2 per shard: permuted)" if permuted else ""
    _divides(B, nb, "batch", f"query_specs[0]={b_e!r}")
    _divides(Hq, nh, "query heads", f"query_specs[2]={h_e!r}")
    _divides(Sq, seq_parts, "query length", f"query_specs[1]={s_e!r}{per}")
    if ring or permuted:
        _divides(Skv, seq_parts, "key length", f"kv_specs[1]={kv_s!r}{per}")
    group = Hq // Hkv
    kv_head_slice = 0
    if kv_h is not None:
        _divides(Hkv, nh, "key/value heads", f"kv_specs[2]={kv_h!r}")
    elif nh > 1:
        local = Hq // nh
        if local % group and group % local:
            raise ValueError(
                f"query heads are sharded {nh} ways ({local} per shard) but k/v heads are whole, with "
                f"{group} query heads per k/v head; neither divides the other, so shard k/v heads too "
                f"(kv_specs[2]={h_e!r})")
        kv_head_slice = max(1, local // group)

    tiles, mask, mask_consts, block_size, kv_band, tiles_spec = (), None, (), None, None, ()
    if block_mask is None:
        check_layout(query, key)
    else:
        check_block_mask(block_mask, query.shape, Skv)
        Bm, Hm = block_mask.shape[:2]
        rows = (b_e if Bm == B else None, h_e if Hm == Hq else None)
        if n == 1:
            # Batch / head parallelism only: each shard takes its rows of the index lists
            # as they are (no dense tile states, the lists' width and kv_band kept).
            tiles = tuple(block_mask.tile_lists())
            tiles_spec = tuple(P(*rows) for _ in tiles)
            kv_band = block_mask.kv_band
        else:
            tiles = _layout_states(block_mask, n, permuted, ring)
            tiles_spec = P(*rows, s_e, None)
        mask, mask_consts, block_size = block_mask.mask, tuple(block_mask.mask_consts), block_mask.block_size
    call = prepare(query, Skv, score_mod, block_mask, scale=scale, kernel_options=kernel_options, backend=backend)
    score_consts = call.score_consts

    plan = _Plan(
        seq_axes=axes_of(s_e), batch_axes=axes_of(b_e), head_axes=axes_of(h_e), n=n, permuted=permuted,
        ring=ring, q_len=Sq, kv_len=Skv, q_local=Sq // n, kv_local=Skv // n if ring else Skv,
        batch_local=B // nb, heads_local=Hq // nh, kv_head_slice=kv_head_slice, group=group,
        score=call.spec.score, mask=mask, block_size=block_size, kv_band=kv_band, scale=call.spec.scale,
        backend=backend, kernel_options=call.spec.kernel_options)

    def body(q, k, v, score_consts, mask_consts, tiles):
        if plan.kv_head_slice:
            start = _index(plan.head_axes) * plan.heads_local // plan.group
            k, v = (jax.lax.dynamic_slice_in_dim(x, start, plan.kv_head_slice, axis=2) for x in (k, v))
        if not plan.ring:
            if plan.n > 1:
                # Gathered here rather than by shard_map's input resharding: the transpose
                # is then a reduce-scatter of dK/dV instead of an all-reduce.
                k, v = jax.lax.all_gather((k, v), _axis_name(plan.seq_axes), axis=1, tiled=True)
            return _local_attention(plan, q, k, v, score_consts, mask_consts, tiles, 0)
        return _ring(plan, q, k, v, score_consts, mask_consts, tiles)

    q_spec, kv_spec = P(b_e, s_e, h_e, None), P(b_e, s_e, kv_h, None)
    in_specs = (q_spec, kv_spec, kv_spec, tuple(P() for _ in score_consts),
                tuple(P() for _ in mask_consts), tiles_spec)
    # check_vma=False: the mods' jaxprs and the backends were traced without manual axes.
    # Only the named axes go manual: over the others q/k/v are replicated, and a manual
    # replicated input would have its cotangent all-reduced over them.
    sharded = jax.shard_map(body, mesh=specs.mesh, in_specs=in_specs, out_specs=(q_spec, P(b_e, h_e, s_e)),
                            axis_names=frozenset(specs.names()), check_vma=False)

    # Under jit even when called eagerly: an eager shard_map would run the shards'
    # custom_vjp (symbolic zeros) op by op, which JAX does not implement, and an abstract
    # mesh places arrays only inside jit.
    @jax.jit
    def placed(*args):
        return sharded(*jax.tree.map(lambda x, s: _place(x, s, mesh), args, in_specs,
                                     is_leaf=lambda x: isinstance(x, P)))

    out, lse = placed(query, key, value, score_consts, mask_consts, tiles)
    return (out, lse) if return_lse else out


# -- entry points -------------------------------------------------------------------------

def _type_spec(x) -> tuple:
    """The 4 entries of ``x``'s sharding type: its Explicit mesh axes (None elsewhere)."""
    spec = tuple(jax.typeof(x).sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def specs_from_types(query, key, value) -> AttentionSpecs | None:
    """Batch / head parallelism read off the Explicit-axis shardings of q, k, v, or None.

    Attention is independent per batch element and head, so q's batch and head entries
    become the specs (k/v take q's batch entry, and q's head entry when both shard their
    heads like q, else whole heads; the output is sharded like q) and no shard talks to
    another. A sharded sequence needs context parallelism, a sharded head_dim a
    contraction over the mesh: both raise. None when no array has an Explicit-axis entry.
    """
    arrays = (("query", query), ("key", key), ("value", value))
    types = {name: _type_spec(x) for name, x in arrays}
    if not any(e is not None for spec in types.values() for e in spec):
        return None
    b_e, _, h_e, _ = types["query"]
    kv_h = h_e if types["key"][2] == types["value"][2] == h_e else None
    for name, spec in types.items():
        if spec[1] is not None:
            raise ValueError(
                f"{name} is sharded over mesh axis {spec[1]!r} along its sequence (dim 1); flex_attention "
                "splits the sequence over the mesh (context parallelism) only inside "
                "flexjax.sharding.attention_specs(query_specs=..., kv_specs=...): wrap the call in "
                f"`with flexjax.sharding.attention_specs(query_specs={(b_e, spec[1], h_e, None)!r}, "
                f"kv_specs={(b_e, None, kv_h, None)!r}):` (k/v all-gathered; kv_specs[1]={spec[1]!r} for a "
                f"ring), or reshard {name} to P({spec[0]!r}, None, {spec[2]!r}, None)")
        if spec[3] is not None:
            raise ValueError(
                f"{name} is sharded over mesh axis {spec[3]!r} along head_dim (dim 3), which attention "
                f"contracts over; shard its heads (dim 2) instead, or reshard it to P({spec[0]!r}, None, "
                f"{spec[2]!r}, None)")
    mesh = next(jax.typeof(x).sharding.mesh for name, x in arrays if any(e is not None for e in types[name]))
    specs = make_specs((b_e, None, h_e, None), (b_e, None, kv_h, None))
    return dataclasses.replace(specs, mesh=mesh)


def maybe_sharded_attention(query, key, value, score_mod=None, block_mask=None, *, scale=None,
                            return_lse=False, backend=None, kernel_options=None, dropout=False,
                            max_scores=False) -> Any:
    """The hook of ``flexjax.flex_attention``: the sharded result, or NotImplemented.

    The active ``attention_specs`` say how to shard; without them, q/k/v sharded over
    Explicit mesh axes (``jax.typeof(q).sharding``) along batch or heads are split as
    their shardings say (``specs_from_types``). NotImplemented (run the ordinary
    single-device path) when neither names a mesh axis, or inside a ``shard_map`` over
    the axes (the arrays there are already per-shard).
    """
    specs = active_specs()
    if specs is None:
        specs = specs_from_types(query, key, value)
    elif not specs.names():
        specs = None
    if specs is None or set(specs.names()) & set(jax.sharding.get_abstract_mesh().manual_axes):
        return NotImplemented
    for wanted, what in ((dropout, "dropout_rate > 0"),
                         (max_scores, "return_aux=AuxRequest(max_scores=True) or (min_scores=True)")):
        if wanted:
            # Each shard sees local b/h/positions: its dropout hash and row maxima would need
            # the global ones mapped in, which the sharded path does not do yet.
            raise NotImplementedError(
                f"{what} is not supported for sharded inputs (attention_specs or Explicit shardings) yet; "
                "run flex_attention on unsharded arrays, or inside your own shard_map")
    return sharded_flex_attention(specs, query, key, value, score_mod, block_mask, scale=scale,
                                  return_lse=return_lse, backend=backend, kernel_options=kernel_options)


def flex_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                   score_mod: Callable | None = None, block_mask: BlockMask | None = None, *,
                   scale: float | None = None, return_lse: bool = False, return_aux=None, sinks=None,
                   dropout_rate: float = 0.0, dropout_rng=None,
                   backend: str | None = None, kernel_options: dict | None = None) -> Any:
    """``flexjax.flex_attention``, sharded as the active ``attention_specs`` say.

    Same arguments and results, with global shapes: q/k/v are (batch, seq, heads,
    head_dim) arrays of the whole problem (in ``permute_tokens`` order when the specs
    are permuted), ``block_mask`` is built for the whole sequence in original positions,
    and the output (and lse) come back sharded like the query. It is
    ``flexjax.flex_attention`` itself, which dispatches here (``maybe_sharded_attention``).
    """
    return _flex_attention(query, key, value, score_mod, block_mask, scale=scale, return_lse=return_lse,
                           return_aux=return_aux, sinks=sinks, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                           backend=backend, kernel_options=kernel_options)


def visited_tiles(block_mask: BlockMask) -> np.ndarray:
    """BlockMask tiles each context shard computes, under the active ``attention_specs``.

    Returns:
      int64 ``(n, steps)``: row i is shard i; ``steps`` is 1 for all-gathered k/v and n
      for the ring (column t: the k/v block it holds at step t). Tiles are counted over
      the BlockMask's (b, h) rows; a shard skips every other tile.
    """
    specs = active_specs()
    if specs is None:
        raise ValueError("visited_tiles reads the active attention_specs; call it inside `with attention_specs(...):`")
    n = specs.context_shards()
    ring = specs.kv[1] is not None and n > 1
    states = np.asarray(_layout_states(block_mask, n, specs.permuted and n > 1, ring))
    per_tile = (states != EMPTY).sum((0, 1))
    rows = per_tile.reshape(n, -1, per_tile.shape[-1]).sum(1)
    if not ring:
        return rows.sum(-1, keepdims=True)
    blocks = rows.reshape(n, n, -1).sum(-1)  # [shard, owner of the k/v block]
    return np.stack([blocks[i, (i - np.arange(n)) % n] for i in range(n)])


register_sharded_dispatch(maybe_sharded_attention)
