"""``BlockMask.from_kv_blocks``: a BlockMask from PyTorch-style kv block lists, built on device.

The lists name, per q block, its partial kv blocks (the mask_mod decides pair by pair) and
optionally its full ones (every pair attends); every other block is skipped. They are scattered
into (B, H, nQ, nKV) membership arrays, which give the BlockMask's eight lists (the q-major ones
that the backward walks included) and which its mask captures, all in jnp with widths that depend
on the shapes only: one compile serves every index set of the same shapes, under ``jit`` with
traced lists too.

This module sits below ``_block_mask_type`` (the classmethod imports it; it receives the class):
it imports nothing that imports the type.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ._factory import (
    check_block_size,
    check_seq_lengths,
    eager_outside_abstract_mesh,
    fail_on_host,
    int_array,
    member_rows,
    named,
)
from ._trace import mod_name, trace_mod

_NAMES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


def _block_size(block_size, BLOCK_SIZE) -> tuple[int, int]:
    if block_size is not None and BLOCK_SIZE is not None:
        raise ValueError(f"pass the block size once: block_size={block_size!r} or BLOCK_SIZE={BLOCK_SIZE!r} "
                         "(PyTorch's name), not both")
    name, value = ("BLOCK_SIZE", BLOCK_SIZE) if BLOCK_SIZE is not None else ("block_size", block_size)
    return check_block_size(128 if value is None else value, name)


def _lists_args(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) -> list[jax.Array]:
    """The given lists as int32 arrays, their ranks and (B, H, nQ) checked against each other."""
    if (full_kv_num_blocks is None) != (full_kv_indices is None):
        given, missing = (("full_kv_num_blocks", "full_kv_indices") if full_kv_indices is None
                          else ("full_kv_indices", "full_kv_num_blocks"))
        raise ValueError(f"full_kv_num_blocks and full_kv_indices must be given together or both omitted: "
                         f"{given} is given but {missing} is None")
    raw = (kv_num_blocks, kv_indices) + (() if full_kv_indices is None else (full_kv_num_blocks, full_kv_indices))
    arrays = []
    for name, x in zip(_NAMES, raw):
        is_num = name.endswith("num_blocks")
        shape = "(B, H, num_q_blocks)" if is_num else "(B, H, num_q_blocks, W)"
        arr = int_array(name, x, shape)
        if arr.ndim != (3 if is_num else 4):
            raise ValueError(f"{name} must have shape {shape}, got shape {tuple(arr.shape)}")
        arrays.append(arr)
    for num, idx in zip(arrays[0::2], arrays[1::2]):
        if num.shape != idx.shape[:3]:
            n_name, i_name = _NAMES[arrays.index(num)], _NAMES[arrays.index(num) + 1]
            raise ValueError(f"{n_name} must have shape (B, H, num_q_blocks) = {tuple(idx.shape[:3])}, the first "
                             f"three axes of {i_name} {tuple(idx.shape)}; got shape {tuple(num.shape)}")
    if len(arrays) == 4:
        (B0, H0, nq0), (B1, H1, nq1) = arrays[1].shape[:3], arrays[3].shape[:3]
        if nq0 != nq1 or (B0 != B1 and 1 not in (B0, B1)) or (H0 != H1 and 1 not in (H0, H1)):
            raise ValueError(
                f"full_kv_indices {tuple(arrays[3].shape)} must match kv_indices {tuple(arrays[1].shape)} in B, H "
                f"(or be 1 there, to broadcast) and num_q_blocks: expected shape "
                f"({B0} or 1, {H0} or 1, {nq0}, Wf)")
    return arrays


def _seq_lengths(seq_lengths, nq: int, width: int, bq: int, bkv: int) -> tuple[int, int]:
    if seq_lengths is None:
        if width == 0:
            raise ValueError("kv_indices has width 0, so the default KV_LEN (its width times block_kv, as in "
                             "PyTorch) would be 0: pass seq_lengths=(Q_LEN, KV_LEN)")
        return nq * bq, width * bkv
    q_len, kv_len = check_seq_lengths(seq_lengths)
    if nq != -(-q_len // bq):
        raise ValueError(
            f"kv_num_blocks and kv_indices have {nq} q-block rows but Q_LEN={q_len} in blocks of block_q={bq} "
            f"makes {-(-q_len // bq)}: expected shapes (B, H, {-(-q_len // bq)}) and (B, H, {-(-q_len // bq)}, W)")
    return q_len, kv_len


def _row_flags(num, idx, nkv: int):
    """Per row: its count is negative, past the list's width, past nKV; per entry: listed and out of range."""
    listed = jnp.arange(idx.shape[-1]) < num[..., None]
    return num < 0, num > idx.shape[-1], num > nkv, listed & ((idx < 0) | (idx >= nkv))


