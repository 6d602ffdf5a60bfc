"""The BlockMask type: the tile-level sparsity of a mask_mod as sparse index lists, a pytree.

Everything that reads or reshapes a BlockMask's lists lives here (``lists_from_states``, the
rows taken for queries at other positions: ``select_rows``, ``decode_block_mask``), and so
does ``full_block_mask``, which needs no mask_mod. Building one from a mask_mod (the
interval analysis, pair-by-pair evaluation of undecided tiles) is ``_block_mask.py``'s.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ._factory import check_block_size, eager_outside_abstract_mesh, entry, int_array, member_rows
from ._trace import StaticMod, remapped, trace_mod
from .backends._contract import TileLists

EMPTY, PARTIAL, FULL = 0, 1, 2


def noop_mask(b, h, q_idx, kv_idx):
    """A mask_mod that attends everywhere."""
    return jnp.full(jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(kv_idx)), True)


def _check_dim(name: str, value, allow_none: bool) -> int:
    if value is None and allow_none:
        return 1
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value <= 0:
        hint = " or None to broadcast" if allow_none else ""
        raise ValueError(f"{name} must be a positive int{hint}, got {value!r}")
    return int(value)


def _list_width(need: int, most: int, width, n_cols: int) -> int:
    """Width of one concrete tile list whose busiest row has ``most`` entries, where the
    busiest row of its direction has ``need`` partial + full tiles; ``width``: the user's
    ``max_blocks_per_row`` (both lists of a direction are then that wide) or None.
    ValueError when that bound is too small."""
    if width is None:
        return max(1, most)
    w = min(int(width), n_cols)
    if need > w:
        raise ValueError(
            f"max_blocks_per_row={width} is too small: some block row has {need} non-empty tiles; "
            f"pass max_blocks_per_row >= {need} (or None)")
    return w


def lists_from_states(states: jax.Array, width: int | tuple[int, int] | None = None) -> TileLists:
    """Sparse tile lists from a (B, H, nQ, nKV) array of EMPTY/PARTIAL/FULL.

    Returns ``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
    q_num_blocks, q_indices, full_q_num_blocks, full_q_indices)``. Indices of each row are
    ascending; entries past the row's count are valid block indices (which ones is
    unspecified: readers stop at the count).

    Concrete states give lists as wide as they need to be, each on its own: ``kv_indices``
    holds the most partial tiles of any q block, ``full_kv_indices`` the most full ones
    (each at least 1), the transposed lists the same per kv block. Traced states give
    lists of width nKV (nQ), or ``width`` when it is given (an int for both directions, or
    a pair (kv lists, q lists)): a bound on the partial + full tiles of any row, so both
    lists of a direction are that wide, and concrete states check that it suffices.
    """
    kv_w, q_w = width if isinstance(width, tuple) else (width, width)
    if not isinstance(states, jax.core.Tracer):
        return TileLists(*_np_lists(np.asarray(states), kv_w, q_w))

    partial, full = states == PARTIAL, states == FULL
    kv_n, kv_i = member_rows(partial, kv_w)
    fkv_n, fkv_i = member_rows(full, kv_w)
    q_n, q_i = member_rows(jnp.swapaxes(partial, -1, -2), q_w)
    fq_n, fq_i = member_rows(jnp.swapaxes(full, -1, -2), q_w)
    return TileLists(kv_n, kv_i, fkv_n, fkv_i, q_n, q_i, fq_n, fq_i)


# Rows of states sorted per step by ``_np_lists``: its int64 order stays near 64 MiB.
_LIST_CHUNK_ELEMENTS = 1 << 23


def _np_lists(states: np.ndarray, kv_width: int | None, q_width: int | None) -> tuple[jax.Array, ...]:
    """``lists_from_states`` of concrete states, in NumPy, a chunk of rows at a time.

    One stable sort per row of the keys (0 partial, 1 full, 3 empty) puts the partial
    columns first, then the full ones, then the others, each ascending (NumPy sorts
    8-bit keys by radix, in linear time).
    """
    lead, (nq, nkv) = states.shape[:-2], states.shape[-2:]
    flat = states.reshape((-1, nq, nkv))
    out = []
    for axis_rows, n_rows, n_cols, width in ((1, nq, nkv, kv_width), (2, nkv, nq, q_width)):
        n_p = (flat == PARTIAL).sum(3 - axis_rows, dtype=np.int32)
        n_f = (flat == FULL).sum(3 - axis_rows, dtype=np.int32)
        need = int((n_p + n_f).max(initial=0))
        w_p = _list_width(need, int(n_p.max(initial=0)), width, n_cols)
        w_f = _list_width(need, int(n_f.max(initial=0)), width, n_cols)
        idx_p = np.zeros((flat.shape[0], n_rows, w_p), np.int32)
        idx_f = np.zeros((flat.shape[0], n_rows, w_f), np.int32)
        step = max(1, _LIST_CHUNK_ELEMENTS // n_cols)
        cols = np.arange(w_f)
        for g in range(flat.shape[0]):
            for r0 in range(0, n_rows, step):
                rows = flat[g, r0:r0 + step] if axis_rows == 1 else np.ascontiguousarray(flat[g, :, r0:r0 + step].T)
                # (state - 1) & 3 maps PARTIAL, FULL, EMPTY to the sort keys 0, 1, 3.
                order = np.argsort((rows - np.int8(1)) & np.int8(3), axis=-1, kind="stable")
                idx_p[g, r0:r0 + step] = order[:, :w_p]
                start = np.minimum(n_p[g, r0:r0 + step, None] + cols, n_cols - 1)
                idx_f[g, r0:r0 + step] = np.take_along_axis(order, start, axis=-1)
        for n, idx in ((n_p, idx_p), (n_f, idx_f)):
            out += [jnp.asarray(n.reshape(lead + (n_rows,))), jnp.asarray(idx.reshape(lead + (n_rows, idx.shape[-1])))]
    return tuple(out)


# Rows of a list read per step by ``_cell_counts`` and ``block_states_of``: their int64
# temporaries stay near 32 MiB.
_VIEW_CHUNK_ELEMENTS = 1 << 22


def _cell_counts(num, idx, b: int, h: int, fq: int, fkv: int, rows: int, cols: int) -> np.ndarray:
    """(rows, cols) int64: the listed tiles of (b, h) in each cell of fq x fkv tiles."""
    # Whole arrays to NumPy (a view on CPU), then (b, h): a device slice would copy it.
    num, idx = np.asarray(num)[b, h], np.asarray(idx)[b, h]
    counts = np.zeros(rows * cols, np.int64)
    step = max(1, _VIEW_CHUNK_ELEMENTS // idx.shape[-1])
    for r0 in range(0, idx.shape[0], step):
        part = idx[r0:r0 + step]
        valid = np.arange(part.shape[-1]) < num[r0:r0 + step, None]
        cell = (np.arange(r0, r0 + part.shape[0])[:, None] // fq) * cols + part // fkv
        counts += np.bincount(cell[valid], minlength=rows * cols)
    return counts.reshape(rows, cols)


def block_states_of(bm: BlockMask, b: int, h: int) -> np.ndarray:
    """int8 (nQ, nKV) states of one (b, h) of a BlockMask with concrete lists, in NumPy.

    ``block_states()`` for a picture: no (B, H) array and no scatter over every entry at once.
    """
    nq, nkv = bm.num_blocks
    out = np.zeros((nq, nkv), np.int8)
    for num, idx, value in ((bm.kv_num_blocks, bm.kv_indices, PARTIAL), (bm.full_kv_num_blocks, bm.full_kv_indices,
                                                                         FULL)):
        num, idx = np.asarray(num)[b, h], np.asarray(idx)[b, h]
        step = max(1, _VIEW_CHUNK_ELEMENTS // idx.shape[-1])
        for r0 in range(0, nq, step):
            part = idx[r0:r0 + step]
            valid = np.arange(part.shape[-1]) < num[r0:r0 + step, None]
            r = np.broadcast_to(np.arange(r0, r0 + part.shape[0])[:, None], part.shape)
            out[r[valid], part[valid]] = value
    return out


def _states_from_lists(num, idx, value, n_cols) -> jax.Array:
    B, H, n_rows, _ = idx.shape
    valid = jnp.arange(idx.shape[-1])[None, None, None, :] < num[..., None]
    b = jnp.arange(B)[:, None, None, None]
    h = jnp.arange(H)[None, :, None, None]
    r = jnp.arange(n_rows)[None, None, :, None]
    out = jnp.zeros((B, H, n_rows, n_cols), jnp.int8)
    return out.at[b, h, r, idx].max(jnp.where(valid, value, EMPTY).astype(jnp.int8))


@jax.tree_util.register_pytree_node_class
class BlockMask:
    """Tile-level sparsity of a mask_mod, as sparse index lists (PyTorch's layout).

    Tiles are ``block_size = (block_q, block_kv)``; each is empty, partial (the mask_mod
    must be applied) or full (every pair attends). Padding past ``Q_LEN``/``KV_LEN``
    counts as masked, so edge tiles with padding are at most partial.

    A pytree: the attributes below are its children. Static (the pytree's aux data):
    ``seq_lengths = (Q_LEN, KV_LEN)``, ``block_size``, the traced mask_mod, and ``kv_band``:
    the widest kv range (first to last non-empty tile of any q block, in positions), known
    when the lists are concrete at construction (None when built under ``jit``); it stays
    with the mask across ``jit`` boundaries so backends can pick tiles. B and H are 1 where
    the mask broadcasts over that axis.

    Attributes:
      kv_num_blocks: int32 (B, H, nQ), partial tiles per q block.
      kv_indices: int32 (B, H, nQ, W), their kv block indices, ascending (entries past a
        row's count are valid block indices, to be ignored); W is the most partial tiles
        of any q block when built eagerly (at least 1), nKV under ``jit``, or
        ``max_blocks_per_row`` when given.
      full_kv_num_blocks: int32 (B, H, nQ), full tiles per q block.
      full_kv_indices: int32 (B, H, nQ, W), their kv block indices, as ``kv_indices``; built
        eagerly without ``max_blocks_per_row``, each list has its own W (causal: 1 for the
        partial lists, nKV - 1 for the full ones).
      q_num_blocks: int32 (B, H, nKV), partial tiles per kv block: with the three below, the
        transposed lists (per kv block, its q blocks) that the dK/dV pass walks.
      q_indices: int32 (B, H, nKV, W), their q block indices, ascending.
      full_q_num_blocks: int32 (B, H, nKV), full tiles per kv block.
      full_q_indices: int32 (B, H, nKV, W), their q block indices, ascending.
      mask_consts: the arrays the mask_mod closes over.
    """

    def __init__(self, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                 q_num_blocks, q_indices, full_q_num_blocks, full_q_indices, mask_consts=(),
                 *, seq_lengths: tuple[int, int], block_size: tuple[int, int],
                 mask: StaticMod | None, kv_band: int | None = None):
        self.kv_num_blocks = kv_num_blocks
        self.kv_indices = kv_indices
        self.full_kv_num_blocks = full_kv_num_blocks
        self.full_kv_indices = full_kv_indices
        self.q_num_blocks = q_num_blocks
        self.q_indices = q_indices
        self.full_q_num_blocks = full_q_num_blocks
        self.full_q_indices = full_q_indices
        self.mask_consts = tuple(mask_consts)
        self.seq_lengths = tuple(seq_lengths)
        self.block_size = tuple(block_size)
        self.mask = mask
        self.kv_band = kv_band

    # -- pytree -------------------------------------------------------------------------
    def tree_flatten(self):
        children = (self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks,
                    self.full_kv_indices, self.q_num_blocks, self.q_indices,
                    self.full_q_num_blocks, self.full_q_indices, self.mask_consts)
        return children, (self.seq_lengths, self.block_size, self.mask, self.kv_band)

    @classmethod
    def tree_unflatten(cls, aux, children):
        seq_lengths, block_size, mask, kv_band = aux
        return cls(*children, seq_lengths=seq_lengths, block_size=block_size, mask=mask, kv_band=kv_band)

    def tile_lists(self) -> TileLists:
        """The eight tile lists as the backends read them (``backends._contract.TileLists``)."""
        return TileLists(self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices,
                         self.q_num_blocks, self.q_indices, self.full_q_num_blocks, self.full_q_indices)

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_states(cls, states, mask_consts, *, seq_lengths, block_size, mask) -> BlockMask:
        """Builds a BlockMask from a (B, H, nQ, nKV) array of EMPTY/PARTIAL/FULL."""
        return cls(*lists_from_states(states), mask_consts, seq_lengths=seq_lengths,
                   block_size=block_size, mask=mask)

    @classmethod
    def from_kv_blocks(cls, kv_num_blocks, kv_indices, full_kv_num_blocks=None, full_kv_indices=None,
                       block_size: int | tuple[int, int] | None = None, mask_mod: Callable | None = None,
                       seq_lengths: tuple[int, int] | None = None, *,
                       BLOCK_SIZE: int | tuple[int, int] | None = None) -> BlockMask:
        """A BlockMask from per-q-block lists of kv blocks, with PyTorch FlexAttention's semantics.

        Row ``i`` of ``kv_indices[b, h]`` names q block ``i``'s partial kv blocks in its first
        ``kv_num_blocks[b, h, i]`` entries (the rest are ignored): there ``mask_mod`` decides pair
        by pair (without one, every pair attends). ``full_kv_*`` name the blocks taken whole,
        without ``mask_mod``. Every other block is skipped; a row with no block gives output 0.
        Positions past ``seq_lengths`` are masked in every block. Indices may come in any order;
        a block listed twice counts once, and a block listed both partial and full is full.

        Built on device in jnp, with list widths that depend on the shapes only (kv lists
        ``min(nKV, W + Wf)`` wide, q lists ``nQ``; ``kv_band`` None): the lists may be traced
        inside ``jit``, and one compile serves every index set of the same shapes. The
        BlockMask's mask_mod, ``from_kv_blocks(<mask_mod>)``, captures the lists as (B, H, nQ,
        nKV) bool arrays: it is the mask they stand for, wherever a backend evaluates it.

        Args:
          kv_num_blocks: int (B, H, nQ), partial blocks per q block.
          kv_indices: int (B, H, nQ, W), their kv block indices.
          full_kv_num_blocks: int (B', H', nQ), full blocks per q block; with ``full_kv_indices``
            or not at all.
          full_kv_indices: int (B', H', nQ, Wf), their kv block indices. B' / H' are B / H or 1
            (broadcast); B and H may be 1 to broadcast over the query's batch / heads.
          block_size: an int or ``(block_q, block_kv)``; default 128.
          mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` for the partial blocks, or None.
            One that reads ``b`` (``h``) needs lists with B (H) equal to the query's.
          seq_lengths: ``(Q_LEN, KV_LEN)``; default ``(nQ * block_q, W * block_kv)``, as PyTorch's.
          BLOCK_SIZE: PyTorch's name for ``block_size`` (give one of them).

        Returns:
          A BlockMask of shape ``(B, H, Q_LEN, KV_LEN)``.

        Raises:
          TypeError: a list is not an integer array, or a bad ``mask_mod``.
          ValueError: shapes that do not fit each other or ``seq_lengths`` (nQ must be
            ``ceil(Q_LEN / block_q)``), ``full_kv_*`` half given, both ``block_size`` and
            ``BLOCK_SIZE``; a count outside ``[0, min(W, nKV)]`` or a listed index outside
            ``[0, nKV)``, ``nKV = ceil(KV_LEN / block_kv)``: at once for concrete lists, when the
            computation runs for traced ones (``flexjax.paged.set_runtime_checks`` turns that off).
        """
        from ._from_kv_blocks import from_kv_blocks

        return from_kv_blocks(cls, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, block_size,
                              mask_mod, seq_lengths, BLOCK_SIZE=BLOCK_SIZE)

    # -- views --------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, H, Q_LEN, KV_LEN); B or H is 1 where the mask broadcasts."""
        B, H = self.kv_num_blocks.shape[:2]
        return (B, H, *self.seq_lengths)

    @property
    def num_blocks(self) -> tuple[int, int]:
        """The number of q and kv blocks, (nQ, nKV) (the lists may be narrower than nKV)."""
        (q_len, kv_len), (bq, bkv) = self.seq_lengths, self.block_size
        return -(-q_len // bq), -(-kv_len // bkv)

    @property
    def mask_mod(self) -> Callable:
        """The mask_mod as a callable over broadcasting arguments."""
        mask, consts = self.mask, self.mask_consts
        if mask is None:
            return noop_mask

        def mask_mod(b, h, q_idx, kv_idx):
            return mask(consts, b, h, q_idx, kv_idx)

        mask_mod.__name__ = mask.name
        return mask_mod

    def block_states(self) -> jax.Array:
        """int8 (B, H, nQ, nKV): 0 empty, 1 partial, 2 full."""
        nkv = self.num_blocks[1]
        partial = _states_from_lists(self.kv_num_blocks, self.kv_indices, PARTIAL, nkv)
        full = _states_from_lists(self.full_kv_num_blocks, self.full_kv_indices, FULL, nkv)
        return jnp.maximum(partial, full)

    def tile_states(self, b: int = 0, h: int = 0) -> np.ndarray:
        """int8 (nQ, nKV) states of batch ``b``, head ``h`` in NumPy (concrete lists only), for pictures:
        ``block_states()[b, h]`` without the (B, H) array."""
        return block_states_of(self, b, h)

    def to_dense(self) -> jax.Array:
        """int32 (B, H, nQ, nKV): 1 where a tile is computed (partial or full), as torch's."""
        return (self.block_states() != EMPTY).astype(jnp.int32)

    def sparsity(self) -> float:
        """Percentage of tiles that are skipped (empty)."""
        nq, nkv = self.num_blocks
        lead = np.prod(self.kv_num_blocks.shape, dtype=np.float64)
        computed = np.asarray(self.kv_num_blocks, np.float64).sum() + np.asarray(self.full_kv_num_blocks,
                                                                                  np.float64).sum()
        return 100.0 * (1.0 - computed / (lead * nkv)) if nq else 0.0

    def to_string(self, grid_size: tuple[int, int] = (24, 48), limit: int = 4) -> str:
        """A picture of the tiles: '█' full, '░' partial, ' ' empty, per (b, h).

        Larger grids are shown coarsened to ``grid_size`` (a cell shows its most
        computed tile). At most ``limit`` (b, h) pairs are drawn.
        """
        if self._is_traced():
            return f"{self!r}\n(the tile lists are traced inside jit: call to_string() outside jit to see them)"
        B, H = self.kv_num_blocks.shape[:2]
        nq, nkv = self.num_blocks
        fq, fkv = math.ceil(nq / grid_size[0]), math.ceil(nkv / grid_size[1])
        rows, cols = math.ceil(nq / fq), math.ceil(nkv / fkv)
        chars = {EMPTY: " ", PARTIAL: "░", FULL: "█"}
        lines = [repr(self)]
        if fq > 1 or fkv > 1:
            lines.append(f"(each cell covers {fq}x{fkv} tiles)")
        shown = 0
        for b in range(B):
            for h in range(H):
                if shown == limit:
                    lines.append(f"... ({B * H - limit} more (b, h) pairs)")
                    return "\n".join(lines)
                # Counted from the lists, never as an nQ x nKV array: a cell is full when
                # all fq x fkv of its tiles are (cells past the grid's edge count as empty).
                counts = [_cell_counts(n, idx, b, h, fq, fkv, rows, cols)
                          for n, idx in ((self.kv_num_blocks, self.kv_indices),
                                         (self.full_kv_num_blocks, self.full_kv_indices))]
                coarse = np.where(counts[1] == fq * fkv, FULL, np.where(counts[0] + counts[1] > 0, PARTIAL, EMPTY))
                lines.append(f"b={b}, h={h}")
                lines.extend("".join(chars[int(c)] * 2 for c in row) + "|" for row in coarse)
                shown += 1
        return "\n".join(lines)

    def plot(self, **kwargs):
        """Draws the tiles with matplotlib (see ``flexjax._plot.plot_block_mask``)."""
        from ._plot import plot_block_mask

        return plot_block_mask(self, **kwargs)

    def __str__(self) -> str:
        return self.to_string()

    def _is_traced(self) -> bool:
        """Whether the tile lists are abstract (inside jit), so only static facts are known."""
        return any(isinstance(x, jax.core.Tracer) or not isinstance(x, (jax.Array, np.ndarray))
                   for x in self.tile_lists())

    def __repr__(self) -> str:
        B, H, Q, KV = self.shape
        sp = "traced" if self._is_traced() else f"{self.sparsity():.2f}%"
        name = self.mask.name if self.mask is not None else "noop_mask"
        return (f"BlockMask(shape=({B}, {H}, {Q}, {KV}), block_size={self.block_size}, "
                f"sparsity={sp}, mask_mod={name})")

    def __getitem__(self, index) -> BlockMask:
        """Selects batches/heads, e.g. ``bm[0]``, ``bm[:, 2]``, and q-block rows, ``bm[:, :, row]``.

        Batch/head selection keeps the 4-D layout; the mask_mod is still called with the
        original b/h, so such a slice is for inspection (``to_string``, ``to_dense``).

        ``bm[:, :, row]`` (PyTorch's decode idiom) takes q-block row ``row``: an int, an
        integer scalar or a ``(B,)`` integer array (one row per sequence), any of them
        traced inside ``jit``, or a slice ``start:stop``. The result is a BlockMask for
        ``Q_LEN = rows * block_q`` whose mask_mod is the original with ``q_idx`` shifted by
        ``row * block_q``, so it is exact for those queries. A decode step whose queries sit
        at arbitrary positions wants ``flexjax.paged.decode_block_mask(bm, positions, q_len)``:
        the rows those positions fall in and ``q_idx`` shifted by the positions.
        """
        if not isinstance(index, tuple):
            index = (index,)
        if len(index) > 3:
            raise IndexError(f"BlockMask indexes batch, heads and q-block rows, got {len(index)} indices")
        rows = index[2] if len(index) == 3 else slice(None)
        index = tuple(slice(i, i + 1) if isinstance(i, (int, np.integer)) else i for i in index[:2])
        index = index + (slice(None),) * (2 - len(index))

        def take(x):
            return x[index]

        children, aux = self.tree_flatten()
        out = BlockMask.tree_unflatten(aux, [take(c) for c in children[:8]] + [children[8]])
        if isinstance(rows, slice) and rows == slice(None):
            return out
        bq, nq = self.block_size[0], self.num_blocks[0]
        if isinstance(rows, slice):
            start, stop, step = rows.indices(nq)
            if step != 1 or stop <= start:
                raise IndexError(f"a q-block row slice must be a non-empty start:stop, got {rows}")
            r = jnp.arange(start, stop, dtype=jnp.int32)[None, :]
            shift, q_len = start * bq, (stop - start) * bq
        else:
            r = jnp.asarray(rows)
            if not jnp.issubdtype(r.dtype, jnp.integer) or r.ndim > 1:
                raise IndexError(f"a q-block row index must be an int, a slice or an integer (B,) array, "
                                 f"got {rows!r}")
            r = r.astype(jnp.int32)
            shift, q_len = r * bq, bq
            r = r.reshape(-1, 1)
        return select_rows(out, r, r, shift, min(q_len, self.seq_lengths[0]))


def _serialize_aux(aux) -> bytes:
    """A BlockMask's static data (lengths, block size, mask_mod, kv_band) as bytes, for jax.export.

    The mask_mod is stored as its callable (traced again when loaded): by cloudpickle
    when it is installed, which stores lambdas and closures too, else by pickle.
    """
    try:
        import cloudpickle
    except ImportError:
        try:
            return pickle.dumps(aux)
        except (pickle.PicklingError, AttributeError) as e:
            raise TypeError(
                f"cannot serialize the BlockMask's mask_mod {aux[2].name!r} for jax.export: pickle stores only "
                "module-level functions and flexjax's factories; install cloudpickle (pip install "
                "'flexjax[export]') to store lambdas and closures") from e
    return cloudpickle.dumps(aux)


jax.export.register_pytree_node_serialization(
    BlockMask, serialized_name="flexjax.BlockMask", serialize_auxdata=_serialize_aux,
    deserialize_auxdata=pickle.loads)


def _with_kv_band(bm: BlockMask) -> BlockMask:
    """``bm`` with its static kv_band filled in, when its lists are concrete."""
    bm.kv_band = _kv_band(bm)
    return bm


def _kv_band(bm: BlockMask) -> int | None:
    """Widest (last - first + 1) non-empty kv block range of any q block, in positions.

    None when the lists are traced (not known until run time).
    """
    lists = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
    if any(isinstance(x, jax.core.Tracer) or not hasattr(x, "shape") for x in lists):
        return None
    kv_n, kv_i, fkv_n, fkv_i = (np.asarray(x) for x in lists)
    nkv = bm.num_blocks[1]

    def ends(n, idx):
        # Rows are ascending: their first entry and their n-th.
        last = np.take_along_axis(idx, np.maximum(n - 1, 0)[..., None], axis=-1)[..., 0]
        return np.where(n > 0, idx[..., 0], nkv), np.where(n > 0, last, -1)

    (f0, l0), (f1, l1) = ends(kv_n, kv_i), ends(fkv_n, fkv_i)
    width = np.maximum(l0, l1) - np.minimum(f0, f1) + 1
    return int(max(width.max(), 1)) * bm.block_size[1]


# -- rows at other positions (decode steps, q-block slices) ---------------------------------

def select_rows(bm: BlockMask, lo, hi, shift, q_len: int) -> BlockMask:
    """A BlockMask of ``q_len`` queries whose q block ``i`` is the union of ``bm``'s q-block
    rows ``lo[..., i]`` and ``hi[..., i]``, with the mask_mod's ``q_idx`` shifted by ``shift``.

    ``lo``/``hi``: int32 (Bt, n) rows (Bt 1 or the batch); ``shift``: a scalar or (B,)
    int32 array (may be traced). A tile is full where full in both rows, partial where
    non-empty in either (the shifted mask_mod decides per pair: exact). ``hi is lo`` (one
    query per sequence): the rows' own kv lists, gathered (no union to sort).
    """
    nq, nkv = bm.num_blocks
    one_row = hi is lo
    lo = jnp.clip(lo, 0, nq - 1)
    hi = lo if one_row else jnp.clip(hi, 0, nq - 1)
    kv_n, kv_i, fkv_n, fkv_i = bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices
    Bt = max(kv_n.shape[0], lo.shape[0])
    Hm = kv_n.shape[1]

    def gathered(n, idx, r):  # rows r of one list pair: counts (Bt, Hm, n), indices (Bt, Hm, n, W)
        n = jnp.broadcast_to(n, (Bt,) + n.shape[1:])
        idx = jnp.broadcast_to(idx, (Bt,) + idx.shape[1:])
        r = jnp.broadcast_to(r[:, None, :], (Bt, Hm, r.shape[-1]))
        return jnp.take_along_axis(n, r, axis=2), jnp.take_along_axis(idx, r[..., None], axis=2)

    def row(n, idx, r, value):
        return _states_from_lists(*gathered(n, idx, r), value, nkv)

    def states(r):
        return jnp.maximum(row(kv_n, kv_i, r, PARTIAL), row(fkv_n, fkv_i, r, FULL))

    a = states(lo)
    if one_row:
        # (The transposed lists still come from the states: only a backward reads them.)
        lists = (*gathered(kv_n, kv_i, lo), *gathered(fkv_n, fkv_i, lo), *lists_from_states(a)[4:])
    else:
        b = states(hi)
        united = jnp.where((a == FULL) & (b == FULL), FULL,
                           jnp.where((a != EMPTY) | (b != EMPTY), PARTIAL, EMPTY)).astype(jnp.int8)
        lists = lists_from_states(united)
    mask, consts = bm.mask, ()
    if bm.mask is not None:
        # q_idx moved by ``shift`` (a scalar or (B,) array), clamped into range.
        q_last = bm.seq_lengths[0] - 1
        shifted = remapped("mask", bm.mask_mod, name=f"{bm.mask.name}@q+offset", index=lambda b, h, q_idx, kv_idx: (
            b, h, jnp.minimum(q_idx + entry(shift, b), q_last), kv_idx))
        traced = trace_mod(shifted, "mask", arg_name="mask_mod")
        mask, consts = traced.static(), traced.consts
    out = BlockMask(*lists, consts, seq_lengths=(q_len, bm.seq_lengths[1]), block_size=bm.block_size,
                    mask=mask)
    return _with_kv_band(out)


def decode_block_mask(block_mask: BlockMask, positions, q_len: int = 1) -> BlockMask:
    """The BlockMask of ``q_len`` queries at ``positions``, taken from one built for the cache.

    The cache idiom: build ``create_block_mask(mask_mod, B, H, L_max, L_max)`` once, and in
    the jitted step call ``decode_block_mask(bm, positions, q_len)``. Query ``i`` of batch
    ``b`` sits at position ``positions[b] + i``; the result's mask_mod is the original with
    ``q_idx`` shifted by ``positions[b]`` (PyTorch's decode idiom shifts it by hand), and its
    tile rows are the original rows those positions fall in. With a causal mask, tiles past
    the position are absent, so the step reads only the keys up to it.

    Args:
      block_mask: built for ``(Q_LEN, KV_LEN) = (L_max, L_max)`` (any KV_LEN).
      positions: an int, an integer scalar or a ``(B,)`` integer array (may be traced).
      q_len: the number of queries per sequence in the step (static).

    Returns:
      A BlockMask of shape ``(B or 1, H, q_len, KV_LEN)`` for ``flex_attention``.

    Raises:
      TypeError / ValueError: a wrong type or shape of ``positions`` or ``q_len``.
    """
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a BlockMask, got {type(block_mask).__name__}")
    if isinstance(q_len, bool) or not isinstance(q_len, (int, np.integer)) or q_len < 1:
        raise ValueError(f"q_len must be a positive int (queries per sequence), got {q_len!r}")
    if q_len > block_mask.seq_lengths[0]:
        raise ValueError(f"q_len={q_len} exceeds the block mask's Q_LEN={block_mask.seq_lengths[0]}")
    pos = int_array("positions", positions, "() or (B,)")
    if pos.ndim > 1:
        raise ValueError(f"positions must be a scalar or of shape (B,), got shape {pos.shape}")
    bq = block_mask.block_size[0]
    n = -(-q_len // bq)
    first = jnp.arange(n, dtype=jnp.int32) * bq
    last = jnp.minimum(first + bq, q_len) - 1
    p = pos.reshape(-1, 1)
    lo = (p + first) // bq
    return select_rows(block_mask, lo, lo if q_len == 1 else (p + last) // bq, pos, int(q_len))


def check_broadcast(mask: StaticMod | None, B, H, *, data_shape: tuple[int, int] | None = None) -> None:
    """Raises when a BlockMask broadcasts over an axis its mask_mod reads.

    A mask_mod that reads ``b`` evaluated at ``b = 0`` only gives every batch element
    batch 0's tiles: a silent wrong answer. From ``create_block_mask``, ``B``/``H`` are
    the arguments (None = broadcast); from ``flex_attention``, they are the BlockMask's
    sizes and ``data_shape`` is the query's ``(batch, heads)``.
    """
    if mask is None:
        return
    for axis, name, size, first, every, count in (
            ("b", "B", B, "batch 0", "batch element", "batch size"),
            ("h", "H", H, "head 0", "head", "number of query heads")):
        if axis not in mask.uses:
            continue
        if data_shape is None and size is None:
            raise ValueError(
                f"mask_mod {mask.name!r} reads {axis}, so {name}=None would use {first}'s mask for every "
                f"{every}; pass {name}=<{count}> to create_block_mask")
        wanted = None if data_shape is None else data_shape[0 if axis == "b" else 1]
        if data_shape is not None and size == 1 and wanted > 1:
            raise ValueError(
                f"block_mask was built with {name}=1 (or None) but its mask_mod {mask.name!r} reads {axis} and the "
                f"query has {count} {wanted}, so {first}'s mask would be used for every {every}; rebuild it "
                f"with create_block_mask(..., {name}={wanted})")


@eager_outside_abstract_mesh
def full_block_mask(B: int, H: int, Q_LEN: int, KV_LEN: int, *, block_size=(128, 128)) -> BlockMask:
    """The BlockMask of full attention, without evaluating any mask_mod."""
    bq, bkv = check_block_size(block_size)
    nq, nkv = -(-Q_LEN // bq), -(-KV_LEN // bkv)
    q_full = (jnp.arange(nq) + 1) * bq <= Q_LEN
    kv_full = (jnp.arange(nkv) + 1) * bkv <= KV_LEN
    states = jnp.where(q_full[:, None] & kv_full[None, :], FULL, PARTIAL).astype(jnp.int8)
    states = jnp.broadcast_to(states, (B, H, nq, nkv))
    return _with_kv_band(BlockMask.from_states(states, (), seq_lengths=(Q_LEN, KV_LEN),
                                               block_size=(bq, bkv), mask=None))
