"""The Mosaic GPU kernels: a warp-specialized forward and a block-sparse backward (dQ, dK/dV).

Every kernel is one CTA of three warpgroups (``plgpu.kernel(num_threads=3)``): warpgroup 2
is the producer, which walks the CTA's row (or column) of the BlockMask's tile lists as
scalars and issues TMA copies of the tiles the consumers need into a ring of ``stages``
shared-memory slots; warpgroups 0 and 1 are consumers, each owning 64 rows (query rows in
the forward and dQ, key rows in dK/dV) of the CTA's 128, running ``wgmma`` from shared
memory with float32 accumulators in registers. A slot is refilled once both consumers have
arrived on its "consumed" barrier. In the forward the consumers take turns on the tensor
cores (the ping-pong schedule of FlashAttention-3: a two-arrival barrier around each pair
of MMAs), so one warpgroup's softmax overlaps the other's MMAs.

The mods run on (64, tk) tiles in the WGMMA register layout: ``q_idx`` / ``kv_idx`` are
iotas, hoisted row values (per query) and column values (per key) are copied into shared
memory by TMA and broadcast. Partial tiles apply the mask_mod and the padding test, full
tiles neither. The same kernels run in Mosaic GPU's interpreter on a CPU host
(``InterpretGPUParams``), which simulates the shared memory, barriers, TMA and wgmma.

Accumulation across the list walk is in registers: every MMA writes a fresh accumulator
(``run_scoped`` with ``plgpu.ACC``), which the kernel adds to its running value (one
register add per element, the form Mosaic GPU's interpreter runs as it lowers).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .._layout import Geom, Mods

# Rows of one consumer warpgroup (a wgmma's M); two consumers per CTA.
WG_ROWS = 64
CONSUMERS = 2
CTA_ROWS = WG_ROWS * CONSUMERS


@functools.cache
def _interpret_params():
    """Mosaic GPU's interpreter, with the one rule it lacks on a CPU host.

    ``plgpu.layout_cast`` only names a register layout (the value is unchanged), and the
    interpreter binds it as an ordinary primitive, for which JAX 0.10 registers no CPU
    lowering: the identity is that lowering.
    """
    from jax._src.interpreters import mlir
    from jax._src.pallas.mosaic_gpu import core as gpu_core
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    mlir.register_lowering(gpu_core.layout_cast_p, lambda ctx, x, **_: [x], platform="cpu")
    return InterpretGPUParams()


def _load(ref, axis_kept: int):
    """A (n,) vector from shared memory in the layout of a WGMMA tile's rows (0) or columns (1)."""
    return plgpu.layout_cast(ref[...], _layout(axis_kept))


def _transforms(dtype):
    """Shared-memory layout of a 16-bit (rows, 64k) tile that wgmma reads: (8, 64) tiles, 128-byte swizzle."""
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _div(x, n: int):
    return x if n == 1 else lax.div(x, jnp.int32(n))


def _rem(x, n: int):
    return jnp.int32(0) if n == 1 else lax.rem(x, jnp.int32(n))


def _layout(axis_kept: int | None):
    """WGMMA layout of a tile (None) or of its rows (0: one value per row) / columns (1)."""
    if axis_kept is None:
        return plgpu.Layout.WGMMA
    return plgpu.Layout.WGMMA.reduce(1 - axis_kept)


class _Lists:
    """One CTA's walk over a row of the partial then the full tile list, ``sub`` steps per entry."""

    def __init__(self, n_ref, idx_ref, fn_ref, fidx_ref, bm, hm, row, sub: int):
        self.idx_ref, self.fidx_ref = idx_ref, fidx_ref
        self.bm, self.hm, self.row, self.sub = bm, hm, row, sub
        self.n_partial = n_ref[bm, hm, row] * sub
        self.n = self.n_partial + fn_ref[bm, hm, row] * sub
        self.cols = idx_ref.shape[-1]

    def tile(self, t):
        """The tile index (in kernel tiles) of step ``t`` of the walk (partial steps first)."""
        full = t >= self.n_partial
        u = jnp.where(full, t - self.n_partial, t)
        e = jnp.minimum(_div(u, self.sub), self.cols - 1)
        entry = jnp.where(full, self.fidx_ref[self.bm, self.hm, self.row, e],
                          self.idx_ref[self.bm, self.hm, self.row, e])
        return entry * self.sub + _rem(u, self.sub)


def _mod_tile(cm, score, b, h, q_idx, kv_idx, rows, cols):
    if cm is None:
        return score
    return cm.evaluate(score, b, h, q_idx, kv_idx, rows, cols, None)


def _cast_back(cm, vals, ids):
    """Hoisted values travel as float32 / int32; the mod sees its own dtype."""
    out = []
    for x, v in zip(vals, ids):
        dtype = cm.storage_dtype(v)
        out.append(x if x.dtype == dtype else x.astype(dtype))
    return tuple(out)


