"""Ragged mixed batches over paged KV: prefill chunks and decode steps of many sequences in one call.

A continuous-batching server packs the new tokens of every sequence into one query array
``(T, Hq, D)`` with ``cu_q_lens`` (``int32 (num_seqs + 1,)``) marking where each sequence's
queries start; sequence ``i``'s queries are the last ``q_len_i`` of its ``kv_lengths[i]``
tokens (its new tokens are already in the pages, or written by ``write_and_attend``).

How it runs: the queries are cut into q tiles that never cross a sequence, and each tile
becomes one row of a "virtual batch" of the paged forward (``flexjax.paged``'s kernels:
the C++ kernel on CPU, the decode path, the pallas kernels). Sequences with one query
(decode steps) get tiles of one row, where the GQA heads fill the rows; the others get
tiles of up to 64 rows. Each tile's kv tiles are classified at run time by the interval
analysis of the mask_mod on (sequence, the tile's query positions, kv tile): tiles past
the sequence's length, or that the mask cannot reach, are absent from its list and their
pages are never read. The capacities are static (``T`` and ``num_seqs`` from the shapes),
the mix is traced: one compile serves every mix.

The mods see ``b`` = sequence index and logical positions in that sequence; the tile
bookkeeping (sequence, first position, rows in use, length) rides as captured arrays of a
wrapper mod, so gradients reach the query and the mods' captured arrays through the paged
call's autodiff.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ._block_mask_type import EMPTY, FULL, PARTIAL, BlockMask, lists_from_states
from ._factory import fail_on_host, int_array
from ._paged_core import (
    _logical_like,
    _page_table,
    _paged,
    _write_slots,
    check_backend,
    check_pages,
    choose_paged,
    paged_plan,
)
from ._spec import check_scale, check_sinks, min_scores_pass, prepare, results
from ._trace import mod_name, remapped, trace_mod
from .backends import get_backend

# Packed rows (q tile rows x GQA group) of a prefill q tile, and the most queries a sequence
# may have to get a decode tile of its own (one query: its GQA heads fill the tile's rows,
# as in a decode step). Measured with benchmarks/bench_serving.py (8 chunks + 56 decodes,
# Hq=8, Hkv=2, D=64, float32, 2-core CPU): tiles of 8 / 16 / 32 / 64 / 128 query rows
# (32 / 64 / 128 / 256 / 512 packed rows) took 181 / 165 / 147 / 226 / 222 ms: each backend's
# ``ragged_rows`` (128; pallas on cuda in float32: 64).
NARROW_Q = 1


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _check_layout(cu, lengths, T: int, capacity: int) -> jax.Array:
    """cu_q_lens starts at 0, never decreases and ends within T; 0 <= q_len <= kv_len <= capacity (the 0 of
    ``fail_on_host`` comes back, to be added into the lengths)."""
    q_lens = cu[1:] - cu[:-1]
    ok = (cu[0] == 0) & jnp.all(q_lens >= 0) & (cu[-1] <= T) & jnp.all(q_lens <= lengths) & jnp.all(
        (lengths >= 0) & (lengths <= capacity))

    def fail(cu_, lengths_):
        raise ValueError("flex_attention_ragged: " + _layout_error(np.asarray(cu_), np.asarray(lengths_), T, capacity)
                         + f" (cu_q_lens={np.asarray(cu_).tolist()}, kv_lengths={np.asarray(lengths_).tolist()})")

    return fail_on_host(ok, fail, cu, lengths)


def _layout_error(cu, lengths, T: int, capacity: int) -> str:
    """What is wrong with a ragged layout, the first fault named by its argument and sequence."""
    if cu[0] != 0:
        return f"cu_q_lens[0] = {int(cu[0])}; it must be 0 (sequence 0's queries start at query[0])"
    q_lens = cu[1:] - cu[:-1]
    for i in range(q_lens.size):
        if q_lens[i] < 0:
            return (f"cu_q_lens decreases at sequence {i} (cu_q_lens[{i}] = {int(cu[i])} > cu_q_lens[{i + 1}] = "
                    f"{int(cu[i + 1])}); it must never decrease")
    if cu[-1] > T:
        return f"cu_q_lens[-1] = {int(cu[-1])} is past query.shape[0] = {T}; pass a query of at least that many rows"
    for i in range(lengths.size):
        if not 0 <= lengths[i] <= capacity:
            return (f"kv_lengths[{i}] = {int(lengths[i])} but the page table holds {capacity} tokens a sequence "
                    f"(max_pages x page_size); pass lengths in [0, {capacity}] or a wider page table")
        if q_lens[i] > lengths[i]:
            return (f"sequence {i} has {int(q_lens[i])} new queries but kv_lengths[{i}] = {int(lengths[i])}; "
                    "kv_lengths counts the new tokens: write them first, or use write_and_attend")
    return "the layout cannot be right"


class _Tiles:
    """One class of q tiles (``bq`` rows each): per tile its sequence, first query (index in
    the packed array), first logical position and rows in use (0: an unused tile)."""

    def __init__(self, bq, seq, tok, pos, rows):
        self.bq, self.seq, self.tok, self.pos, self.rows = bq, seq, tok, pos, rows


def _plan(cu, lengths, T: int, S: int, wide: int, narrow: int):
    q_lens = cu[1:] - cu[:-1]
    first = lengths - q_lens  # logical position of each sequence's first query
    is_narrow = q_lens <= narrow
    n_w = jnp.where(is_narrow, 0, -(-q_lens // wide))
    ends = jnp.cumsum(n_w)
    starts = ends - n_w
    NW = -(-T // wide) + S  # at most one partly used tile per sequence
    t = jnp.arange(NW, dtype=jnp.int32)
    seq_w = jnp.clip(jnp.searchsorted(ends, t, side="right"), 0, S - 1).astype(jnp.int32)
    r0 = (t - starts[seq_w]) * wide
    rows_w = jnp.where(t < ends[-1], jnp.clip(q_lens[seq_w] - r0, 0, wide), 0)
    wide_tiles = _Tiles(wide, seq_w, cu[seq_w] + r0, first[seq_w] + r0, rows_w)
    seq_n = jnp.arange(S, dtype=jnp.int32)
    narrow_tiles = _Tiles(narrow, seq_n, cu[:-1], first, jnp.where(is_narrow, q_lens, 0))
    return wide_tiles, narrow_tiles, is_narrow, starts


def _tile_states(user_mask, tiles: _Tiles, lengths, Hm: int, bkv: int, nkv: int):
    """(N, Hm, 1, nkv) int8 states of each q tile's kv tiles: EMPTY past the sequence's
    length or where the interval analysis proves no pair attends, FULL where it proves
    every pair does (whole tile inside the length, every row in use), else PARTIAL."""
    from ._analysis import classify

    kvl = lengths[tiles.seq][:, None, None]
    j = jnp.arange(nkv, dtype=jnp.int32)[None, None, :]
    kv_lo = j * bkv
    kv_hi = jnp.maximum(jnp.minimum(kv_lo + bkv, kvl) - 1, kv_lo)
    q_lo = tiles.pos[:, None, None]
    q_hi = q_lo + jnp.maximum(tiles.rows, 1)[:, None, None] - 1
    b = tiles.seq[:, None, None]
    h = jnp.arange(Hm, dtype=jnp.int32)[None, :, None]
    all_t, all_f = classify(user_mask.static(), tuple(user_mask.consts), b, h, q_lo, q_hi, kv_lo, kv_hi)
    rows = tiles.rows[:, None, None]
    empty = (rows == 0) | (kv_lo >= kvl) | all_f
    full = all_t & (rows == tiles.bq) & (kv_lo + bkv <= kvl)
    st = jnp.where(empty, EMPTY, jnp.where(full, FULL, PARTIAL)).astype(jnp.int8)
    return st[:, :, None, :]


def _wrap_mods(score_mod, mask_mod, tiles: _Tiles, lengths):
    """The mods of the virtual batch: ``b`` is a tile, ``q_idx`` a row of it; the user's mods
    get the sequence and logical positions. Returns (the score_mod or None, the traced mask)."""
    seq, pos, rows, kvl = tiles.seq, tiles.pos, tiles.rows, lengths[tiles.seq]
    user_mask = mask_mod if mask_mod is not None else _causal

    def index(b, h, q_idx, kv_idx):
        return seq[b], h, pos[b] + q_idx, kv_idx

    def in_use(b, h, q_idx, kv_idx):  # the tile's rows in use, the sequence's keys
        return (q_idx < rows[b]) & (kv_idx < kvl[b])

    mask = remapped("mask", user_mask, index=index, also=in_use, name=f"ragged({mod_name(user_mask)})")
    return (remapped("score", score_mod, index=index, name=f"ragged({mod_name(score_mod)})"),
            trace_mod(mask, "mask", arg_name="mask_mod"))


def _class_call(name, tiles: _Tiles, query, k_pages, v_pages, pt, lengths, score_mod, mask_mod, user_mask, scale,
                bkv, kernel_options, backend, scales):
    """One tile class's call on backend ``name``: its ``_paged`` arguments, the first its ``Plan`` or the
    reason ``name`` cannot serve it."""
    T, Hq, D = query.shape
    bq = tiles.bq
    kv_len = pt.shape[1] * k_pages.shape[1]
    nkv = kv_len // bkv
    Hm = Hq if "h" in user_mask.static().uses else 1
    lists = lists_from_states(_tile_states(user_mask, tiles, lengths, Hm, bkv, nkv))
    score_fn, mask = _wrap_mods(score_mod, mask_mod, tiles, lengths)
    # (The q block: the tile, at least 16 rows, the least a Triton tile takes; one q block a row.)
    bm = BlockMask(*lists, mask.consts, seq_lengths=(bq, kv_len), block_size=(max(bq, 16), bkv), mask=mask.static())
    rows = jnp.clip(tiles.tok[:, None] + jnp.arange(bq, dtype=jnp.int32), 0, T - 1)
    q_tiles = query[rows]  # (N, bq, Hq, D)
    spec, score_consts, mask_consts, lists = prepare(q_tiles, kv_len, score_fn, bm, scale=scale,
                                                     kernel_options=kernel_options, backend=backend)
    plan = paged_plan(name, spec, q_tiles, k_pages, v_pages, score_consts, mask_consts, lists, scales)
    return plan, spec, q_tiles, k_pages, v_pages, score_consts, mask_consts, lists, (pt[tiles.seq], scales)


def flex_attention_ragged(query, k_pages, v_pages, page_table, kv_lengths, cu_q_lens, *, score_mod=None,
                          mask_mod=None, scale=None, sinks=None, return_aux=None, backend: str | None = None,
                          kernel_options: dict | None = None, k_scale=None, v_scale=None, k_new=None, v_new=None):
    """Attention for a mixed batch: prefill chunks and decode steps of many sequences in one call.

    Sequence ``i`` has ``kv_lengths[i]`` tokens in its pages (``page_table[i]``), of which
    the last ``q_len_i = cu_q_lens[i + 1] - cu_q_lens[i]`` are new: their queries are
    ``query[cu_q_lens[i]:cu_q_lens[i + 1]]``. A decode step is ``q_len_i = 1``, a prefill
    chunk any ``q_len_i <= kv_lengths[i]``. The result equals ``flexjax.flex_attention``
    run sequence by sequence on its gathered cache ``gather(k_pages, page_table)[i,
    :kv_lengths[i]]`` with the queries at positions ``kv_lengths[i] - q_len_i + r``.
    ``cu_q_lens`` and ``kv_lengths`` may be traced: one compile serves every mix of
    sequences up to the static capacities (``T`` packed queries, ``num_seqs`` sequences).

    Args:
      query: (T, Hq, D), the packed new tokens; rows at or past ``cu_q_lens[-1]`` are
        padding (their output is 0, their lse -inf).
      k_pages, v_pages: (num_pages, page_size, Hkv, D / Dv); ``Hq % Hkv == 0``.
      page_table: int32 (num_seqs, max_pages), logical page -> physical page.
      kv_lengths: int32 (num_seqs,), tokens per sequence including the new ones.
      cu_q_lens: int32 (num_seqs + 1,), ``cu_q_lens[0] == 0``, non-decreasing, at most T.
      score_mod, mask_mod: written in logical positions: ``b`` is the sequence index,
        ``q_idx`` and ``kv_idx`` positions in that sequence. ``mask_mod=None`` is causal
        (``q_idx >= kv_idx``); keys at or past ``kv_lengths[b]`` are always masked. Only
        the kv tiles a mask can reach are read: the interval analysis of the mask_mod's
        jaxpr on (sequence, the q tile's positions, kv tile) decides, at run time.
      scale: the factor on q·k (default ``1/sqrt(D)``).
      sinks: float (Hq,) or (Hq, n_sinks), as in ``flexjax.flex_attention``.
      return_aux: an ``AuxRequest``: ``(out, AuxOutput)`` with ``lse``, ``max_scores`` and
        ``min_scores`` shaped (Hq, T), as ``flexjax.flex_attention``'s without the batch axis.
      backend: None: the platform's first backend with a paged path that serves the call (as
        ``paged.flex_attention``; ``paged.explain(..., cu_q_lens=...)`` says which); "xla" (on
        CPU the C++ kernel where it compiles the mods),
        "pallas" (its paged decode kernels, GPU and TPU; interpret mode on CPU) or "triton"
        (its forward kernel reading pages through the table; NVIDIA GPUs).
      kernel_options: the pallas or triton backend's.
      k_scale, v_scale: for int8 / float8_e4m3fn pools (``flexjax.paged.quantize``),
        float32 (Hkv,) or (num_pages, Hkv); tiles are dequantized as they are loaded.
      k_new, v_new: (T, Hkv, D / Dv), the new tokens' K and V packed as ``query``: written
        into their pages first, in the same call (``write_and_attend``, whose result comes
        back: ``(out, k_pages, v_pages)``, with the scales after them for quantized pools).

    Returns:
      out (T, Hq, Dv) in the query's dtype, or ``(out, AuxOutput)``; with ``k_new``, as
      ``write_and_attend``.

    Raises:
      ValueError: a malformed layout (checked eagerly for concrete arguments, at run time
        through a host callback under jit).
    """
    if (k_new is None) != (v_new is None):
        raise ValueError("pass k_new and v_new together (the new tokens' K and V), or neither")
    if k_new is not None:
        return write_and_attend(query, k_new, v_new, k_pages, v_pages, page_table, kv_lengths, cu_q_lens,
                                k_scale=k_scale, v_scale=v_scale, score_mod=score_mod, mask_mod=mask_mod,
                                scale=scale, sinks=sinks, return_aux=return_aux, backend=backend,
                                kernel_options=kernel_options)
    check_backend("flex_attention_ragged", backend, kernel_options)
    if not hasattr(query, "shape") or not hasattr(query, "dtype"):
        raise TypeError(f"query must be a JAX array of shape (T, Hq, D), got {type(query).__name__}")
    if query.ndim != 3:
        raise ValueError(f"query must be (T, Hq, D): the new tokens of all sequences packed, got shape "
                         f"{tuple(query.shape)}")
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if not hasattr(x, "shape") or x.ndim != 4:
            raise ValueError(f"{name} must be (num_pages, page_size, kv_heads, head_dim), got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    if k_pages.shape[:3] != v_pages.shape[:3]:
        raise ValueError(f"k_pages and v_pages must share (num_pages, page_size, kv_heads), got {k_pages.shape} "
                         f"and {v_pages.shape}")
    T, Hq, D = query.shape
    pt = _page_table(page_table)
    S = pt.shape[0]
    lengths = int_array("kv_lengths", kv_lengths, "(num_seqs,)")
    if lengths.shape != (S,):
        raise ValueError(f"kv_lengths must be int32 (num_seqs={S},) (one per page_table row), got shape "
                         f"{lengths.shape}")
    cu = int_array("cu_q_lens", cu_q_lens, "(num_seqs + 1,)")
    if cu.shape != (S + 1,):
        raise ValueError(f"cu_q_lens must be int32 (num_seqs + 1 = {S + 1},), got shape {cu.shape}")
    from ._quant import check_scales
    from ._spec import check_qkv
    scales = check_scales(k_pages, v_pages, k_scale, v_scale)
    check_qkv(query[None], *_logical_like(1, k_pages.shape[1], k_pages, v_pages, query.dtype if scales else None))
    sinks = check_sinks(sinks, Hq)
    if return_aux is not None:
        from ._spec import check_outputs
        check_outputs(False, return_aux)
    if T == 0:
        raise ValueError("query must hold at least one token (T >= 1)")
    ps = k_pages.shape[1]
    kv_len = pt.shape[1] * ps
    lengths = lengths + _check_layout(cu, lengths, T, kv_len)
    lengths = lengths + check_pages("flex_attention_ragged", pt, lengths, k_pages.shape[0], ps)
    scale = check_scale(scale, D)
    bkv = math.gcd(ps, 128)
    G = Hq // k_pages.shape[2]
    user_mask = trace_mod(mask_mod if mask_mod is not None else _causal, "mask", arg_name="mask_mod")
    plans = {}

    def plan_of(name):
        # A backend may want fewer packed rows (pallas on cuda in float32: its shared memory).
        rows = get_backend(name).ragged_rows(query.dtype, kernel_options or {})
        wide = min(max(16, rows // G), 64, 1 << max(0, (T - 1).bit_length()))
        narrow = min(NARROW_Q, wide)
        wide_tiles, narrow_tiles, is_narrow, starts = _plan(cu, lengths, T, S, wide, narrow)
        calls = [_class_call(name, tiles, query, k_pages, v_pages, pt, lengths, score_mod, mask_mod, user_mask,
                             scale, bkv, kernel_options, backend, scales) for tiles in (wide_tiles, narrow_tiles)]
        plans[name] = (wide, narrow, is_narrow, starts, calls)
        # The wide class's plan stands for the call (explain names its forward); a refusal of either, for both.
        return next((c[0] for c in calls if isinstance(c[0], str)), calls[0][0])

    plan, _ = choose_paged("ragged", backend, plan_of)
    wide, narrow, is_narrow, starts, calls = plans[plan.backend]
    out_w, lse_w, ms_w = _paged(*calls[0])
    out_n, lse_n, ms_n = _paged(*calls[1])
    # Each packed token's row: its sequence's decode tile, or wide tile starts[s] + o // wide.
    x = jnp.arange(T, dtype=jnp.int32)
    s = jnp.clip(jnp.searchsorted(cu, x, side="right") - 1, 0, S - 1).astype(jnp.int32)
    o = x - cu[s]
    live = x < cu[-1]
    nar = is_narrow[s]
    tw, rw = jnp.clip(starts[s] + o // wide, 0, out_w.shape[0] - 1), o % wide
    rn = jnp.clip(o, 0, narrow - 1)
    out = jnp.where((live & nar)[:, None, None], out_n[s, rn], jnp.where(live[:, None, None], out_w[tw, rw], 0))

    def rows_of(a_w, a_n):  # (N, Hq, bq) -> (Hq, T)
        v = jnp.where(nar[:, None], a_n[s, :, rn], a_w[tw, :, rw])
        return jnp.where(live[:, None], v, -jnp.inf).T

    lse, ms = rows_of(lse_w, lse_n), rows_of(ms_w, ms_n)
    min_scores = min_scores_pass(
        lambda mod, aux, arrays: flex_attention_ragged(*arrays, page_table, kv_lengths, cu_q_lens, score_mod=mod,
                                                       mask_mod=mask_mod, scale=scale, return_aux=aux,
                                                       backend=backend, kernel_options=kernel_options,
                                                       k_scale=k_scale, v_scale=v_scale),
        score_mod, return_aux, (query, k_pages, v_pages))
    res = results(out[None], lse[None], ms[None], sinks, False, return_aux,
                  None if min_scores is None else min_scores[None])
    if return_aux is not None:
        out, aux = res
        return out[0], type(aux)(*(None if a is None else a[0] for a in aux))
    return res[0]


def write_and_attend(query, k_new, v_new, k_pages, v_pages, page_table, kv_lengths, cu_q_lens, *, k_scale=None,
                     v_scale=None, tail=None, **kwargs):
    """Writes the new tokens' K/V into their pages and attends, in one call.

    ``k_new`` / ``v_new`` are (T, Hkv, D / Dv), packed as ``query``: token
    ``cu_q_lens[i] + r`` of sequence ``i`` goes to its logical position
    ``kv_lengths[i] - q_len_i + r`` (``kv_lengths`` counts the new tokens). Tokens whose
    position falls outside the sequence's pages (a negative table entry, past ``max_pages
    * page_size``), and padding rows at or past ``cu_q_lens[-1]``, are dropped, as
    ``flexjax.paged.write`` drops them. Functional: returns ``(out, k_pages, v_pages)``
    with the updated pools (donate the pools to the jitted step for an in-place update);
    under jit the write and the attention are one XLA program, the attention reading the
    written pages. ``kwargs`` are ``flex_attention_ragged``'s.

    Quantized pools take ``k_scale`` / ``v_scale`` (as ``flexjax.paged.write``): the new
    tokens are quantized as they are written, and ``(out, k_pages, v_pages, k_scale,
    v_scale)`` comes back (per-page scales may have grown); with ``tail`` (a
    ``paged.float_tail(num_seqs, k_pages, v_pages)``), pages are quantized from their values and
    the new tail comes back last (``flexjax.paged.write``).
    """
    k_new, v_new = jnp.asarray(k_new), jnp.asarray(v_new)
    T = query.shape[0] if hasattr(query, "shape") and query.ndim == 3 else None
    if (k_new.ndim != 3 or v_new.ndim != 3 or k_new.shape[0] != T or v_new.shape[0] != T
            or k_new.shape[1:] != k_pages.shape[2:] or v_new.shape[1:] != v_pages.shape[2:]):
        raise ValueError(f"k_new / v_new must be (T, kv_heads, head_dim) packed as query (T={T}), matching the "
                         f"pools' {tuple(k_pages.shape[2:])} / {tuple(v_pages.shape[2:])}, got {k_new.shape} / "
                         f"{v_new.shape}")
    pt = _page_table(page_table)
    S = pt.shape[0]
    lengths = int_array("kv_lengths", kv_lengths, "(num_seqs,)")
    cu = int_array("cu_q_lens", cu_q_lens, "(num_seqs + 1,)")
    if lengths.shape != (S,) or cu.shape != (S + 1,):
        raise ValueError(f"kv_lengths must be (num_seqs={S},) and cu_q_lens (num_seqs + 1,), got {lengths.shape} "
                         f"and {cu.shape}")
    ps = k_pages.shape[1]
    x = jnp.arange(T, dtype=jnp.int32)
    s = jnp.clip(jnp.searchsorted(cu, x, side="right") - 1, 0, S - 1)
    pos = lengths[s] - (cu[s + 1] - cu[s]) + (x - cu[s])
    inside = (x < cu[-1]) & (pos >= 0) & (pos < pt.shape[1] * ps)
    page = pt[s, jnp.clip(pos // ps, 0, pt.shape[1] - 1)]
    page = jnp.where(inside & (page >= 0), page, k_pages.shape[0])  # dropped
    slot = pos % ps
    # (Each sequence's tokens are consecutive positions, the padding one more run.)
    written = _write_slots(k_pages, v_pages, page, slot, k_new, v_new, k_scale, v_scale, runs=S + 1, seq=s,
                           tail=tail, batch=S)
    k_pages, v_pages = written[:2]
    scales = dict(zip(("k_scale", "v_scale"), written[2:4]))
    out = flex_attention_ragged(query, k_pages, v_pages, pt, lengths, cu, **scales, **kwargs)
    return (out, *written)
