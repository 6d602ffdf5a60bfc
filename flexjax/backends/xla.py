"""The xla backend: block-sparse FlashAttention-2 forward and backward in pure JAX.

Visits only the non-empty tiles of the BlockMask (coarsened to compute tiles that are
multiples of its blocks), applies mask_mod only on partial tiles, keeps an online
softmax in float32 and never materializes a (q_len, kv_len) array. Dao, "FlashAttention-2"
(https://arxiv.org/abs/2307.08691) gives the algorithm.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .._block_mask import EMPTY, FULL, PARTIAL, BlockMask, lists_from_states
from ._common import MASK_VALUE, ROW_INIT, allowed, apply_score_mod, finish_lse

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


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def heuristics(platform: str, block_size: tuple[int, int], q_len: int, kv_len: int,
               sparse: bool | None) -> KernelOptions:
    """Default tiles for ``platform``.

    ``sparse`` says whether most tiles are empty (known when the BlockMask is concrete;
    None when it is traced, and then the dense-ish default is used).
    """
    bq, bkv = block_size
    if sparse:
        # Band-like masks (sliding window, small documents): big tiles would mostly
        # compute masked pairs; mask-block tiles waste least.
        fq, fk = max(1, 128 // bq), max(1, 128 // bkv)
    else:
        # 2-core CPU, f32, D=64: q 512 x kv 256 reached ~200 effective GFLOP/s on causal
        # S=4096 (DESIGN.md); smaller tiles pay ~tens of us per loop step.
        fq, fk = max(1, 512 // bq), max(1, 256 // bkv)
    tq = min(bq * fq, _round_up(q_len, bq))
    tk = min(bkv * fk, _round_up(kv_len, bkv))
    return KernelOptions(block_q=tq, block_kv=tk, bwd_block_q=tq, bwd_block_kv=tk)


def _resolve(spec) -> KernelOptions:
    opts = spec.options
    default = heuristics(jax.default_backend(), spec.block_size, spec.q_len, spec.kv_len, spec.sparse)
    values = {f: opts.get(f) or getattr(default, f) for f in _FIELDS}
    return KernelOptions(**values)


def unsupported_reason(spec, q, k, v):
    opts = spec.options
    unknown = sorted(set(opts) - set(_FIELDS))
    if unknown:
        return f"unknown kernel_options {unknown} for the xla backend; it takes {list(_FIELDS)}"
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
    return None


# -- tiles ---------------------------------------------------------------------------------

def _coarse_lists(lists, block_size, tq, tk, q_len, kv_len):
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


@dataclasses.dataclass(frozen=True)
class _Geom:
    tq: int
    tk: int
    nq: int  # q tiles after padding
    nk: int  # kv tiles after padding
    q_len: int
    kv_len: int


def _pad_seq(x, n):
    """Pads axis -2 (seq) of x to length n with zeros."""
    pad = [(0, 0)] * x.ndim
    pad[-2] = (0, n - x.shape[-2])
    return jnp.pad(x, pad)


def _to_tiles(q, k, v, g):
    """(B, S, H, D) inputs to (B, Hkv, G, Sq_pad, D) and (B, Hkv, Skv_pad, D), float32."""
    B, Sq, Hq, D = q.shape
    Hkv = k.shape[2]
    qt = jnp.transpose(q.astype(jnp.float32), (0, 2, 1, 3)).reshape(B, Hkv, Hq // Hkv, Sq, D)
    kt = jnp.transpose(k.astype(jnp.float32), (0, 2, 1, 3))
    vt = jnp.transpose(v.astype(jnp.float32), (0, 2, 1, 3))
    return _pad_seq(qt, g.nq * g.tq), _pad_seq(kt, g.nk * g.tk), _pad_seq(vt, g.nk * g.tk)


def _tile_indices(g, i, j):
    """Global (q_idx (tq, 1), kv_idx (1, tk)) clamped into range, and their validity."""
    qi = i * g.tq + jnp.arange(g.tq, dtype=jnp.int32)[:, None]
    ki = j * g.tk + jnp.arange(g.tk, dtype=jnp.int32)[None, :]
    return (jnp.minimum(qi, g.q_len - 1), jnp.minimum(ki, g.kv_len - 1), qi < g.q_len, ki < g.kv_len)


def _slice_seq(x, start, size):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=x.ndim - 2)


def _scores(spec, g, score_consts, mask_consts, qt, kt, b_ids, h_ids, i, j, masked):
    """Raw scores and the score_mod'ed, masked scores of tile (i, j); f32 (..., tq, tk)."""
    s_raw = jnp.einsum("bhgqd,bhkd->bhgqk", qt, kt, preferred_element_type=jnp.float32) * spec.scale
    qi, ki, qv, kv = _tile_indices(g, i, j)
    b = b_ids[:, None, None, None, None]
    h = h_ids[None, :, :, None, None]

    def mod(s, consts):
        return apply_score_mod(spec, consts, s, b, h, qi, ki)

    ok = allowed(spec, mask_consts, b, h, qi, ki, qv, kv) if masked else None
    return s_raw, mod, ok


