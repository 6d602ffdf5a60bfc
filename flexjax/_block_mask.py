"""BlockMask: the tile-level sparsity of a mask_mod, built chunk by chunk, as a pytree."""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ._factory import named
from ._trace import StaticMod, mod_name, trace_mod

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


def lists_from_states(states: jax.Array) -> tuple[jax.Array, ...]:
    """Sparse tile lists from a (B, H, nQ, nKV) array of EMPTY/PARTIAL/FULL.

    Returns ``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
    q_num_blocks, q_indices, full_q_num_blocks, full_q_indices)``. Indices of each row are
    ascending; entries past the row's count are other (valid) block indices.
    """

    def rows(member):
        n = member.shape[-1]
        idx = jnp.arange(n, dtype=jnp.int32)
        order = jnp.argsort(jnp.where(member, idx, n + idx), axis=-1).astype(jnp.int32)
        return member.sum(-1, dtype=jnp.int32), order

    partial, full = states == PARTIAL, states == FULL
    kv_n, kv_i = rows(partial)
    fkv_n, fkv_i = rows(full)
    q_n, q_i = rows(jnp.swapaxes(partial, -1, -2))
    fq_n, fq_i = rows(jnp.swapaxes(full, -1, -2))
    return kv_n, kv_i, fkv_n, fkv_i, q_n, q_i, fq_n, fq_i


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
      kv_indices: int32 (B, H, nQ, nKV), their kv block indices, ascending.
      full_kv_num_blocks, full_kv_indices: the same for full tiles.
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
        """(nQ, nKV): the number of q and kv blocks."""
        return self.kv_indices.shape[-2], self.kv_indices.shape[-1]

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

    def to_dense(self) -> jax.Array:
        """int32 (B, H, nQ, nKV): 1 where a tile is computed (partial or full), as torch's."""
        return (self.block_states() != EMPTY).astype(jnp.int32)

    def sparsity(self) -> float:
        """Percentage of tiles that are skipped (empty)."""
        dense = np.asarray(self.to_dense())
        return 100.0 * (1.0 - dense.mean())

    def to_string(self, grid_size: tuple[int, int] = (24, 48), limit: int = 4) -> str:
        """A picture of the tiles: '█' full, '░' partial, ' ' empty, per (b, h).

        Larger grids are shown coarsened to ``grid_size`` (a cell shows its most
        computed tile). At most ``limit`` (b, h) pairs are drawn.
        """
        if self._is_traced():
            return f"{self!r}\n(the tile lists are traced inside jit: call to_string() outside jit to see them)"
        states = np.asarray(self.block_states())
        B, H, nq, nkv = states.shape
        fq, fkv = math.ceil(nq / grid_size[0]), math.ceil(nkv / grid_size[1])
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
                s = states[b, h]
                pad = np.zeros((math.ceil(nq / fq) * fq, math.ceil(nkv / fkv) * fkv), np.int8)
                pad[:nq, :nkv] = s
                cells = pad.reshape(pad.shape[0] // fq, fq, pad.shape[1] // fkv, fkv)
                coarse = np.where((cells == FULL).all((1, 3)), FULL,
                                  np.where((cells != EMPTY).any((1, 3)), PARTIAL, EMPTY))
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
                   for x in self.tree_flatten()[0][:8])

    def __repr__(self) -> str:
        B, H, Q, KV = self.shape
        sp = "traced" if self._is_traced() else f"{self.sparsity():.2f}%"
        name = self.mask.name if self.mask is not None else "noop_mask"
        return (f"BlockMask(shape=({B}, {H}, {Q}, {KV}), block_size={self.block_size}, "
                f"sparsity={sp}, mask_mod={name})")

    def __getitem__(self, index) -> BlockMask:
        """Selects batches/heads, e.g. ``bm[0]``, ``bm[:, 2]``; keeps the 4-D layout.

        The mask_mod is still called with the original b/h, so a slice is for
        inspection (``to_string``, ``to_dense``), not for attention over other data.
        """
        if not isinstance(index, tuple):
            index = (index,)
        if len(index) > 2:
            raise IndexError(f"BlockMask indexes batch and heads only, got {len(index)} indices")
        index = tuple(slice(i, i + 1) if isinstance(i, (int, np.integer)) else i for i in index)
        index = index + (slice(None),) * (2 - len(index))

        def take(x):
            return x[index]

        children, aux = self.tree_flatten()
        return BlockMask.tree_unflatten(aux, [take(c) for c in children[:8]] + [children[8]])


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
    nkv = kv_i.shape[-1]
    cols = np.arange(nkv)

    def ends(n, idx):
        valid = cols < n[..., None]
        return np.where(valid, idx, nkv).min(-1), np.where(valid, idx, -1).max(-1)

    (f0, l0), (f1, l1) = ends(kv_n, kv_i), ends(fkv_n, fkv_i)
    width = np.maximum(l0, l1) - np.minimum(f0, f1) + 1
    return int(max(width.max(), 1)) * bm.block_size[1]


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


def _build_lists(mask: StaticMod, consts, B, H, q_len, kv_len, bq, bkv) -> tuple[jax.Array, ...]:
    return lists_from_states(_build_states(mask, consts, B, H, q_len, kv_len, bq, bkv))


_build_lists_jit = jax.jit(_build_lists, static_argnums=(0, 2, 3, 4, 5, 6, 7))


def _build_jit(mask: StaticMod, consts, B, H, q_len, kv_len, bq, bkv) -> BlockMask:
    """The BlockMask of ``mask``, its tile lists computed under jit.

    It is assembled outside jit to keep this call's ``mask``: on a cache hit jit hands
    back the first trace's static outputs, a StaticMod whose mod may close over that
    trace's tracers (and then cannot be pickled).
    """
    lists = _build_lists_jit(mask, consts, B, H, q_len, kv_len, bq, bkv)
    return BlockMask(*lists, consts, seq_lengths=(q_len, kv_len), block_size=(bq, bkv), mask=mask)


def create_block_mask(mask_mod: Callable | None, B: int | None, H: int | None, Q_LEN: int,
                      KV_LEN: int, *, block_size: int | tuple[int, int] = 128) -> BlockMask:
    """Classifies every (q block, kv block) tile of ``mask_mod`` as empty, partial or full.

    Works eagerly and inside ``jax.jit`` (arrays the mask_mod closes over may be traced).
    Memory is O(S * block): the mask is evaluated one slab of q blocks at a time.

    Args:
      mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = attend), or None for
        full attention.
      B, H: batch size and number of query heads, or None to broadcast over that axis
        (only allowed when the mask_mod does not read ``b`` / ``h``).
      Q_LEN, KV_LEN: sequence lengths (any positive ints).
      block_size: tile size, an int or ``(block_q, block_kv)``.

    Returns:
      A BlockMask (a pytree) for ``flex_attention(..., block_mask=...)``.
    """
    B_arg, H_arg = B, H
    B = _check_dim("B", B, allow_none=True)
    H = _check_dim("H", H, allow_none=True)
    Q_LEN = _check_dim("Q_LEN", Q_LEN, allow_none=False)
    KV_LEN = _check_dim("KV_LEN", KV_LEN, allow_none=False)
    bq, bkv = _check_block_size(block_size)
    if mask_mod is None:
        return full_block_mask(B, H, Q_LEN, KV_LEN, block_size=(bq, bkv))
    traced = trace_mod(mask_mod, "mask", arg_name="mask_mod")
    check_broadcast(traced.static(), B_arg, H_arg)
    return _with_kv_band(_build_jit(traced.static(), traced.consts, B, H, Q_LEN, KV_LEN, bq, bkv))


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
