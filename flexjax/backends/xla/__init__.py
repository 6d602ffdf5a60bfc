"""The xla backend: block-sparse FlashAttention-2 forward and backward in pure JAX.

Visits only the non-empty tiles of the BlockMask (coarsened to compute tiles that are
multiples of its blocks), applies mask_mod only on partial tiles, keeps an online
softmax in float32 (float64 for float64 inputs) and never materializes a (q_len, kv_len) array. Dao, "FlashAttention-2"
(https://arxiv.org/abs/2307.08691) gives the algorithm.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ... import _dropout
from .. import _softmax, current_platform
from .._common import acc_dtype, allowed, apply_score_mod, coarse_lists
from .._contract import Implementation, Residuals, TileLists, always, planned, planner

NAME = "xla"


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Tile sizes of the xla backend; each must be a multiple of the BlockMask's block.

    Attributes:
      block_q: forward q tile (rows of one compute step).
      block_kv: forward kv tile.
      bwd_block_q: backward q tile.
      bwd_block_kv: backward kv tile (the dK/dV accumulator of one outer step).
    """

    block_q: int | None = None
    block_kv: int | None = None
    bwd_block_q: int | None = None
    bwd_block_kv: int | None = None


_FIELDS = tuple(f.name for f in dataclasses.fields(KernelOptions))
# kernel_options that are not tiles: ``cpu_kernel=False`` runs the forward's XLA loops even
# where the C++ kernel (backends/xla/cpu) could serve it.
SWITCHES = ("cpu_kernel",)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# The band forward maps over q tiles two at a time (vmapped pairs): fewer loop steps, each
# twice as large; measured 70 vs 77 ms on sliding window 256 at S=8192 (1, 3, 4 were slower).
_BAND_BATCH = 2

# Masks whose q blocks attend to at most this many kv positions (first to last non-empty
# tile) run the band forward: one contiguous kv slice per q tile, one matmul, no loop.
# Sliding window 256 at S=8192 (band 384): 63 ms against 69 ms for 128x128 loops. Wider
# bands compute ever more masked pairs per slice: 4 causal documents of 1024 (band 1024)
# were no faster than 512x256 loops, so they stay on the loops.
_BAND_MAX = 512


