"""The GPU kernel template (Triton lowering; also what runs in interpret mode on CPU).

Forward: one program per (q tile, batch x query head) walks its row of the BlockMask's
partial then full tile lists, with an online softmax in registers. Backward
(FlashAttention-2): a dQ kernel over the same lists, and a dK/dV kernel per (kv tile,
batch x kv head) over the transposed lists and the query heads of its GQA group, so K/V
are never copied per query head and dK/dV need no reduction afterwards. The lists are
int32 input refs; captured arrays the kernel gathers from are whole-array refs. With
dropout the (2,) uint32 seed is the last input (a whole-array ref) and every tile hashes
its keep mask (``_tile.Dropout``); at rate 0 neither exists.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .. import _softmax
from .._layout import Geom, Mods, Prologue, is_float
from ._tile import (
    Dropout,
    ModInputs,
    backward_tile,
    dot,
    dot_nt,
    dot_tn,
    finish,
    flat_index,
    forward_tile,
    onehot_partial,
    reduce_axes,
    tile_indices,
)

# Chunk of an array's flattened gradient reduced per step of the one-hot reduction, which
# walks only the chunks a tile's indices fall in (tq + tk - 1 entries for relative_bias):
# the (tq, tk, chunk) comparison is live in registers. sm_90, relative_bias bf16 D=128, dQ
# 64x64 tile with 8 warps (tests_compile): chunk 16 spilled ~34 KB per thread (4 warps),
# 4 spilled 1.1 KB, 1 spilled 164 B, 2 none.
_ONEHOT_CHUNK = 2
# Chunk that zeroes each program's gradient slab (stores only); a multiple of _ONEHOT_CHUNK.
_ZERO_CHUNK = 16


def _whole(x):
    """A BlockSpec for the whole array, the same block for every program."""
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _div(x, n: int):
    """x // n for non-negative int32 x; lax.div with an int32 divisor, since the Triton
    lowering mistypes the weak-typed literal that jnp's floor_divide emits."""
    return x if n == 1 else lax.div(x, jnp.int32(n))


def _rem(x, n: int):
    return jnp.int32(0) if n == 1 else lax.rem(x, jnp.int32(n))


def _take(it, n):
    return tuple(next(it) for _ in range(n))


def _compiler_params(target: str | None, interpret: bool, warps: int, stages: int):
    """Triton launch parameters; they also select the Triton lowering over Mosaic GPU.

    JAX 0.11 deprecates that lowering (a DeprecationWarning when a kernel is lowered);
    its CompilerParams are the same as in 0.10.
    """
    if target != "cuda" or interpret:
        return None
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=warps, num_stages=stages)


class _Program:
    """Per-program indices and loaders shared by the three kernels."""

    def __init__(self, g: Geom, b, h):
        self.g, self.b, self.h = g, b, h
        self.bm = b if g.Bm > 1 else 0

    def hm(self, h):
        return h if self.g.Hm > 1 else 0

    def mod_inputs(self, pro_refs, uses_rows, uses_cols, h, q_start, kv_start):
        rows_refs, cols_refs, arr_refs = pro_refs
        g = self.g

        def bh(uses):
            ub, uh = uses
            return (self.b if ub else 0), (h if uh else 0)

        rows = tuple(ref[(*bh(u), pl.ds(q_start, g.tq), slice(None))] for ref, u in zip(rows_refs, uses_rows))
        cols = tuple(ref[(*bh(u), slice(None), pl.ds(kv_start, g.tk))] for ref, u in zip(cols_refs, uses_cols))
        return ModInputs(rows, cols, lambda k, idx: arr_refs[k][tuple(idx)])

    def tile(self, h, q_start, kv_start):
        g = self.g
        return tile_indices(self.b, h, q_start, kv_start, g.tq, g.tk, g.q_len, g.kv_len)


def _uses(cm):
    return (cm.row_uses, cm.col_uses) if cm is not None else ((), ())


def _walk(n_ref, idx_ref, program, h, row, sub, body, carry):
    """Loops ``body(tile_index, carry)`` over one row of a tile list, ``sub`` steps per entry."""
    n = n_ref[program.bm, program.hm(h), row] * sub

    def step(t, c):
        entry = idx_ref[program.bm, program.hm(h), row, _div(t, sub)]
        return body(entry * sub + _rem(t, sub), c)

    return lax.fori_loop(0, n, step, carry)