# -- forward -------------------------------------------------------------------------------

def _fwd_core(spec, g, score_consts, mask_consts, qt, kt, vt, lists, b_ids, h_ids):
    """Forward for one group of (batch, head) rows that share their tile lists.

    qt: (Bs, Hs, Gs, Sq_pad, D); kt, vt: (Bs, Hs, Skv_pad, D); lists: coarse tile lists
    with the (b, h) axes already removed, (nQ,) / (nQ, nKV). Returns out (Bs, Hs, Gs,
    Sq_pad, Dv) and lse (Bs, Hs, Gs, Sq_pad), float32.
    """
    kv_n, kv_i, fkv_n, fkv_i = lists[:4]
    lead = qt.shape[:3]
    dv = vt.shape[-1]

    def q_tile(i):
        q_i = _slice_seq(qt, i * g.tq, g.tq)

        def step(masked, idx_list):
            def body(t, carry):
                m, l, acc = carry
                j = idx_list[t]
                k_j = _slice_seq(kt, j * g.tk, g.tk)
                v_j = _slice_seq(vt, j * g.tk, g.tk)
                s_raw, mod, ok = _scores(spec, g, score_consts, mask_consts, q_i, k_j, b_ids, h_ids, i, j, masked)
                s = mod(s_raw, score_consts)
                if masked:
                    s = jnp.where(ok, s, MASK_VALUE)
                m_new = jnp.maximum(m, s.max(-1))
                # m starts at ROW_INIT > MASK_VALUE, so excluded pairs give exp(<= -1e38) = 0
                # even in rows with no allowed key yet, with no -inf arithmetic (which was
                # measured 2x slower here) and no NaN.
                p = jnp.exp(s - m_new[..., None])
                alpha = jnp.exp(m - m_new)
                l = l * alpha + p.sum(-1)
                acc = acc * alpha[..., None] + jnp.einsum(
                    "bhgqk,bhkd->bhgqd", p, v_j, preferred_element_type=jnp.float32)
                return m_new, l, acc

            return body

        carry = (jnp.full(lead + (g.tq,), ROW_INIT, jnp.float32),
                 jnp.zeros(lead + (g.tq,), jnp.float32),
                 jnp.zeros(lead + (g.tq, dv), jnp.float32))
        carry = jax.lax.fori_loop(0, kv_n[i], step(True, kv_i[i]), carry)
        carry = jax.lax.fori_loop(0, fkv_n[i], step(False, fkv_i[i]), carry)
        m, l, acc = carry
        out = acc / jnp.where(l > 0, l, 1.0)[..., None]
        lse = finish_lse(m, l)
        return out, lse

    outs, lses = jax.lax.map(q_tile, jnp.arange(g.nq, dtype=jnp.int32))
    # (nQ, Bs, Hs, Gs, tq, ...) -> (Bs, Hs, Gs, nQ * tq, ...)
    out = jnp.moveaxis(outs, 0, 3).reshape(lead + (g.nq * g.tq, dv))
    lse = jnp.moveaxis(lses, 0, 3).reshape(lead + (g.nq * g.tq,))
    return out, lse


