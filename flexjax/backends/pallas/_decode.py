"""The pallas decode kernel (GPU template, interpret mode on CPU): KV split over programs.

A decode step has few queries, so one q tile holds all of them and the kv tiles of a
row are split over ``C`` programs (flash-decoding, https://pytorch.org/blog/flash-decoding/):
program (c, q tile, batch x head) walks its share of the row's partial then full tiles
and writes its partial softmax (acc, max, sum); the shares are merged by their
log-sum-exp afterwards. The counts come from the traced tile lists, so tiles past a
sequence's length cost nothing. Paged KV: K/V are page pools read through the page
table, an int32 ref, in logical positions. Residuals are the pallas backward's (row max,
row sum), so the backward is the usual one.

The query heads of a GQA group and the queries share one tile's rows, so K/V are read once
per kv head. Mods that read ``h`` (ALiBi, per-head tables) pack on the GPU template where
the tile lists are shared by every head (a BlockMask built with ``H=None``): each row's
head reaches the mods as a (rows, 1) tile, hoisted per-(head, query) values are laid out
per packed row; hoisted per-(head, key) values, per-head lists and TPU's kernel take one
program per query head.

TPU (Mosaic): program (batch, head, chunk) walks only its share of the row's tiles, the
counts read from the scalar-prefetched lists at run time (a grid step per tile of the
lists' width would cost a step per idle tile), copying each tile's K and V rows of its kv
head from HBM by DMA, double-buffered: the next tile's copy runs while this one computes.
The cache stays in its (B, S, Hkv, D) layout, seen as (B, S, Hkv * D), so a kv head is a
128-lane-aligned slice (Mosaic cannot slice the second-minor dimension at an arbitrary
head); paged pools are read through the page table in SMEM. ``tpu_reason`` says which
calls it serves; the others take the TPU's tiled kernels (``flexjax.paged`` raises).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .. import _softmax
from .._contract import Residuals
from .._layout import Mods, geometry, pad_axis, prologues
from ..xla._decode import DECODE_MAX_Q
from ..xla._decode import serves as xla_serves
from ._gpu import _compiler_params, _div, _pro_refs, _Program, _rem, _take, _uses, _whole
from ._tile import ModInputs, Tile, finish, forward_tile, tile_indices

# Programs the kv tiles of one row are split over (flash-decoding's split-KV).
_CHUNKS = 4


def q_tile(spec, o) -> int | None:
    """The one q tile holding all queries, or None where no tile fits.

    Interpret mode: ``Sq`` (whole mask blocks above one block; below, only the first
    ``Sq`` rows of the block are computed). Triton: a power of two >= 16 that divides the
    BlockMask's q block or is a multiple of it.
    """
    sq, bq = spec.q_len, spec.block_size[0]
    if o.target != "cuda" or o.interpret:
        return sq if sq <= bq else -(-sq // bq) * bq
    t = max(16, 1 << (sq - 1).bit_length())
    return t if bq % t == 0 or t % bq == 0 else None


def serves(spec, q, o) -> bool:
    """The decode kernel serves few queries (``Sq <= DECODE_MAX_Q``); on TPU only where
    ``tpu_reason`` is None as well."""
    return xla_serves(spec, q) and spec.q_len <= DECODE_MAX_Q and q_tile(spec, o) is not None


def tpu_reason(spec, q, v, lists, mods: Mods) -> str | None:
    """None where the TPU decode kernel serves this call, else why not."""
    D, Dv = q.shape[-1], v.shape[-1]
    if D % 128 or Dv % 128:
        return ("the TPU decode kernel copies a kv head's rows as 128-lane slices of the cache; head dims must be "
                f"multiples of 128, got D={D}, Dv={Dv}")
    if spec.q_len > spec.block_size[0]:
        return f"the TPU decode kernel takes the queries in one q block: Sq={spec.q_len} > block {spec.block_size[0]}"
    if lists.kv_num.shape[1] != 1:
        return ("the TPU decode kernel walks one tile list per sequence; this BlockMask has one per head (build "
                "it with H=None)")
    for m in (mods.score, mods.mask):
        if m is not None and (m.arrays or m.diags):
            return (f"the TPU decode kernel reads no captured tables, and {m.name} reads one along q_idx and "
                    "kv_idx")
    return None


def _packs(spec, g, s_pro, m_pro, tpu: bool) -> bool:
    """Whether the query heads of a GQA group share one tile: more than one head per kv
    head and one q block. Mods that read ``h`` pack too on the GPU template (not TPU's),
    where the tile lists are shared by every head and no hoisted column value depends on
    h: the kernel parts then get each row's head as a (rows, 1) tile, and the hoisted row
    values are laid out per packed row (its head and query)."""
    if g.G == 1 or g.sq != g.cq:
        return False
    if not any(m is not None and "h" in m.uses for m in (spec.score, spec.mask)):
        return all(x.shape[1] == 1 for p in (s_pro, m_pro) for x in (*p.rows, *p.cols))
    return not tpu and g.Hm == 1 and all(x.shape[1] == 1 for p in (s_pro, m_pro) for x in p.cols)


def _kernel(*refs, g, mods: Mods, scale: float, shapes, per: int, paged: bool, pack: int, quant: bool = False):
    it = iter(refs)
    kv_n, kv_i, fkv_n, fkv_i = _take(it, 4)
    pt_ref = next(it) if paged else None
    ks_ref, vs_ref = _take(it, 2) if quant else (None, None)
    q_ref, k_ref, v_ref = _take(it, 3)
    s_refs, m_refs = _pro_refs(it, shapes[0]), _pro_refs(it, shapes[1])
    o_ref, m_ref, l_ref = _take(it, 3)
    c, i, bh = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if pack > 1:
        # Rows r = g * Sq + s of kv head kvh: query s of query head kvh * G + g. h picks the
        # lists' head (shared by every head), pro_h the hoisted rows' (laid out per packed row
        # over kv heads), and the mods read each row's head from the tile.
        b, kvh = _div(bh, g.Hkv), _rem(bh, g.Hkv)
        h, row, pro_h = kvh * g.G, 0, kvh
    else:
        b, h = _div(bh, g.Hq), _rem(bh, g.Hq)
        kvh, row, pro_h = _div(h, g.G), _div(i, g.sub_q), h
    prog = _Program(g, b, h)
    q = q_ref[...]
    q_start = i * g.tq
    s_uses, m_uses = _uses(mods.score), _uses(mods.mask)
    sub = g.sub_k
    n_p = kv_n[prog.bm, prog.hm(h), row] * sub
    n_all = n_p + fkv_n[prog.bm, prog.hm(h), row] * sub
    lo = c * per
    hi = jnp.minimum(lo + per, n_all)

    def tile(ks):
        if pack == 1:
            return prog.tile(h, q_start, ks)
        r = lax.broadcasted_iota(jnp.int32, (g.tq, 1), 0)
        ki = ks + lax.broadcasted_iota(jnp.int32, (1, g.tk), 1)
        # (Padding rows past the group's take its last head: mods see only real heads.)
        h_rows = h + _div(jnp.minimum(r, jnp.int32(pack * g.q_len - 1)), g.q_len)
        return Tile(b, h_rows, lax.rem(r, jnp.int32(g.q_len)), jnp.minimum(ki, g.kv_len - 1),
                    r < pack * g.q_len, ki < g.kv_len)

    def load(ref, ks, scale_ref=None):
        if not paged:
            return ref[pl.ds(ks, g.tk), :]
        ps = ref.shape[1]
        page = pt_ref[b, _div(ks, ps)]
        x = ref[page, pl.ds(_rem(ks, ps), g.tk), kvh, :]
        if scale_ref is None:
            return x
        # A quantized pool: the codes times their page's scale, in the query's dtype.
        return (x.astype(jnp.float32) * scale_ref[page, kvh]).astype(q.dtype)

    def body(masked, idx_ref, base):
        def step(t, carry):
            e = t - base
            entry = idx_ref[prog.bm, prog.hm(h), row, _div(e, sub)]
            ks = pl.multiple_of((entry * sub + _rem(e, sub)) * g.tk, g.tk)
            k, v = load(k_ref, ks, ks_ref), load(v_ref, ks, vs_ref)
            tl = tile(ks)
            return forward_tile(mods, carry, q, k, v, tl, scale, masked,
                                prog.mod_inputs(s_refs, *s_uses, pro_h, q_start, ks),
                                prog.mod_inputs(m_refs, *m_uses, pro_h, q_start, ks))

        return step

    dv = o_ref.shape[-1]
    carry = (*_softmax.start((g.tq, 1), jnp.float32),
             jnp.zeros((g.tq, dv), jnp.float32))
    carry = lax.fori_loop(lo, jnp.minimum(hi, n_p), body(True, kv_i, 0), carry)
    carry = lax.fori_loop(jnp.maximum(lo, n_p), hi, body(False, fkv_i, n_p), carry)
    out, m, l = finish(carry)
    o_ref[...] = out
    m_ref[...] = m
    l_ref[...] = l


def _tpu_kernel(*refs, g, mods: Mods, scale: float, shapes, chunks: int, paged: bool, pack: int, D: int, Dv: int,
                quant: bool = False):
    it = iter(refs)
    kv_n, kv_i, fkv_n, fkv_i = _take(it, 4)
    pt_ref = next(it) if paged else None
    q_ref, k_hbm, v_hbm = _take(it, 3)
    ks_ref, vs_ref = _take(it, 2) if quant else (None, None)
    s_refs, m_refs = _pro_refs(it, shapes[0]), _pro_refs(it, shapes[1])
    o_ref, m_ref, l_ref, kbuf, vbuf, sem = _take(it, 6)
    b, hh, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kvh, h = (hh, hh * g.G) if pack > 1 else (_div(hh, g.G), hh)
    bm = b if g.Bm > 1 else 0
    n_p = kv_n[bm, 0, 0]
    n_all = n_p + fkv_n[bm, 0, 0]
    lo, hi = _div(c * n_all, chunks), _div((c + 1) * n_all, chunks)
    tq, tk = g.tq, g.tk

    def block(e):  # the kv tile of list entry e: the partial tiles', then the full tiles'
        part = kv_i[bm, 0, 0, jnp.minimum(e, kv_i.shape[-1] - 1)]
        full = fkv_i[bm, 0, 0, jnp.clip(e - n_p, 0, fkv_i.shape[-1] - 1)]
        return jnp.where(e < n_p, part, full)

    def copies(e, slot):
        ks = block(e) * tk
        if paged:
            ps = k_hbm.shape[1]
            page = jnp.clip(pt_ref[b, _div(ks, ps)], 0, k_hbm.shape[0] - 1)
            rows = (page, pl.ds(pl.multiple_of(_rem(ks, ps), tk), tk))
        else:
            rows = (b, pl.ds(pl.multiple_of(ks, tk), tk))
        return (pltpu.make_async_copy(k_hbm.at[(*rows, pl.ds(pl.multiple_of(kvh * D, 128), D))], kbuf.at[slot],
                                      sem.at[0, slot]),
                pltpu.make_async_copy(v_hbm.at[(*rows, pl.ds(pl.multiple_of(kvh * Dv, 128), Dv))], vbuf.at[slot],
                                      sem.at[1, slot]))

    @pl.when(lo < hi)
    def _():
        for cp in copies(lo, 0):
            cp.start()

    def inputs(refs, cm, ks):  # (the prologues' blocks are this program's (b, h) already)
        if cm is None:
            return ModInputs((), (), None)
        rows, cols, _ = refs
        return ModInputs(tuple(r[...] for r in rows),
                         tuple(col[:, pl.ds(pl.multiple_of(ks, tk), tk)] for col in cols), None)

    def body(masked):
        def step(e, carry):
            slot = _rem(e - lo, 2)
            for cp in copies(e, slot):
                cp.wait()

            @pl.when(e + 1 < hi)
            def _():
                for cp in copies(e + 1, 1 - slot):
                    cp.start()

            ks = block(e) * tk
            kt, vt = kbuf[slot], vbuf[slot]
            if quant:  # a quantized pool: the codes times their page's scale (SMEM, flat), in q's dtype
                page = jnp.clip(pt_ref[b, _div(ks, k_hbm.shape[1])], 0, k_hbm.shape[0] - 1)
                at = page * g.Hkv + kvh
                kt = (kt.astype(jnp.float32) * ks_ref[at]).astype(q_ref.dtype)
                vt = (vt.astype(jnp.float32) * vs_ref[at]).astype(q_ref.dtype)
            if pack > 1:
                r = lax.broadcasted_iota(jnp.int32, (tq, tk), 0)
                ki = ks + lax.broadcasted_iota(jnp.int32, (tq, tk), 1)
                tl = Tile(b, h, lax.rem(r, jnp.int32(g.q_len)), jnp.minimum(ki, g.kv_len - 1), r < pack * g.q_len,
                          ki < g.kv_len)
            else:
                tl = tile_indices(b, h, 0, ks, tq, tk, g.q_len, g.kv_len, full_2d=True)
            return forward_tile(mods, carry, q_ref[...], kt, vt, tl, scale, masked,
                                inputs(s_refs, mods.score, ks), inputs(m_refs, mods.mask, ks))

        return step

    carry = (*_softmax.start((tq, 1), jnp.float32),
             jnp.zeros((tq, Dv), jnp.float32))
    carry = lax.fori_loop(lo, jnp.minimum(hi, n_p), body(True), carry)
    carry = lax.fori_loop(jnp.maximum(lo, n_p), hi, body(False), carry)
    out, m, l = finish(carry)
    o_ref[...] = out
    m_ref[...] = m
    l_ref[...] = l


def _tpu_call(g, mods, scale, qp, k, v, lists, s_pro, m_pro, o, pack: int, page_table, scales=None):
    """The TPU kernel's (acc (chunks, B, tq, H, Dv), max, sum (chunks, B, H, tq, 1)), as the GPU template's."""
    B, tq, H, D = qp.shape
    Dv = v.shape[-1]
    paged = page_table is not None
    chunks = _CHUNKS
    # The cache as (rows, Hkv * D): a kv head's D lanes are one aligned slice of a row.
    kf, vf = (x.reshape(*x.shape[:2], -1) for x in (k, v))
    qt = jnp.swapaxes(qp, 1, 2)  # (B, H, tq, D)

    def pro_specs(cm, pro):
        if cm is None:
            return []
        hsel = (lambda hh: hh * g.G) if pack > 1 else (lambda hh: hh)

        def at(u):
            return lambda b, hh, c, *_: ((b if u[0] else 0), (hsel(hh) if u[1] else 0), 0, 0)

        return ([pl.BlockSpec((None, None, tq, 1), at(u)) for u in cm.row_uses]
                + [pl.BlockSpec((None, None, 1, g.skv), at(u)) for u in cm.col_uses])

    pro_args = (*s_pro.rows, *s_pro.cols, *m_pro.rows, *m_pro.cols)
    quant = scales is not None
    smem = [pl.BlockSpec(memory_space=pltpu.SMEM)] * 2 if quant else []
    in_specs = ([pl.BlockSpec((None, None, tq, D), lambda b, hh, c, *_: (b, hh, 0, 0)),
                 pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)] + smem
                + pro_specs(mods.score, s_pro) + pro_specs(mods.mask, m_pro))
    vec = pl.BlockSpec((None, None, None, tq, 1), lambda b, hh, c, *_: (c, b, hh, 0, 0))
    out_specs = [pl.BlockSpec((None, None, None, tq, Dv), lambda b, hh, c, *_: (c, b, hh, 0, 0)), vec, vec]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5 if paged else 4, grid=(B, H, chunks), in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((2, g.tk, D), k.dtype), pltpu.VMEM((2, g.tk, Dv), v.dtype),
                        pltpu.SemaphoreType.DMA((2, 2))])
    kernel = functools.partial(_tpu_kernel, g=g, mods=mods, scale=scale, shapes=(s_pro, m_pro), chunks=chunks,
                               paged=paged, pack=pack, D=D, Dv=Dv, quant=quant)
    vec_shape = jax.ShapeDtypeStruct((chunks, B, H, tq, 1), jnp.float32)
    acc, m, l = pl.pallas_call(
        kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((chunks, B, H, tq, Dv), jnp.float32), vec_shape, vec_shape],
        interpret=o.interpret, compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 3),
        name="flexjax_decode",
    )(*lists.by_q, *([page_table] if paged else []), qt, kf, vf, *(s.reshape(-1) for s in scales or ()), *pro_args)
    return acc.transpose(0, 1, 3, 2, 4), m, l


def forward_with_residuals(spec, q, k, v, score_consts, mask_consts, lists, o, mods: Mods, page_table=None,
                           scales=None):
    """out (B, Sq, Hq, Dv), lse and the rows' ``Residuals``.

    ``page_table``: int32 (B, max_pages) when k and v are page pools (num_pages,
    page_size, Hkv, .) in logical positions (``spec.kv_len = max_pages * page_size``).
    ``scales``: an int8 / float8_e4m3fn pool's (k_scale, v_scale), float32 (num_pages, Hkv).
    """
    B, Sq, Hq, D = q.shape
    Dv = v.shape[-1]
    paged = page_table is not None
    tpu = o.target == "tpu"
    # (TPU: the queries' rows in whole 16-row sublane tiles, the BlockMask's kv block per tile.)
    tq = -(-Sq // 16) * 16 if tpu else q_tile(spec, o)
    tk = spec.block_size[1] if paged or tpu else o.block_kv
    kshape = (B, spec.kv_len) + k.shape[2:]
    g, lists = geometry(spec, q, jax.ShapeDtypeStruct(kshape, k.dtype), lists, tq, tk)
    qp = pad_axis(q, 1, tq if tpu else g.sq)
    if not paged:
        k, v = pad_axis(k, 1, g.skv), pad_axis(v, 1, g.skv)
    s_pro, m_pro = prologues(mods, score_consts, mask_consts, g)
    G, R = g.G, g.G * Sq
    pack = G if _packs(spec, g, s_pro, m_pro, tpu) else 1
    if pack > 1:
        # The G query heads of a kv head and the Sq queries become the rows of one tile
        # (row g * Sq + s), laid out as a sequence of R rows over Hkv heads, so K/V are
        # read once per kv head.
        tq = max(16, 1 << (R - 1).bit_length()) if o.target == "cuda" and not o.interpret else R
        if tpu:
            tq = -(-R // 16) * 16
        qp = pad_axis(q.reshape(B, Sq, g.Hkv, G, D).transpose(0, 3, 1, 2, 4).reshape(B, R, g.Hkv, D), 1, tq)
        r = jnp.arange(tq)
        rows_of, heads_of = jnp.where(r < R, r % Sq, 0), jnp.where(r < R, r // Sq, 0)

        def per_row(x):  # a hoisted row value (B', H', sq, 1) -> (B', 1 or Hkv, tq, 1) in packed rows
            if x.shape[1] == 1:
                return x[:, :, rows_of]
            return x.reshape(x.shape[0], g.Hkv, G, *x.shape[2:])[:, :, heads_of, rows_of]

        s_pro, m_pro = (dataclasses.replace(p, rows=tuple(per_row(x) for x in p.rows)) for p in (s_pro, m_pro))
        g = dataclasses.replace(g, tq=tq)
    H, Gp = (g.Hkv, 1) if pack > 1 else (Hq, G)
    nqt = 1 if pack > 1 else -(-Sq // tq)
    if tpu:
        acc, m, l = _tpu_call(g, mods, spec.scale, qp, k, v, lists, s_pro, m_pro, o, pack, page_table, scales)
        return _merge(acc, m, l, q, pack, Sq, G, g.Hkv, Hq, Dv)
    width = (lists.kv_idx.shape[-1] + lists.full_kv_idx.shape[-1]) * g.sub_k
    chunks = max(1, min(_CHUNKS, width))
    per = -(-width // chunks)
    pro_args = (*s_pro.rows, *s_pro.cols, *s_pro.arrays, *m_pro.rows, *m_pro.cols, *m_pro.arrays)
    if paged:
        kv_specs = [_whole(k), _whole(v)]
        head = [page_table, *(scales or ())]
    else:
        kv_specs = [pl.BlockSpec((None, g.skv, None, x.shape[-1]), lambda c, i, bh: (bh // H, 0, (bh % H) // Gp, 0))
                    for x in (k, v)]
        head = []
    in_specs = ([_whole(x) for x in lists.by_q] + [_whole(x) for x in head]
                + [pl.BlockSpec((None, tq, None, D), lambda c, i, bh: (bh // H, i, bh % H, 0))] + kv_specs
                + [_whole(x) for x in pro_args])
    vec = pl.BlockSpec((None, None, None, tq, 1), lambda c, i, bh: (c, bh // H, bh % H, i, 0))
    out_specs = [pl.BlockSpec((None, None, tq, None, Dv), lambda c, i, bh: (c, bh // H, i, bh % H, 0)), vec, vec]
    vec_shape = jax.ShapeDtypeStruct((chunks, B, H, nqt * tq, 1), jnp.float32)
    kernel = functools.partial(_kernel, g=g, mods=mods, scale=spec.scale, shapes=(s_pro, m_pro), per=per,
                               paged=paged, pack=pack, quant=scales is not None)
    acc, m, l = pl.pallas_call(
        kernel, grid=(chunks, nqt, B * H), in_specs=in_specs, out_specs=out_specs,
        out_shape=[jax.ShapeDtypeStruct((chunks, B, nqt * tq, H, Dv), jnp.float32), vec_shape, vec_shape],
        interpret=o.interpret, compiler_params=_compiler_params(o.target, o.interpret, o.num_warps, o.num_stages),
        name="flexjax_decode",
    )(*lists.by_q, *head, qp, k, v, *pro_args)
    return _merge(acc, m, l, q, pack, Sq, G, g.Hkv, Hq, Dv)


def _merge(acc, m, l, q, pack, Sq, G, Hkv, Hq, Dv):
    """out, lse and (max, sum) from the chunks' normalized rows and their (max, sum)."""
    chunks, B, R = acc.shape[0], acc.shape[1], G * Sq
    if pack > 1:
        m, l = (x[:, :, :, :R].reshape(chunks, B, Hq, Sq, 1) for x in (m, l))
        acc = acc[:, :, :R].reshape(chunks, B, G, Sq, Hkv, Dv).transpose(0, 1, 3, 4, 2, 5)
        acc = acc.reshape(chunks, B, Sq, Hq, Dv)
    # Merge the chunks by their log-sum-exp (each chunk's acc is normalised by its own sum).
    m, l = m[:, :, :, :Sq, 0], l[:, :, :, :Sq, 0]
    m_all, l_all, acc = _softmax.merge_parts(m, l, acc[:, :, :Sq].transpose(0, 1, 3, 2, 4) * l[..., None], axis=0)
    acc = acc.transpose(0, 2, 1, 3)
    out = acc / jnp.where(l_all > 0, l_all, 1.0).transpose(0, 2, 1)[..., None]
    res = Residuals.from_running(m_all, l_all)
    return out.astype(q.dtype), res.lse(), res

