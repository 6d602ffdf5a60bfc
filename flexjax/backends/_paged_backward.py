"""The backward of every backend's paged calls: one XLA loop that reads the pools through the page
table as the forward did (no logical cache), on the tile walk and page gathers of xla's decode path."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._common import acc_dtype, allowed, apply_score_mod
from .xla._decode import _gather, _pool_rows, row_lists, step_shape, tile_entries


def paged_backward(spec, q, k_pages, v_pages, page_table, out, lse, dout, dlse, score_consts, mask_consts, lists,
                   grad_consts, scales=None):
    """The backward of a paged call, reading the pools through the table as the forward does.

    No logical cache is formed: the loop walks each row's kv tiles (the lists the forward
    walked) in sub-tiles gathered from their pages, recomputes P from the forward's lse, and
    adds each sub-tile's dK and dV into pool-shaped gradients at the rows it read (a
    scatter-add: sequences sharing pages add up). Rows are packed as in the forward (the
    ``Sq`` queries of a kv head's ``G`` query heads).

    Returns:
      ``(dq, dk_pages, dv_pages, dscore)``: dq like q; the pools' gradients, float32 like
      the pools (None for a quantized pool, whose codes take none); dscore, the gradients of
      the score_mod's captured arrays where ``grad_consts`` says so (None elsewhere).
    """
    B, Sq, Hq, D = q.shape
    Hkv, Dv, ps = k_pages.shape[2], v_pages.shape[-1], k_pages.shape[1]
    G, R = Hq // Hkv, (Hq // Hkv) * Sq
    dt = acc_dtype(q.dtype)
    bkv, Skv = spec.block_size[1], spec.kv_len
    kv_n, kv_i, fkv_n, fkv_i = row_lists(spec, lists, Hq, Hkv)
    hk = kv_n.shape[1]
    C, w = step_shape(B, Hkv, D, Dv, 4, bkv, kv_i.shape[-1] + fkv_i.shape[-1])
    n_sub, wg = bkv // w, min(w, Skv)
    steps = ((jnp.max(kv_n + fkv_n) * n_sub) + C - 1) // C

    def packed(x):  # (B, Sq, Hq, X) -> (B, Hkv, R, X), row g * Sq + s
        return x.reshape(B, Sq, Hkv, G, -1).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, R, x.shape[-1])

    qp = packed(q.astype(dt) * spec.scale)
    dop = packed(dout.astype(dt))
    lse_p = packed(jnp.swapaxes(lse, 1, 2)[..., None].astype(dt))[..., 0]
    delta = jnp.sum(dout.astype(dt) * out.astype(dt), -1)  # (B, Sq, Hq)
    delta_p = packed(delta[..., None])[..., 0] - packed(jnp.swapaxes(dlse, 1, 2)[..., None].astype(dt))[..., 0]
    rows = jnp.arange(R, dtype=jnp.int32)
    q_idx = (rows % Sq)[None, None, None, :, None]
    h_idx = (jnp.arange(Hkv, dtype=jnp.int32)[:, None] * G + rows[None, :] // Sq)[None, :, None, :, None]
    b_idx = jnp.arange(B, dtype=jnp.int32)[:, None, None, None, None]
    chunk = jnp.arange(C, dtype=jnp.int32)
    quant = scales is not None
    k_scale, v_scale = scales if quant else (None, None)
    kf, vf = k_pages.reshape((-1,) + k_pages.shape[2:]), v_pages.reshape((-1,) + v_pages.shape[2:])
    n_rows = kf.shape[0]
    flags = tuple(bool(g) for g in grad_consts) if spec.score is not None else ()
    want = [i for i, f in enumerate(flags) if f]
    heads = jnp.arange(Hkv, dtype=jnp.int32)

    def gather(x, start, scale):
        return _gather(x, start, scale, page_table=page_table, ps=ps, skv=Skv, wg=wg, hk=hk, hkv=Hkv, dt=dt)

    def body(t, carry):
        dq, dk, dv, dc = carry
        e = chunk * steps + t
        j, live = tile_entries(kv_n, kv_i, fkv_n, fkv_i, e // n_sub)
        start = jnp.broadcast_to(j * bkv + (e % n_sub) * w, (B, hk, C))
        live = jnp.broadcast_to(live, (B, hk, C))
        kt, vt = gather(kf, start, k_scale).astype(dt), gather(vf, start, v_scale).astype(dt)
        spec_k = "bckhd" if hk == 1 else "bhckd"
        s = jnp.einsum(f"bhrd,{spec_k}->bhcrk", qp, kt)
        kv_idx = (start[..., None] + jnp.arange(wg, dtype=jnp.int32))[:, :, :, None, :]
        kv_ok = live[..., None, None] & (kv_idx < Skv)
        kv_c = jnp.minimum(kv_idx, Skv - 1)

        def mod(s, fc):
            consts = list(score_consts)
            for i, c in zip(want, fc):
                consts[i] = c
            return apply_score_mod(spec, tuple(consts), s, b_idx, h_idx, q_idx, kv_c)

        sm, vjp = jax.vjp(mod, s, tuple(score_consts[i] for i in want))
        ok = allowed(spec, mask_consts, b_idx, h_idx, q_idx, kv_c, True, kv_ok)
        lse_b = lse_p[:, :, None, :, None]
        p = jnp.where(ok & jnp.isfinite(lse_b), jnp.exp(sm - jnp.where(jnp.isfinite(lse_b), lse_b, 0.0)), 0.0)
        dp = jnp.einsum(f"bhrd,{spec_k}->bhcrk", dop, vt)
        ds = p * (dp - delta_p[:, :, None, :, None])
        ds_raw, d_fc = vjp(ds)
        dq = dq + jnp.einsum(f"bhcrk,{spec_k}->bhrd", ds_raw, kt)
        dc = tuple(a + b.astype(a.dtype) for a, b in zip(dc, d_fc))
        if not quant:
            # Each sub-tile's rows of the pool (rows past the length or of dead entries: dropped).
            first, _ = _pool_rows(page_table, start, ps)  # (B, hk, C)
            at = first[..., None] + jnp.arange(wg, dtype=jnp.int32)  # (B, hk, C, wg)
            at = jnp.where(kv_ok[:, :, :, 0, :], at, n_rows)
            at = jnp.broadcast_to(at, (B, Hkv, C, wg))
            dk_t = jnp.einsum("bhcrk,bhrd->bhckd", ds_raw, qp)
            dv_t = jnp.einsum("bhcrk,bhrd->bhckd", p, dop)
            hh = heads[None, :, None, None]
            dk = dk.at[at, hh].add(dk_t, mode="drop")
            dv = dv.at[at, hh].add(dv_t, mode="drop")
        return dq, dk, dv, dc

    pool_grad = (lambda x: jnp.zeros(x.shape, dt)) if not quant else (lambda x: jnp.zeros((), dt))
    carry = (jnp.zeros((B, Hkv, R, D), dt), pool_grad(kf), pool_grad(vf),
             tuple(jnp.zeros(score_consts[i].shape, dt) for i in want))
    dq, dk, dv, dc = jax.lax.fori_loop(0, steps, body, carry)
    dq = (dq * spec.scale).reshape(B, Hkv, G, Sq, D).transpose(0, 3, 1, 2, 4).reshape(B, Sq, Hq, D)
    dscore = [None] * len(flags)
    for i, d in zip(want, dc):
        dscore[i] = d
    if quant:
        return dq, None, None, tuple(dscore)
    return dq, dk.reshape(k_pages.shape), dv.reshape(v_pages.shape), tuple(dscore)