# -- backward ------------------------------------------------------------------------------

def _bwd_core(spec, g, score_consts, mask_consts, qt, kt, vt, dot, lse, delta, lists, b_ids, h_ids):
    """dq, dk, dv and score-const gradients for one group of rows sharing tile lists.

    Walks kv tiles in order; for each, its q tiles (transposed lists) carrying the
    tile's dK/dV; dQ accumulates into a carried array. Sequential, so deterministic.
    """
    q_n, q_i, fq_n, fq_i = lists[4:]
    float_idx = [n for n, c in enumerate(score_consts) if jnp.issubdtype(c.dtype, jnp.inexact)]
    lead = qt.shape[:3]
    d, dv_dim = qt.shape[-1], vt.shape[-1]
    lse_safe = jnp.where(lse == -jnp.inf, 0.0, lse)

    def with_float(consts_f):
        consts = list(score_consts)
        for n, c in zip(float_idx, consts_f):
            consts[n] = c
        return tuple(consts)

    def kv_tile(j, carry):
        dq, dk_all, dv_all, dconsts = carry
        k_j = _slice_seq(kt, j * g.tk, g.tk)
        v_j = _slice_seq(vt, j * g.tk, g.tk)

        def step(masked, idx_list):
            def body(t, inner):
                dq, dk, dv, dconsts = inner
                i = idx_list[t]
                q_i = _slice_seq(qt, i * g.tq, g.tq)
                do_i = _slice_seq(dot, i * g.tq, g.tq)
                lse_i = jax.lax.dynamic_slice_in_dim(lse_safe, i * g.tq, g.tq, axis=3)
                delta_i = jax.lax.dynamic_slice_in_dim(delta, i * g.tq, g.tq, axis=3)
                s_raw, mod, ok = _scores(spec, g, score_consts, mask_consts, q_i, k_j, b_ids, h_ids, i, j, masked)
                consts_f = tuple(score_consts[n] for n in float_idx)
                s, mod_vjp = jax.vjp(lambda s_, c_: mod(s_, with_float(c_)), s_raw, consts_f)
                p = jnp.exp(s - lse_i[..., None])
                if masked:
                    p = jnp.where(ok, p, 0.0)
                dv = dv + jnp.einsum("bhgqk,bhgqd->bhkd", p, do_i, preferred_element_type=jnp.float32)
                dp = jnp.einsum("bhgqd,bhkd->bhgqk", do_i, v_j, preferred_element_type=jnp.float32)
                ds = p * (dp - delta_i[..., None])
                ds_raw, dc = mod_vjp(ds)
                ds_raw = ds_raw * spec.scale
                dk = dk + jnp.einsum("bhgqk,bhgqd->bhkd", ds_raw, q_i, preferred_element_type=jnp.float32)
                dq_i = jnp.einsum("bhgqk,bhkd->bhgqd", ds_raw, k_j, preferred_element_type=jnp.float32)
                dq = jax.lax.dynamic_update_slice_in_dim(
                    dq, _slice_seq(dq, i * g.tq, g.tq) + dq_i, i * g.tq, axis=3)
                dconsts = tuple(a + b for a, b in zip(dconsts, dc))
                return dq, dk, dv, dconsts

            return body

        inner = (dq, jnp.zeros(lead[:2] + (g.tk, d), jnp.float32),
                 jnp.zeros(lead[:2] + (g.tk, dv_dim), jnp.float32), dconsts)
        inner = jax.lax.fori_loop(0, q_n[j], step(True, q_i[j]), inner)
        inner = jax.lax.fori_loop(0, fq_n[j], step(False, fq_i[j]), inner)
        dq, dk_j, dv_j, dconsts = inner
        dk_all = jax.lax.dynamic_update_slice_in_dim(dk_all, dk_j, j * g.tk, axis=2)
        dv_all = jax.lax.dynamic_update_slice_in_dim(dv_all, dv_j, j * g.tk, axis=2)
        return dq, dk_all, dv_all, dconsts

    init = (jnp.zeros(qt.shape, jnp.float32), jnp.zeros(kt.shape, jnp.float32),
            jnp.zeros(vt.shape, jnp.float32),
            tuple(jnp.zeros(score_consts[n].shape, jnp.float32) for n in float_idx))
    dq, dk, dv, dconsts = jax.lax.fori_loop(0, g.nk, kv_tile, init)
    return dq, dk, dv, dconsts


