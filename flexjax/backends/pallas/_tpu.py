"""The TPU kernel template (Mosaic): the tile lists are scalar prefetch.

The grid's last axis walks a row of the BlockMask: step ``t`` visits the row's t-th
partial tile, then its full tiles, and idles past the end (the index maps repeat the last
block, so an idle step issues no new DMA). K/V and the hoisted column values arrive as
blocks chosen by the prefetched lists; accumulators live in VMEM scratch. Inputs use
the (batch, heads, seq, dim) layout, whose last two block dims Mosaic can tile. Mosaic
cannot gather, so the compiler has already rejected mods that read captured arrays with
both q_idx and kv_idx, except along the diagonal ``kv_idx - q_idx``: such values arrive
as one vector per (b, h) over the diagonals (``_layout.DiagWindow``), and a tile is the
Toeplitz block of one contiguous slice, built by a strided lane rotation (``diag_tile``).
Their gradient is that rotation's transpose, summed over rows, accumulated per (b, h)
across the dQ kernel's q tiles in a resident output block. With dropout the (2,) uint32
seed is the last input, a whole array in SMEM (libtpu compiles the uint32 hash on v5e).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._layout import DiagWindow, Geom, Mods, Prologue, diag_window, is_float
from ._tile import Dropout, ModInputs, backward_tile, dot, dot_tn, finish, forward_tile, tile_indices


def _lists_at(g: Geom, refs, b, h, row, t):
    """(block index, is partial, is active) of step ``t`` of a list row, from scalar refs."""
    n_ref, i_ref, fn_ref, fi_ref = refs
    bm = b if g.Bm > 1 else 0
    hm = h if g.Hm > 1 else 0
    n, nf = n_ref[bm, hm, row], fn_ref[bm, hm, row]
    # Past the row's end, repeat its last block (no new DMA); an empty row reads block 0.
    tt = jnp.maximum(jnp.minimum(t, n + nf - 1), 0)
    partial_blk = i_ref[bm, hm, row, jnp.minimum(tt, i_ref.shape[-1] - 1)]
    full_blk = fi_ref[bm, hm, row, jnp.clip(tt - n, 0, fi_ref.shape[-1] - 1)]
    return jnp.where(tt < n, partial_blk, full_blk), t < n, (t >= n) & (t < n + nf)


def _steps(idx, full_idx, n_tiles: int) -> int:
    """Grid steps that walk a row of the lists: its partial then its full tiles, at most
    the lists' widths together and the row's tiles (both lists may be that wide)."""
    return min(idx.shape[-1] + full_idx.shape[-1], n_tiles)


def _bh(uses, b, h):
    ub, uh = uses
    return (b if ub else 0), (h if uh else 0)


def _mod_specs(cm, pro: Prologue, g: Geom, row_map, col_map, bh_map):
    """BlockSpecs of one mod's hoisted rows ((tq, 1) blocks), cols ((1, tk) blocks) and diagonals.

    A diagonal value's whole vector is one block (its tiles slice it in the kernel);
    ``bh_map(u, *grid_and_refs)`` gives its (b, h).
    """
    if cm is None:
        return []
    specs = [pl.BlockSpec((None, None, g.tq, 1), functools.partial(row_map, u)) for u in cm.row_uses]
    specs += [pl.BlockSpec((None, None, 1, g.tk), functools.partial(col_map, u)) for u in cm.col_uses]
    size = diag_window(g).size
    specs += [pl.BlockSpec((None, None, 1, size), lambda *a, u=u: (*bh_map(u, *a), 0, 0)) for u in cm.diag_uses]
    return specs


def _split_mod_refs(it, pro: Prologue):
    rows = tuple(next(it) for _ in pro.rows)
    cols = tuple(next(it) for _ in pro.cols)
    diags = tuple(next(it) for _ in pro.diags)
    return rows, cols, diags


def _diag_slice(g: Geom, win: DiagWindow, q_start, kv_start):
    """(start, rem) of a tile's diagonal slice ``w[start : start + span]``, start a multiple of 128.

    Column m of the slice holds diagonal ``rem + tq - 1 + j - i`` of tile row i, column j.
    """
    base = kv_start - q_start + (win.offset - (g.tq - 1))
    if win.aligned:
        return pl.multiple_of(base, 128), 0
    rem = base % 128
    return pl.multiple_of(base - rem, 128), rem


def diag_tile(ref, g: Geom, win: DiagWindow, q_start, kv_start):
    """The (tq, tk) tile of a diagonal value from its (1, size) vector ref."""
    start, rem = _diag_slice(g, win, q_start, kv_start)
    x = jnp.broadcast_to(ref[:, pl.ds(start, win.span)], (g.tq, win.span))
    # Row i rotated right by rotation + i: column j reads lane (j - rotation - i) mod span =
    # rem + tq - 1 + j - i, inside the slice since rem + tq + tk - 1 <= span.
    rotation = win.span - (g.tq - 1) - rem
    return pltpu.roll(x, rotation, 1, stride=1, stride_axis=0)[:, : g.tk]


def _flip_rows(x):
    """``x[::-1]``: sublane gathers within each 8-row block, then the blocks in reverse order.

    Mosaic has no reverse; a row gather inside one (8, 128) vreg tile is what it can do.
    (Row counts that are not multiples of 8 only occur in interpret mode.)
    """
    if x.shape[0] % 8:
        return x[::-1]
    flip = 7 - lax.broadcasted_iota(jnp.int32, (8, x.shape[1]), 0)
    blocks = [jnp.take_along_axis(x[r:r + 8], flip, axis=0) for r in range(0, x.shape[0], 8)]
    return jnp.concatenate(blocks[::-1], axis=0)


def diag_grad(dt, g: Geom, win: DiagWindow, q_start, kv_start):
    """(start, (1, span) float32): ``diag_tile``'s transpose applied to the tile gradient ``dt``.

    Each stored diagonal receives the sum of ``dt`` along it. Mosaic rotates lanes only by
    small non-negative strides, which line up anti-diagonals; on the row-reversed tile
    those are ``dt``'s diagonals: row i' = tq - 1 - i rotated right by ``rem + i'`` puts
    ``dt[i, m - rem - (tq - 1) + i]`` at lane m, and the zero padding past column tk
    absorbs the wrap-around.
    """
    start, rem = _diag_slice(g, win, q_start, kv_start)
    x = jnp.concatenate([_flip_rows(dt.astype(jnp.float32)), jnp.zeros((g.tq, win.span - g.tk), jnp.float32)],
                        axis=1)
    x = pltpu.roll(x, rem, 1, stride=1, stride_axis=0)
    return start, x.sum(axis=0, keepdims=True)


def _inputs(refs, g: Geom, q_start, kv_start) -> ModInputs:
    """One mod's tile inputs; diagonal tiles follow the rows (``CompiledMod.evaluate``)."""
    rows, cols, diags = refs
    win = diag_window(g)
    diag_tiles = tuple(diag_tile(d, g, win, q_start, kv_start) for d in diags)
    return ModInputs((*(r[...] for r in rows), *diag_tiles), tuple(c[...] for c in cols), None)


