"""Building BlockMasks from mask_mods: interval analysis of the mask's tiles, exact evaluation of the rest.

``create_block_mask`` classifies each (q block, kv block) tile as full, partial or empty by
interval abstract evaluation of the mask_mod (``_analysis.classify``); only the tiles it
cannot decide are evaluated pair by pair. The type it returns and the list utilities are
``_block_mask_type.py``'s (re-exported here).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ._block_mask_type import (  # noqa: F401 (_states_from_lists, block_states_of, noop_mask: imported from here)
    EMPTY,
    FULL,
    PARTIAL,
    BlockMask,
    _check_dim,
    _list_width,
    _states_from_lists,
    _with_kv_band,
    block_states_of,
    check_broadcast,
    full_block_mask,
    lists_from_states,
    noop_mask,
)
from ._factory import check_block_size, eager_outside_abstract_mesh, named
from ._trace import StaticMod, mod_name, trace_mod
from .backends._contract import TileLists

# Elements of mask evaluated per lax.map step when building a BlockMask: 2**24 keeps a
# step's int32 temporaries near 64 MiB whatever the sequence length.
_BUILD_CHUNK_ELEMENTS = 1 << 24


def _combined(b, h, q_idx, kv_idx, *, mods, word):
    op = jnp.logical_and if word == "and" else jnp.logical_or
    out = mods[0](b, h, q_idx, kv_idx)
    for m in mods[1:]:
        out = op(out, m(b, h, q_idx, kv_idx))
    return out


def _combine(mods: Sequence[Callable], word: str) -> Callable:
    if not mods:
        raise ValueError(f"{word}_masks needs at least one mask_mod, got none")
    for m in mods:
        if not callable(m):
            raise TypeError(f"{word}_masks takes mask_mod callables, got {type(m).__name__}")
    return named(_combined, f"{word}_masks({', '.join(mod_name(m) for m in mods)})", mods=tuple(mods), word=word)


def and_masks(*mask_mods: Callable) -> Callable:
    """A mask_mod that attends where every one of ``mask_mods`` does."""
    return _combine(mask_mods, "and")


def or_masks(*mask_mods: Callable) -> Callable:
    """A mask_mod that attends where any one of ``mask_mods`` does."""
    return _combine(mask_mods, "or")


def _tile_states_for_q_block(mask: StaticMod, consts, qb, *, B, H, q_len, kv_len, bq, bkv, nkv):
    """States (B', H', nKV) of q block ``qb``, evaluating the mask on a (bq, nKV*bkv) slab."""
    q = qb * bq + jnp.arange(bq, dtype=jnp.int32)[:, None]
    kv = jnp.arange(nkv * bkv, dtype=jnp.int32)[None, :]
    valid = (q < q_len) & (kv < kv_len)
    b = jnp.arange(B, dtype=jnp.int32)[:, None, None, None] if "b" in mask.uses else jnp.int32(0)
    h = jnp.arange(H, dtype=jnp.int32)[None, :, None, None] if "h" in mask.uses else jnp.int32(0)
    # Mods never see out-of-range indices: clamp them and mask the padding here.
    m = mask(consts, b, h, jnp.minimum(q, q_len - 1), jnp.minimum(kv, kv_len - 1)) & valid
    m = m.reshape(m.shape[:-2] + (bq, nkv, bkv))
    anyv = m.any(axis=(-3, -1))
    allv = m.all(axis=(-3, -1))
    return jnp.where(allv, FULL, jnp.where(anyv, PARTIAL, EMPTY)).astype(jnp.int8)


def _build_states(mask: StaticMod, consts, B, H, q_len, kv_len, bq, bkv):
    nq, nkv = -(-q_len // bq), -(-kv_len // bkv)
    Bm = B if "b" in mask.uses else 1
    Hm = H if "h" in mask.uses else 1
    per_block = Bm * Hm * bq * nkv * bkv
    chunk = max(1, min(nq, _BUILD_CHUNK_ELEMENTS // per_block))
    fn = lambda qb: _tile_states_for_q_block(  # noqa: E731
        mask, consts, qb, B=Bm, H=Hm, q_len=q_len, kv_len=kv_len, bq=bq, bkv=bkv, nkv=nkv)
    states = jax.lax.map(fn, jnp.arange(nq, dtype=jnp.int32), batch_size=chunk)
    states = states.reshape(nq, *states.shape[-3:]) if states.ndim == 4 else states.reshape(nq, 1, 1, nkv)
    states = jnp.moveaxis(states, 0, 2)  # (B', H', nQ, nKV)
    return jnp.broadcast_to(states, (B, H, nq, nkv))


_build_states_jit = jax.jit(_build_states, static_argnums=(0, 2, 3, 4, 5, 6, 7))

# The analysis classifies at most this many tiles at once: a grid of more q x kv blocks is
# classified first in super tiles (a power of 2 of blocks on a side), and only the super
# tiles it cannot decide are split into blocks. 2**18 tiles: ~1 ms of interval arithmetic.
_ANALYSIS_TILES = 1 << 18
# Tiles enumerated exactly per lax.map step: 2**22 pairs keeps a step near 16 MiB.
_ENUM_PAIRS = 1 << 22
UNKNOWN = 3


def _ranges(idx, size, length):
    """Inclusive valid index range [idx * size, min(idx * size + size, length) - 1]."""
    lo = idx * size
    return lo, jnp.minimum(lo + size, length) - 1


def _bh(mask, b, h):
    return (b if "b" in mask.uses else jnp.zeros_like(b)), (h if "h" in mask.uses else jnp.zeros_like(h))


def _analyse(mask, consts, b, h, qi, ki, tq, tk, q_len, kv_len):
    """Codes FULL / EMPTY / UNKNOWN of (tq, tk) tiles over their valid pairs, by interval analysis."""
    from ._analysis import classify

    q_lo, q_hi = _ranges(qi, tq, q_len)
    kv_lo, kv_hi = _ranges(ki, tk, kv_len)
    b, h = _bh(mask, b, h)
    t, f = classify(mask, consts, b, h, q_lo, q_hi, kv_lo, kv_hi)
    return jnp.where(t, FULL, jnp.where(f, EMPTY, UNKNOWN)).astype(jnp.int8)


def _sample(mask, consts, codes, b, h, qi, ki, bq, bkv, q_len, kv_len):
    """UNKNOWN tiles where a 3x3 grid of exact samples finds both values become PARTIAL."""
    q_lo, q_hi = _ranges(qi, bq, q_len)
    kv_lo, kv_hi = _ranges(ki, bkv, kv_len)
    b, h = _bh(mask, b, h)
    seen_t, seen_f = jnp.bool_(False), jnp.bool_(False)
    for q in (q_lo, (q_lo + q_hi) // 2, q_hi):
        for kv in (kv_lo, (kv_lo + kv_hi) // 2, kv_hi):
            v = mask(consts, b, h, q, kv)
            seen_t, seen_f = seen_t | v, seen_f | ~v
    return jnp.where((codes == UNKNOWN) & seen_t & seen_f, PARTIAL, codes).astype(jnp.int8)


def _enumerate(mask, consts, b, h, qi, ki, q_len, kv_len, bq, bkv):
    """Exact codes FULL / PARTIAL / EMPTY over the valid pairs of a list of tiles (N,)."""
    def one(t):
        b_, h_, qi_, ki_ = t
        q = qi_ * bq + jnp.arange(bq, dtype=jnp.int32)[:, None]
        kv = ki_ * bkv + jnp.arange(bkv, dtype=jnp.int32)[None, :]
        valid = (q < q_len) & (kv < kv_len)
        bb, hh = _bh(mask, b_, h_)
        m = mask(consts, bb, hh, jnp.minimum(q, q_len - 1), jnp.minimum(kv, kv_len - 1))
        anyv, allv = (m & valid).any(), (m | ~valid).all()
        return jnp.where(allv, FULL, jnp.where(anyv, PARTIAL, EMPTY)).astype(jnp.int8)

    chunk = max(1, _ENUM_PAIRS // (bq * bkv))
    return jax.lax.map(one, (b, h, qi, ki), batch_size=min(chunk, b.shape[0]))


def _padded_edges(codes, qi, ki, bq, bkv, q_len, kv_len):
    """FULL tiles that contain padding (past Q_LEN / KV_LEN) become PARTIAL."""
    pad = ((qi + 1) * bq > q_len) | ((ki + 1) * bkv > kv_len)
    return jnp.where((codes == FULL) & pad, PARTIAL, codes).astype(jnp.int8)


def _super_factor(nq, nkv) -> int:
    f = 1
    while -(-nq // f) * -(-nkv // f) > _ANALYSIS_TILES:
        f *= 2
    return f


def _grid_codes(mask, consts, Bm, Hm, q_len, kv_len, tq, tk):
    """Analysis codes (Bm, Hm, nQ', nKV') of the (tq, tk) tile grid."""
    nq, nkv = -(-q_len // tq), -(-kv_len // tk)
    b = jnp.arange(Bm, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(Hm, dtype=jnp.int32)[None, :, None, None]
    qi = jnp.arange(nq, dtype=jnp.int32)[:, None]
    ki = jnp.arange(nkv, dtype=jnp.int32)[None, :]
    return jnp.broadcast_to(_analyse(mask, consts, b, h, qi, ki, tq, tk, q_len, kv_len), (Bm, Hm, nq, nkv))


def _tile_codes(mask, consts, b, h, qi, ki, q_len, kv_len, bq, bkv):
    """Analysis, then samples, codes of a list of block tiles (N,)."""
    codes = _analyse(mask, consts, b, h, qi, ki, bq, bkv, q_len, kv_len)
    return _sample(mask, consts, codes, b, h, qi, ki, bq, bkv, q_len, kv_len)


_grid_codes_jit = jax.jit(_grid_codes, static_argnums=(0, 2, 3, 4, 5, 6, 7))
_tile_codes_jit = jax.jit(_tile_codes, static_argnums=(0, 6, 7, 8, 9))
_enumerate_jit = jax.jit(_enumerate, static_argnums=(0, 6, 7, 8, 9))


def _bucket(n: int) -> int:
    """Padded length of a tile list: a power of 2 (few recompiles), at least 64."""
    return max(64, 1 << (n - 1).bit_length())


def _run_on_tiles(fn, mask, consts, coords, *rest):
    """``fn`` on the tiles at ``coords`` (4 int arrays (N,)), padded to a bucket; codes (N,)."""
    n = coords[0].size
    pad = _bucket(n) - n
    args = [jnp.asarray(np.pad(c.astype(np.int32), (0, pad), mode="edge")) for c in coords]
    return np.array(fn(mask, consts, *args, *rest))[:n]


def _nonzero(x: np.ndarray) -> tuple[np.ndarray, ...]:
    """``np.nonzero(x)``, ten times faster on a large n-d array with few hits."""
    return np.unravel_index(np.flatnonzero(x), x.shape)


def _blocks_of(top, code, f, nq, nkv):
    """(b, h, q block, kv block) of every block inside the super tiles of ``top`` equal to ``code``."""
    sb, sh, sq, sk = _nonzero(top == code)
    off_q, off_k = np.divmod(np.arange(f * f, dtype=np.int32), f)
    qi = (sq[:, None].astype(np.int32) * f + off_q[None, :]).ravel()
    ki = (sk[:, None].astype(np.int32) * f + off_k[None, :]).ravel()
    bi, hi = np.repeat(sb, f * f), np.repeat(sh, f * f)
    keep = (qi < nq) & (ki < nkv)
    return bi[keep], hi[keep], qi[keep], ki[keep]


def _decide(mask, consts, coords, q_len, kv_len, bq, bkv):
    """Exact codes FULL / PARTIAL / EMPTY (valid pairs) of block tiles: analysis, samples, then pairs."""
    codes = np.full(coords[0].shape, UNKNOWN, np.int8)
    if coords[0].size:
        codes = _run_on_tiles(_tile_codes_jit, mask, consts, coords, q_len, kv_len, bq, bkv)
    left = np.nonzero(codes == UNKNOWN)[0]
    if left.size:
        sub = tuple(c[left] for c in coords)
        codes[left] = _run_on_tiles(_enumerate_jit, mask, consts, sub, q_len, kv_len, bq, bkv)
    return codes


def _analysed_lists_eager(mask: StaticMod, consts, Bm, Hm, q_len, kv_len, bq, bkv, width):
    """The tile lists by analysis, samples, and exact evaluation of the rest, or None.

    None when the analysis runs under a trace (the captured arrays or the whole build
    are traced): ``_analysed_states_traced`` is then used. Large grids are classified in
    super tiles first, and only the super tiles the analysis cannot decide are split into
    blocks. The lists are assembled from runs of full super tiles and the non-empty
    blocks of the undecided ones (``_direction_lists``), never from an nQ x nKV array.
    """
    nq, nkv = -(-q_len // bq), -(-kv_len // bkv)
    f = _super_factor(nq, nkv)
    top = _grid_codes_jit(mask, consts, Bm, Hm, q_len, kv_len, bq * f, bkv * f)
    if isinstance(top, jax.core.Tracer):
        return None
    top = np.asarray(top)
    unknown = _blocks_of(top, UNKNOWN, f, nq, nkv)
    codes = _decide(mask, consts, unknown, q_len, kv_len, bq, bkv)
    keep = codes != EMPTY
    g, qi, ki = (unknown[0] * Hm + unknown[1])[keep], unknown[2][keep], unknown[3][keep]
    full = (top == FULL).reshape((Bm * Hm,) + top.shape[2:])
    pad_q, pad_k = q_len % bq != 0, kv_len % bkv != 0
    kv = _direction_lists(full, f, g, qi, ki, codes[keep], nq, nkv, pad_q, pad_k, width, (Bm, Hm))
    q = _direction_lists(full.swapaxes(1, 2), f, g, ki, qi, codes[keep], nkv, nq, pad_k, pad_q, width, (Bm, Hm))
    return TileLists(*kv, *q)


def _direction_lists(full, f, g, r, c, codes, n_rows, n_cols, pad_row, pad_col, width, lead):
    """``(num, indices, full_num, full_indices)`` of one direction (rows: q blocks for the kv
    lists, kv blocks for the q lists), from its non-empty tiles as column intervals.

    Args:
      full: bool (G, n_rows', n_cols'): the super tiles (f x f blocks) the analysis found
        full; each run of them along a super row is one interval of each of its block rows.
      g, r, c, codes: the other non-empty blocks (group b * Hm + h, row, column, PARTIAL or
        FULL), one interval each.
      pad_row, pad_col: the last row / column of blocks holds padding, so its full tiles
        are partial.
      width: ``max_blocks_per_row`` or None; lead: (Bm, Hm), G = Bm * Hm.
    """
    d = np.diff(full.astype(np.int8), axis=-1, prepend=np.int8(0), append=np.int8(0))
    sg, ss, k0 = _nonzero(d == 1)
    k1 = _nonzero(d == -1)[2]
    rr = ss[:, None] * f + np.arange(f)
    inside = rr < n_rows
    per_run = inside.sum(1)
    rows = np.concatenate([(sg[:, None] * n_rows + rr)[inside], g * n_rows + r])
    c0 = np.concatenate([np.repeat(k0 * f, per_run), c])
    c1 = np.concatenate([np.repeat(np.minimum(k1 * f, n_cols), per_run), c + 1])
    is_full = np.concatenate([np.ones(rows.size - r.size, bool), codes == FULL])
    if pad_row:
        is_full &= rows % n_rows != n_rows - 1
    if pad_col:
        edge = is_full & (c1 == n_cols)
        c1 = c1 - edge
        rows, c0, c1 = (np.concatenate([x, y]) for x, y in ((rows, rows[edge]), (c0, c1[edge]), (c1, c1[edge] + 1)))
        is_full = np.concatenate([is_full, np.zeros(int(edge.sum()), bool)])
        keep = c0 < c1
        rows, c0, c1, is_full = rows[keep], c0[keep], c1[keep], is_full[keep]
    total = full.shape[0] * n_rows
    kinds = [_runs(rows[is_full == kind], c0[is_full == kind], c1[is_full == kind], n_cols, total)
             for kind in (False, True)]
    need = int((kinds[0][3] + kinds[1][3]).max(initial=0))
    out = ()
    for run_row, run_c0, run_len, n in kinds:
        w = _list_width(need, int(n.max(initial=0)), width, n_cols)
        out += (jnp.asarray(n.reshape(lead + (n_rows,))),
                _expand_runs(run_row, run_c0, run_len, n, w, n_cols, lead + (n_rows,)))
    return out


def _runs(rows, c0, c1, n_cols, total):
    """Disjoint column intervals [c0, c1) of rows -> their maximal runs, ordered by (row,
    column), as (row, first column, length), and each of the ``total`` rows' entry count."""
    order = np.argsort(rows.astype(np.int64) * (n_cols + 1) + c0)
    rows, c0, c1 = rows[order], c0[order], c1[order]
    new = np.ones(rows.size, bool)
    new[1:] = (rows[1:] != rows[:-1]) | (c0[1:] != c1[:-1])
    ends = np.ones(rows.size, bool)
    ends[:-1] = new[1:]
    run_row, run_c0 = rows[new], c0[new]
    run_len = c1[ends] - run_c0
    return run_row, run_c0, run_len, np.bincount(run_row, weights=run_len, minlength=total).astype(np.int32)


