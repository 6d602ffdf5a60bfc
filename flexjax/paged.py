"""KV caches: block masks for decode steps at traced positions, and attention over paged KV.

A decode loop that never recompiles allocates its cache once (capacity ``L_max``), keeps
per-sequence lengths and positions as traced arrays and calls one jitted step forever.
Its block mask is built once for ``L_max x L_max`` and each step takes the rows it needs
(``decode_block_mask`` or ``BlockMask.__getitem__``), with the mask_mod's ``q_idx``
shifted to the queries' positions; tiles past a sequence's length are then absent from
the row and skipped at run time.

Paged KV keeps K/V in physical pools ``(num_pages, page_size, kv_heads, head_dim)`` and a
page table ``int32 (B, max_pages)`` from logical to physical pages. ``flex_attention``
here takes the block mask and mods in logical positions (as if the cache were
contiguous, ``KV_LEN = max_pages * page_size``) and reads pages through the table.
``allocate`` makes the pools; ``reserve`` assigns free pages on demand as sequences grow
and ``release`` frees a finished sequence's (both jit-able, a free map of the pool beside
the table); ``write`` puts new tokens into their pages.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from . import _dropout, _quant
from ._block_mask_type import (  # noqa: F401 (decode_block_mask and select_rows are public here)
    EMPTY,
    FULL,
    PARTIAL,
    BlockMask,
    _states_from_lists,
    _with_kv_band,
    decode_block_mask,
    full_block_mask,
    lists_from_states,
    select_rows,
)
from ._factory import (
    int_array,
    set_runtime_checks,  # noqa: F401 (public here)
)
from ._paged_core import (  # noqa: F401
    _logical_like,
    _page_table,
    _paged,
    _write_slots,
    check_backend,
    check_pages,
    choose_paged,
    explaining,
    gather,
    paged_plan,
)
from ._quant import FloatTail, dequantize, quantize  # noqa: F401 (public here)
from ._spec import (
    check_block_mask,
    check_outputs,
    check_qkv,
    check_sinks,
    min_scores_pass,
    prepare,
    results,
)
from ._trace import remapped, trace_mod
from .backends._contract import TileLists


def _per_sequence(name: str, x, B: int) -> jax.Array:
    """An integer scalar or (B,) argument as int32 (B,)."""
    arr = int_array(name, x, "() or (B,)")
    if arr.shape not in ((), (B,)):
        raise ValueError(f"{name} must be a scalar or of shape (B={B},), got shape {arr.shape}")
    return jnp.broadcast_to(arr, (B,))


def _free_map(free_pages) -> jax.Array:
    free = jnp.asarray(free_pages)
    if free.dtype != jnp.bool_ or free.ndim != 1:
        raise TypeError(f"free_pages must be a bool array of shape (num_pages,), got {free.dtype} {free.shape}")
    return free


# -- paged KV ------------------------------------------------------------------------------

def allocate(num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype=jnp.float32,
             v_head_dim: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Zeroed page pools ``k_pages (num_pages, page_size, kv_heads, head_dim)`` and ``v_pages``.

    Allocate once; ``write`` fills them step by step (pass them with ``donate_argnums`` to
    the jitted step so the update happens in place).
    """
    for name, n in (("num_pages", num_pages), ("page_size", page_size), ("kv_heads", kv_heads),
                    ("head_dim", head_dim)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    dv = head_dim if v_head_dim is None else v_head_dim
    return (jnp.zeros((num_pages, page_size, kv_heads, head_dim), dtype),
            jnp.zeros((num_pages, page_size, kv_heads, dv), dtype))


def page_table_for(lengths, page_size: int, max_pages: int, *, num_pages: int | None = None,
                   seed: int | None = None) -> np.ndarray:
    """A host-side page table int32 (B, max_pages) giving each sequence distinct pages.

    Sequence ``b`` gets ``ceil(lengths[b] / page_size)`` pages; its other entries are -1
    (unassigned, as ``reserve`` marks them: a ``write`` there is dropped, never lands in
    another sequence's page). ``seed`` shuffles the physical pages (tests); ``num_pages``
    defaults to the pages needed.
    """
    lengths = np.asarray(lengths, np.int64)
    need = -(-lengths // page_size)
    if (need > max_pages).any():
        raise ValueError(f"a length of {int(lengths.max())} needs {int(need.max())} pages of {page_size}; "
                         f"max_pages is {max_pages}")
    total = int(need.sum())
    num_pages = total if num_pages is None else num_pages
    if total > num_pages:
        raise ValueError(f"the lengths need {total} pages, the pool has {num_pages}")
    pages = np.arange(num_pages)
    if seed is not None:
        pages = np.random.default_rng(seed).permutation(num_pages)
    table = np.full((lengths.size, max_pages), -1, np.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = pages[start:start + n]
        start += n
    return table


def reserve(page_table, free_pages, new_lengths, page_size: int):
    """Assigns free pages on demand so that sequence ``b`` can hold ``new_lengths[b]`` tokens.

    jit-able (all arguments but ``page_size`` may be traced), for a server whose sequences
    grow: call it before ``write`` with the lengths after the step. A logical page is
    unassigned where its table entry is negative (start from
    ``jnp.full((B, max_pages), -1, jnp.int32)`` and ``jnp.ones(num_pages, bool)``).

    Args:
      page_table: int32 (B, max_pages), logical -> physical page, -1 where unassigned.
      free_pages: bool (num_pages,), True where a physical page is free.
      new_lengths: int32 scalar or (B,), the tokens each sequence must be able to hold.
      page_size: the pools' page size (static).

    Returns:
      ``(page_table, free_pages, ok)``: every unassigned logical page below
      ``ceil(new_lengths[b] / page_size)`` gets the lowest-numbered free page (in row-major
      order of the table), which is then taken. ``ok`` (a bool scalar) is False when the
      pool has too few free pages or a length is negative or past ``max_pages * page_size``;
      then nothing is assigned (the table and free map come back as they were), so check it
      (``bool(ok)`` on the host, or ``jax.lax.cond`` in the step) before writing.
    """
    pt = _page_table(page_table)
    B, max_pages = pt.shape
    free = _free_map(free_pages)
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    n = _per_sequence("new_lengths", new_lengths, B)
    num_pages = free.shape[0]
    pages_needed = -(-n // page_size)
    need = (jnp.arange(max_pages, dtype=jnp.int32)[None, :] < pages_needed[:, None]) & (pt < 0)
    rank = jnp.cumsum(need.reshape(-1).astype(jnp.int32)).reshape(B, max_pages) - 1
    # The free pages in ascending order (a cumulative sum, not a sort: this runs every step).
    order = jnp.nonzero(free, size=num_pages, fill_value=0)[0].astype(jnp.int32)
    ok = (need.sum() <= free.sum()) & jnp.all((n >= 0) & (n <= max_pages * page_size))
    take = need & ok
    assigned = order[jnp.clip(rank, 0, num_pages - 1)]
    new_pt = jnp.where(take, assigned, pt)
    new_free = free.at[jnp.where(take, assigned, num_pages).reshape(-1)].set(False, mode="drop")
    return new_pt, new_free, ok


def release(page_table, free_pages, done, *, k_scale=None, v_scale=None, tail=None):
    """Frees the pages of the sequences where ``done`` is True and marks their table rows
    unassigned (-1); jit-able. Returns ``(page_table, free_pages)``, or with the per-(page, head)
    scales of a quantized pool ``(page_table, free_pages, k_scale, v_scale)``, the freed pages'
    scales set to 0, so that the sequence that takes a page next quantizes it from its own
    tokens. (Pages shared between sequences are not reference-counted: release a shared page
    once.)

    Args:
      page_table: int32 (B, max_pages), -1 where unassigned.
      free_pages: bool (num_pages,).
      done: bool (B,).
      k_scale, v_scale: float32 (num_pages, Hkv), a quantized pool's scales (``write``'s); pass both
        or neither.
      tail: the pools' ``FloatTail``; comes back last, the done sequences' rows cleared.
    """
    pt = _page_table(page_table)
    free = _free_map(free_pages)
    done = jnp.asarray(done)
    if done.dtype != jnp.bool_ or done.shape != (pt.shape[0],):
        raise TypeError(f"done must be a bool array of shape (B={pt.shape[0]},), got {done.dtype} {done.shape}")
    drop = done[:, None] & (pt >= 0)
    freed = jnp.where(drop, pt, free.shape[0]).reshape(-1)
    new_free = free.at[freed].set(True, mode="drop")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("release: pass k_scale and v_scale together (a quantized pool's scales), or neither")
    if tail is not None and k_scale is None:
        raise ValueError("release: a tail goes with the pool's k_scale and v_scale; pass them too")
    if k_scale is None:
        return jnp.where(done[:, None], -1, pt), new_free
    scales = []
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        scale = jnp.asarray(scale)
        if scale.ndim != 2 or scale.shape[0] != free.shape[0]:
            raise ValueError(f"release: {name} must be the per-(page, head) scales, float32 (num_pages="
                             f"{free.shape[0]}, Hkv), got shape {scale.shape}")
        scales.append(scale.at[freed].set(0.0, mode="drop"))
    if tail is None:
        return jnp.where(done[:, None], -1, pt), new_free, *scales
    if not isinstance(tail, tuple) or len(tail) != 3 or jnp.shape(tail[2]) != (pt.shape[0],):
        raise ValueError(f"release: tail must be the pools' paged.FloatTail for B={pt.shape[0]} sequences")
    tail = FloatTail(tail[0], tail[1], jnp.where(done, -1, jnp.asarray(tail[2], jnp.int32)))
    return jnp.where(done[:, None], -1, pt), new_free, *scales, tail


def write(k_pages, v_pages, page_table, positions, k_new, v_new, *, k_scale=None, v_scale=None, tail=None):
    """Writes new tokens into the pools; returns the updated ``(k_pages, v_pages)``, or
    ``(k_pages, v_pages, k_scale, v_scale)`` for quantized pools (and the new ``tail`` last
    where one is given).

    Functional and jit-able (donate the pools for an in-place update). Quantized pools
    (int8 / float8_e4m3fn, see ``quantize``) take their scales: per kv head ``(Hkv,)``, the
    new tokens are quantized with them (clipped past ``qmax * scale``); per (page, kv head)
    ``(num_pages, Hkv)``, a page's scale grows where a new token needs it (its earlier
    tokens requantized) and the new scales come back. Pass ``tail=float_tail(B, k_pages,
    v_pages)`` (and carry the one that comes back) to keep each sequence's newest page in
    float32 beside the pool: pages are then quantized from their values, each element within
    half a step of its page's ``amax / qmax`` whatever the order and size of the writes
    (without it: half a step of a scale that may reach 3x that; docs/decoding.md).

    Args:
      k_pages, v_pages: (num_pages, page_size, kv_heads, head_dim / v_head_dim).
      page_table: int32 (B, max_pages).
      positions: int32 scalar or (B,), the logical position of each sequence's first new
        token (may be traced).
      k_new, v_new: (B, T, kv_heads, .), T new tokens per sequence at ``positions[b] + t``,
        or (B, kv_heads, .) for one token each. Tokens at logical positions outside
        ``[0, max_pages * page_size)``, or in a logical page whose table entry is negative
        (unassigned, see ``reserve``), are dropped (as JAX drops out-of-bounds scatter
        updates), never written to another slot.
    """
    k_new, v_new = jnp.asarray(k_new), jnp.asarray(v_new)
    if k_new.ndim == 3 and v_new.ndim == 3:  # one token per sequence
        k_new, v_new = k_new[:, None], v_new[:, None]
    if (k_new.ndim != 4 or v_new.ndim != 4 or k_new.shape[:2] != v_new.shape[:2]
            or k_new.shape[2:] != k_pages.shape[2:] or v_new.shape[2:] != v_pages.shape[2:]):
        raise ValueError(f"k_new / v_new must be (B, T, {k_pages.shape[2]}, .) with the same B and T, matching "
                         f"the pools' heads and head dims, got {k_new.shape} / {v_new.shape}")
    B, T = k_new.shape[:2]
    pt = _page_table(page_table, B)
    pos = _per_sequence("positions", positions, B)
    ps = k_pages.shape[1]
    logical = pos[:, None] + jnp.arange(T, dtype=jnp.int32)
    inside = (logical >= 0) & (logical < pt.shape[1] * ps)
    page = jnp.take_along_axis(pt, jnp.clip(logical // ps, 0, pt.shape[1] - 1), axis=1)
    page = jnp.where(inside & (page >= 0), page, k_pages.shape[0])  # past the pool: the update is dropped
    slot = logical % ps
    seq = jnp.repeat(jnp.arange(B, dtype=jnp.int32), T)
    return _write_slots(k_pages, v_pages, page.reshape(-1), slot.reshape(-1), k_new.reshape(-1, *k_new.shape[2:]),
                        v_new.reshape(-1, *v_new.shape[2:]), k_scale, v_scale, runs=B, seq=seq, tail=tail, batch=B)


def float_tail(batch: int, k_pages, v_pages) -> FloatTail:
    """An empty ``FloatTail`` for ``batch`` sequences over these quantized pools: each sequence's
    newest page kept in float32 (``batch x page_size x kv_heads x (head_dim + v_head_dim) x 4``
    bytes), so that ``write`` / ``write_and_attend`` quantize every page from its values. Carry it
    through the step as the pools and scales; ``release`` clears a finished sequence's row."""
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    if not (_quant.is_quantized(k_pages.dtype) and _quant.is_quantized(v_pages.dtype)):
        raise ValueError(f"float_tail is for int8 / float8_e4m3fn pools, got {k_pages.dtype} / {v_pages.dtype}")
    return _quant.new_tail(int(batch), k_pages, v_pages)


def _with_lengths(bm: BlockMask, kv_lengths, B: int):
    """``bm`` with keys at or past ``kv_lengths[b]`` masked (a BlockMask of batch ``B``): tiles past the
    length become empty (skipped at run time), tiles across it partial; the mask_mod adds the test."""
    nq, nkv = bm.num_blocks
    bkv = bm.block_size[1]

    def states():
        st = jnp.maximum(_states_from_lists(bm.kv_num_blocks, bm.kv_indices, PARTIAL, nkv),
                         _states_from_lists(bm.full_kv_num_blocks, bm.full_kv_indices, FULL, nkv))
        st = jnp.broadcast_to(st, (B,) + st.shape[1:])
        j = jnp.arange(nkv, dtype=jnp.int32)
        n = kv_lengths[:, None, None, None]
        st = jnp.where(j * bkv >= n, EMPTY, jnp.where((st == FULL) & ((j + 1) * bkv > n), PARTIAL, st))
        return st.astype(jnp.int8)

    lists = _row_lists_with_lengths(bm, kv_lengths, B, states) if nq == 1 else lists_from_states(states())
    mask_mod = remapped("mask", None if bm.mask is None else bm.mask_mod,
                        also=lambda b, h, q_idx, kv_idx: kv_idx < kv_lengths[b],
                        name=f"{bm.mask.name if bm.mask is not None else 'noop_mask'}&kv_lengths")
    traced = trace_mod(mask_mod, "mask", arg_name="mask_mod")
    return BlockMask(*lists, traced.consts, seq_lengths=bm.seq_lengths, block_size=bm.block_size, mask=traced.static())


def _row_lists_with_lengths(bm: BlockMask, kv_lengths, B: int, states: Callable[[], jax.Array]):
    """``_with_lengths``' lists for one q block a row (decoding), as ``lists_from_states``
    gives them, without its sorts where the row's lists are ascending (as every BlockMask
    flexjax builds holds them): the partial tiles below the length and the full tiles within
    it are then prefixes of their lists, and the one full tile across the length joins the
    partial ones at their end. Unsorted lists take the sorts (``lax.cond``). The transposed
    lists (one q block: a tile's state) come from the states, which a forward-only step
    does not compute."""
    nkv, bkv = bm.num_blocks[1], bm.block_size[1]
    H = bm.kv_num_blocks.shape[1]

    def wide(x):  # (B, H, 1, w) -> (B, H, 1, nkv), as lists_from_states' traced widths
        return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, nkv - x.shape[-1]))).astype(jnp.int32)

    kv_n, kv_i = (jnp.broadcast_to(x, (B, H) + x.shape[2:]) for x in (bm.kv_num_blocks, bm.kv_indices))
    fkv_n, fkv_i = (jnp.broadcast_to(x, (B, H) + x.shape[2:]) for x in (bm.full_kv_num_blocks, bm.full_kv_indices))
    n = kv_lengths.astype(jnp.int32)[:, None, None, None]
    vp = jnp.arange(kv_i.shape[-1]) < kv_n[..., None]
    vf = jnp.arange(fkv_i.shape[-1]) < fkv_n[..., None]

    def ascending(idx, valid):
        return jnp.all((idx[..., 1:] > idx[..., :-1]) | ~valid[..., 1:])

    def prefixes():
        p_n = jnp.sum(vp & (kv_i * bkv < n), -1, dtype=jnp.int32)
        f_n = jnp.sum(vf & ((fkv_i + 1) * bkv <= n), -1, dtype=jnp.int32)
        across = jnp.any(vf & (fkv_i * bkv < n) & ((fkv_i + 1) * bkv > n), -1)
        t = jnp.arange(nkv, dtype=jnp.int32)
        p_i = jnp.where(across[..., None] & (t == p_n[..., None]), n // bkv, wide(kv_i))
        return p_n + across.astype(jnp.int32), p_i, f_n, wide(fkv_i)

    if kv_i.shape[-1] > nkv or fkv_i.shape[-1] > nkv:  # (wider than a row: no BlockMask's lists)
        return lists_from_states(states())
    kv = jax.lax.cond(ascending(kv_i, vp) & ascending(fkv_i, vf), prefixes, lambda: lists_from_states(states()).by_q)
    st = states()[..., 0, :]  # (B, H, nkv): each kv block's one q block
    q_n, fq_n = ((st == s).astype(jnp.int32) for s in (PARTIAL, FULL))
    zeros = jnp.zeros(q_n.shape + (1,), jnp.int32)
    return TileLists(*kv, q_n, zeros, fq_n, zeros)


def flex_attention(query, k_pages, v_pages, page_table, kv_lengths, score_mod=None, block_mask=None, *,
                   scale=None, return_lse: bool = False, return_aux=None, sinks=None, dropout_rate: float = 0.0,
                   dropout_rng=None, backend: str | None = None, kernel_options: dict | None = None,
                   k_scale=None, v_scale=None):
    """``flexjax.flex_attention`` over a paged KV cache, reading pages through the table.

    The block mask and mods are written in logical positions, as if the cache were
    contiguous with ``KV_LEN = max_pages * page_size``; the result equals
    ``flexjax.flex_attention`` on ``gather(k_pages, page_table)`` with keys at or past
    ``kv_lengths[b]`` masked. Only the pages of non-empty tiles are read (tiles past a
    sequence's length are skipped at run time). ``jax.grad`` reads the pages through the
    table too (``backends._paged_backward.paged_backward``, whatever the backend: the pools'
    gradients are added at the rows read); the forward-mode tangent (``jax.jvp``) gathers
    the logical cache.

    Args:
      query: (B, Sq, Hq, D).
      k_pages, v_pages: (num_pages, page_size, Hkv, D / Dv); ``Hq % Hkv == 0``.
      page_table: int32 (B, max_pages), logical page -> physical page.
      kv_lengths: int32 (B,), valid keys per sequence (may be traced).
      score_mod, block_mask, scale, return_lse: as in ``flexjax.flex_attention``; the
        block mask is built for ``(Sq, max_pages * page_size)`` and its kv block must
        divide ``page_size``.
      return_aux: an ``AuxRequest`` for ``(out, AuxOutput)``, as in
        ``flexjax.flex_attention`` (``lse``, and ``max_scores`` / ``min_scores``, each row's
        maximum / minimum of the modified, unmasked scores over the sequence's valid keys;
        -inf / +inf where none).
      sinks: attention sinks, float (Hq,) or (Hq, n_sinks), as in ``flexjax.flex_attention``
        (logits joining every row's normalizer; ``jax.grad`` reaches them).
      dropout_rate, dropout_rng: as in ``flexjax.flex_attention``; the paged kernels are
        decode paths and have no dropout, so a rate above 0 raises ``NotImplementedError``
        (``flexjax.flex_attention`` on ``gather(k_pages, page_table)`` has it).
      backend: None: the platform's first backend with a paged path that serves the call
        (``flexjax.backends.platform_backends()``: on CPU xla; on GPU triton, then pallas, then
        xla; on TPU pallas, then xla; each one passed over warns, as ``flex_attention``'s
        chooser does; ``paged.explain`` says which); "xla" (the decode path, any Sq) or "pallas" (its decode kernel,
        ``Sq <= 64``: the GPU template, or on TPU the Mosaic kernel, which needs head dims
        that are multiples of 128 and a BlockMask built with ``H=None``; interpret mode on
        CPU) or "triton" (its forward kernel reading pages through the table; NVIDIA GPUs,
        Triton's interpreter on CPU; head dims powers of two).
      kernel_options: the pallas or triton backend's (e.g. ``{"target": "cuda"}``).
      k_scale, v_scale: for int8 / float8_e4m3fn pools (``quantize``), float32 (Hkv,) or
        (num_pages, Hkv): each tile is dequantized as it is loaded (``x * scale``). The
        scales get no gradient.

    Returns:
      (B, Sq, Hq, Dv) in the query's dtype, or ``(out, lse)``, or ``(out, AuxOutput)``.
    """

    check_backend("flexjax.paged.flex_attention", backend, kernel_options)
    if k_pages.ndim != 4 or v_pages.ndim != 4 or k_pages.shape[:3] != v_pages.shape[:3]:
        raise ValueError("k_pages and v_pages must be (num_pages, page_size, kv_heads, head_dim) with the same "
                         f"first three sizes, got {getattr(k_pages, 'shape', None)} and "
                         f"{getattr(v_pages, 'shape', None)}")
    check_outputs(return_lse, return_aux)
    if _dropout.check_rate(dropout_rate) > 0:
        raise NotImplementedError("flexjax.paged.flex_attention has no dropout (its kernels are decode paths): "
                                  "pass dropout_rate=0.0, or call flexjax.flex_attention on "
                                  "flexjax.paged.gather(k_pages, page_table) and its v_pages")
    B, Sq, Hq, D = query.shape
    sinks = check_sinks(sinks, Hq)
    ps = k_pages.shape[1]
    pt = _page_table(page_table, B)
    lengths = int_array("kv_lengths", kv_lengths, "(B,)")
    if lengths.shape != (B,):
        raise ValueError(f"kv_lengths must be int32 (B={B},), got shape {lengths.shape}")
    kv_len = pt.shape[1] * ps
    lengths = lengths + check_pages("flexjax.paged.flex_attention", pt, lengths, k_pages.shape[0], ps)
    scales = _quant.check_scales(k_pages, v_pages, k_scale, v_scale)
    # dtypes, heads and head dims, checked as for a contiguous cache of one page.
    check_qkv(query, *_logical_like(B, ps, k_pages, v_pages, query.dtype if scales else None))
    if block_mask is None:
        bkv = math.gcd(ps, 128)
        block_mask = full_block_mask(1, 1, Sq, kv_len, block_size=(128, bkv))
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a BlockMask, got {type(block_mask).__name__}")
    if block_mask.seq_lengths != (Sq, kv_len):
        raise ValueError(f"block_mask was built for (Q_LEN, KV_LEN)={block_mask.seq_lengths}; a paged call "
                         f"needs ({Sq}, max_pages * page_size = {kv_len}): rebuild it with "
                         f"create_block_mask(mask_mod, B, H, {Sq}, {kv_len})")
    check_block_mask(block_mask, query.shape, kv_len)  # its batch and head sizes
    bkv = block_mask.block_size[1]
    if ps % bkv:
        raise ValueError(f"page_size ({ps}) must be a multiple of the block mask's kv block ({bkv}); rebuild "
                         f"it with block_size=(block_q, d) for a d dividing {ps}")
    spec, score_consts, mask_consts, lists = prepare(query, kv_len, score_mod, _with_lengths(block_mask, lengths, B),
                                                     scale=scale, kernel_options=kernel_options, backend=backend)
    plan, _ = choose_paged("paged", backend, lambda n: paged_plan(n, spec, query, k_pages, v_pages, score_consts,
                                                                  mask_consts, lists, scales))
    out, lse, max_scores = _paged(plan, spec, query, k_pages, v_pages, score_consts, mask_consts, lists,
                                  (pt, scales))
    min_scores = min_scores_pass(
        lambda mod, aux, arrays: flex_attention(*arrays, page_table, kv_lengths, mod, block_mask, scale=scale,
                                                return_aux=aux, backend=backend, kernel_options=kernel_options,
                                                k_scale=k_scale, v_scale=v_scale),
        score_mod, return_aux, (query, k_pages, v_pages))
    return results(out, lse, max_scores, sinks, return_lse, return_aux, min_scores)


def explain(query, k_pages, v_pages, page_table, kv_lengths, score_mod=None, block_mask=None, *, cu_q_lens=None,
            mask_mod=None, scale=None, sinks=None, backend: str | None = None, kernel_options: dict | None = None,
            k_scale=None, v_scale=None, platform: str | None = None):
    """What a paged call would run, without running it: ``paged.flex_attention``'s (``cu_q_lens=None``) or,
    with ``cu_q_lens``, ``flex_attention_ragged``'s (``mask_mod`` then, not a ``block_mask``). Returns a
    ``flexjax.Explanation``: the backend chosen (``backend=None``: the platform's first backend with a
    paged path that serves the call), its paged forward's implementation, the backward (one XLA loop
    reading the pools through the table, every backend's) and the backends passed over, with why.

    ``platform`` ("cpu", "gpu" / "cuda", "tpu"; None: JAX's) asks what would run there, from any host.
    Arguments may be arrays or ``jax.ShapeDtypeStruct`` values where the call takes traced ones; raises
    what the call raises for invalid arguments.
    """
    from ._api import Explanation
    from ._paged_core import _Chosen
    from .backends import for_platform

    if cu_q_lens is None:
        if mask_mod is not None:
            raise ValueError("paged.explain: a paged call takes a block_mask, not a mask_mod (mask_mod goes with "
                             "cu_q_lens, a ragged call)")
        call = functools.partial(flex_attention, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                 sinks=sinks, backend=backend, kernel_options=kernel_options, k_scale=k_scale,
                                 v_scale=v_scale)
        args = (query, k_pages, v_pages, page_table, kv_lengths)
    else:
        if block_mask is not None:
            raise ValueError("paged.explain: a ragged call (cu_q_lens given) takes a mask_mod, not a block_mask")
        call = functools.partial(flex_attention_ragged, score_mod=score_mod, mask_mod=mask_mod, scale=scale,
                                 sinks=sinks, backend=backend, kernel_options=kernel_options, k_scale=k_scale,
                                 v_scale=v_scale)
        args = (query, k_pages, v_pages, page_table, kv_lengths, cu_q_lens)
    try:
        with for_platform(platform), explaining():
            jax.eval_shape(lambda *a: call(*a), *args)
    except _Chosen as chosen:
        plan = chosen.plan
        return Explanation(plan.backend, plan.forward, plan.backward, tuple(chosen.skipped), plan.skipped_forward,
                           (), plan)
    raise AssertionError("paged.explain: the call made no backend choice")  # (every paged call chooses)


# Mixed prefill / decode batches (continuous batching) over the same pools.
from ._ragged import flex_attention_ragged, write_and_attend  # noqa: E402,F401 (public here)
