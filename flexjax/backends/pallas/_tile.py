"""Tile math shared by the GPU and TPU kernels: scores, mods, online softmax, tile VJP."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ... import _dropout
from .. import _softmax
from .._layout import Mods

_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b
_NN = (((1,), (0,)), ((), ()))  # a @ b


def dot(a, b, dims=_NN):
    """Matmul in the inputs' dtype with float32 accumulation."""
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def dot_nt(a, b):
    return dot(a, b, _NT)


def dot_tn(a, b):
    return dot(a, b, _TN)


@dataclasses.dataclass
class ModInputs:
    """What one tile of one mod reads: hoisted row/col tiles and an array loader."""

    rows: tuple = ()
    cols: tuple = ()
    load: Callable[[int, list], Any] | None = None


@dataclasses.dataclass
class Tile:
    """Indices of one (tq, tk) tile: b, h scalars; q_idx (tq, 1), kv_idx (1, tk) clamped."""

    b: Any
    h: Any
    q_idx: Any
    kv_idx: Any
    q_valid: Any
    kv_valid: Any


def tile_indices(b, h, q_start, kv_start, tq, tk, q_len, kv_len, full_2d: bool = False) -> Tile:
    """Tile indices; ``full_2d`` makes them (tq, tk) (Mosaic prefers full vreg shapes)."""
    shape_q, shape_k = ((tq, tk), (tq, tk)) if full_2d else ((tq, 1), (1, tk))
    qi = q_start + lax.broadcasted_iota(jnp.int32, shape_q, 0)
    ki = kv_start + lax.broadcasted_iota(jnp.int32, shape_k, 1)
    # Mods never see out-of-range indices: clamp them; the padding is masked separately.
    return Tile(b, h, jnp.minimum(qi, q_len - 1), jnp.minimum(ki, kv_len - 1), qi < q_len, ki < kv_len)


@dataclasses.dataclass
class Dropout:
    """Dropout on the probabilities of one kernel: the rate and the two uint32 seed words (scalars).

    The keep mask is ``_dropout.keep_mask`` of the tile's global indices, so it is the same
    for every tile size, template and pass.
    """

    rate: float
    seed: tuple

    @property
    def inv_keep(self) -> float:
        return 1.0 / (1.0 - self.rate)

    def keep(self, t: Tile):
        """bool keep mask of tile ``t`` (the shape of ``t.q_idx & t.kv_idx``)."""
        # One row hash per query row and one column hash per key: on (tq, tk) index tiles
        # (the TPU template's) hash the first column / row only and broadcast.
        q_idx = t.q_idx[:, :1] if t.q_idx.shape[-1] > 1 else t.q_idx
        kv_idx = t.kv_idx[:1, :] if t.kv_idx.shape[0] > 1 else t.kv_idx
        keep = _dropout.keep_from_hashes(_dropout.row_hash(self.seed, t.b, t.h, q_idx),
                                         _dropout.col_hash(self.seed, kv_idx), self.rate)
        return jnp.broadcast_to(keep, jnp.broadcast_shapes(t.q_idx.shape, t.kv_idx.shape))


def apply_score(mods: Mods, s_raw, t: Tile, inputs: ModInputs):
    if mods.score is None:
        return s_raw
    return mods.score.evaluate(s_raw, t.b, t.h, t.q_idx, t.kv_idx, inputs.rows, inputs.cols, inputs.load)


def allowed(mods: Mods, t: Tile, inputs: ModInputs):
    """The mask of a partial tile: the in-range test and the mask_mod."""
    ok = t.q_valid & t.kv_valid
    if mods.mask is not None:
        ok = ok & mods.mask.evaluate(None, t.b, t.h, t.q_idx, t.kv_idx, inputs.rows, inputs.cols, inputs.load)
    return ok


def softmax_step(carry, s, v, keep=None):
    """One online-softmax step: carry (m (tq, 1), l (tq, 1), acc (tq, Dv)) float32.

    Row statistics stay 2-D so the same code suits Triton and Mosaic layouts. ``keep``
    (dropout): the row max and sum stay those of all probabilities, ``acc`` takes only
    the kept ones (``finish`` rescales by 1 / (1 - rate)).
    """
    m, l, acc = carry
    m_new, l, p, alpha = _softmax.step(m, l, s, keepdims=True)
    pv = p if keep is None else jnp.where(keep, p, 0.0)
    acc = acc * alpha + dot(pv.astype(v.dtype), v)
    return m_new, l, acc


def finish(carry, drop: Dropout | None = None):
    """(out (tq, Dv), row max (tq, 1), row sum (tq, 1)) from the final carry.

    Out is 0 and the max 0 on empty rows (sum 0). The max and sum stay apart (lse =
    max + log(sum) is formed outside): at |max| ~ 1e30 float32 lse has lost log(sum),
    which the backward needs. With dropout, out = (P * keep) V / (1 - rate).
    """
    m, l, acc = carry
    out = acc / jnp.where(l > 0, l, 1.0)
    if drop is not None:
        out = out * drop.inv_keep
    return out, jnp.where(l > 0, m, 0.0), l


def forward_tile(mods, carry, q, k, v, t: Tile, scale, masked: bool, score_in: ModInputs, mask_in: ModInputs,
                 drop: Dropout | None = None):
    """Forward of one tile: scores, score_mod, (mask_mod), online softmax (with dropout on P)."""
    s = apply_score(mods, dot_nt(q, k) * scale, t, score_in)
    if masked:
        s = jnp.where(allowed(mods, t, mask_in), s, -jnp.inf)
    return softmax_step(carry, s, v, None if drop is None else drop.keep(t))


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