# -- batching over rows whose tile lists differ -------------------------------------------

def _over_g(f):
    """vmaps ``f`` over query heads within a kv group (k/v are not batched)."""

    def inner(qt, kv, qrows, lists, b_ids, h_ids):
        qo, kvo, go = f(qt[:, :, None], kv, tuple(x[:, :, None] for x in qrows),
                        tuple(x[:, :, None] for x in lists), b_ids, h_ids[:, None])
        return tuple(x[:, :, 0] for x in qo), kvo, go

    vm = jax.vmap(inner, in_axes=(2, None, 2, 2, None, 1), out_axes=(2, 0, 0))

    def outer(*args):
        qo, kvo, go = vm(*args)
        # dK/dV of a kv head sum over its query heads.
        return qo, tuple(x.sum(0) for x in kvo), tuple(x.sum(0) for x in go)

    return outer


def _over_hkv(f):
    def inner(qt, kv, qrows, lists, b_ids, h_ids):
        qo, kvo, go = f(qt[:, None], tuple(x[:, None] for x in kv), tuple(x[:, None] for x in qrows),
                        tuple(x[:, None] for x in lists), b_ids, h_ids[None])
        return tuple(x[:, 0] for x in qo), tuple(x[:, 0] for x in kvo), go

    vm = jax.vmap(inner, in_axes=(1, 1, 1, 1, None, 0), out_axes=(1, 1, 0))

    def outer(*args):
        qo, kvo, go = vm(*args)
        return qo, kvo, tuple(x.sum(0) for x in go)

    return outer


def _over_b(f):
    def inner(qt, kv, qrows, lists, b_ids, h_ids):
        qo, kvo, go = f(qt[None], tuple(x[None] for x in kv), tuple(x[None] for x in qrows),
                        tuple(x[None] for x in lists), b_ids[None], h_ids)
        return tuple(x[0] for x in qo), tuple(x[0] for x in kvo), go

    vm = jax.vmap(inner, in_axes=(0, 0, 0, 0, 0, None), out_axes=(0, 0, 0))

    def outer(*args):
        qo, kvo, go = vm(*args)
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
        f = _over_hkv(_over_g(f))
    if not batch_shared:
        f = _over_b(f)
    return f(qt, kv, qrows, lists, b_ids, h_ids)


