"""Pieces every backend shares: mod evaluation on tiles and the softmax edge cases."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .._block_mask import EMPTY, FULL, PARTIAL, BlockMask, lists_from_states
from ._contract import TileLists

# Scores of excluded pairs. The online softmax's running max starts at the lowest finite
# value (``row_init``), never at -inf, so ``s - m`` is never (-inf) - (-inf) = NaN: an
# excluded pair gives exp(-inf) = 0 even in a row that has seen no allowed key, and a row
# of allowed scores at finfo.min (HuggingFace-style masking in a score_mod) still has
# its max and gives uniform weights, as in the reference. Measured on XLA:CPU: no slower
# than a finite mask value (10.3-12.0 ms against 10.5-10.7 ms per 20 tile steps).
MASK_VALUE = -float("inf")


def row_init(dtype) -> float:
    """Start of the online softmax's running max: the lowest finite value of ``dtype``."""
    return float(jnp.finfo(dtype).min)


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


def lse_of(m, l):
    """log-sum-exp from a row's max ``m`` and sum ``l`` of exp(s - m); -inf where no key contributed."""
    alive = l > 0
    return jnp.where(alive, m + jnp.log(jnp.where(alive, l, 1.0)), -jnp.inf)


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


# Rows whose max score is at least this large in magnitude are recomputed in the kernels'
# backward from their max and sum rather than from lse: in float32, lse = max + log(sum)
# keeps log(sum) only to ulp(max) (at 2**12, 2.4e-4 relative in P; at 1e30, not at all).
HUGE_ROW = 2.0**12


def backward_rows(out, lse, dout, dlse, residuals):
    """Per-row inputs of kernels that recompute P from lse: (lse, delta, dO), float32.

    ``residuals`` is each row's (max, sum), (B, Hq, Sq). delta = rowsum(dO * O) - dlse (a
    cotangent on lse adds P * dlse to dS). lse -inf (no allowed key) becomes 0, so exp(s -
    lse) cannot overflow before the mask zeroes it. Rows with a huge max (``HUGE_ROW``) get
    their max in lse's place, which gives P * sum, and dO and delta divided by the sum: dV =
    P^T dO and dS = P (dP - delta) come out exact.
    """
    delta = jnp.einsum("bqhd,bqhd->bhq", dout.astype(jnp.float32), out.astype(jnp.float32))
    delta = delta - dlse.astype(jnp.float32)
    lse_safe = jnp.where(lse == -jnp.inf, 0.0, lse)
    row_max, row_sum = residuals
    huge = (jnp.abs(row_max) >= HUGE_ROW) & (row_sum > 0)
    inv_sum = jnp.where(huge, 1.0 / jnp.where(huge, row_sum, 1.0), 1.0)
    lse_safe = jnp.where(huge, row_max, lse_safe)
    dout = inv_sum.transpose(0, 2, 1)[..., None] * dout.astype(jnp.float32)
    return lse_safe, delta * inv_sum, dout


# kernel_options of the kernel backends (pallas, triton): tiles and Triton launch parameters.
TILE_FIELDS = ("block_q", "block_kv", "bwd_block_q", "bwd_block_kv")
LAUNCH_FIELDS = ("num_warps", "num_stages", "bwd_num_warps", "bwd_num_stages")


def check_tiles_and_launch(opts: dict, block_size) -> None:
    """Tiles and launch parameters are positive ints; a tile divides the BlockMask's block or is a multiple of it.

    Raises:
      ValueError: naming the key.
    """
    for f in TILE_FIELDS + LAUNCH_FIELDS:
        val = opts.get(f)
        if val is None:
            continue
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val <= 0:
            raise ValueError(f"kernel_options[{f!r}] must be a positive int, got {val!r}")
        if f in TILE_FIELDS:
            base = block_size[0] if f.endswith("block_q") else block_size[1]
            if val % base and base % val:
                raise ValueError(
                    f"kernel_options[{f!r}]={val} must divide the BlockMask's block ({base}) or be a "
                    f"multiple of it")


def dropout_args(spec, dropout_seed) -> dict:
    """The kernel templates' dropout keywords (pallas, triton): none at rate 0, so the
    kernels are then the plain ones; else ``rate`` and the (2,) uint32 ``seed``."""
    rate = spec.dropout_rate
    if not rate:
        return {}
    if dropout_seed is None:
        raise ValueError(f"dropout_rate={rate} needs dropout_seed, a (2,) uint32 array")
    return {"rate": rate, "seed": jnp.asarray(dropout_seed, jnp.uint32).reshape(2)}