def _pro_refs(it, pro: Prologue):
    return (_take(it, len(pro.rows)), _take(it, len(pro.cols)), _take(it, len(pro.arrays)))


def _dropout(it, rate: float):
    """The Dropout of a kernel whose inputs end with the (2,) int32 seed ref; None at rate 0."""
    if not rate:
        return None
    seed_ref = next(it)
    return Dropout(rate, (seed_ref[0], seed_ref[1]))


def _seed_args(seed, rate: float):
    """The seed operand (a trailing kernel input) when dropout is on, as int32 (see ``_dropout``)."""
    return (jax.lax.bitcast_convert_type(seed, jnp.int32),) if rate else ()


# -- forward ---------------------------------------------------------------------------------

def _fwd_kernel(*refs, g: Geom, mods: Mods, scale: float, shapes, rate: float):
    it = iter(refs)
    kv_n, kv_i, fkv_n, fkv_i, q_ref, k_ref, v_ref = _take(it, 7)
    s_refs, m_refs = _pro_refs(it, shapes[0]), _pro_refs(it, shapes[1])
    drop = _dropout(it, rate)
    o_ref, m_ref, l_ref = _take(it, 3)
    i, bh = pl.program_id(0), pl.program_id(1)
    b, h = _div(bh, g.Hq), _rem(bh, g.Hq)
    prog = _Program(g, b, h)
    q = q_ref[...]
    q_start = i * g.tq
    row = _div(i, g.sub_q)
    s_uses, m_uses = _uses(mods.score), _uses(mods.mask)

    def body(masked):
        def step(j, carry):
            ks = pl.multiple_of(j * g.tk, g.tk)
            k = k_ref[pl.ds(ks, g.tk), :]
            v = v_ref[pl.ds(ks, g.tk), :]
            t = prog.tile(h, q_start, ks)
            return forward_tile(mods, carry, q, k, v, t, scale, masked,
                                prog.mod_inputs(s_refs, *s_uses, h, q_start, ks),
                                prog.mod_inputs(m_refs, *m_uses, h, q_start, ks), drop)

        return step

    dv = v_ref.shape[-1]
    carry = (*_softmax.start((g.tq, 1), jnp.float32),
             jnp.zeros((g.tq, dv), jnp.float32))
    carry = _walk(kv_n, kv_i, prog, h, row, g.sub_k, body(True), carry)
    carry = _walk(fkv_n, fkv_i, prog, h, row, g.sub_k, body(False), carry)
    out, m, l = finish(carry, drop)
    o_ref[...] = out.astype(o_ref.dtype)
    m_ref[...] = m
    l_ref[...] = l