def _pro_args(pro: Prologue):
    return (*pro.rows, *pro.cols, *pro.diags)


def _seed(seed, rate: float):
    """(in_specs, operands) of the dropout seed: a (2,) whole array in SMEM (int32, the hash's
    type), after the mods'."""
    if not rate:
        return [], ()
    return [pl.BlockSpec(memory_space=pltpu.SMEM)], (jax.lax.bitcast_convert_type(seed, jnp.int32),)


def _dropout(it, rate: float):
    if not rate:
        return None
    seed_ref = next(it)
    return Dropout(rate, (seed_ref[0], seed_ref[1]))


def _params(n_parallel: int):
    return pltpu.CompilerParams(dimension_semantics=("parallel",) * n_parallel + ("arbitrary",) * (4 - n_parallel))


def _tile(g: Geom, b, h, q_start, kv_start):
    return tile_indices(b, h, q_start, kv_start, g.tq, g.tk, g.q_len, g.kv_len, full_2d=True)


# -- forward ---------------------------------------------------------------------------------

def _fwd_kernel(*refs, g: Geom, mods: Mods, scale: float, pros, rate: float):
    it = iter(refs)
    lists = tuple(next(it) for _ in range(4))
    q_ref, k_ref, v_ref = next(it), next(it), next(it)
    s_refs, m_refs = _split_mod_refs(it, pros[0]), _split_mod_refs(it, pros[1])
    drop = _dropout(it, rate)
    o_ref, max_ref, sum_ref, m_sc, l_sc, acc_sc = it
    b, h, i, t = (pl.program_id(a) for a in range(4))
    blk, partial, active = _lists_at(g, lists, b, h, i, t)

    @pl.when(t == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    def step(masked):
        q_start, kv_start = i * g.tq, blk * g.tk
        tile = _tile(g, b, h, q_start, kv_start)
        carry = forward_tile(mods, (m_sc[...], l_sc[...], acc_sc[...]), q_ref[...], k_ref[...], v_ref[...], tile,
                             scale, masked, _inputs(s_refs, g, q_start, kv_start),
                             _inputs(m_refs, g, q_start, kv_start), drop)
        m_sc[...], l_sc[...], acc_sc[...] = carry

    pl.when(partial)(lambda: step(True))
    pl.when(active & ~partial)(lambda: step(False))

    @pl.when(t == pl.num_programs(3) - 1)
    def _():
        out, row_max, row_sum = finish((m_sc[...], l_sc[...], acc_sc[...]), drop)
        o_ref[...] = out.astype(o_ref.dtype)
        max_ref[...] = row_max
        sum_ref[...] = row_sum


def forward(g: Geom, mods: Mods, scale, q, k, v, lists, s_pro: Prologue, m_pro: Prologue, *,
            target, interpret: bool, warps=None, stages=None, rate: float = 0.0, seed=None):
    """Same contract as the GPU template's ``forward`` (inputs in (B, seq, heads, dim))."""
    del target, warps, stages
    G = g.G
    qt, kt, vt = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    D, Dv = q.shape[-1], v.shape[-1]
    nsteps = _steps(lists.kv_idx, lists.full_kv_idx, g.skv // g.ck)
    L = lists.by_q

    def kv_map(b, h, i, t, *refs):
        return (b, h // G, _lists_at(g, refs, b, h, i, t)[0], 0)

    def row_map(u, b, h, i, t, *refs):
        return (*_bh(u, b, h), i, 0)

    def col_map(u, b, h, i, t, *refs):
        return (*_bh(u, b, h), 0, _lists_at(g, refs, b, h, i, t)[0])

    def bh_map(u, b, h, i, t, *refs):
        return _bh(u, b, h)

    q_spec = pl.BlockSpec((None, None, g.tq, D), lambda b, h, i, t, *_: (b, h, i, 0))
    in_specs = [q_spec, pl.BlockSpec((None, None, g.tk, D), kv_map), pl.BlockSpec((None, None, g.tk, Dv), kv_map)]
    in_specs += (_mod_specs(mods.score, s_pro, g, row_map, col_map, bh_map)
                 + _mod_specs(mods.mask, m_pro, g, row_map, col_map, bh_map))
    seed_specs, seed_args = _seed(seed, rate)
    in_specs += seed_specs
    vec_spec = pl.BlockSpec((None, None, g.tq, 1), lambda b, h, i, t, *_: (b, h, i, 0))
    out_specs = [pl.BlockSpec((None, None, g.tq, Dv), lambda b, h, i, t, *_: (b, h, i, 0)), vec_spec, vec_spec]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4, grid=(g.B, g.Hq, g.sq // g.tq, nsteps), in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((g.tq, 1), jnp.float32), pltpu.VMEM((g.tq, 1), jnp.float32),
                        pltpu.VMEM((g.tq, Dv), jnp.float32)])
    kernel = functools.partial(_fwd_kernel, g=g, mods=mods, scale=scale, pros=(s_pro, m_pro), rate=rate)
    vec = jax.ShapeDtypeStruct((g.B, g.Hq, g.sq, 1), jnp.float32)
    out, row_max, row_sum = pl.pallas_call(
        kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((g.B, g.Hq, g.sq, Dv), q.dtype), vec, vec],
        compiler_params=_params(3), interpret=interpret, name="flexjax_fwd",
    )(*L, qt, kt, vt, *_pro_args(s_pro), *_pro_args(m_pro), *seed_args)
    return jnp.swapaxes(out, 1, 2), row_max, row_sum


# -- backward --------------------------------------------------------------------------------

def _dq_kernel(*refs, g: Geom, mods: Mods, scale: float, pros, n_drows: int, n_ddiags: int, rate: float):
    it = iter(refs)
    lists = tuple(next(it) for _ in range(4))
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = (next(it) for _ in range(6))
    s_refs, m_refs = _split_mod_refs(it, pros[0]), _split_mod_refs(it, pros[1])
    drop = _dropout(it, rate)
    dq_ref = next(it)
    drow_refs = tuple(next(it) for _ in range(n_drows))
    # Resident across the q tiles and steps of one (b, h): diagonals gather from every q tile.
    ddiag_refs = tuple(next(it) for _ in range(n_ddiags))
    dq_sc, *drow_sc = it
    b, h, i, t = (pl.program_id(a) for a in range(4))
    blk, partial, active = _lists_at(g, lists, b, h, i, t)
    n_rows = len(pros[0].rows)
    win = diag_window(g)

    @pl.when(t == 0)
    def _():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)
        for sc in drow_sc:
            sc[...] = jnp.zeros(sc.shape, jnp.float32)

    if ddiag_refs:
        @pl.when((i == 0) & (t == 0))
        def _():
            for ref in ddiag_refs:
                ref[...] = jnp.zeros(ref.shape, jnp.float32)

    def step(masked):
        k = k_ref[...]
        q_start, kv_start = i * g.tq, blk * g.tk
        tg = backward_tile(mods, q_ref[...], k, v_ref[...], do_ref[...], lse_ref[...], delta_ref[...],
                           _tile(g, b, h, q_start, kv_start), scale, masked, _inputs(s_refs, g, q_start, kv_start),
                           _inputs(m_refs, g, q_start, kv_start), drop=drop)
        dq_sc[...] += dot(tg.ds.astype(k.dtype), k)
        for sc, d in zip(drow_sc, [d for d in tg.rows[:n_rows] if d is not None]):
            sc[...] += d
        for ref, d in zip(ddiag_refs, [d for d in tg.rows[n_rows:] if d is not None]):
            start, sums = diag_grad(d, g, win, q_start, kv_start)
            ref[:, pl.ds(start, win.span)] += sums

    pl.when(partial)(lambda: step(True))
    pl.when(active & ~partial)(lambda: step(False))

    @pl.when(t == pl.num_programs(3) - 1)
    def _():
        dq_ref[...] = (dq_sc[...] * scale).astype(dq_ref.dtype)
        for ref, sc in zip(drow_refs, drow_sc):
            ref[...] = sc[...]