def heuristics(platform: str, block_size: tuple[int, int], q_len: int, kv_len: int,
               kv_band: int | None) -> KernelOptions:
    """Default tiles for ``platform`` (this backend's numbers were measured on a 2-core CPU).

    ``kv_band`` is the widest kv range a q block attends to (known when the BlockMask is
    concrete; None when it is traced, and then the dense default is used).
    """
    bq, bkv = block_size
    if kv_band is not None and kv_band <= _BAND_MAX:
        # Band-like masks (sliding window, short documents): big tiles would mostly
        # compute masked pairs; ~128-row tiles waste least.
        fq, fk = max(1, 128 // bq), max(1, 128 // bkv)
    else:
        # f32, D=64: q 512 x kv 256 reached ~200 effective GFLOP/s on causal S=4096
        # (DESIGN.md); smaller tiles pay ~tens of us per loop step.
        fq, fk = max(1, 512 // bq), max(1, 256 // bkv)
    tq = min(bq * fq, _round_up(q_len, bq))
    tk = min(bkv * fk, _round_up(kv_len, bkv))
    return KernelOptions(block_q=tq, block_kv=tk, bwd_block_q=tq, bwd_block_kv=tk)


def _resolve(spec) -> tuple[KernelOptions, int | None]:
    """The tiles for ``spec`` and, when the forward runs as a band, its kv width."""
    opts = spec.options
    default = heuristics(current_platform(), spec.block_size, spec.q_len, spec.kv_len, spec.kv_band)
    values = {f: opts.get(f) or getattr(default, f) for f in _FIELDS}
    band = None
    if spec.kv_band is not None and spec.kv_band <= _BAND_MAX and "block_q" not in opts and "block_kv" not in opts:
        # kv_band is measured per mask block row, so the band forward's q tiles are
        # exactly the mask's q blocks (a coarser tile could span a wider kv range).
        band = spec.kv_band
        values["block_q"], values["block_kv"] = spec.block_size
    return KernelOptions(**values), band


def validate_options(spec) -> None:
    """Raises ValueError for an invalid value of one of this backend's kernel_options."""
    opts = spec.options
    if not isinstance(opts.get("cpu_kernel", True), bool):
        raise ValueError(f"kernel_options['cpu_kernel'] must be a bool, got {opts['cpu_kernel']!r}")
    bq, bkv = spec.block_size
    for f in _FIELDS:
        val = opts.get(f)
        if val is None:
            continue
        base = bq if f.endswith("block_q") else bkv
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val <= 0 or val % base:
            raise ValueError(
                f"kernel_options[{f!r}] must be a positive multiple of the BlockMask's "
                f"block ({base}), got {val!r}"
            )


def resolve(spec, q, k, v) -> tuple[KernelOptions, int | None] | str:
    """The tiles and the band width (``_resolve``): the xla backend serves every call with its own
    kernel_options."""
    unknown = sorted(set(spec.options) - set(_FIELDS) - set(SWITCHES))
    if unknown:
        return f"unknown kernel_options {unknown} for the xla backend; it takes {[*_FIELDS, *SWITCHES]}"
    return _resolve(spec)


plan = planner(__name__)


def _band_reason(spec, options, **_) -> str | None:
    if options[1] is None:
        return (f"the mask's widest kv range ({spec.kv_band}) is unknown or above {_BAND_MAX}, or forward tiles "
                "were given")
    return None


def _cpu_reason(spec, q, k, v, score_consts, mask_consts, dropout_seed, **_) -> str | None:
    from . import cpu  # the C++ kernel (AVX-512 CPUs with a C++ compiler)
    return cpu.reason(spec, q, k, v, score_consts, mask_consts, dropout_seed)


def _cpu_backward_reason(spec, q, k, v, score_consts, mask_consts, dropout_seed, grad_consts, **_) -> str | None:
    from . import cpu
    return cpu.backward_reason(spec, q, k, v, score_consts, mask_consts, grad_consts, dropout_seed)


def _decode_reason(spec, q, **_) -> str | None:
    from . import _decode  # few queries (Sq <= 64): GQA rows packed, KV chunks merged by lse
    return _decode.reason(spec, q)


# The ways this backend serves each pass, in the order they are tried (``_contract.make_plan``).
# The C++ kernel's primitive lowers to the next implementation that serves where it cannot be called
# (``jax.export``, another platform): ``Plan.forward_fallback`` / ``backward_fallback``.
FORWARD = (
    Implementation("cpu_kernel", _cpu_reason, fallback=True),   # one fused C++ call (backends/xla/cpu)
    Implementation("decode", _decode_reason),    # few queries: GQA rows packed, kv chunks merged by lse
    Implementation("band", _band_reason),        # one contiguous kv slice per q tile, no loop
    Implementation("loops", always),             # a loop over each q tile's kv tiles
)
BACKWARD = (
    Implementation("cpu_kernel", _cpu_backward_reason, fallback=True),
    Implementation("loops", always),
)
# The forward over paged KV pools (``flexjax.paged``): the C++ kernel reads each tile from its
# page in place; else the decode path gathers the tiles it reads through the page table.
PAGED_FORWARD = (
    Implementation("cpu_kernel", _cpu_reason, fallback=True),
    Implementation("decode", always),
)


def supports_paged(spec, q, k, v, lists, options) -> str | None:
    """None: the xla backend serves every paged call (``k`` / ``v`` stand for the logical cache)."""
    return None


def ragged_rows(dtype, kernel_options: dict) -> int:
    """Query rows (heads x tokens) a ragged call packs in a tile: 128."""
    return 128


def supports_quantized(spec, q, pages, options) -> str | None:
    """None: int8 and float8_e4m3fn pools are dequantized as their tiles are read."""
    return None


def paged_forward(spec, q, k_pages, v_pages, page_table, score_consts, mask_consts, lists, scales=None, *, plan):
    """``forward_with_residuals`` over page pools (num_pages, page_size, Hkv, .) and a page
    table (B, max_pages), by ``plan.forward``; ``spec.kv_len`` is max_pages * page_size. ``scales``: a
    quantized pool's (k_scale, v_scale), float32 (num_pages, Hkv)."""
    if plan.forward == "cpu_kernel":
        from . import cpu
        return cpu.paged_forward(spec, q, k_pages, v_pages, page_table, score_consts, mask_consts, lists,
                                 _decode_paged_forward, scales=scales)
    return _decode_paged_forward(spec, q, k_pages, v_pages, page_table, score_consts, mask_consts, lists, scales)


def _decode_paged_forward(spec, q, k_pages, v_pages, page_table, score_consts, mask_consts, lists, scales=None):
    from . import _decode
    return _decode.forward_with_residuals(spec, q, k_pages, v_pages, score_consts, mask_consts, lists,
                                          page_table=page_table, scales=scales)


# -- tiles ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Geom:
    tq: int
    tk: int
    nq: int  # q tiles after padding
    nk: int  # kv tiles after padding
    q_len: int
    kv_len: int


def _pad_seq(x, n, axis=-2):
    """Pads ``axis`` (a sequence axis) of x to length n with zeros."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n - x.shape[axis])
    return jnp.pad(x, pad)


def _heads_major(x, hkv):
    """(B, S, H, D) -> (B, Hkv, H // Hkv, S, D) in the accumulation dtype."""
    B, S, H, D = x.shape
    return jnp.transpose(x.astype(acc_dtype(x.dtype)), (0, 2, 1, 3)).reshape(B, hkv, H // hkv, S, D)


def _tile_indices(g, i, j):
    """Global (q_idx (tq, 1), kv_idx (1, tk)) clamped into range, and their validity."""
    qi = i * g.tq + jnp.arange(g.tq, dtype=jnp.int32)[:, None]
    ki = j * g.tk + jnp.arange(g.tk, dtype=jnp.int32)[None, :]
    return (jnp.minimum(qi, g.q_len - 1), jnp.minimum(ki, g.kv_len - 1), qi < g.q_len, ki < g.kv_len)


def _slice(x, start, size, axis):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _heads_apart() -> bool:
    """Whether tiles keep batch and heads as two matmul batch axes (else one merged axis).

    Under a mesh with Auto axes (``jax.set_mesh``) GSPMD partitions the traced program,
    and a merged (Bs * Hs) axis is no tiling it can express for head-sharded inputs: it
    would all-gather every head onto every device. Elsewhere the merged axis is faster
    (causal S=4096 forward on XLA:CPU: ~205-213 ms merged against ~220-230 ms apart).
    """
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and any(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def _row_lead(lead) -> tuple[int, ...]:
    """The matmul batch axes of a tile with leading axes ``lead = (Bs, Hs, Gs)``."""
    return tuple(lead[:2]) if _heads_apart() else (lead[0] * lead[1],)


def _rows(x, lead):
    """(Bs, Hs, [Gs,] a, b) tile -> (*row_lead, [Gs *] a, b): a free reshape of a fresh slice."""
    return x.reshape(_row_lead(lead) + (-1,) + x.shape[-1:])


def _bmm(a, b):
    """(*N, M, K) @ (*N, K, P) -> (*N, M, P) in the operands' (accumulation) dtype.

    Every matmul here is laid out so the contraction is a's last axis and b's
    second-to-last: XLA:CPU then calls its matmul directly instead of first transposing
    a (tq, tk)-sized tile (measured: those copies cost more than the matmuls).
    """
    batch = tuple(range(a.ndim - 2))
    return jax.lax.dot_general(a, b, (((a.ndim - 1,), (a.ndim - 2,)), (batch, batch)),
                               preferred_element_type=a.dtype)


class _Tile:
    """Index arguments and the mask of tile (i, j), shaped (Bs, Hs, Gs, tq, tk)."""

    def __init__(self, spec, g, mask_consts, b_ids, h_ids, i, j, masked):
        self.q_idx, self.kv_idx, q_ok, kv_ok = _tile_indices(g, i, j)
        self.b = b_ids[:, None, None, None, None]
        self.h = h_ids[None, :, :, None, None]
        self.ok = allowed(spec, mask_consts, self.b, self.h, self.q_idx, self.kv_idx, q_ok, kv_ok) if masked else None

    def score_mod(self, spec, consts, s):
        return apply_score_mod(spec, consts, s, self.b, self.h, self.q_idx, self.kv_idx)

    def dropout(self, spec, seed, p):
        """``p`` with dropout applied (kept entries scaled by 1 / (1 - rate)); ``p`` itself at rate 0."""
        return _dropped(spec, seed, p, self.b, self.h, self.q_idx, self.kv_idx)


def _dropped(spec, seed, p, b, h, q_idx, kv_idx):
    """``p`` times the dropout keep mask of (b, h, q_idx, kv_idx) over ``1 - rate`` (no-op at rate 0)."""
    if spec.dropout_rate == 0:
        return p
    keep = _dropout.keep_mask(seed, b, h, q_idx, kv_idx, spec.dropout_rate)
    return jnp.where(keep, p * (1.0 / (1.0 - spec.dropout_rate)), 0.0)


# -- forward -------------------------------------------------------------------------------

def _fwd_core(spec, g, score_consts, mask_consts, qt, kT, vt, lists, b_ids, h_ids, seed=None):
    """Forward for one group of (batch, head) rows that share their tile lists.

    qt: (Bs, Hs, Gs, Sq_pad, D); kT: (Bs, Hs, D, Skv_pad); vt: (Bs, Hs, Skv_pad, Dv);
    lists: coarse tile lists of this group, (nQ,) / (nQ, nKV). Returns out (Bs, Hs, Gs,
    Sq_pad, Dv) and the row stats (lse, max, sum: ``Residuals``'), each (Bs, Hs, Gs, Sq_pad), in qt's dtype.
    """
    kv_n, kv_i, fkv_n, fkv_i = lists.by_q
    lead = qt.shape[:3]
    dv = vt.shape[-1]
    tile_shape = lead + (g.tq, g.tk)
    dt = qt.dtype

    def q_tile(i):
        q_i = _rows(_slice(qt, i * g.tq, g.tq, 3), lead)

        def step(masked, idx_list):
            def body(t, carry):
                m, l, acc = carry
                j = idx_list[t]
                tile = _Tile(spec, g, mask_consts, b_ids, h_ids, i, j, masked)
                s = _bmm(q_i, _rows(_slice(kT, j * g.tk, g.tk, 3), lead))
                s = tile.score_mod(spec, score_consts, s.reshape(tile_shape))
                if masked:
                    s = jnp.where(tile.ok, s, _softmax.MASK_VALUE)
                m_new, l, p, alpha = _softmax.step(m, l, s)
                pv = _bmm(_rows(tile.dropout(spec, seed, p), lead), _rows(_slice(vt, j * g.tk, g.tk, 2), lead))
                acc = acc * alpha[..., None] + pv.reshape(acc.shape)
                return m_new, l, acc

            return body

        carry = (*_softmax.start(lead + (g.tq,), dt), jnp.zeros(lead + (g.tq, dv), dt))
        carry = jax.lax.fori_loop(0, kv_n[i], step(True, kv_i[i]), carry)
        carry = jax.lax.fori_loop(0, fkv_n[i], step(False, fkv_i[i]), carry)
        m, l, acc = carry
        out = acc / jnp.where(l > 0, l, 1.0)[..., None]
        return out, (_softmax.lse_of(m, l), *Residuals.from_running(m, l))

    return _q_major(jax.lax.map(q_tile, jnp.arange(g.nq, dtype=jnp.int32)), lead)


def _q_major(tiles, lead):
    """(nQ, Bs, Hs, Gs, tq, ...) per-q-tile results -> (Bs, Hs, Gs, nQ * tq, ...)."""
    def one(x):
        x = jnp.moveaxis(x, 0, 3)
        return x.reshape(lead + (-1,) + x.shape[5:])

    return jax.tree.map(one, tiles)


def _fwd_band_core(spec, g, width, score_consts, mask_consts, qt, kT, vt, lists, b_ids, h_ids, seed=None):
    """Forward for band-like masks: each q tile attends one contiguous kv slice.

    The slice starts at the q tile's first non-empty kv tile and is ``width`` positions
    long, which covers every non-empty tile (``width`` is the mask's widest band); the
    mask_mod decides inside it. One matmul pair per q tile and a plain softmax replace
    the loop over tiles, whose per-step cost dominates for narrow bands.
    Shapes as in ``_fwd_core``; kT and vt are padded to at least ``width``.
    """
    kv_n, kv_i, fkv_n, fkv_i = lists.by_q
    lead = qt.shape[:3]
    skv_pad = kT.shape[-1]
    nkv = g.nk  # the lists may be narrower than nKV: any index past the last tile marks 'none'

    def q_tile(i):
        first = jnp.minimum(jnp.where(kv_n[i] > 0, kv_i[i, 0], nkv), jnp.where(fkv_n[i] > 0, fkv_i[i, 0], nkv))
        start = jnp.clip(first * g.tk, 0, skv_pad - width)
        q_idx = i * g.tq + jnp.arange(g.tq, dtype=jnp.int32)[:, None]
        kv_idx = start + jnp.arange(width, dtype=jnp.int32)[None, :]
        b = b_ids[:, None, None, None, None]
        h = h_ids[None, :, :, None, None]
        q_c, kv_c = jnp.minimum(q_idx, g.q_len - 1), jnp.minimum(kv_idx, g.kv_len - 1)
        ok = allowed(spec, mask_consts, b, h, q_c, kv_c, q_idx < g.q_len, kv_idx < g.kv_len)
        ok = ok & (kv_n[i] + fkv_n[i] > 0)
        s = _bmm(_rows(_slice(qt, i * g.tq, g.tq, 3), lead), _rows(_slice(kT, start, width, 3), lead))
        s = apply_score_mod(spec, score_consts, s.reshape(lead + (g.tq, width)), b, h, q_c, kv_c)
        s = jnp.where(ok, s, _softmax.MASK_VALUE)
        m, l, p, _ = _softmax.step(*_softmax.start(s.shape[:-1], s.dtype), s)
        p = _dropped(spec, seed, p, b, h, q_c, kv_c)
        pv = _bmm(_rows(p, lead), _rows(_slice(vt, start, width, 2), lead)).reshape(lead + (g.tq, -1))
        return pv / jnp.where(l > 0, l, 1.0)[..., None], (_softmax.lse_of(m, l), *Residuals.from_running(m, l))

    return _q_major(jax.lax.map(q_tile, jnp.arange(g.nq, dtype=jnp.int32), batch_size=_BAND_BATCH), lead)


# -- backward ------------------------------------------------------------------------------

def _bwd_core(spec, g, score_consts, grad_consts, mask_consts, qt, kT, kt, vT, dot, qT, doT, row_max, log_sum,
              delta, lists, b_ids, h_ids, seed=None):
    """dq, dk, dv and score-const gradients for one group of rows sharing tile lists.

    qt, dot: (Bs, Hs, Gs, Sq_pad, D / Dv) and their transposes qT, doT (Bs, Hs, Gs, D / Dv,
    Sq_pad); kT, vT: (Bs, Hs, D / Dv, Skv_pad); kt: (Bs, Hs, Skv_pad, D); row_max, log_sum, delta: (Bs,
    Hs, Gs, Sq_pad). Walks kv tiles in order and, for each,
    its q tiles (transposed lists), carrying the tile's dK^T/dV^T; dQ accumulates into a
    carried array. Sequential, so deterministic.
    """
    q_n, q_i, fq_n, fq_i = lists.by_kv
    float_idx = [n for n, want in enumerate(grad_consts) if want]
    lead = qt.shape[:3]
    d, dv_dim = qt.shape[-1], dot.shape[-1]
    tile_shape = lead + (g.tq, g.tk)

    def with_float(consts_f):
        consts = list(score_consts)
        for n, c in zip(float_idx, consts_f):
            consts[n] = c
        return tuple(consts)

    def kv_tile(j, carry):
        dq, dkT_all, dvT_all, dconsts = carry
        kT_j = _rows(_slice(kT, j * g.tk, g.tk, 3), lead)
        vT_j = _rows(_slice(vT, j * g.tk, g.tk, 3), lead)
        k_j = _rows(_slice(kt, j * g.tk, g.tk, 2), lead)

        def step(masked, idx_list):
            def body(t, inner):
                dq, dkT, dvT, dconsts = inner
                i = idx_list[t]
                tile = _Tile(spec, g, mask_consts, b_ids, h_ids, i, j, masked)
                q_blk = _slice(qt, i * g.tq, g.tq, 3)
                do_blk = _slice(dot, i * g.tq, g.tq, 3)
                max_i = _slice(row_max, i * g.tq, g.tq, 3)
                log_sum_i = _slice(log_sum, i * g.tq, g.tq, 3)
                delta_i = _slice(delta, i * g.tq, g.tq, 3)
                s_raw = _bmm(_rows(q_blk, lead), kT_j).reshape(tile_shape)
                consts_f = tuple(score_consts[n] for n in float_idx)
                s, mod_vjp = jax.vjp(lambda s_, c_: tile.score_mod(spec, with_float(c_), s_), s_raw, consts_f)
                p = jnp.exp((s - max_i[..., None]) - log_sum_i[..., None])
                if masked:
                    p = jnp.where(tile.ok, p, 0.0)
                p_rows = _rows(tile.dropout(spec, seed, p), lead)
                # (Gs, tq) must be adjacent for the transposed operands: a real copy only
                # for GQA groups (Gs > 1), a free reshape otherwise.
                doT_i = jnp.moveaxis(_slice(doT, i * g.tq, g.tq, 4), 2, 3).reshape(_row_lead(lead) + (dv_dim, -1))
                dvT = dvT + _bmm(doT_i, p_rows)
                dp = tile.dropout(spec, seed, _bmm(_rows(do_blk, lead), vT_j).reshape(tile_shape))
                ds = p * (dp - delta_i[..., None])
                ds_raw, dc = mod_vjp(ds)
                ds_rows = _rows(ds_raw, lead)
                qT_i = jnp.moveaxis(_slice(qT, i * g.tq, g.tq, 4), 2, 3).reshape(_row_lead(lead) + (d, -1))
                dkT = dkT + _bmm(qT_i, ds_rows)
                dq_i = _bmm(ds_rows, k_j).reshape(lead + (g.tq, d))
                dq = jax.lax.dynamic_update_slice_in_dim(dq, _slice(dq, i * g.tq, g.tq, 3) + dq_i, i * g.tq, axis=3)
                dconsts = tuple(a + b for a, b in zip(dconsts, dc))
                return dq, dkT, dvT, dconsts

            return body

        inner = (dq, jnp.zeros(_row_lead(lead) + (d, g.tk), qt.dtype),
                 jnp.zeros(_row_lead(lead) + (dv_dim, g.tk), qt.dtype), dconsts)
        inner = jax.lax.fori_loop(0, q_n[j], step(True, q_i[j]), inner)
        inner = jax.lax.fori_loop(0, fq_n[j], step(False, fq_i[j]), inner)
        dq, dkT_j, dvT_j, dconsts = inner
        dkT_all = jax.lax.dynamic_update_slice_in_dim(dkT_all, dkT_j.reshape(lead[:2] + (d, g.tk)), j * g.tk, axis=3)
        dvT_all = jax.lax.dynamic_update_slice_in_dim(dvT_all, dvT_j.reshape(lead[:2] + (dv_dim, g.tk)),
                                                      j * g.tk, axis=3)
        return dq, dkT_all, dvT_all, dconsts

    init = (jnp.zeros(qt.shape, qt.dtype), jnp.zeros(kT.shape, qt.dtype),
            jnp.zeros(vT.shape, qt.dtype),
            tuple(jnp.zeros(score_consts[n].shape, jnp.promote_types(qt.dtype, score_consts[n].dtype))
                  for n in float_idx))
    dq, dkT, dvT, dconsts = jax.lax.fori_loop(0, g.nk, kv_tile, init)
    return dq, dkT, dvT, dconsts


# -- batching over rows whose tile lists differ -------------------------------------------

def _vmap_group_axis(f, q_axis: int, kv_axis: int | None, b_axis: int | None, h_axis: int | None):
    """vmaps ``f`` over one (batch / kv-head / query-head) axis of the row groups.

    ``f`` keeps seeing that axis with size 1 (it is re-inserted around the call). Axes:
    ``q_axis`` of qt, the per-query-row arrays and the lists; ``kv_axis`` of the k/v
    arrays (None: k/v are shared, e.g. the query heads of one kv head, and their
    outputs are summed over the vmapped axis); ``b_axis`` / ``h_axis`` of b_ids / h_ids.
    Global outputs (captured-array gradients) are summed over the vmapped axis.
    """

    def ex(x, axis):
        return x if axis is None else jnp.expand_dims(x, axis)

    def sq(x, axis):
        return x if axis is None else jnp.squeeze(x, axis)

    def inner(qt, kv, qrows, lists, b_ids, h_ids):
        qo, kvo, go = f(ex(qt, q_axis), tuple(ex(x, kv_axis) for x in kv), tuple(ex(x, q_axis) for x in qrows),
                        tuple(ex(x, q_axis) for x in lists), ex(b_ids, b_axis), ex(h_ids, h_axis))
        return tuple(sq(x, q_axis) for x in qo), tuple(sq(x, kv_axis) for x in kvo), go

    vm = jax.vmap(inner, in_axes=(q_axis, kv_axis, q_axis, q_axis, b_axis, h_axis),
                  out_axes=(q_axis, 0 if kv_axis is None else kv_axis, 0))

    def outer(*args):
        qo, kvo, go = vm(*args)
        if kv_axis is None:
            # dK/dV of a kv head sum over its query heads.
            kvo = tuple(x.sum(0) for x in kvo)
        return qo, kvo, tuple(x.sum(0) for x in go)

    return outer


def _run_groups(core, batch_shared, head_shared, qt, kv, qrows, lists, b_ids, h_ids):
    """Runs ``core`` once per group of (batch, head) rows with their own tile lists.

    Rows that share lists (a BlockMask with B or H of 1) stay inside ``core`` and are
    batched into its matmuls; the others are vmapped. ``core(qt, kv, qrows, lists, b_ids,
    h_ids)`` sees qt (Bs, Hs, Gs, Sq, D), kv arrays (Bs, Hs, Skv, .), qrows like qt,
    lists with a leading (1, 1, 1), b_ids (Bs,), h_ids (Hs, Gs); it returns (per-query-row
    outputs, per-kv-row outputs, global outputs summed over groups).
    """
    f = core
    if not head_shared:
        # Query heads within a kv group (k/v shared), then kv heads.
        f = _vmap_group_axis(f, q_axis=2, kv_axis=None, b_axis=None, h_axis=1)
        f = _vmap_group_axis(f, q_axis=1, kv_axis=1, b_axis=None, h_axis=0)
    if not batch_shared:
        f = _vmap_group_axis(f, q_axis=0, kv_axis=0, b_axis=0, h_axis=None)
    return f(qt, kv, qrows, lists, b_ids, h_ids)


def _prepare(spec, q, k, lists, options, backward: bool):
    B, Sq, Hq, _ = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    opts, band = options
    if backward:
        band = None
    tq, tk = (opts.bwd_block_q, opts.bwd_block_kv) if backward else (opts.block_q, opts.block_kv)
    g = _Geom(tq=tq, tk=tk, nq=-(-Sq // tq), nk=-(-spec.kv_len // tk), q_len=Sq, kv_len=spec.kv_len)
    coarse = coarse_lists(lists, spec.block_size, tq, tk, Sq, spec.kv_len)
    Bm, Hm = coarse[0].shape[:2]
    batch_shared, head_shared = Bm == 1, Hm == 1
    # Lists as (Bm, Hkv_m, G_m, ...) to line up with the query layout (B, Hkv, G, ...).
    shape = (Bm, 1, 1) if head_shared else (Bm, Hkv, G)
    coarse = TileLists(*(x.reshape(shape + x.shape[2:]) for x in coarse))
    b_ids = jnp.arange(B, dtype=jnp.int32)
    h_ids = jnp.arange(Hq, dtype=jnp.int32).reshape(Hkv, G)
    return g, band, coarse, batch_shared, head_shared, b_ids, h_ids


def forward_with_residuals(spec, q, k, v, score_consts, mask_consts, lists, dropout_seed=None, plan=None):
    """out, lse and, for the backward, each row's ``Residuals`` (B, Hq, Sq), by ``plan.forward``."""
    plan = planned(sys.modules[__name__], plan, spec, q, k, v, score_consts, mask_consts, lists, dropout_seed)
    if plan.forward == "cpu_kernel":
        from . import cpu
        return cpu.forward(spec, q, k, v, score_consts, mask_consts, lists,
                           _Bound(_FORWARDS[plan.forward_fallback], plan.options))
    return _FORWARDS[plan.forward](spec, q, k, v, score_consts, mask_consts, lists, dropout_seed, options=plan.options)


@dataclasses.dataclass(frozen=True)
class _Bound:
    """An XLA implementation with the plan's options, as the C++ primitive's other lowering calls it
    (hashable: a primitive parameter)."""

    run: Callable
    options: tuple

    def __call__(self, *args, **kwargs):
        return self.run(*args, **kwargs, options=self.options)


def _decode_forward(spec, q, k, v, score_consts, mask_consts, lists, dropout_seed=None, *, options):
    from . import _decode
    return _decode.forward_with_residuals(spec, q, k, v, score_consts, mask_consts, lists)


def _loops_forward(spec, q, k, v, score_consts, mask_consts, lists, dropout_seed=None, *, options):
    """``forward_with_residuals`` in XLA ops: a loop over each q tile's kv tiles (or the band forward, where
    ``options`` carry a band width)."""
    g, band, coarse, b_sh, h_sh, b_ids, h_ids = _prepare(spec, q, k, lists, options, backward=False)
    hkv = k.shape[2]
    skv_pad = max(g.nk * g.tk, band or 0)
    # Scaling q once (O(S*D)) instead of every (tq, tk) score tile saves a pass per tile.
    qt = _pad_seq(_heads_major(q, hkv) * spec.scale, g.nq * g.tq)
    kT = _pad_seq(jnp.swapaxes(_heads_major(k, hkv)[:, :, 0], -1, -2), skv_pad, axis=-1)
    vt = _pad_seq(_heads_major(v, hkv)[:, :, 0], skv_pad)

    def core(qt_, kv, qrows, lists_, b_, h_):
        lst = TileLists(*(x[0, 0, 0] for x in lists_))
        if band is not None:
            out, stats = _fwd_band_core(spec, g, band, score_consts, mask_consts, qt_, *kv, lst, b_, h_, dropout_seed)
        else:
            out, stats = _fwd_core(spec, g, score_consts, mask_consts, qt_, *kv, lst, b_, h_, dropout_seed)
        return (out, *stats), (), ()

    (out, *stats), _, _ = _run_groups(core, b_sh, h_sh, qt, (kT, vt), (), coarse, b_ids, h_ids)
    B, Sq, Hq, _ = q.shape
    out = out[..., :Sq, :].reshape(B, Hq, Sq, -1).transpose(0, 2, 1, 3).astype(q.dtype)
    lse, row_max, row_sum = (x[..., :Sq].reshape(B, Hq, Sq) for x in stats)
    return out, lse, Residuals(row_max, row_sum)


# The XLA implementations of ``FORWARD`` by name ("band" is the loops' forward with a band width in its options).
_FORWARDS = {"decode": _decode_forward, "band": _loops_forward, "loops": _loops_forward}


def backward(spec, q, k, v, out, lse, dout, dlse, score_consts, mask_consts, lists, grad_consts, residuals,
             dropout_seed=None, plan=None):
    """dq, dk, dv and the gradients of the captured arrays flagged in ``grad_consts``; None
    for the others, by ``plan.backward_for(grad_consts)``.

    ``residuals``: the ``Residuals`` of ``forward_with_residuals``: P is recomputed from the
    row max and log-sum, since lse alone loses the log-sum on rows whose scores are huge in magnitude.
    """
    plan = planned(sys.modules[__name__], plan, spec, q, k, v, score_consts, mask_consts, lists, dropout_seed)
    if plan.backward_for(grad_consts) == "cpu_kernel":  # dq, dk, dv as one fused C++ call
        from . import cpu
        dq, dk, dv = cpu.backward(spec, q, k, v, out, lse, dout, dlse, score_consts, mask_consts, lists, residuals,
                                  _Bound(_loops_backward, plan.options))
        return dq, dk, dv, (None,) * len(score_consts)
    return _loops_backward(spec, q, k, v, out, lse, dout, dlse, score_consts, mask_consts, lists, grad_consts,
                           residuals, dropout_seed, options=plan.options)


def _loops_backward(spec, q, k, v, out, lse, dout, dlse, score_consts, mask_consts, lists, grad_consts, residuals,
                    dropout_seed=None, *, options):
    """``backward`` in XLA ops: a loop over kv tiles, each over its q tiles."""
    g, _, coarse, b_sh, h_sh, b_ids, h_ids = _prepare(spec, q, k, lists, options, backward=True)
    B, Sq, Hq, D = q.shape
    hkv = k.shape[2]
    sq_pad, skv_pad = g.nq * g.tq, g.nk * g.tk
    # With q pre-scaled, s = (q*scale)·k and dK = dS^T (q*scale) need no per-tile scaling;
    # dQ = scale * dS K is scaled once at the end.
    qt = _pad_seq(_heads_major(q, hkv) * spec.scale, sq_pad)
    kt = _pad_seq(_heads_major(k, hkv)[:, :, 0], skv_pad)
    kT = jnp.swapaxes(kt, -1, -2)
    vT = jnp.swapaxes(_pad_seq(_heads_major(v, hkv)[:, :, 0], skv_pad), -1, -2)
    dot = _pad_seq(_heads_major(dout, hkv), sq_pad)
    # delta = rowsum(dO * O); a cotangent on lse adds P * dlse to dS, i.e. delta - dlse.
    dt = acc_dtype(q.dtype)
    delta = jnp.einsum("bqhd,bqhd->bhq", dout.astype(dt), out.astype(dt)) - dlse
    pad_rows = ((0, 0), (0, 0), (0, 0), (0, sq_pad - Sq))
    # Padded rows get max 0 and log-sum 0; every P there is masked to 0 anyway.
    max_t, log_sum_t = (jnp.pad(x.astype(dt).reshape(B, hkv, Hq // hkv, Sq), pad_rows)
                        for x in residuals.recompute_stats())
    delta_t = jnp.pad(delta.reshape(B, hkv, Hq // hkv, Sq), pad_rows)
    float_idx = [n for n, want in enumerate(grad_consts) if want]

    def core(qt_, kv, qrows, lists_, b_, h_):
        dq, dkT, dvT, dconsts = _bwd_core(spec, g, score_consts, grad_consts, mask_consts, qt_, *kv, *qrows,
                                          TileLists(*(x[0, 0, 0] for x in lists_)), b_, h_, dropout_seed)
        return (dq,), (dkT, dvT), dconsts

    qrows = (dot, jnp.swapaxes(qt, -1, -2), jnp.swapaxes(dot, -1, -2), max_t, log_sum_t, delta_t)
    (dq,), (dkT, dvT), dconsts = _run_groups(core, b_sh, h_sh, qt, (kT, kt, vT), qrows,
                                             coarse, b_ids, h_ids)
    dq = (dq[..., :Sq, :] * spec.scale).reshape(B, Hq, Sq, D).transpose(0, 2, 1, 3).astype(q.dtype)
    dk = dkT[..., : spec.kv_len].transpose(0, 3, 1, 2).astype(k.dtype)
    dv = dvT[..., : spec.kv_len].transpose(0, 3, 1, 2).astype(v.dtype)
    dscore = [None] * len(score_consts)
    for n, dcn in zip(float_idx, dconsts):
        dscore[n] = dcn.astype(score_consts[n].dtype)
    return dq, dk, dv, tuple(dscore)


# -- forward-mode tangent --------------------------------------------------------------------

def _tangent_core(spec, g, score_consts, t_consts, mask_consts, qt, kv, qrows, lists, b_ids, h_ids, seed, has):
    """Tangent of (out, lse) for one group of rows sharing tile lists.

    With P the probabilities (from the saved row max and log-sum), W the dropout weights
    and dS the tangent of the modified scores: dP = P * (dS - mu), mu = rowsum(P * dS) =
    the lse tangent, so d out = (P W dS) V - mu (P W) V + (P W) dV. One pass over each q
    tile's kv list, with the forward's tiles. ``has`` flags which of (dq, dk, dv) exist.
    """
    kT, vt, *kv_t = kv
    tkT = kv_t.pop(0) if has[1] else None
    tvt = kv_t.pop(0) if has[2] else None
    tqt = qrows[0] if has[0] else None
    row_max, log_sum = qrows[-2:]
    kv_n, kv_i, fkv_n, fkv_i = lists.by_q
    float_idx = [n for n, t in enumerate(t_consts) if t is not None]
    lead = qt.shape[:3]
    dv = vt.shape[-1]
    tile_shape = lead + (g.tq, g.tk)
    dt = qt.dtype
    any_ds = has[0] or has[1] or bool(float_idx)

    def with_float(consts_f):
        consts = list(score_consts)
        for n, c in zip(float_idx, consts_f):
            consts[n] = c
        return tuple(consts)

    def q_tile(i):
        q_i = _rows(_slice(qt, i * g.tq, g.tq, 3), lead)
        tq_i = _rows(_slice(tqt, i * g.tq, g.tq, 3), lead) if has[0] else None
        max_i = _slice(row_max, i * g.tq, g.tq, 3)[..., None]
        log_sum_i = _slice(log_sum, i * g.tq, g.tq, 3)[..., None]

        def step(masked, idx_list):
            def body(t, carry):
                acc_o, acc_d, acc_v, mu = carry
                j = idx_list[t]
                tile = _Tile(spec, g, mask_consts, b_ids, h_ids, i, j, masked)
                kT_j = _rows(_slice(kT, j * g.tk, g.tk, 3), lead)
                v_j = _rows(_slice(vt, j * g.tk, g.tk, 2), lead)
                s_raw = _bmm(q_i, kT_j).reshape(tile_shape)
                if any_ds:
                    ds_raw = jnp.zeros(tile_shape, dt)
                    if has[0]:
                        ds_raw = ds_raw + _bmm(tq_i, kT_j).reshape(tile_shape)
                    if has[1]:
                        ds_raw = ds_raw + _bmm(q_i, _rows(_slice(tkT, j * g.tk, g.tk, 3), lead)).reshape(tile_shape)
                    consts_f = tuple(score_consts[n] for n in float_idx)
                    tangents_f = tuple(t_consts[n] for n in float_idx)
                    s, ds = jax.jvp(lambda s_, c_: tile.score_mod(spec, with_float(c_), s_), (s_raw, consts_f),
                                    (ds_raw, tangents_f))
                else:
                    s = tile.score_mod(spec, score_consts, s_raw)
                p = jnp.exp((s - max_i) - log_sum_i)
                if masked:
                    p = jnp.where(tile.ok, p, 0.0)
                pw = tile.dropout(spec, seed, p)
                acc_o = acc_o + _bmm(_rows(pw, lead), v_j).reshape(acc_o.shape)
                if any_ds:
                    # p > 0 guards 0 * inf where a score (and its tangent) is infinite.
                    pds = jnp.where(p > 0, p * ds, 0.0)
                    mu = mu + pds.sum(-1)
                    acc_d = acc_d + _bmm(_rows(jnp.where(p > 0, pw * ds, 0.0), lead), v_j).reshape(acc_d.shape)
                if has[2]:
                    acc_v = acc_v + _bmm(_rows(pw, lead), _rows(_slice(tvt, j * g.tk, g.tk, 2), lead)).reshape(
                        acc_v.shape)
                return acc_o, acc_d, acc_v, mu

            return body

        zeros_o = jnp.zeros(lead + (g.tq, dv), dt)
        carry = (zeros_o, zeros_o, zeros_o, jnp.zeros(lead + (g.tq,), dt))
        carry = jax.lax.fori_loop(0, kv_n[i], step(True, kv_i[i]), carry)
        carry = jax.lax.fori_loop(0, fkv_n[i], step(False, fkv_i[i]), carry)
        acc_o, acc_d, acc_v, mu = carry
        return acc_d - mu[..., None] * acc_o + acc_v, mu

    return _q_major(jax.lax.map(q_tile, jnp.arange(g.nq, dtype=jnp.int32)), lead)


def tangent(spec, q, k, v, out, residuals, score_consts, mask_consts, lists, tq, tk, tv, t_consts,
            dropout_seed=None):
    """Forward-mode tangent (d out, d lse) of flex_attention, blockwise (any backend's forward).

    Args:
      q, k, v, out: the primal inputs and output; residuals: the forward's ``Residuals``.
      tq, tk, tv: tangents of q, k, v, or None (zero); t_consts: one per score_mod
        captured array, None where zero.

    Returns:
      d out (B, Sq, Hq, Dv) and d lse (B, Hq, Sq), in the accumulation dtype.
    """
    del out
    g, _, coarse, b_sh, h_sh, b_ids, h_ids = _prepare(spec, q, k, lists, _resolve(spec), backward=True)
    B, Sq, Hq, _ = q.shape
    hkv = k.shape[2]
    sq_pad, skv_pad = g.nq * g.tq, g.nk * g.tk
    dt = acc_dtype(q.dtype)
    qt = _pad_seq(_heads_major(q, hkv) * spec.scale, sq_pad)
    kT = _pad_seq(jnp.swapaxes(_heads_major(k, hkv)[:, :, 0], -1, -2), skv_pad, axis=-1)
    vt = _pad_seq(_heads_major(v, hkv)[:, :, 0], skv_pad)
    has = (tq is not None, tk is not None, tv is not None)
    kv = [kT, vt]
    if has[1]:
        kv.append(_pad_seq(jnp.swapaxes(_heads_major(tk, hkv)[:, :, 0], -1, -2), skv_pad, axis=-1))
    if has[2]:
        kv.append(_pad_seq(_heads_major(tv, hkv)[:, :, 0], skv_pad))
    pad_rows = ((0, 0), (0, 0), (0, 0), (0, sq_pad - Sq))
    # Rows with no allowed key: max 0 (every P there is masked to 0 anyway).
    qrows = [jnp.pad(x.astype(dt).reshape(B, hkv, Hq // hkv, Sq), pad_rows) for x in residuals.recompute_stats()]
    if has[0]:
        qrows.insert(0, _pad_seq(_heads_major(tq, hkv) * spec.scale, sq_pad))
    t_consts = tuple(None if t is None else t.astype(jnp.promote_types(dt, t.dtype)) for t in t_consts)

    def core(qt_, kv_, qrows_, lists_, b_, h_):
        t_out, t_lse = _tangent_core(spec, g, score_consts, t_consts, mask_consts, qt_, kv_, qrows_,
                                     TileLists(*(x[0, 0, 0] for x in lists_)), b_, h_, dropout_seed, has)
        return (t_out, t_lse), (), ()

    (t_out, t_lse), _, _ = _run_groups(core, b_sh, h_sh, qt, tuple(kv), tuple(qrows), coarse, b_ids, h_ids)
    t_out = t_out[..., :Sq, :].reshape(B, Hq, Sq, -1).transpose(0, 2, 1, 3)
    return t_out, t_lse[..., :Sq].reshape(B, Hq, Sq)
