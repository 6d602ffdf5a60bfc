"""The xla backend's decode path: few queries, GQA rows packed, KV chunks merged by lse.

A decode step has one (or a few) queries per sequence. Padding them to a q tile of 128
rows would compute 128x the work, and reading K/V once per query head would multiply the
bytes read by the GQA group size. Here the ``Sq`` queries of the ``G`` query heads of a
kv head form the ``G * Sq`` rows of one tile, so K/V are read once per kv head; the kv
tiles of the BlockMask's (traced) lists are split into chunks whose partial softmaxes
are merged by their log-sum-exp (flash-decoding, https://pytorch.org/blog/flash-decoding/).
The loop runs ``ceil(tiles / chunks)`` steps, a count read from the traced tile lists at
run time: a step at length 1000 of a 65536-capacity cache visits about 1000 keys.

The residuals are ``Residuals`` (row max, row sum) (B, Hq, Sq), as every backend's, so the
xla backward serves a decode-path forward unchanged.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..._block_mask_type import EMPTY, FULL, PARTIAL, _states_from_lists, lists_from_states
from .. import _softmax
from .._common import acc_dtype, allowed, apply_score_mod
from .._contract import Residuals

# Queries per sequence up to which the decode path runs. Measured on the 2-core CPU (B=4,
# Hq=32, Hkv=8, D=128, f32, cache 4096, causal_bottom_right), decode path against the
# tiled forward (128-row q tiles): Sq=1 24 vs 455 ms, Sq=16 96 vs 620 ms, Sq=64 311 vs
# 958 ms; larger Sq were not measured, so they keep the tiled forward.
DECODE_MAX_Q = 64

# Bytes of K plus V (all batches and kv heads) one loop step gathers. Measured on the
# 2-core CPU at 16k (B=4, Hq=32, Hkv=8, D=128, causal), interleaved medians of 5, for
# 256 KiB / 512 KiB / 1 / 2 / 4 MiB: f32 156 / 130 / 133 / 142 / 144 ms, bf16 77 / 74 /
# 78 / 78 / 86 ms: flat between 512 KiB and 2 MiB (smaller steps pay ~20 us each).
_STEP_BYTES = 1 << 20

# AttentionSpec fields this path reads; any other field (dropout, sinks, ...) must hold
# its default, else the normal path serves the call.
_FIELDS_READ = frozenset({"score", "mask", "scale", "q_len", "kv_len", "block_size", "kernel_options", "kv_band"})


def reason(spec, q) -> str | None:
    """None where the decode path computes this call (``Sq <= DECODE_MAX_Q``, no tile options,
    and every feature it does not implement at its default, e.g. ``dropout_rate == 0``), else why not."""
    if spec.q_len > DECODE_MAX_Q:
        return f"{spec.q_len} queries, more than the decode path's {DECODE_MAX_Q}"
    if "block_q" in spec.options or "block_kv" in spec.options:
        return "explicit forward tiles in kernel_options"
    for f in dataclasses.fields(spec):
        if f.name not in _FIELDS_READ and getattr(spec, f.name) != f.default:
            return f"{f.name}={getattr(spec, f.name)!r}, which the decode path does not implement"
    return None


def serves(spec, q) -> bool:
    """Whether the decode path computes this call (``reason`` is None)."""
    return reason(spec, q) is None


def row_lists(spec, lists, Hq: int, Hkv: int):
    """One row of tile lists per (batch, kv head) for all its packed rows.

    Returns ``(kv_n, kv_i, fkv_n, fkv_i)`` shaped (Bm, Hk, ...) with Hk 1 or Hkv. When the
    BlockMask has one q block and no per-head lists, its own row is used (traced counts
    intact). Otherwise the rows of the q blocks and of the query heads of a group are
    united: a tile is full where it is full in all of them, partial where it is non-empty
    in any (the mask_mod then decides per pair, which is exact).
    """
    kv_n, kv_i, fkv_n, fkv_i = lists.by_q
    Bm, Hm, nq = kv_n.shape
    if nq == 1 and Hm == 1:
        return kv_n[:, :, 0], kv_i[:, :, 0], fkv_n[:, :, 0], fkv_i[:, :, 0]
    # nKV from the lengths, not from the lists' width (index lists may be compact).
    nkv = -(-spec.kv_len // spec.block_size[1])
    states = jnp.maximum(_states_from_lists(kv_n, kv_i, PARTIAL, nkv),
                         _states_from_lists(fkv_n, fkv_i, FULL, nkv))
    hk = 1 if Hm == 1 else Hkv
    states = states.reshape(Bm, hk, (Hm // hk) * nq, nkv)
    united = jnp.where((states == FULL).all(2), FULL,
                       jnp.where((states != EMPTY).any(2), PARTIAL, EMPTY)).astype(jnp.int8)
    kv_n, kv_i, fkv_n, fkv_i = lists_from_states(united[:, :, None, :])[:4]
    return kv_n[:, :, 0], kv_i[:, :, 0], fkv_n[:, :, 0], fkv_i[:, :, 0]


def step_shape(B: int, Hkv: int, D: int, Dv: int, itemsize: int, bkv: int, max_tiles: int) -> tuple[int, int]:
    """(chunks C, sub-tile width w) of one loop step: about ``_STEP_BYTES`` of K/V.

    Below a whole block per step, each chunk walks its blocks in sub-tiles of ``w``
    positions (a power of two dividing ``bkv``); above, C chunks of one block each.
    """
    positions = max(1, _STEP_BYTES // (B * Hkv * (D + Dv) * itemsize))
    if positions >= bkv:
        return max(1, min(max_tiles, positions // bkv)), bkv
    w = 1 << (positions.bit_length() - 1)
    while bkv % w:
        w //= 2
    return 1, w


def tile_entries(kv_n, kv_i, fkv_n, fkv_i, e):
    """Block index of entry ``e`` of the row (partial blocks first, then full ones) and its liveness.

    ``e`` broadcasts against (Bm, Hk, C); returns (j, live) of that shape.
    """
    kv_n, fkv_n = kv_n[..., None], fkv_n[..., None]
    e = jnp.broadcast_to(e, kv_n.shape[:-1] + e.shape[-1:])
    in_partial = e < kv_n
    ip = jnp.take_along_axis(kv_i, jnp.clip(e, 0, kv_i.shape[-1] - 1), axis=-1)
    ifull = jnp.take_along_axis(fkv_i, jnp.clip(e - kv_n, 0, fkv_i.shape[-1] - 1), axis=-1)
    return jnp.where(in_partial, ip, ifull), e < kv_n + fkv_n


def _gather(x, start, scale, *, page_table, ps, skv, wg, hk, hkv, dt):
    """The sub-tiles of ``wg`` positions starting at ``start`` (B, hk, C) of k or v: (B, C, wg,
    Hkv, d) where hk is 1, else (B, Hkv, C, wg, d) (each kv head its own start).

    Sub-tiles are read in place (no padded copy of the cache): a start within wg of the end
    is pulled back, and the caller masks the positions before the nominal start. Paged
    (``page_table``): x is the pool flattened to rows (num_pages * ps, Hkv, d), the table maps
    the logical page to a physical one, and a sub-tile never crosses a page (w divides bkv,
    which divides the page size); ``scale`` (num_pages, Hkv), a quantized pool's, multiplies
    the sub-tile (one scale per page and kv head).
    """
    if page_table is None:
        x_axis, row, page = 0, jnp.minimum(start, skv - wg), None
    else:
        row, page = _pool_rows(page_table, start, ps)
        x_axis = None
    d = x.shape[-1]
    if hk == 1:
        one = lambda xs, o: jax.lax.dynamic_slice_in_dim(xs, o, wg, 0)  # noqa: E731
        t = jax.vmap(jax.vmap(one, (None, 0)), (x_axis, 0))(x, row[:, 0])  # (B, C, wg, Hkv, d)
        if scale is not None:
            t = t.astype(dt) * scale[page[:, 0]][:, :, None, :, None]
        return t

    def one_h(xs, o, h):
        return jax.lax.dynamic_slice(xs, (o, h, 0), (wg, 1, d))[:, 0]

    heads = jnp.arange(hkv, dtype=jnp.int32)
    f = jax.vmap(jax.vmap(one_h, (None, 0, None)), (None, 0, 0))
    t = jax.vmap(f, (x_axis, 0, None))(x, row, heads)  # (B, Hkv, C, wg, d)
    if scale is not None:
        t = t.astype(dt) * scale[page, heads[None, :, None]][..., None, None]
    return t


def _pool_rows(page_table, start, ps):
    """(row of the flattened pool where each sub-tile starts, its physical page), both start's shape."""
    B = start.shape[0]
    logical = jnp.clip(start // ps, 0, page_table.shape[1] - 1).reshape(B, -1)
    page = jnp.take_along_axis(page_table, logical, axis=1).reshape(start.shape)
    return page * ps + start % ps, page


def forward_with_residuals(spec, q, k, v, score_consts, mask_consts, lists, dropout_seed=None, page_table=None,
                           scales=None):
    """out (B, Sq, Hq, Dv), lse and the rows' ``Residuals`` (B, Hq, Sq).

    Args:
      q: (B, Sq, Hq, D); k: (B, Skv, Hkv, D); v: (B, Skv, Hkv, Dv), as given (no copy of
        the cache: tiles are gathered from them in place). With ``page_table`` (int32 (B,
        max_pages)), k and v are page pools (num_pages, page_size, Hkv, .) and positions
        are logical (``spec.kv_len = max_pages * page_size``); the block size must divide
        the page size, so no tile crosses a page.
      lists: the BlockMask's eight tile lists.
      scales: with ``page_table`` and int8 / float8 pools, their (k_scale, v_scale), float32
        (num_pages, Hkv): each gathered sub-tile is dequantized (``x * scale``) as it is read.
      dropout_seed: unused (the path serves only ``dropout_rate == 0``).
    """
    del dropout_seed
    B, Sq, Hq, D = q.shape
    Skv, Hkv, Dv = (k.shape[1] if page_table is None else spec.kv_len), k.shape[2], v.shape[-1]
    G, R = Hq // Hkv, (Hq // Hkv) * Sq
    dt = acc_dtype(q.dtype)
    bkv = spec.block_size[1]
    kv_n, kv_i, fkv_n, fkv_i = row_lists(spec, lists, Hq, Hkv)
    hk = kv_n.shape[1]
    C, w = step_shape(B, Hkv, D, Dv, k.dtype.itemsize, bkv, kv_i.shape[-1] + fkv_i.shape[-1])
    n_sub, wg = bkv // w, min(w, Skv)
    # Steps of the loop: the longest row's sub-tile count over C chunks, known only at run time.
    steps = ((jnp.max(kv_n + fkv_n) * n_sub) + C - 1) // C
    # Rows r = g * Sq + s: query s of query head kvh * G + g. q is scaled once here.
    qp = (q.astype(dt) * spec.scale).reshape(B, Sq, Hkv, G, D).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, R, D)
    rows = jnp.arange(R, dtype=jnp.int32)
    q_idx = (rows % Sq)[None, None, None, :, None]
    h_idx = (jnp.arange(Hkv, dtype=jnp.int32)[:, None] * G + rows[None, :] // Sq)[None, :, None, :, None]
    b_idx = jnp.arange(B, dtype=jnp.int32)[:, None, None, None, None]
    chunk = jnp.arange(C, dtype=jnp.int32)

    ps = k.shape[1] if page_table is not None else None

    def gather(x, start, scale=None):
        return _gather(x, start, scale, page_table=page_table, ps=ps, skv=Skv, wg=wg, hk=hk, hkv=Hkv, dt=dt)

    def body(t, carry):
        m, l, acc, kv = carry
        if k.dtype != dt:
            # A 16-bit cache rides in the carry behind a barrier: XLA:CPU would otherwise
            # hoist the tiles' upcast out of the loop as a float32 copy of the whole cache
            # (bf16, 64k, window 4096: 1392 ms a step instead of 33 ms).
            kv = jax.lax.optimization_barrier(kv)
        e = chunk * steps + t
        j, live = tile_entries(kv_n, kv_i, fkv_n, fkv_i, e // n_sub)  # (Bm, hk, C)
        start = jnp.broadcast_to(j * bkv + (e % n_sub) * w, (B, hk, C))
        live = jnp.broadcast_to(live, (B, hk, C))
        kt, vt = gather(kv[0], start, k_scale), gather(kv[1], start, v_scale)
        spec_k = "bckhd" if hk == 1 else "bhckd"
        s = jnp.einsum(f"bhrd,{spec_k}->bhcrk", qp, kt.astype(dt))
        kv_idx = (jnp.minimum(start, Skv - wg)[..., None] + jnp.arange(wg, dtype=jnp.int32))[:, :, :, None, :]
        first = start[..., None, None]
        kv_ok = live[..., None, None] & (kv_idx >= first) & (kv_idx < jnp.minimum(first + w, spec.kv_len))
        kv_c = jnp.minimum(kv_idx, spec.kv_len - 1)
        s = apply_score_mod(spec, score_consts, s, b_idx, h_idx, q_idx, kv_c)
        s = jnp.where(allowed(spec, mask_consts, b_idx, h_idx, q_idx, kv_c, True, kv_ok), s, _softmax.MASK_VALUE)
        m_new, l, p, alpha = _softmax.step(m, l, s)
        pv = jnp.einsum(f"bhcrk,{spec_k}->bhcrd", p, vt.astype(dt))
        return m_new, l, acc * alpha[..., None] + pv, kv

    carry = (*_softmax.start((B, Hkv, C, R), dt), jnp.zeros((B, Hkv, C, R, Dv), dt))
    k_scale, v_scale = (None, None) if scales is None else scales
    if page_table is not None:
        k, v = k.reshape((-1,) + k.shape[2:]), v.reshape((-1,) + v.shape[2:])
    m, l, acc, _ = jax.lax.fori_loop(0, steps, body, carry + ((k, v),))
    m_all, l_all, acc = _softmax.merge_parts(m, l, acc, axis=2)  # the chunks, by their log-sum-exp
    out = acc / jnp.where(l_all > 0, l_all, 1.0)[..., None]
    out = out.reshape(B, Hkv, G, Sq, Dv).transpose(0, 3, 1, 2, 4).reshape(B, Sq, Hq, Dv).astype(q.dtype)
    res = Residuals(*(x.reshape(B, Hq, Sq) for x in Residuals.from_running(m_all, l_all)))
    return out, res.lse(), res