def _dkv_kernel(*refs, g: Geom, mods: Mods, scale: float, pros, n_dcols: int, nq: int, rate: float):
    it = iter(refs)
    lists = tuple(next(it) for _ in range(4))
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = (next(it) for _ in range(6))
    s_refs, m_refs = _split_mod_refs(it, pros[0]), _split_mod_refs(it, pros[1])
    drop = _dropout(it, rate)
    dk_ref, dv_ref = next(it), next(it)
    dcol_refs = tuple(next(it) for _ in range(n_dcols))
    dk_sc, dv_sc = it
    b, kvh, j, t = (pl.program_id(a) for a in range(4))
    h = kvh * g.G + t // nq
    tt = t % nq
    blk, partial, active = _lists_at(g, lists, b, h, j, tt)

    @pl.when(t == 0)
    def _():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when(tt == 0)
    def _():
        for ref in dcol_refs:
            ref[...] = jnp.zeros(ref.shape, jnp.float32)

    def step(masked):
        q, do = q_ref[...], do_ref[...]
        q_start, kv_start = blk * g.tq, j * g.tk
        tg = backward_tile(mods, q, k_ref[...], v_ref[...], do, lse_ref[...], delta_ref[...],
                           _tile(g, b, h, q_start, kv_start), scale, masked, _inputs(s_refs, g, q_start, kv_start),
                           _inputs(m_refs, g, q_start, kv_start), drop=drop)
        dv_sc[...] += dot_tn(tg.p.astype(do.dtype), do)
        dk_sc[...] += dot_tn(tg.ds.astype(q.dtype), q)
        for ref, d in zip(dcol_refs, [d for d in tg.cols if d is not None]):
            ref[...] += d

    pl.when(partial)(lambda: step(True))
    pl.when(active & ~partial)(lambda: step(False))

    @pl.when(t == pl.num_programs(3) - 1)
    def _():
        dk_ref[...] = (dk_sc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def backward(g: Geom, mods: Mods, scale, q, k, v, do, lse, delta, lists, s_pro: Prologue, m_pro: Prologue, *,
             target, interpret: bool, warps=None, stages=None, rate: float = 0.0, seed=None):
    """Same contract as the GPU template's ``backward``; ``d_rows`` continues with one
    (B, Hq, 1, diag_window(g).size) gradient per float diagonal value (None for others)."""
    del target, warps, stages
    G = g.G
    qt, kt, vt, dot_ = (jnp.swapaxes(x, 1, 2) for x in (q, k, v, do))
    D, Dv = q.shape[-1], v.shape[-1]
    nq, nk = g.sq // g.tq, g.skv // g.tk
    float_rows = [is_float(r) for r in s_pro.rows]
    float_cols = [is_float(c) for c in s_pro.cols]
    float_diags = [is_float(d) for d in s_pro.diags]
    seed_specs, seed_args = _seed(seed, rate)
    pro_args = (*_pro_args(s_pro), *_pro_args(m_pro), *seed_args)
    win = diag_window(g)

    # dQ: grid (b, h, q tile, step over the kv list).
    def kv_map(b, h, i, t, *refs):
        return (b, h // G, _lists_at(g, refs, b, h, i, t)[0], 0)

    def row_map(u, b, h, i, t, *refs):
        return (*_bh(u, b, h), i, 0)

    def col_map(u, b, h, i, t, *refs):
        return (*_bh(u, b, h), 0, _lists_at(g, refs, b, h, i, t)[0])

    def bh_map(u, b, h, i, t, *refs):
        return _bh(u, b, h)

    def q_block(d):
        return pl.BlockSpec((None, None, g.tq, d), lambda b, h, i, t, *_: (b, h, i, 0))

    in_specs = [q_block(D), pl.BlockSpec((None, None, g.tk, D), kv_map), pl.BlockSpec((None, None, g.tk, Dv), kv_map),
                q_block(Dv), q_block(1), q_block(1)]
    in_specs += (_mod_specs(mods.score, s_pro, g, row_map, col_map, bh_map)
                 + _mod_specs(mods.mask, m_pro, g, row_map, col_map, bh_map) + seed_specs)
    out_specs = [q_block(D)] + [q_block(1) for f in float_rows if f]
    out_specs += [pl.BlockSpec((None, None, 1, win.size), lambda b, h, i, t, *_: (b, h, 0, 0))
                  for f in float_diags if f]
    out_shape = [jax.ShapeDtypeStruct(qt.shape, q.dtype)]
    out_shape += [jax.ShapeDtypeStruct((g.B, g.Hq, g.sq, 1), jnp.float32) for f in float_rows if f]
    out_shape += [jax.ShapeDtypeStruct((g.B, g.Hq, 1, win.size), jnp.float32) for f in float_diags if f]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4, grid=(g.B, g.Hq, nq, _steps(lists.kv_idx, lists.full_kv_idx, g.skv // g.ck)),
        in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((g.tq, D), jnp.float32)] + [pltpu.VMEM((g.tq, 1), jnp.float32)
                                                               for f in float_rows if f])
    kernel = functools.partial(_dq_kernel, g=g, mods=mods, scale=scale, pros=(s_pro, m_pro), n_drows=sum(float_rows),
                               n_ddiags=sum(float_diags), rate=rate)
    # Diagonal gradients accumulate over the q tiles of a (b, h), so those run in order.
    dq, *rest = pl.pallas_call(kernel, grid_spec=grid_spec, out_shape=out_shape,
                               compiler_params=_params(2 if any(float_diags) else 3),
                               interpret=interpret, name="flexjax_bwd_dq",
                               )(*lists.by_q, qt, kt, vt, dot_, lse, delta, *pro_args)
    it = iter(rest)
    d_rows = tuple(next(it) if f else None for f in float_rows)
    d_rows += tuple(next(it) if f else None for f in float_diags)

    # dK/dV: grid (b, kv head, kv tile, step over (query head of the group, q list)).
    nq = _steps(lists.q_idx, lists.full_q_idx, g.sq // g.cq)  # steps per query head (compact lists: not the q tiles)

    def q_map(b, kvh, j, t, *refs):
        h = kvh * G + t // nq
        return (b, h, _lists_at(g, refs, b, h, j, t % nq)[0], 0)

    def row_map_t(u, b, kvh, j, t, *refs):
        h = kvh * G + t // nq
        return (*_bh(u, b, h), _lists_at(g, refs, b, h, j, t % nq)[0], 0)

    def col_map_t(u, b, kvh, j, t, *refs):
        return (*_bh(u, b, kvh * G + t // nq), 0, j)

    def bh_map_t(u, b, kvh, j, t, *refs):
        return _bh(u, b, kvh * G + t // nq)

    def kv_block(d):
        return pl.BlockSpec((None, None, g.tk, d), lambda b, kvh, j, t, *_: (b, kvh, j, 0))

    in_specs = [pl.BlockSpec((None, None, g.tq, D), q_map), kv_block(D), kv_block(Dv),
                pl.BlockSpec((None, None, g.tq, Dv), q_map), pl.BlockSpec((None, None, g.tq, 1), q_map),
                pl.BlockSpec((None, None, g.tq, 1), q_map)]
    in_specs += (_mod_specs(mods.score, s_pro, g, row_map_t, col_map_t, bh_map_t)
                 + _mod_specs(mods.mask, m_pro, g, row_map_t, col_map_t, bh_map_t) + seed_specs)
    out_specs = [kv_block(D), kv_block(Dv)] + [
        pl.BlockSpec((None, None, 1, g.tk), lambda b, kvh, j, t, *_: (b, kvh * G + t // nq, 0, j))
        for f in float_cols if f]
    out_shape = [jax.ShapeDtypeStruct(kt.shape, k.dtype), jax.ShapeDtypeStruct(vt.shape, v.dtype)]
    out_shape += [jax.ShapeDtypeStruct((g.B, g.Hq, 1, g.skv), jnp.float32) for f in float_cols if f]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4, grid=(g.B, g.Hkv, nk, G * nq), in_specs=in_specs,
        out_specs=out_specs, scratch_shapes=[pltpu.VMEM((g.tk, D), jnp.float32), pltpu.VMEM((g.tk, Dv), jnp.float32)])
    kernel = functools.partial(_dkv_kernel, g=g, mods=mods, scale=scale, pros=(s_pro, m_pro),
                               n_dcols=sum(float_cols), nq=nq, rate=rate)
    dk, dv, *rest = pl.pallas_call(kernel, grid_spec=grid_spec, out_shape=out_shape, compiler_params=_params(3),
                                   interpret=interpret, name="flexjax_bwd_dkv",
                                   )(*lists.by_kv, qt, kt, vt, dot_, lse, delta, *pro_args)
    it = iter(rest)
    d_cols = tuple(next(it) if f else None for f in float_cols)
    return (jnp.swapaxes(dq, 1, 2), jnp.swapaxes(dk, 1, 2), jnp.swapaxes(dv, 1, 2), d_rows, d_cols,
            tuple(None for _ in s_pro.arrays))