# Index lists of at least this many entries are written on the device (``_expand_jit``),
# when their rows hold at most ``_DEVICE_RUNS`` runs: one fused pass, no host array to copy
# (a NumPy list and its device copy would double the peak memory of a 256 MiB list).
_DEVICE_LIST_ELEMENTS = 1 << 22
# The pass costs one select per run and entry, memory-bound at few runs (CPU, 8192 x 8192
# int32: 58 ms for 1 run, 62-69 ms for 8 on the idle 2-core machine; 90-98 ms for 1 and
# 136-150 ms for 16 under load), still well under the host path's write and copy.
_DEVICE_RUNS = 16


def _expand_runs(run_row, run_c0, run_len, n, w, n_cols, shape):
    """Index lists ``shape + (w,)`` int32 that list each row's runs (``_runs``) in order.

    Entries past a row's count ``n`` continue its last run, capped at the last column, so
    they are valid block indices.
    """
    total = n.size
    per_row = np.bincount(run_row, minlength=total)
    first = np.cumsum(per_row) - per_row
    # Where each run starts in its row's list, and column - place over the run.
    place = np.cumsum(run_len) - run_len - (np.cumsum(n, dtype=np.int64) - n)[run_row]
    delta = (run_c0 - place).astype(np.int32)
    most = int(per_row.max(initial=0))
    if total * w >= _DEVICE_LIST_ELEMENTS and 0 < most <= _DEVICE_RUNS:
        k = np.arange(run_row.size) - first[run_row]
        starts = np.full((total, most), w, np.int32)
        starts[run_row, k] = place
        deltas = np.zeros((total, most), np.int32)
        deltas[run_row, k] = delta
        return _expand_jit(starts.reshape(shape + (most,)), deltas.reshape(shape + (most,)), w, n_cols)
    # On the host: each row is its runs then one padding segment; an entry is its column
    # in the list plus its segment's delta.
    seg_len = np.empty(run_row.size + total, np.int64)
    seg_delta = np.zeros(run_row.size + total, np.int32)
    at_run = np.arange(run_row.size) + run_row
    at_pad = first + per_row + np.arange(total)
    seg_len[at_run], seg_len[at_pad] = run_len, w - n
    seg_delta[at_run] = delta
    has = per_row > 0
    seg_delta[at_pad[has]] = delta[(first + per_row - 1)[has]]
    idx = np.repeat(seg_delta, seg_len).reshape(total, w)
    idx += np.arange(w, dtype=np.int32)
    np.minimum(idx, n_cols - 1, out=idx)
    return jnp.asarray(idx.reshape(shape + (w,)))