# -- forward ---------------------------------------------------------------------------------

def forward(g: Geom, mods: Mods, scale: float, q, k, v, lists, rows, cols, *, stages: int, interpret: bool,
            block_kv: int):
    """q (B, sq, Hq, D), k/v (B, skv, Hkv, D), 16-bit, padded (sq a multiple of 128, skv of ``block_kv``).

    ``rows`` / ``cols``: the hoisted values of both mods, (B', H', sq) / (B', H', skv), float32
    or int32, score_mod's first. Returns out (B, sq, Hq, D) and each row's max and sum
    (B, Hq, sq) float32 (``Residuals``' format: -inf and 0 on a row with no allowed key).
    """
    B, Hq, D, tk = g.B, g.Hq, q.shape[-1], block_kv
    dtype = q.dtype
    kv_n, kv_i, fkv_n, fkv_i = lists.by_q
    n_srows = len(mods.score.rows) if mods.score is not None else 0
    n_scols = len(mods.score.cols) if mods.score is not None else 0
    n_rows, n_cols = len(rows), len(cols)

    def kernel(*refs):
        it = iter(refs)
        kv_n_r, kv_i_r, fkv_n_r, fkv_i_r, q_ref, kt_ref, v_ref = (next(it) for _ in range(7))
        row_refs = tuple(next(it) for _ in range(n_rows))
        col_refs = tuple(next(it) for _ in range(n_cols))
        o_ref, m_ref, l_ref = next(it), next(it), next(it)
        (qo_smem, k_smem, v_smem, p_smem, stat_smem, row_smem, col_smem), bars = next(it), next(it)
        nb = 1 + n_rows
        (k_bar, v_bar, q_bar, col_bar, k_free, v_free, sched) = bars
        h, i, b = lax.axis_index("h"), lax.axis_index("q"), lax.axis_index("b")
        wg = lax.axis_index("wg")
        kvh = _div(h, g.G)
        bm = b if g.Bm > 1 else 0
        hm = h if g.Hm > 1 else 0
        walk = _Lists(kv_n_r, kv_i_r, fkv_n_r, fkv_i_r, bm, hm, _div(i, g.sub_q), g.sub_k)

        def rb(ref):  # (B', H', n) -> this program's (n,) slice
            return ref.at[b if ref.shape[0] > 1 else 0, h if ref.shape[1] > 1 else 0]

        @pl.when(wg == CONSUMERS)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")

            @pl.loop(0, walk.n)
            def _(t):
                slot = _rem(t, stages)
                ks = walk.tile(t) * tk

                @pl.when(t >= stages)
                def _():
                    plgpu.barrier_wait(k_free.at[slot])

                plgpu.copy_gmem_to_smem(kt_ref.at[b, kvh, :, pl.ds(ks, tk)], k_smem.at[slot], k_bar.at[slot])
                for c, ref in enumerate(col_refs):
                    plgpu.copy_gmem_to_smem(rb(ref).at[pl.ds(ks, tk)], col_smem[c].at[slot], col_bar.at[c * stages + slot])

                @pl.when(t >= stages)
                def _():
                    plgpu.barrier_wait(v_free.at[slot])

                plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(ks, tk), kvh], v_smem.at[slot], v_bar.at[slot])

        @pl.when(wg < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")
            q0 = i * CTA_ROWS + wg * WG_ROWS
            my_q, my_p = qo_smem.at[wg], p_smem.at[wg]
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, WG_ROWS), h], my_q, q_bar.at[wg * nb])
            for r, ref in enumerate(row_refs):
                plgpu.copy_gmem_to_smem(rb(ref).at[pl.ds(q0, WG_ROWS)], row_smem[r].at[wg], q_bar.at[wg * nb + 1 + r])
            for r in range(nb):
                plgpu.barrier_wait(q_bar.at[wg * nb + r])
            shape = (WG_ROWS, tk)
            q_iota = q0 + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
            row_vals = tuple(
                lax.broadcast_in_dim(_load(row_smem[r].at[wg], 0), shape, [0])
                for r in range(n_rows))
            q_valid = q_iota < g.q_len
            q_idx = jnp.minimum(q_iota, g.q_len - 1)

            def sched_barrier():
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(sched)

            pl.when(wg == 1)(sched_barrier)

            def step(masked):
                def body(t, carry):
                    m, l, acc = carry
                    slot = _rem(t, stages)
                    ks = walk.tile(t) * tk
                    plgpu.barrier_wait(k_bar.at[slot])

                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, my_q, k_smem.at[slot])
                        sched_barrier()
                        return acc_ref[...]

                    s = pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32)) * scale
                    plgpu.barrier_arrive(k_free.at[slot])
                    kv_iota = ks + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
                    kv_idx = jnp.minimum(kv_iota, g.kv_len - 1)
                    col_vals = []
                    for c in range(n_cols):
                        plgpu.barrier_wait(col_bar.at[c * stages + slot])
                        col_vals.append(lax.broadcast_in_dim(
                            _load(col_smem[c].at[slot], 1), shape, [1]))
                    srows, mrows = row_vals[:n_srows], row_vals[n_srows:]
                    scols, mcols = tuple(col_vals[:n_scols]), tuple(col_vals[n_scols:])
                    if mods.score is not None:
                        s = _mod_tile(mods.score, s, b, h, q_idx, kv_idx,
                                      _cast_back(mods.score, srows, mods.score.rows),
                                      _cast_back(mods.score, scols, mods.score.cols))
                    if masked:
                        ok = q_valid & (kv_iota < g.kv_len)
                        if mods.mask is not None:
                            ok = ok & _mod_tile(mods.mask, None, b, h, q_idx, kv_idx,
                                                _cast_back(mods.mask, mrows, mods.mask.rows),
                                                _cast_back(mods.mask, mcols, mods.mask.cols))
                        s = jnp.where(ok, s, -jnp.inf)
                    m_new = jnp.maximum(m, s.max(axis=1))
                    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                    p = jnp.exp(s - lax.broadcast_in_dim(m_use, shape, [0]))
                    alpha = jnp.exp(m - m_use)
                    l = l * alpha + p.sum(axis=1)
                    my_p[...] = p.astype(dtype)
                    plgpu.commit_smem()
                    plgpu.barrier_wait(v_bar.at[slot])

                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, my_p, v_smem.at[slot])
                        sched_barrier()
                        return acc_ref[...]

                    o = pl.run_scoped(pv, plgpu.ACC((WG_ROWS, D), jnp.float32))
                    plgpu.barrier_arrive(v_free.at[slot])
                    acc = acc * lax.broadcast_in_dim(alpha, (WG_ROWS, D), [0]) + o
                    return m_new, l, acc

                return body

            m = plgpu.layout_cast(jnp.full((WG_ROWS,), -jnp.inf, jnp.float32), _layout(0))
            l = plgpu.layout_cast(jnp.full((WG_ROWS,), 0.0, jnp.float32), _layout(0))
            acc = plgpu.layout_cast(jnp.full((WG_ROWS, D), 0.0, jnp.float32), plgpu.Layout.WGMMA)
            carry = lax.fori_loop(0, walk.n_partial, step(True), (m, l, acc))
            m, l, acc = lax.fori_loop(walk.n_partial, walk.n, step(False), carry)
            pl.when(wg == 0)(sched_barrier)
            alive = l > 0
            inv = jnp.where(alive, 1.0 / jnp.where(alive, l, 1.0), 0.0)
            my_q[...] = (acc * lax.broadcast_in_dim(inv, (WG_ROWS, D), [0])).astype(dtype)
            stat_smem[wg, 0] = jnp.where(alive, m, 0.0)
            stat_smem[wg, 1] = l
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(my_q, o_ref.at[b, pl.ds(q0, WG_ROWS), h])
            plgpu.copy_smem_to_gmem(stat_smem.at[wg, 0], m_ref.at[b, h, pl.ds(q0, WG_ROWS)])
            plgpu.copy_smem_to_gmem(stat_smem.at[wg, 1], l_ref.at[b, h, pl.ds(q0, WG_ROWS)])
            plgpu.wait_smem_to_gmem(0)

    tr = _transforms(dtype)
    scratch = (
        (plgpu.SMEM((CONSUMERS, WG_ROWS, D), dtype, transforms=tr),
         plgpu.SMEM((stages, D, tk), dtype, transforms=tr),
         plgpu.SMEM((stages, tk, D), dtype, transforms=tr),
         plgpu.SMEM((CONSUMERS, WG_ROWS, tk), dtype, transforms=tr),
         plgpu.SMEM((CONSUMERS, 2, WG_ROWS), jnp.float32),
         tuple(plgpu.SMEM((CONSUMERS, WG_ROWS), r.dtype) for r in rows),
         tuple(plgpu.SMEM((stages, tk), c.dtype) for c in cols)),
        (plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_barriers=CONSUMERS * (1 + n_rows)),
         plgpu.Barrier(num_barriers=max(n_cols, 1) * stages),
         plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
         plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
         plgpu.Barrier(num_arrivals=CONSUMERS)),
    )
    vec = jax.ShapeDtypeStruct((B, Hq, g.sq), jnp.float32)
    call = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((B, g.sq, Hq, D), dtype), vec, vec),
        scratch_types=scratch,
        grid=(Hq, g.sq // CTA_ROWS, B),
        grid_names=("h", "q", "b"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        interpret=_interpret_params() if interpret else None,
    )
    return call(kv_n, kv_i, fkv_n, fkv_i, q, k.transpose(0, 2, 3, 1), v, *rows, *cols)


__all__ = ["forward", "WG_ROWS", "CTA_ROWS"]
functools  # noqa: B018