def _prepare(spec, q, k, lists, backward: bool):
    B, Sq, Hq, _ = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    opts = _resolve(spec)
    tq, tk = (opts.bwd_block_q, opts.bwd_block_kv) if backward else (opts.block_q, opts.block_kv)
    g = _Geom(tq=tq, tk=tk, nq=-(-Sq // tq), nk=-(-spec.kv_len // tk), q_len=Sq, kv_len=spec.kv_len)
    coarse = _coarse_lists(lists, spec.block_size, tq, tk, Sq, spec.kv_len)
    Bm, Hm = coarse[0].shape[:2]
    batch_shared, head_shared = Bm == 1, Hm == 1
    # Lists as (Bm, Hkv_m, G_m, ...) to line up with the query layout (B, Hkv, G, ...).
    shape = (Bm, 1, 1) if head_shared else (Bm, Hkv, G)
    coarse = tuple(x.reshape(shape + x.shape[2:]) for x in coarse)
    b_ids = jnp.arange(B, dtype=jnp.int32)
    h_ids = jnp.arange(Hq, dtype=jnp.int32).reshape(Hkv, G)
    return g, coarse, batch_shared, head_shared, b_ids, h_ids


def forward(spec, q, k, v, score_consts, mask_consts, lists):
    g, coarse, b_sh, h_sh, b_ids, h_ids = _prepare(spec, q, k, lists, backward=False)
    qt, kt, vt = _to_tiles(q, k, v, g)

    def core(qt_, kv, qrows, lists_, b_, h_):
        out, lse = _fwd_core(spec, g, score_consts, mask_consts, qt_, *kv,
                             tuple(x[0, 0, 0] for x in lists_), b_, h_)
        return (out, lse), (), ()

    (out, lse), _, _ = _run_groups(core, b_sh, h_sh, qt, (kt, vt), (), coarse, b_ids, h_ids)
    B, Sq, Hq, _ = q.shape
    out = out[..., :Sq, :].reshape(B, Hq, Sq, -1).transpose(0, 2, 1, 3).astype(q.dtype)
    lse = lse[..., :Sq].reshape(B, Hq, Sq)
    return out, lse


def backward(spec, q, k, v, out, lse, dout, dlse, score_consts, mask_consts, lists):
    g, coarse, b_sh, h_sh, b_ids, h_ids = _prepare(spec, q, k, lists, backward=True)
    qt, kt, vt = _to_tiles(q, k, v, g)
    B, Sq, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    sq_pad = g.nq * g.tq
    dout32 = dout.astype(jnp.float32)
    # delta = rowsum(dO * O); a cotangent on lse adds P * dlse to dS, i.e. delta - dlse.
    delta = jnp.einsum("bqhd,bqhd->bhq", dout32, out.astype(jnp.float32)) - dlse.astype(jnp.float32)
    dot = _pad_seq(jnp.transpose(dout32, (0, 2, 1, 3)).reshape(B, Hkv, G, Sq, -1), sq_pad)
    pad_rows = ((0, 0), (0, 0), (0, 0), (0, sq_pad - Sq))
    lse_t = jnp.pad(lse.reshape(B, Hkv, G, Sq), pad_rows, constant_values=-jnp.inf)
    delta_t = jnp.pad(delta.reshape(B, Hkv, G, Sq), pad_rows)
    float_idx = [n for n, c in enumerate(score_consts) if jnp.issubdtype(c.dtype, jnp.inexact)]

    def core(qt_, kv, qrows, lists_, b_, h_):
        dq, dk, dv, dconsts = _bwd_core(spec, g, score_consts, mask_consts, qt_, *kv, *qrows,
                                        tuple(x[0, 0, 0] for x in lists_), b_, h_)
        return (dq,), (dk, dv), dconsts

    (dq,), (dk, dv), dconsts = _run_groups(core, b_sh, h_sh, qt, (kt, vt), (dot, lse_t, delta_t),
                                           coarse, b_ids, h_ids)
    dq = dq[..., :Sq, :].reshape(B, Hq, Sq, D).transpose(0, 2, 1, 3).astype(q.dtype)
    dk = dk[..., : spec.kv_len, :].transpose(0, 2, 1, 3).astype(k.dtype)
    dv = dv[..., : spec.kv_len, :].transpose(0, 2, 1, 3).astype(v.dtype)
    dscore = [None] * len(score_consts)
    for n, dcn in zip(float_idx, dconsts):
        dscore[n] = dcn.astype(score_consts[n].dtype)
    return dq, dk, dv, tuple(dscore)