def forward(g: Geom, mods: Mods, scale, q, k, v, lists, s_pro: Prologue, m_pro: Prologue, *,
            target: str | None, interpret: bool, warps: int, stages: int, rate: float = 0.0, seed=None):
    """q (B, sq, Hq, D), k/v (B, skv, Hkv, .) padded; returns out (B, sq, Hq, Dv) and each row's max and
    sum (B, Hq, sq, 1) float32 (see ``_tile.finish``). ``rate`` > 0: dropout on P with the (2,)
    uint32 ``seed``."""
    G, Hq = g.G, g.Hq
    kv_n, kv_i, fkv_n, fkv_i = lists.by_q
    D, Dv = q.shape[-1], v.shape[-1]
    pro_args = (*s_pro.rows, *s_pro.cols, *s_pro.arrays, *m_pro.rows, *m_pro.cols, *m_pro.arrays,
                *_seed_args(seed, rate))
    in_specs = [_whole(x) for x in (kv_n, kv_i, fkv_n, fkv_i)] + [
        pl.BlockSpec((None, g.tq, None, D), lambda i, bh: (bh // Hq, i, bh % Hq, 0)),
        pl.BlockSpec((None, g.skv, None, D), lambda i, bh: (bh // Hq, 0, (bh % Hq) // G, 0)),
        pl.BlockSpec((None, g.skv, None, Dv), lambda i, bh: (bh // Hq, 0, (bh % Hq) // G, 0)),
    ] + [_whole(x) for x in pro_args]
    vec_spec = pl.BlockSpec((None, None, g.tq, 1), lambda i, bh: (bh // Hq, bh % Hq, i, 0))
    out_specs = [pl.BlockSpec((None, g.tq, None, Dv), lambda i, bh: (bh // Hq, i, bh % Hq, 0)), vec_spec, vec_spec]
    kernel = functools.partial(_fwd_kernel, g=g, mods=mods, scale=scale, shapes=(s_pro, m_pro), rate=rate)
    vec = jax.ShapeDtypeStruct((g.B, Hq, g.sq, 1), jnp.float32)
    out, row_max, row_sum = pl.pallas_call(
        kernel, grid=(g.sq // g.tq, g.B * Hq), in_specs=in_specs, out_specs=out_specs,
        out_shape=[jax.ShapeDtypeStruct((g.B, g.sq, Hq, Dv), q.dtype), vec, vec],
        interpret=interpret, compiler_params=_compiler_params(target, interpret, warps, stages),
        name="flexjax_fwd",
    )(kv_n, kv_i, fkv_n, fkv_i, q, k, v, *pro_args)
    return out, row_max, row_sum


# -- backward: dQ ----------------------------------------------------------------------------

def _dq_kernel(*refs, g: Geom, mods: Mods, scale: float, shapes, n_drows: int, arr_info, rate: float):
    it = iter(refs)
    kv_n, kv_i, fkv_n, fkv_i, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = _take(it, 10)
    s_refs, m_refs = _pro_refs(it, shapes[0]), _pro_refs(it, shapes[1])
    drop = _dropout(it, rate)
    dq_ref = next(it)
    drow_refs = _take(it, n_drows)
    darr_refs = _take(it, sum(1 for info in arr_info if info is not None))
    i, bh = pl.program_id(0), pl.program_id(1)
    b, h = _div(bh, g.Hq), _rem(bh, g.Hq)
    prog = _Program(g, b, h)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_start = i * g.tq
    row = _div(i, g.sub_q)
    s_uses, m_uses = _uses(mods.score), _uses(mods.mask)
    darr_of = {}
    slot = iter(darr_refs)
    for n, info in enumerate(arr_info):
        if info is not None:
            darr_of[n] = (next(slot), info)
            ref = darr_of[n][0]

            @pl.loop(0, ref.shape[-1] // _ZERO_CHUNK)
            def _(c, ref=ref):
                ref[pl.ds(pl.multiple_of(c * _ZERO_CHUNK, _ZERO_CHUNK), _ZERO_CHUNK)] = jnp.zeros(
                    (_ZERO_CHUNK,), jnp.float32)

    def body(masked):
        def step(j, carry):
            dq, drows = carry
            ks = pl.multiple_of(j * g.tk, g.tk)
            k = k_ref[pl.ds(ks, g.tk), :]
            v = v_ref[pl.ds(ks, g.tk), :]
            t = prog.tile(h, q_start, ks)
            tg = backward_tile(mods, q, k, v, do, lse, delta, t, scale, masked,
                               prog.mod_inputs(s_refs, *s_uses, h, q_start, ks),
                               prog.mod_inputs(m_refs, *m_uses, h, q_start, ks), drop=drop)
            dq = dq + dot(tg.ds.astype(k.dtype), k)
            drows = tuple(a + d for a, d in zip(drows, [d for d in tg.rows if d is not None]))
            for kk, idx, d in tg.reads:
                if d is None:
                    continue
                ref, shape = darr_of[kk]
                flat = flat_index(idx, shape)
                flat = jnp.broadcast_to(flat, d.shape)
                # Only the chunks this tile's indices reach; the order stays fixed (deterministic).
                first = _div(reduce_axes(jnp.min, flat), _ONEHOT_CHUNK)
                last = _div(reduce_axes(jnp.max, flat), _ONEHOT_CHUNK)

                @pl.loop(first, last + 1)
                def _(c, ref=ref, flat=flat, d=d):
                    start = pl.multiple_of(c * _ONEHOT_CHUNK, _ONEHOT_CHUNK)
                    ref[pl.ds(start, _ONEHOT_CHUNK)] += onehot_partial(flat, d, start, _ONEHOT_CHUNK)

            return dq, drows

        return step

    carry = (jnp.zeros((g.tq, q.shape[-1]), jnp.float32),
             tuple(jnp.zeros((g.tq, 1), jnp.float32) for _ in range(n_drows)))
    carry = _walk(kv_n, kv_i, prog, h, row, g.sub_k, body(True), carry)
    dq, drows = _walk(fkv_n, fkv_i, prog, h, row, g.sub_k, body(False), carry)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)
    for ref, d in zip(drow_refs, drows):
        ref[...] = d


# -- backward: dK/dV -------------------------------------------------------------------------

def _dkv_kernel(*refs, g: Geom, mods: Mods, scale: float, shapes, n_dcols: int, rate: float):
    it = iter(refs)
    q_n, q_i, fq_n, fq_i, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = _take(it, 10)
    s_refs, m_refs = _pro_refs(it, shapes[0]), _pro_refs(it, shapes[1])
    drop = _dropout(it, rate)
    dk_ref, dv_ref = _take(it, 2)
    dcol_refs = _take(it, n_dcols)
    j, bkv = pl.program_id(0), pl.program_id(1)
    b, kvh = _div(bkv, g.Hkv), _rem(bkv, g.Hkv)
    prog = _Program(g, b, kvh * g.G)
    k, v = k_ref[...], v_ref[...]
    ks = j * g.tk
    col = _div(j, g.sub_k)
    s_uses, m_uses = _uses(mods.score), _uses(mods.mask)

    def head(gi, carry):
        dk, dv = carry
        h = kvh * g.G + gi

        def body(masked):
            def step(i, c):
                dk, dv, dcols = c
                qs = pl.multiple_of(i * g.tq, g.tq)
                rows = pl.ds(qs, g.tq)
                # Both products before the mods, and q and dO read again for dK and dV
                # rather than held across the tile's VJP: sm_90 f32 D=256 relative_bias,
                # 16x16/4w dK/dV (tests_compile): ptxas went from 32 registers and 7.8 KB
                # spilled per thread to 252 registers, none (each change alone: 464 B, 15 KB).
                qk = dot_nt(q_ref[rows, h, :], k)
                dov = dot_nt(do_ref[rows, h, :], v)
                lse = lse_ref[h, rows, :]
                delta = delta_ref[h, rows, :]
                t = prog.tile(h, qs, ks)
                tg = backward_tile(mods, None, None, None, None, lse, delta, t, scale, masked,
                                   prog.mod_inputs(s_refs, *s_uses, h, qs, ks),
                                   prog.mod_inputs(m_refs, *m_uses, h, qs, ks), qk=qk, dov=dov, drop=drop)
                dv = dv + dot_tn(tg.p.astype(do_ref.dtype), do_ref[rows, h, :])
                dk = dk + dot_tn(tg.ds.astype(q_ref.dtype), q_ref[rows, h, :])
                dcols = tuple(a + d for a, d in zip(dcols, [d for d in tg.cols if d is not None]))
                return dk, dv, dcols

            return step

        c = (dk, dv, tuple(jnp.zeros((1, g.tk), jnp.float32) for _ in range(n_dcols)))
        c = _walk(q_n, q_i, prog, h, col, g.sub_q, body(True), c)
        dk, dv, dcols = _walk(fq_n, fq_i, prog, h, col, g.sub_q, body(False), c)
        for ref, d in zip(dcol_refs, dcols):
            ref[h, :, pl.ds(ks, g.tk)] = d
        return dk, dv

    carry = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = lax.fori_loop(0, g.G, head, carry)
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def backward(g: Geom, mods: Mods, scale, q, k, v, do, lse, delta, lists, s_pro: Prologue, m_pro: Prologue, *,
             target: str | None, interpret: bool, warps: int, stages: int, rate: float = 0.0, seed=None):
    """Padded inputs as in ``forward``; lse (-inf replaced by 0) and delta (B, Hq, sq, 1) float32.

    Returns dq, dk, dv (padded), and the score_mod's gradients: per row / col (B, Hq, sq, 1)
    / (B, Hq, 1, skv) float32 (None for non-float ones), per array its flat gradient (None
    for non-float ones).
    """
    G, Hq, Hkv = g.G, g.Hq, g.Hkv
    D, Dv = q.shape[-1], v.shape[-1]
    pro_args = (*s_pro.rows, *s_pro.cols, *s_pro.arrays, *m_pro.rows, *m_pro.cols, *m_pro.arrays,
                *_seed_args(seed, rate))
    params = _compiler_params(target, interpret, warps, stages)
    float_rows = [is_float(r) for r in s_pro.rows]
    float_cols = [is_float(c) for c in s_pro.cols]
    arr_info = tuple(a.shape if is_float(a) else None for a in s_pro.arrays)
    nq, nk = g.sq // g.tq, g.skv // g.tk

    # dQ
    row_spec = lambda d: pl.BlockSpec((None, g.tq, None, d), lambda i, bh: (bh // Hq, i, bh % Hq, 0))  # noqa: E731
    seq_spec = lambda d: pl.BlockSpec((None, g.skv, None, d), lambda i, bh: (bh // Hq, 0, (bh % Hq) // G, 0))  # noqa: E731
    vec_spec = pl.BlockSpec((None, None, g.tq, 1), lambda i, bh: (bh // Hq, bh % Hq, i, 0))
    flat_sizes = [-(-math.prod(s) // _ZERO_CHUNK) * _ZERO_CHUNK for s in arr_info if s is not None]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_specs = [row_spec(D)]
    out_shape += [jax.ShapeDtypeStruct((g.B, Hq, g.sq, 1), jnp.float32) for f in float_rows if f]
    out_specs += [pl.BlockSpec((None, None, g.tq, 1), lambda i, bh: (bh // Hq, bh % Hq, i, 0))
                  for f in float_rows if f]
    out_shape += [jax.ShapeDtypeStruct((nq, g.B * Hq, n), jnp.float32) for n in flat_sizes]
    out_specs += [pl.BlockSpec((None, None, n), lambda i, bh: (i, bh, 0)) for n in flat_sizes]
    kernel = functools.partial(_dq_kernel, g=g, mods=mods, scale=scale, shapes=(s_pro, m_pro),
                               n_drows=sum(float_rows), arr_info=arr_info, rate=rate)
    dq, *rest = pl.pallas_call(
        kernel, grid=(nq, g.B * Hq),
        in_specs=[_whole(x) for x in lists.by_q] + [row_spec(D), seq_spec(D), seq_spec(Dv), row_spec(Dv),
                                                   vec_spec, vec_spec] + [_whole(x) for x in pro_args],
        out_specs=out_specs, out_shape=out_shape, interpret=interpret, compiler_params=params,
        name="flexjax_bwd_dq",
    )(*lists.by_q, q, k, v, do, lse, delta, *pro_args)
    it = iter(rest)
    d_rows = tuple(next(it) if f else None for f in float_rows)
    d_arrays = []
    for shape in arr_info:
        if shape is None:
            d_arrays.append(None)
        else:
            d_arrays.append(next(it).sum((0, 1))[: math.prod(shape)].reshape(shape))

    # dK/dV
    kv_spec = lambda d: pl.BlockSpec((None, g.tk, None, d), lambda j, b: (b // Hkv, j, b % Hkv, 0))  # noqa: E731
    all_q = lambda d: pl.BlockSpec((None, g.sq, Hq, d), lambda j, b: (b // Hkv, 0, 0, 0))  # noqa: E731
    all_vec = pl.BlockSpec((None, Hq, g.sq, 1), lambda j, b: (b // Hkv, 0, 0, 0))
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    out_shape += [jax.ShapeDtypeStruct((g.B, Hq, 1, g.skv), jnp.float32) for f in float_cols if f]
    out_specs = [kv_spec(D), kv_spec(Dv)] + [
        pl.BlockSpec((None, Hq, 1, g.skv), lambda j, b: (b // Hkv, 0, 0, 0)) for f in float_cols if f]
    kernel = functools.partial(_dkv_kernel, g=g, mods=mods, scale=scale, shapes=(s_pro, m_pro),
                               n_dcols=sum(float_cols), rate=rate)
    dk, dv, *rest = pl.pallas_call(
        kernel, grid=(nk, g.B * Hkv),
        in_specs=[_whole(x) for x in lists.by_kv] + [all_q(D), kv_spec(D), kv_spec(Dv), all_q(Dv), all_vec,
                                                   all_vec] + [_whole(x) for x in pro_args],
        out_specs=out_specs, out_shape=out_shape, interpret=interpret, compiler_params=params,
        name="flexjax_bwd_dkv",
    )(*lists.by_kv, q, k, v, do, lse, delta, *pro_args)
    it = iter(rest)
    d_cols = tuple(next(it) if f else None for f in float_cols)
    return dq, dk, dv, d_rows, d_cols, tuple(d_arrays)
