"""Pieces every backend shares: mod evaluation on tiles and the softmax edge cases."""

from __future__ import annotations

import jax.numpy as jnp

from .._block_mask import EMPTY, FULL, PARTIAL, BlockMask, lists_from_states

# Scores of excluded pairs. A finite value, not -inf: (-inf) - (-inf) is NaN in the online
# softmax of a tile where every pair is excluded; rows that stay fully excluded are fixed
# at the end (output 0, lse -inf).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Start of the online softmax's running max: above MASK_VALUE, so that exp(MASK_VALUE - m)
# is exactly 0 even in a row that has seen no allowed key; below any real score.
ROW_INIT = 0.5 * MASK_VALUE


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


def finish_lse(m, l):
    """lse from the running max ``m`` and sum ``l``; -inf where no key contributed."""
    return jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)


def coarse_lists(lists, block_size, tq, tk, q_len, kv_len):
    """The BlockMask's lists regrouped into (tq, tk) compute tiles."""
    bq, bkv = block_size
    fq, fk = tq // bq, tk // bkv
    bm = BlockMask(*lists, seq_lengths=(q_len, kv_len), block_size=block_size, mask=None)
    if fq == 1 and fk == 1:
        return tuple(lists)
    states = bm.block_states()
    B, H, nq, nkv = states.shape
    nqc, nkc = -(-nq // fq), -(-nkv // fk)
    # Blocks past the end count as empty: they keep a coarse tile from being full.
    states = jnp.pad(states, ((0, 0), (0, 0), (0, nqc * fq - nq), (0, nkc * fk - nkv)))
    cells = states.reshape(B, H, nqc, fq, nkc, fk)
    coarse = jnp.where((cells == FULL).all((3, 5)), FULL,
                       jnp.where((cells != EMPTY).any((3, 5)), PARTIAL, EMPTY)).astype(jnp.int8)
    return lists_from_states(coarse)