def _first(flags) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(flags)[0])


def _fail(names, nkv: int, kv_len: int, bkv: int, *arrays):
    """Raises a ValueError for the first bad entry of the lists (NumPy arrays, on the host)."""
    for name_n, name_i, num, idx in zip(names[0::2], names[1::2], arrays[0::2], arrays[1::2]):
        neg, wide, many, out = (np.asarray(f) for f in _row_flags(num, idx, nkv))
        for flags, why in ((neg, "is negative"),
                           (wide, f"is past the width W={idx.shape[-1]} of {name_i}"),
                           (many, f"is past the number of kv blocks, {nkv} (KV_LEN={kv_len} in blocks of {bkv})")):
            if flags.any():
                b, h, i = _first(flags)
                raise ValueError(f"{name_n}[{b}, {h}, {i}] = {int(num[b, h, i])} {why}: each count must be in "
                                 f"[0, min(W, num_kv_blocks)] = [0, {min(idx.shape[-1], nkv)}]")
        if out.any():
            b, h, i, j = _first(out)
            raise ValueError(
                f"{name_i}[{b}, {h}, {i}, {j}] = {int(idx[b, h, i, j])} is outside [0, {nkv}) (KV_LEN={kv_len} in "
                f"blocks of {bkv}), and q block {i} of (b, h) = ({b}, {h}) lists {int(num[b, h, i])} entries "
                f"({name_n}[{b}, {h}, {i}]); entries past a row's count are ignored")
    raise AssertionError("the lists' check failed but no bad entry was found")


@functools.partial(jax.jit, static_argnums=0)
def _all_good(nkv: int, *arrays) -> jax.Array:
    ok = jnp.bool_(True)
    for num, idx in zip(arrays[0::2], arrays[1::2]):
        for f in _row_flags(num, idx, nkv):
            ok = ok & ~f.any()
    return ok


def _checked(arrays, nkv: int, kv_len: int, bkv: int) -> jax.Array:
    """``fail_on_host``'s int32 0 (to add into the counts): a ValueError now for concrete lists that cannot be
    right, when the computation runs for traced ones."""
    ok = _all_good(nkv, *arrays)
    names = _NAMES[:len(arrays)]
    return fail_on_host(ok, functools.partial(_fail, names, nkv, kv_len, bkv), *arrays)


def _member(num, idx, nq: int, nkv: int) -> jax.Array:
    """bool (B', H', nQ, nKV): the blocks a list pair names (duplicates collapse; entries past a row's
    count, and out-of-range ones when the checks are off, go to a dropped column)."""
    B, H, _, W = idx.shape
    listed = (jnp.arange(W) < num[..., None]) & (idx >= 0) & (idx < nkv)
    col = jnp.where(listed, idx, nkv)
    b = jnp.arange(B)[:, None, None, None]
    h = jnp.arange(H)[None, :, None, None]
    r = jnp.arange(nq)[None, None, :, None]
    return jnp.zeros((B, H, nq, nkv + 1), jnp.bool_).at[b, h, r, col].set(True)[..., :nkv]


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6))
def _build(nq: int, nkv: int, width: int, q_pad: bool, kv_pad: bool, B_H: tuple[int, int], with_mod: bool,
           zero, *arrays):
    """The eight tile lists, and the blocks the mask reads: ``(lists, whole, listed)``, bool (B, H, nQ, nKV)
    each, ``whole`` the full blocks and ``listed`` the partial ones (None, and ``listed`` every listed block,
    without a mask_mod)."""
    partial = _member(arrays[0] + zero, arrays[1], nq, nkv)
    full = jnp.zeros((1, 1, nq, nkv), jnp.bool_)
    if len(arrays) == 4:
        full = _member(arrays[2] + zero, arrays[3], nq, nkv)
    shape = B_H + (nq, nkv)
    partial = jnp.broadcast_to(partial & ~full, shape)  # a block listed both ways is full
    full = jnp.broadcast_to(full, shape)
    whole, listed = (full, partial) if with_mod else (None, partial | full)
    # Full blocks with padding (past Q_LEN / KV_LEN) are partial tiles, as the BlockMask invariant wants
    # (backends mask padding only in partial tiles); the mask keeps them whole.
    pad = np.zeros((nq, nkv), bool)
    pad[nq - 1, :] |= q_pad
    pad[:, nkv - 1] |= kv_pad
    partial, full = partial | (full & pad), full & ~pad
    kv_lists = (*member_rows(partial, width), *member_rows(full, width))
    q_lists = (*member_rows(jnp.swapaxes(partial, -1, -2), nq), *member_rows(jnp.swapaxes(full, -1, -2), nq))
    return kv_lists + q_lists, whole, listed