def _expand_device(starts, deltas, w: int, n_cols: int):
    """``_expand_runs`` on the device: entry t of a row is t plus the delta of its last run
    starting at or before t (``starts`` past the runs are ``w``: never reached)."""
    t = jnp.arange(w, dtype=jnp.int32)
    shift = deltas[..., :1]
    for k in range(1, starts.shape[-1]):
        shift = jnp.where(t >= starts[..., k:k + 1], deltas[..., k:k + 1], shift)
    return jnp.minimum(t + shift, n_cols - 1)


_expand_jit = jax.jit(_expand_device, static_argnums=(2, 3))


def _analysed_states_traced(mask: StaticMod, consts, Bm, Hm, q_len, kv_len, bq, bkv):
    """States (Bm, Hm, nQ, nKV) under a trace: analysis and samples over the whole block grid,
    then each q block row with a tile still undecided is evaluated exactly (``lax.cond``)."""
    nq, nkv = -(-q_len // bq), -(-kv_len // bkv)
    b = jnp.arange(Bm, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(Hm, dtype=jnp.int32)[None, :, None, None]
    qi = jnp.arange(nq, dtype=jnp.int32)[:, None]
    ki = jnp.arange(nkv, dtype=jnp.int32)[None, :]
    codes = _analyse(mask, consts, b, h, qi, ki, bq, bkv, q_len, kv_len)
    codes = jnp.broadcast_to(_sample(mask, consts, codes, b, h, qi, ki, bq, bkv, q_len, kv_len), (Bm, Hm, nq, nkv))
    codes = _padded_edges(codes, qi, ki, bq, bkv, q_len, kv_len)

    def row(i):
        mine = codes[:, :, i]

        def exact():
            st = _tile_states_for_q_block(mask, consts, i, B=Bm, H=Hm, q_len=q_len, kv_len=kv_len,
                                          bq=bq, bkv=bkv, nkv=nkv)
            return jnp.broadcast_to(st, mine.shape)

        return jax.lax.cond((mine == UNKNOWN).any(), exact, lambda: mine)

    # A sequential map keeps lax.cond a real branch (a batched map would run both).
    return jnp.moveaxis(jax.lax.map(row, jnp.arange(nq, dtype=jnp.int32)), 0, 2)


_analysed_states_jit = jax.jit(_analysed_states_traced, static_argnums=(0, 2, 3, 4, 5, 6, 7))
# Grids of at most this many tiles are built in one compiled call (``_analysed_states_jit``):
# one compile instead of several, and no host round trips, where the grid is cheap anyway.
_SMALL_GRID = 1 << 14


def _check_width(lists, width: int):
    """Under jit: raises (at run time, through a host callback) when a row needs more than ``width``."""
    def need(n, fn):
        return (n + fn).max()

    worst = jnp.maximum(need(lists.kv_num, lists.full_kv_num), need(lists.q_num, lists.full_q_num))

    def fail(w):
        raise ValueError(
            f"max_blocks_per_row={width} is too small: some block row has {int(w)} non-empty tiles; "
            f"pass max_blocks_per_row >= {int(w)} (or None)")

    jax.lax.cond(worst > width, lambda w: jax.debug.callback(fail, w), lambda w: None, worst)


def _build_mask(mask: StaticMod, consts, B, H, q_len, kv_len, bq, bkv, analyse: bool,
                max_blocks_per_row: int | None) -> BlockMask:
    Bm = B if "b" in mask.uses else 1
    Hm = H if "h" in mask.uses else 1
    lists = None
    nq, nkv = -(-q_len // bq), -(-kv_len // bkv)
    if analyse:
        if Bm * Hm * nq * nkv > _SMALL_GRID:
            lists = _analysed_lists_eager(mask, consts, Bm, Hm, q_len, kv_len, bq, bkv, max_blocks_per_row)
        if lists is None:
            states = _analysed_states_jit(mask, consts, Bm, Hm, q_len, kv_len, bq, bkv)
    else:
        states = _build_states_jit(mask, consts, Bm, Hm, q_len, kv_len, bq, bkv)
    if lists is None:
        lists = lists_from_states(states, max_blocks_per_row)
    if max_blocks_per_row is not None and isinstance(lists.kv_num, jax.core.Tracer):
        _check_width(lists, max_blocks_per_row)
    lists = tuple(jnp.broadcast_to(x, (B, H) + x.shape[2:]) for x in lists)
    return BlockMask(*lists, consts, seq_lengths=(q_len, kv_len), block_size=(bq, bkv), mask=mask)


def create_block_mask(mask_mod: Callable | None, B: int | None, H: int | None, Q_LEN: int,
                      KV_LEN: int, *, block_size: int | tuple[int, int] = 128, analyse: bool = True,
                      max_blocks_per_row: int | None = None) -> BlockMask:
    """Classifies every (q block, kv block) tile of ``mask_mod`` as empty, partial or full.

    Tiles are classified by interval analysis of the mask_mod's program (``_analysis.py``);
    the tiles it cannot decide are sampled, and those still undecided evaluated pair by
    pair. The result is identical to evaluating every pair. Works eagerly and inside
    ``jax.jit`` (arrays the mask_mod closes over may be traced).

    Args:
      mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = attend), or None for
        full attention.
      B, H: batch size and number of query heads, or None to broadcast over that axis
        (only allowed when the mask_mod does not read ``b`` / ``h``).
      Q_LEN, KV_LEN: sequence lengths (any positive ints).
      block_size: tile size, an int or ``(block_q, block_kv)``.
      analyse: False evaluates every pair (no analysis), for comparison.
      max_blocks_per_row: a bound on the partial + full tiles of any row (q block, or kv
        block for the transposed lists), and then the width of all the index lists (at most
        nKV / nQ). Without it, eagerly each list is as wide as its widest row needs
        (partial and full lists apart); under ``jit`` they are nKV (nQ) wide. A row that
        needs more than the bound raises ``ValueError`` eagerly; under
        ``jit`` a host callback raises it when the computation runs, which surfaces as a
        ``JaxRuntimeError`` carrying the message (the error cannot be missed, and a bound
        that holds costs one comparison).

    Returns:
      A BlockMask (a pytree) for ``flex_attention(..., block_mask=...)``.
    """
    return _create(mask_mod, B, H, Q_LEN, KV_LEN, block_size, analyse, max_blocks_per_row, only_read_axes=False)


def block_mask_over_read_axes(mask_mod: Callable | None, B: int, H: int, Q_LEN: int, KV_LEN: int, *,
                              block_size: int | tuple[int, int] = 128) -> BlockMask:
    """``create_block_mask`` per batch element / head only along the axes ``mask_mod`` reads
    (``b`` / ``h``), broadcast over the others: for callers that hold a mod they did not write
    (``flexjax.flax``), tracing it once."""
    return _create(mask_mod, B, H, Q_LEN, KV_LEN, block_size, True, None, only_read_axes=True)


@eager_outside_abstract_mesh
def _create(mask_mod, B, H, Q_LEN, KV_LEN, block_size, analyse, max_blocks_per_row, *, only_read_axes: bool):
    B_arg, H_arg = B, H  # None = broadcast (the sizes below are 1 there)
    B = _check_dim("B", B, allow_none=True)
    H = _check_dim("H", H, allow_none=True)
    Q_LEN = _check_dim("Q_LEN", Q_LEN, allow_none=False)
    KV_LEN = _check_dim("KV_LEN", KV_LEN, allow_none=False)
    bq, bkv = check_block_size(block_size)
    if max_blocks_per_row is not None:
        max_blocks_per_row = _check_dim("max_blocks_per_row", max_blocks_per_row, allow_none=False)
    if mask_mod is None:
        return full_block_mask(1 if only_read_axes else B, 1 if only_read_axes else H, Q_LEN, KV_LEN,
                               block_size=(bq, bkv))
    traced = trace_mod(mask_mod, "mask", arg_name="mask_mod")
    static = traced.static()  # its key prints the jaxpr: once, not per use
    if only_read_axes:
        B_arg, B = (B_arg, B) if "b" in static.uses else (None, 1)
        H_arg, H = (H_arg, H) if "h" in static.uses else (None, 1)
    check_broadcast(static, B_arg, H_arg)
    return _with_kv_band(_build_mask(static, traced.consts, B, H, Q_LEN, KV_LEN, bq, bkv, analyse,
                                     max_blocks_per_row))


@eager_outside_abstract_mesh
def create_mask(mask_mod: Callable, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int) -> jax.Array:
    """The dense boolean mask ``(B, H, Q_LEN, KV_LEN)`` of ``mask_mod`` (for small sizes)."""
    B = _check_dim("B", B, allow_none=True)
    H = _check_dim("H", H, allow_none=True)
    Q_LEN = _check_dim("Q_LEN", Q_LEN, allow_none=False)
    KV_LEN = _check_dim("KV_LEN", KV_LEN, allow_none=False)
    traced = trace_mod(mask_mod, "mask", arg_name="mask_mod")
    b = jnp.arange(B, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(H, dtype=jnp.int32)[None, :, None, None]
    q = jnp.arange(Q_LEN, dtype=jnp.int32)[:, None]
    kv = jnp.arange(KV_LEN, dtype=jnp.int32)[None, :]
    m = traced.static()(traced.consts, b, h, q, kv)
    return jnp.broadcast_to(m, (B, H, Q_LEN, KV_LEN))