@dataclasses.dataclass
class TileGrads:
    """Backward of one tile.

    Attributes:
      p: the probabilities that multiply V (tq, tk), float32: P, or under dropout
        P * keep / (1 - rate).
      ds: gradient of the raw scores q·k*scale (tq, tk), float32 (before the scale).
      rows, cols: gradients of the score_mod's float row/col tiles (None for others).
      reads: per array read of the score_mod: (array index, clamped indices, gradient
        tile or None).
    """

    p: Any
    ds: Any
    rows: tuple
    cols: tuple
    reads: tuple


def backward_tile(mods, q, k, v, do, lse, delta, t: Tile, scale, masked: bool,
                  score_in: ModInputs, mask_in: ModInputs, *, qk=None, dov=None,
                  drop: Dropout | None = None) -> TileGrads:
    """Recomputes P of one tile and pushes dS through the score_mod's VJP.

    Under dropout (``drop``) the tile's keep mask is regenerated: dP = dO Vᵀ * keep /
    (1 - rate) and dS = P (dP - delta), with delta from the dropped output.

    ``lse`` and ``delta`` are (tq, 1) float32 with -inf lse already replaced by 0.
    ``qk`` and ``dov``: q·kᵀ and dO·vᵀ (tq, tk) float32 when the caller forms them itself
    (then q, k, v and do are not read).
    """
    s_raw = (dot_nt(q, k) if qk is None else qk) * scale
    ok = allowed(mods, t, mask_in) if masked else None
    sm = mods.score
    reads: list = []
    if sm is not None:
        def record(kk, idx):
            val = score_in.load(kk, idx)
            reads.append((kk, idx, val))
            return val

        sm.evaluate(s_raw, t.b, t.h, t.q_idx, t.kv_idx, score_in.rows, score_in.cols, record)
        fl_rows = tuple(x for x in score_in.rows if _is_float(x))
        fl_cols = tuple(x for x in score_in.cols if _is_float(x))
        fl_reads = tuple(val for _, _, val in reads if _is_float(val))

        def f(s_, rows_, cols_, reads_):
            it_r, it_c, it_l = iter(rows_), iter(cols_), iter(reads_)
            rows = tuple(next(it_r) if _is_float(x) else x for x in score_in.rows)
            cols = tuple(next(it_c) if _is_float(x) else x for x in score_in.cols)
            loaded = iter([next(it_l) if _is_float(val) else val for _, _, val in reads])
            return sm.evaluate(s_, t.b, t.h, t.q_idx, t.kv_idx, rows, cols, lambda kk, idx: next(loaded))

        s, vjp = jax.vjp(f, s_raw, fl_rows, fl_cols, fl_reads)
    else:
        s = s_raw
    p = jnp.exp(s - lse)
    if masked:
        p = jnp.where(ok, p, 0.0)
    dp = dot_nt(do, v) if dov is None else dov
    pv = p
    if drop is not None:
        keep = drop.keep(t)
        pv = jnp.where(keep, p * drop.inv_keep, 0.0)
        dp = jnp.where(keep, dp * drop.inv_keep, 0.0)
    ds = p * (dp - delta)
    if sm is None:
        return TileGrads(pv, ds, (), (), ())
    ds_raw, d_rows, d_cols, d_reads = vjp(ds)
    it_r, it_c, it_l = iter(d_rows), iter(d_cols), iter(d_reads)
    rows = tuple(next(it_r) if _is_float(x) else None for x in score_in.rows)
    cols = tuple(next(it_c) if _is_float(x) else None for x in score_in.cols)
    grads = tuple((kk, idx, next(it_l) if _is_float(val) else None) for kk, idx, val in reads)
    return TileGrads(pv, ds_raw, rows, cols, grads)


def reduce_axes(reduce, x, axes=None):
    """``reduce(x, axis=axes)`` (default: every axis) as one reduction per axis, the last first.

    Pallas-Triton lowers a reduction over several axes as such a chain itself, but keeps the input's
    sharding on each intermediate, which under an Explicit mesh (an AbstractMesh's default from JAX
    0.11, the one that lowers for a GPU from a CPU host) raises "Length of sharding.spec". The
    ``-(-x)`` between steps is the one JAX's rule puts there (a layout conversion Triton needs between
    chained reductions, triton#1776); it is exact.
    """
    axes = tuple(range(x.ndim)) if axes is None else tuple(a % x.ndim for a in axes)
    for n, axis in enumerate(sorted(axes, reverse=True)):
        x = reduce(jnp.negative(jnp.negative(x)) if n else x, axis=axis)
    return x


def onehot_partial(flat_idx, grad, start, size):
    """Sum of ``grad`` over the tile positions whose flat index is in [start, start+size).

    Returns (size,) float32: a tile's contribution to one chunk of an array's gradient,
    reduced in a fixed order (no atomics, so the sum is deterministic).
    """
    targets = start + lax.broadcasted_iota(jnp.int32, (1, 1, size), 2)
    hit = flat_idx[:, :, None] == targets
    return reduce_axes(jnp.sum, jnp.where(hit, grad[:, :, None], 0.0), (0, 1))


def flat_index(idx, shape):
    """Row-major flat index of the per-dimension index tiles ``idx`` into ``shape``."""
    flat = idx[0]
    for i, n in zip(idx[1:], shape[1:]):
        flat = flat * n + i
    return flat