def _as_listed(b, h, q_idx, kv_idx, *, mask_mod: Callable | None, whole, listed, bq: int, bkv: int):
    """The mask the lists stand for: True in a ``whole`` block, ``mask_mod`` in a ``listed`` one (True
    without a mask_mod), False elsewhere. ``b`` / ``h`` are read only where the lists do not broadcast."""
    tile = (b if listed.shape[0] > 1 else 0, h if listed.shape[1] > 1 else 0,
            jnp.clip(q_idx // bq, 0, listed.shape[2] - 1), jnp.clip(kv_idx // bkv, 0, listed.shape[3] - 1))
    if mask_mod is None:
        return listed[tile]
    return whole[tile] | (listed[tile] & mask_mod(b, h, q_idx, kv_idx))


@eager_outside_abstract_mesh
def from_kv_blocks(cls, kv_num_blocks, kv_indices, full_kv_num_blocks=None, full_kv_indices=None,
                   block_size=None, mask_mod=None, seq_lengths=None, *, BLOCK_SIZE=None):
    """``BlockMask.from_kv_blocks`` (its docstring says what it does), building a ``cls``.

    The BlockMask's mask is ``_as_listed``: the lists as (B, H, nQ, nKV) bool arrays that it captures, with
    the user's mask_mod inside the partial blocks. The tile lists alone do not carry the semantics: the
    reference backend evaluates the mask everywhere, and tiles coarser than the blocks (kernel_options
    ``block_q`` / ``block_kv``, ``decode_block_mask``'s union of rows) evaluate it in blocks the lists skip.
    """
    bq, bkv = _block_size(block_size, BLOCK_SIZE)
    arrays = _lists_args(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
    _, _, nq, width = arrays[1].shape
    q_len, kv_len = _seq_lengths(seq_lengths, nq, width, bq, bkv)
    nkv = -(-kv_len // bkv)
    if mask_mod is not None:
        trace_mod(mask_mod, "mask", arg_name="mask_mod")  # its errors name the user's mask_mod, not ours
    zero = _checked(arrays, nkv, kv_len, bkv)
    B_H = tuple(max(x.shape[a] for x in arrays) for a in (0, 1))
    list_width = max(1, min(nkv, width + (arrays[3].shape[-1] if len(arrays) == 4 else 0)))
    lists, whole, listed = _build(nq, nkv, list_width, q_len % bq != 0, kv_len % bkv != 0, B_H,
                                  mask_mod is not None, zero, *arrays)
    name = "from_kv_blocks" if mask_mod is None else f"from_kv_blocks({mod_name(mask_mod)})"
    mask = trace_mod(named(_as_listed, name, mask_mod=mask_mod, whole=whole, listed=listed, bq=bq, bkv=bkv),
                     "mask", arg_name="mask_mod")
    return cls(*lists, mask.consts, seq_lengths=(q_len, kv_len), block_size=(bq, bkv), mask=mask.static(),
               kv_band=None)
