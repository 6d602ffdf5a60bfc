"""Geometry of one call: kernel tiles, list granularity, padding, and the mods' prologues."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .._modcompiler import CompiledMod
from ._common import coarse_lists
from ._contract import TileLists


@dataclasses.dataclass(frozen=True)
class Mods:
    """The compiled score_mod and mask_mod of one call (either may be None)."""

    score: CompiledMod | None
    mask: CompiledMod | None


@dataclasses.dataclass(frozen=True)
class Geom:
    """Static sizes of one kernel launch.

    Attributes:
      tq, tk: kernel tile (rows of q, rows of k/v per step).
      cq, ck: granularity of the tile lists the kernel walks; multiples of (tq, tk).
      sq, skv: padded sequence lengths (multiples of cq, ck).
      q_len, kv_len: true lengths.
      B, Hq, Hkv: batch, query heads, kv heads.
      Bm, Hm: batch and head sizes of the lists (1 where the BlockMask broadcasts).
    """

    tq: int
    tk: int
    cq: int
    ck: int
    sq: int
    skv: int
    q_len: int
    kv_len: int
    B: int
    Hq: int
    Hkv: int
    Bm: int
    Hm: int

    @property
    def G(self) -> int:
        return self.Hq // self.Hkv

    @property
    def sub_q(self) -> int:
        return self.cq // self.tq

    @property
    def sub_k(self) -> int:
        return self.ck // self.tk


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def geometry(spec, q, k, lists, tq: int, tk: int):
    """Geometry for kernel tiles (tq, tk) and the lists regrouped to match them.

    A tile smaller than the BlockMask's block walks the block in ``block // tile``
    sub-steps; a larger one (a multiple of the block) regroups the lists.
    """
    bq, bk = spec.block_size
    cq, ck = max(bq, tq), max(bk, tk)
    lists = TileLists(*lists)
    if (cq, ck) != (bq, bk):
        lists = coarse_lists(lists, spec.block_size, cq, ck, spec.q_len, spec.kv_len)
    B, Sq, Hq, _ = q.shape
    g = Geom(tq=tq, tk=tk, cq=cq, ck=ck, sq=_round_up(Sq, cq), skv=_round_up(spec.kv_len, ck),
             q_len=Sq, kv_len=spec.kv_len, B=B, Hq=Hq, Hkv=k.shape[2], Bm=lists.kv_num.shape[0],
             Hm=lists.kv_num.shape[1])
    return g, lists


def pad_axis(x, axis: int, n: int, value=0):
    if x.shape[axis] == n:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


_LANES = 128


@dataclasses.dataclass(frozen=True)
class DiagWindow:
    """Where a kernel tile finds its diagonal values (``CompiledMod.diags``, TPU template).

    A diagonal value is stored once per (b', h') as a vector ``w`` over ``kv_idx - q_idx``:
    ``w[offset + kv_idx - q_idx]``. The tile at (q_start, kv_start) reads
    ``T[i, j] = w[base + tq - 1 + j - i]`` with ``base = kv_start - q_start + offset - (tq -
    1)``: one contiguous slice, loaded from the lane block at ``base`` rounded down to 128.

    Attributes:
      offset: index of ``kv_idx - q_idx = 0``; ``offset - (tq - 1)`` is a multiple of 128,
        so every tile's slice starts on a lane block when tq is a multiple of 128.
      size: length of the stored vector (a multiple of 128).
      span: lanes a tile loads (a multiple of 128, >= tq + tk - 1 plus the in-block start).
      aligned: tq and tk are multiples of 128, so slices start exactly on a lane block.
    """

    offset: int
    size: int
    span: int
    aligned: bool


def diag_window(g: Geom) -> DiagWindow:
    aligned = g.tq % _LANES == 0 and g.tk % _LANES == 0
    base0 = _round_up(g.sq - g.tq, _LANES)  # base of the tile q_start = sq - tq, kv_start = 0 is >= 0
    span = g.tq + g.tk if aligned else _round_up(g.tq + g.tk + _LANES - 1, _LANES)
    size = _round_up(g.skv - g.tk + base0 + span, _LANES)
    return DiagWindow(offset=base0 + g.tq - 1, size=size, span=span, aligned=aligned)


@dataclasses.dataclass(frozen=True)
class Prologue:
    """One mod's hoisted values, shaped for kernels: rows (B', H', sq, 1), cols (B', H', 1, skv).

    ``diags`` (B', H', 1, ``diag_window(g).size``) hold the diagonal values (TPU only).
    """

    rows: tuple
    cols: tuple
    arrays: tuple
    diags: tuple = ()


def run_prologue(cm: CompiledMod | None, consts, g: Geom) -> Prologue:
    if cm is None:
        return Prologue((), (), ())
    rows, cols, arrays = cm.prologue(consts, g.B, g.Hq, g.q_len, g.kv_len, g.sq, g.skv)
    diags = ()
    if cm.diags:
        win = diag_window(g)
        diags = tuple(d[..., None, :] for d in cm.diagonals(consts, g.B, g.Hq, g.q_len, g.kv_len, win.offset,
                                                              win.size))
    return Prologue(tuple(r[..., None] for r in rows), tuple(c[..., None, :] for c in cols), tuple(arrays),
                    diags)


def prologues(mods: Mods, score_consts, mask_consts, g: Geom):
    return run_prologue(mods.score, score_consts, g), run_prologue(mods.mask, mask_consts, g)


def is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def score_const_grads(cm: CompiledMod | None, consts, g: Geom, d_rows, d_cols, d_arrays):
    """Pulls the kernels' gradients of hoisted values and arrays back to the captured arrays.

    ``d_rows`` / ``d_cols`` are (B, Hq, sq, 1) / (B, Hq, 1, skv) per float row / col (None
    for the others); ``d_rows`` continues with one (B, Hq, 1, ``diag_window(g).size``) per
    diagonal value (None for non-float ones), as kernel tiles carry diagonals with the rows.
    ``d_arrays`` holds each float array's gradient (None for the others).
    Returns a tuple with one entry per captured array: its gradient, or None if integer.
    """
    consts = tuple(consts)
    if cm is None or not consts:
        return tuple(None for _ in consts)
    float_idx = [n for n, c in enumerate(consts) if is_float(c)]
    if not float_idx:
        return tuple(None for _ in consts)

    def prologue(fconsts):
        cs = list(consts)
        for n, c in zip(float_idx, fconsts):
            cs[n] = c
        p = run_prologue(cm, cs, g)
        return (tuple(x for x in (*p.rows, *p.diags) if is_float(x)), tuple(x for x in p.cols if is_float(x)),
                tuple(x for x in p.arrays if is_float(x)))

    (rows, cols, arrays), vjp = jax.vjp(prologue, tuple(consts[n] for n in float_idx))

    def fit(d, like):
        # Rows shared over b or h (size 1 there) receive the sum over that axis.
        axes = tuple(a for a in (0, 1) if like.shape[a] == 1 and d.shape[a] != 1)
        return d.sum(axes, keepdims=True).astype(like.dtype)

    ct = (tuple(fit(d, x) for d, x in zip([d for d in d_rows if d is not None], rows)),
          tuple(fit(d, x) for d, x in zip([d for d in d_cols if d is not None], cols)),
          tuple(d.astype(x.dtype) for d, x in zip([d for d in d_arrays if d is not None], arrays)))
    (grads,) = vjp(ct)
    out = [None] * len(consts)
    for n, d in zip(float_idx, grads):
        out[n] = d.astype(consts[n].dtype)
    return tuple(out)
