"""Pieces every backend shares: mod evaluation on tiles and the softmax edge cases."""

from __future__ import annotations

import jax.numpy as jnp

from .._block_mask_type import EMPTY, FULL, PARTIAL, BlockMask, lists_from_states
from ._contract import TileLists


def acc_dtype(dtype):
    """Accumulation dtype: float64 for float64 inputs (under jax_enable_x64), else float32."""
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def index_args(mod, b, h):
    """b and h for evaluating ``mod``; scalars where the mod never reads them."""
    b = b if "b" in mod.uses else jnp.int32(0)
    h = h if "h" in mod.uses else jnp.int32(0)
    return b, h


def apply_score_mod(spec, score_consts, s, b, h, q_idx, kv_idx):
    """score_mod on a tile (identity when there is none); indices already clamped."""
    if spec.score is None:
        return s
    b, h = index_args(spec.score, b, h)
    return jnp.broadcast_to(spec.score(score_consts, s, b, h, q_idx, kv_idx), s.shape)


def allowed(spec, mask_consts, b, h, q_idx, kv_idx, q_valid, kv_valid):
    """The mask of a tile: mask_mod (if any) and the in-range test, broadcasting."""
    ok = q_valid & kv_valid
    if spec.mask is not None:
        bb, hh = index_args(spec.mask, b, h)
        ok = ok & spec.mask(mask_consts, bb, hh, q_idx, kv_idx)
    return ok


def coarse_lists(lists, block_size, tq, tk, q_len, kv_len):
    """The BlockMask's lists regrouped into (tq, tk) compute tiles."""
    bq, bkv = block_size
    fq, fk = tq // bq, tk // bkv
    bm = BlockMask(*lists, seq_lengths=(q_len, kv_len), block_size=block_size, mask=None)
    if fq == 1 and fk == 1:
        return TileLists(*lists)
    states = bm.block_states()
    B, H, nq, nkv = states.shape
    nqc, nkc = -(-nq // fq), -(-nkv // fk)
    # Blocks past the end count as empty: they keep a coarse tile from being full.
    states = jnp.pad(states, ((0, 0), (0, 0), (0, nqc * fq - nq), (0, nkc * fk - nkv)))
    cells = states.reshape(B, H, nqc, fq, nkc, fk)
    coarse = jnp.where((cells == FULL).all((3, 5)), FULL,
                       jnp.where((cells != EMPTY).any((3, 5)), PARTIAL, EMPTY)).astype(jnp.int8)
    # A coarse row gathers fq block rows of at most (partial + full list widths) tiles each:
    # the coarse lists need no more, so compact lists stay compact.
    return lists_from_states(coarse, (min(nkc, fq * (lists.kv_idx.shape[-1] + lists.full_kv_idx.shape[-1])),
                                      min(nqc, fk * (lists.q_idx.shape[-1] + lists.full_q_idx.shape[-1]))))
