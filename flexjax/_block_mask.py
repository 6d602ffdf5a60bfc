"""BlockMask: the tile-level sparsity of a mask_mod, classified by analysis, as a pytree."""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ._factory import entry, int_array, named
from ._trace import StaticMod, mod_name, trace_mod
from .backends._contract import TileLists

EMPTY, PARTIAL, FULL = 0, 1, 2

# Elements of mask evaluated per lax.map step when building a BlockMask: 2**24 keeps a
# step's int32 temporaries near 64 MiB whatever the sequence length.
_BUILD_CHUNK_ELEMENTS = 1 << 24


def noop_mask(b, h, q_idx, kv_idx):
    """A mask_mod that attends everywhere."""
    return jnp.full(jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(kv_idx)), True)


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


def _check_dim(name: str, value, allow_none: bool) -> int:
    if value is None and allow_none:
        return 1
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value <= 0:
        hint = " or None to broadcast" if allow_none else ""
        raise ValueError(f"{name} must be a positive int{hint}, got {value!r}")
    return int(value)


def _check_block_size(block_size) -> tuple[int, int]:
    if isinstance(block_size, (int, np.integer)):
        bs = (block_size, block_size)
    elif isinstance(block_size, (tuple, list)):
        bs = tuple(block_size)
    else:
        bs = ()
    if len(bs) != 2 or any(
        isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x <= 0 for x in bs
    ):
        raise ValueError(
            f"block_size must be a positive int or a pair (block_q, block_kv) of positive ints, got {block_size!r}"
        )
    return int(bs[0]), int(bs[1])


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

    def rows(member, w):
        n = member.shape[-1]
        idx = jnp.arange(n, dtype=jnp.int32)
        order = jnp.argsort(jnp.where(member, idx, n + idx), axis=-1).astype(jnp.int32)
        return member.sum(-1, dtype=jnp.int32), order[..., :min(n, w or n)]

    partial, full = states == PARTIAL, states == FULL
    kv_n, kv_i = rows(partial, kv_w)
    fkv_n, fkv_i = rows(full, kv_w)
    q_n, q_i = rows(jnp.swapaxes(partial, -1, -2), q_w)
    fq_n, fq_i = rows(jnp.swapaxes(full, -1, -2), q_w)
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

    Attributes (children of the pytree):
      kv_num_blocks: int32 (B, H, nQ), partial tiles per q block.
      kv_indices: int32 (B, H, nQ, W), their kv block indices, ascending (entries past a
        row's count are valid block indices, to be ignored); W is the most partial tiles
        of any q block when built eagerly (at least 1), nKV under ``jit``, or
        ``max_blocks_per_row`` when given.
      full_kv_num_blocks, full_kv_indices: the same for full tiles, with their own width
        (causal: 1 for the partial lists, nKV - 1 for the full ones).
      q_num_blocks, q_indices, full_q_num_blocks, full_q_indices: the transposed lists
        (per kv block, its q blocks) that the dK/dV pass walks.
      mask_consts: the arrays the mask_mod closes over.
    Static: ``seq_lengths = (Q_LEN, KV_LEN)``, ``block_size``, the traced mask_mod, and
    ``kv_band``: the widest kv range (first to last non-empty tile of any q block, in
    positions), known when the lists are concrete at construction (None when built under
    ``jit``); it stays with the mask across ``jit`` boundaries so backends can pick tiles.
    B and H are 1 where the mask broadcasts over that axis.
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

    # -- views --------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, H, Q_LEN, KV_LEN); B or H is 1 where the mask broadcasts."""
        B, H = self.kv_num_blocks.shape[:2]
        return (B, H, *self.seq_lengths)

    @property
    def num_blocks(self) -> tuple[int, int]:
        """(nQ, nKV): the number of q and kv blocks (the lists may be narrower than nKV)."""
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

def _shifted(mask, consts, shift, q_len_orig: int) -> Callable:
    """``mask`` with ``q_idx`` moved by ``shift`` (a scalar or (B,) array), clamped into range."""

    def mask_mod(b, h, q_idx, kv_idx):
        return mask(consts, b, h, jnp.minimum(q_idx + entry(shift, b), q_len_orig - 1), kv_idx)

    mask_mod.__name__ = f"{mask.name}@q+offset"
    return mask_mod


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
        traced = trace_mod(_shifted(bm.mask, bm.mask_consts, shift, bm.seq_lengths[0]), "mask",
                           arg_name="mask_mod")
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
    B_arg, H_arg = B, H
    B = _check_dim("B", B, allow_none=True)
    H = _check_dim("H", H, allow_none=True)
    Q_LEN = _check_dim("Q_LEN", Q_LEN, allow_none=False)
    KV_LEN = _check_dim("KV_LEN", KV_LEN, allow_none=False)
    bq, bkv = _check_block_size(block_size)
    if max_blocks_per_row is not None:
        max_blocks_per_row = _check_dim("max_blocks_per_row", max_blocks_per_row, allow_none=False)
    if mask_mod is None:
        return full_block_mask(B, H, Q_LEN, KV_LEN, block_size=(bq, bkv))
    traced = trace_mod(mask_mod, "mask", arg_name="mask_mod")
    static = traced.static()  # its key prints the jaxpr: once, not per use
    check_broadcast(static, B_arg, H_arg)
    return _with_kv_band(_build_mask(static, traced.consts, B, H, Q_LEN, KV_LEN, bq, bkv, analyse,
                                     max_blocks_per_row))


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


def full_block_mask(B: int, H: int, Q_LEN: int, KV_LEN: int, *, block_size=(128, 128)) -> BlockMask:
    """The BlockMask of full attention, without evaluating any mask_mod."""
    bq, bkv = _check_block_size(block_size)
    nq, nkv = -(-Q_LEN // bq), -(-KV_LEN // bkv)
    q_full = (jnp.arange(nq) + 1) * bq <= Q_LEN
    kv_full = (jnp.arange(nkv) + 1) * bkv <= KV_LEN
    states = jnp.where(q_full[:, None] & kv_full[None, :], FULL, PARTIAL).astype(jnp.int8)
    states = jnp.broadcast_to(states, (B, H, nq, nkv))
    return _with_kv_band(BlockMask.from_states(states, (), seq_lengths=(Q_LEN, KV_LEN),
                                               block_size=(bq, bkv), mask=None))


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
