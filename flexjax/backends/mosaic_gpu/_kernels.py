"""The Mosaic GPU kernels: a warp-specialized forward and a block-sparse backward (dQ, dK/dV).

Every kernel is one CTA of warpgroups (``plgpu.kernel(num_threads=...)``): the last is the
producer, which walks the CTA's row (or column) of the BlockMask's tile lists as scalars and
issues TMA copies of the tiles the consumers need into a ring of ``stages`` shared-memory
slots; the others are consumers, each owning ``arch.rows`` rows (64 on sm_90a, 128 on sm_100a)
and running its MMAs through a matrix unit (``_mma``: wgmma with accumulators in registers, or
tcgen05 with accumulators in tensor memory) from shared-memory operands (on sm_90a A from
registers where it is P or dS). A slot is refilled
once every consumer has arrived on its "consumed" barrier. The forward and dQ have two
consumers; dK/dV one or two (``dkv_consumers``). In the forward the consumers take turns on the
tensor cores (the ping-pong schedule of FlashAttention-3: a two-arrival barrier around each
MMA), so one warpgroup's softmax overlaps the other's MMAs.

The mods run on (rows, n) tiles in the arch's register layout: ``q_idx`` / ``kv_idx`` are
iotas, hoisted row values (per query) and column values (per key) are copied into shared
memory by TMA and broadcast. Partial tiles apply the mask_mod and the padding test, full
tiles neither. Dropout regenerates ``_dropout``'s keep mask per tile (``_Drop``). The same
kernels run in Mosaic GPU's interpreter on a CPU host (``InterpretGPUParams``), which
simulates the shared memory, barriers, TMA and wgmma.

The GPU form is FlashAttention-3's (sm_90a): 128-key forward steps with Q K^T one m64n128
wgmma, P in registers as the P·V wgmma's A operand (dS likewise for dS K, P^T and dS^T for dV and
dK), the softmax in base 2 with log2(e) folded into the scale and each exponent one
``ex2.approx``, K / V / Q / dO tiles read through transposed shared-memory views (no transposes
in XLA), the next K tile waited for while P·V runs, grids walked heaviest first
(``heaviest_first``). What the interpreter cannot run, it runs in a second form behind the
matrix unit (``_mma``: ``arch.views``, ``arch.register_a``, ``arch.exp2``): it has no
``run_state`` (an MMA into a live accumulator), no register operand and no transposed view, so
there each MMA writes a fresh accumulator added in registers, P and dS are stored to shared
memory before they multiply, and K^T, V^T, Q^T and dO^T are transposed in XLA before the
kernels. The interpreter checks the numerics of that form; ``tests_compile/mosaic_gpu_suite.py``
checks that the GPU form compiles spill-free in FlashAttention-3's shape.

On sm_100a the forward takes 64-key steps whose scores stay in tensor memory: its softmax reads
them a chunk at a time (``_mma._InTmem``) and writes P to shared memory as it goes, into one of
two buffers (``p_buffers``), and every tile runs in the pipelined chain (``fwd_chain_partial``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ... import _dropout
from .._layout import Geom, Mods
from ._mma import LOG2E, SCORE_CHUNK

# Two consumer warpgroups per CTA in the forward and dQ, each owning ``arch.rows`` rows (64 on
# sm_90a, wgmma's M; 128 on sm_100a, tcgen05's): the CTA's rows are ``cta_rows(arch)``.
CONSUMERS = 2


def dkv_consumers(arch) -> int:
    """Consumer warpgroups of the dK/dV kernel, each owning ``arch.rows`` key rows: two on sm_90a
    (FlashAttention-3's backward: 240 registers a thread after ``setmaxnreg``; the two share each
    Q / dO tile the producer loads, and one's softmax runs while the other's MMAs do). At head dim
    128 a thread then holds 128 registers of dK and dV accumulators beside the 64-query S^T and
    dP^T tiles of a full step; the partial steps run in 32-query sub-steps (``dkv_masked_q``).
    One on sm_100a, whose warpgroups own 128 rows: two consumers' accumulators at D = 128 would
    pass the 512 tensor-memory columns, and at 64 their 256 key rows span two of the BlockMask's
    default 128-blocks (tile lists regrouped in XLA)."""
    return 2 if arch.name == "sm_90a" else 1


def dkv_masked_q(arch, D: int, tq: int) -> int:
    """Queries per sub-step of a dK/dV step on a partial tile (where the mask_mod and the length
    tests apply): 32 on sm_90a at head dim > 64, else the step's own ``tq``. A step's Q and dO tiles
    are loaded whole; a partial one runs over slices of them. At head dim 128, with S^T and dP^T
    m64n64 (``tq`` 64) the full steps compile without spilling in the loop beside dK and dV's 128
    accumulator registers; whole partial steps, which add the mask's index arithmetic, spilled
    12-80 B per thread (causal, chunked_causal, causal_bottom_right_cache, soft-cap; BENCHMARKS.md).
    The sub-steps' MMAs take K = 32, so the kernel's tiles keep a 64-byte swizzle."""
    return min(tq, 32) if arch.name == "sm_90a" and D > 64 else tq


# JAX 0.10's Mosaic GPU: its sm_100a forward at head dim 128 spills at 64-key steps (``heuristics``).
JAX_010 = jax.__version_info__ < (0, 11)

# Registers a thread after ``setmaxnreg`` in a CTA of a producer and two consumer warpgroups
# (32 + 2 x 240 = 512, the register file per thread of a warpgroup; at 24 the sm_100a forward spilled 8 B).
PRODUCER_REGISTERS, CONSUMER_REGISTERS = 32, 240


def fwd_overlap(arch) -> bool:
    """Whether the forward runs its full tiles pipelined, FlashAttention-3's intra-warpgroup
    overlap (both archs, both head dims): each step issues Q K^T of its tile with P·V of the
    previous one and runs its softmax while P·V is in flight (sm_100a: the two tcgen05 MMAs
    committed to two barriers, FlashAttention-4's asynchronous chain; ``_mma.qk_pv``). The
    partial tiles (those the mask_mod is applied to) stay one tile per step: with the overlap
    there, ptxas hoisted the mask's index arithmetic into the Q K^T wait (live registers peaked at
    238 of 240) and 184-372 B per thread spilled (chunked_causal, neg_inf_score, sliding window +
    ALiBi at D = 64, sm_90a)."""
    return True


def fwd_chain_partial(arch, D: int) -> bool:
    """Whether the forward's partial tiles join the pipelined chain too (masked), not one tile per
    step: on sm_100a, whose scores stay in tensor memory and are read a chunk at a time
    (``_mma._InTmem``), so the mask's arithmetic never meets a whole score tile in registers
    (on sm_90a it did: ``fwd_overlap``). Not on JAX 0.10 at head dim 128, whose lowering then
    spilled 8 B per thread in the steps ("neg_inf_score", causal + dropout; at 32-key steps)."""
    return arch.name == "sm_100a" and not (JAX_010 and D > 64)


def cta_rows(arch) -> int:
    """Query rows of a forward / dQ CTA: 128 on sm_90a, 256 on sm_100a."""
    return arch.rows * CONSUMERS


def dkv_rows(arch) -> int:
    """Key rows of a dK/dV CTA: ``arch.rows`` per consumer (``dkv_consumers``)."""
    return arch.rows * dkv_consumers(arch)


def compiler_params():
    """The kernels' Mosaic GPU compiler params: Lane lowering semantics (each thread's view of its
    warpgroup's arrays, with explicit layouts), which the kernels are written in and compiled and
    checked with. JAX 0.10 lowered with Lane by default; 0.11 made Warpgroup the default."""
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


@functools.cache
def _interpret_params():
    """Mosaic GPU's interpreter, with the one rule it lacks on a CPU host.

    ``plgpu.layout_cast`` only names a register layout (the value is unchanged), and the
    interpreter binds it as an ordinary primitive, for which JAX 0.10 registers no CPU
    lowering: the identity is that lowering.

    And JAX 0.10's interpreter jits each simulated warpgroup's body through a function it defines
    anew per call, so every CTA of the grid traced, lowered and compiled the kernel again (over
    half of an interpreted test's time). JAX 0.11 jits a module-level function instead, so one
    compile serves every CTA and warpgroup; on JAX 0.10 the same fix is put in its place.
    """
    from jax._src.interpreters import mlir
    from jax._src.pallas.mosaic_gpu import core as gpu_core
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    mlir.register_lowering(gpu_core.layout_cast_p, lambda ctx, x, **_: [x], platform="cpu")
    try:
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:  # moved in a later JAX: only the speed of the interpreter is at stake
        thread_map = None
    if thread_map is not None and not hasattr(thread_map, "_run") and hasattr(thread_map, "_run_jaxpr"):
        thread_map._run_jaxpr = _run_thread_jaxpr  # JAX 0.10 (0.11 defines _run at module level)
    return InterpretGPUParams()


def _eval_thread(jaxpr, consts, *args):
    from jax._src import core

    core.eval_jaxpr(jaxpr, consts, *args)


def _run_thread_jaxpr(jaxpr, consts, *args):
    """JAX 0.11's ``thread_map._run_jaxpr``: one warpgroup's body, jitted through a module-level
    function, so that the trace, the lowering and the executable are cached by the jaxpr."""
    jax.jit(_eval_thread, static_argnums=(0,)).trace(jaxpr, consts, *args).lower().compile()(consts, *args)


def _load(arch, ref, axis_kept: int):
    """A (n,) vector from shared memory in the layout of a tile's rows (0) or columns (1)."""
    return plgpu.layout_cast(ref[...], arch.layout(axis_kept))


def _transforms(dtype, minor: int = 64):
    """Shared-memory layout of a 16-bit (rows, n) tile that wgmma reads: (8, 64) tiles with a
    128-byte swizzle when n is a multiple of 64, (8, 32) tiles with a 64-byte one for n = 32."""
    width = 64 if minor % 64 == 0 else 32
    return (plgpu.TilingTransform((8, width)), plgpu.SwizzleTransform(width * 2))


LN2 = math.log(2.0)


def _t(arch, tile):
    """A (n, D) shared-memory tile as the (D, n) operand of an MMA: its transposed view on the GPU; in
    the interpreter the tile was transposed in XLA (``_kt``) and is the operand itself."""
    # ``ref.transpose``: what ``plgpu.transpose_ref`` did (deprecated in JAX 0.11.2, removed in 0.12.1).
    return tile.transpose((1, 0)) if arch.views else tile


def _kt(arch, x):
    """The kernel operand of a (B, S, H, D) array read transposed: itself where the kernels read
    transposed views (``_t``), else its (B, H, D, S) transpose, in XLA (the interpreter's form)."""
    return x if arch.views else x.transpose(0, 2, 3, 1)


def _kt_src(arch, ref, b, h, start, n: int):
    """The (n, D) tile (views) or (D, n) transposed tile of ``_kt``'s operand at rows ``start``."""
    return ref.at[b, pl.ds(start, n), h] if arch.views else ref.at[b, h, :, pl.ds(start, n)]


def _kt_smem(arch, stages: int, D: int, n: int, dtype, tr):
    """The ring of ``_kt_src``'s tiles."""
    shape = (stages, n, D) if arch.views else (stages, D, n)
    return plgpu.SMEM(shape, dtype, transforms=tr)


def heaviest_first(n_ref, fn_ref, sub: int, axis_sum: int | None = None):
    """The order in which a kernel's grid walks its rows (or columns) of tiles: the most tiles first
    (causal's last query rows, its first key columns), as FlashAttention-3 schedules causal q tiles,
    so the longest CTAs start first and the short ones fill in behind. (B', H', rows * sub) int32:
    entry ``i`` is the kernel row (``sub`` per row of the lists) that program ``i`` runs. With
    ``axis_sum`` the weights are summed over that axis first (kept as size 1)."""
    w = n_ref + fn_ref
    if axis_sum is not None:
        w = w.sum(axis=axis_sum, keepdims=True)
    w = jnp.repeat(w, sub, axis=-1)
    return jnp.argsort(-w, axis=-1, stable=True).astype(jnp.int32)


def _div(x, n: int):
    return x if n == 1 else lax.div(x, jnp.int32(n))


def _rem(x, n: int):
    return jnp.int32(0) if n == 1 else lax.rem(x, jnp.int32(n))


class _Lists:
    """One CTA's walk over a row of the partial then the full tile list, ``sub`` steps per entry."""

    def __init__(self, n_ref, idx_ref, fn_ref, fidx_ref, bm, hm, row, sub: int):
        self.idx_ref, self.fidx_ref = idx_ref, fidx_ref
        self.bm, self.hm, self.row, self.sub = bm, hm, row, sub
        self.n_partial = n_ref[bm, hm, row] * sub
        self.n = self.n_partial + fn_ref[bm, hm, row] * sub
    def tile(self, t):
        """The tile index (in kernel tiles) of step ``t`` of the walk (partial steps first)."""
        full = t >= self.n_partial
        u = jnp.where(full, t - self.n_partial, t)
        # Both lists are read (a select, not a branch), each at an entry clamped to its own width.
        e = _div(u, self.sub)
        ep = jnp.minimum(e, self.idx_ref.shape[-1] - 1)
        ef = jnp.minimum(e, self.fidx_ref.shape[-1] - 1)
        entry = jnp.where(full, self.fidx_ref[self.bm, self.hm, self.row, ef],
                          self.idx_ref[self.bm, self.hm, self.row, ep])
        return entry * self.sub + _rem(u, self.sub)


def _refill(t, stages: int, free, src, dst, bar):
    """Step ``t`` of a producer: copies ``src`` into ring slot ``t % stages`` of ``dst`` (arriving on
    that slot of ``bar``) once the consumers have released the slot (``free``; every lap but the first)."""
    slot = _rem(t, stages)

    @pl.when(t >= stages)
    def _():
        plgpu.barrier_wait(free.at[slot])

    plgpu.copy_gmem_to_smem(src, dst.at[slot], bar.at[slot])


def _copy_cols(col_refs, col_smem, col_bar, slot, stages: int, start, n: int):
    """Copies keys ``start .. start + n`` of each hoisted column vector into its ring slot."""
    for c, ref in enumerate(col_refs):
        plgpu.copy_gmem_to_smem(ref.at[pl.ds(start, n)], col_smem[c].at[slot], col_bar.at[c * stages + slot])


def _drain(n, stages: int, *frees):
    """The producer waits for the consumers' last uses of each ring slot (the last ``stages``
    steps of ``n``), so it has observed every phase of the "consumed" barriers it waits on,
    as Mosaic GPU's interpreter checks, and no slot is in flight when the kernel ends."""
    @pl.loop(jnp.maximum(n - stages, 0), n)
    def _(t):
        for free in frees:
            plgpu.barrier_wait(free.at[_rem(t, stages)])


class _Drop:
    """Dropout in a kernel: ``_dropout``'s keep mask of (seed, b, h, q_idx, kv_idx), the same bits as
    every backend's. Row hashes (per query) and column hashes (per key) are vectors; a tile's
    keep mask costs one ``fmix`` per element."""

    def __init__(self, arch, rate: float, seed_ref, b, h):
        self.arch, self.rate, self.b, self.h = arch, rate, b, h
        self.seed = (seed_ref[0], seed_ref[1])
        self.inv_keep = 1.0 / (1.0 - rate)

    def _iota(self, start, n: int, axis_kept: int):
        return start + plgpu.broadcasted_iota(jnp.int32, (n,), 0, layout=self.arch.layout(axis_kept))

    def q_hash(self, start, n: int, axis_kept: int, q_len: int):
        """Hashes of queries ``start .. start + n`` (clamped as the mods see them), in the layout
        of a tile's rows (``axis_kept`` 0) or columns (1)."""
        q = jnp.minimum(self._iota(start, n, axis_kept), q_len - 1)
        return _dropout.row_hash(self.seed, self.b, self.h, q)

    def kv_hash(self, start, n: int, axis_kept: int, kv_len: int):
        kv = jnp.minimum(self._iota(start, n, axis_kept), kv_len - 1)
        return _dropout.col_hash(self.seed, kv)

    def keep(self, q_hash, kv_hash, shape, q_axis: int):
        """The bool keep tile; queries along ``q_axis`` (0 in the forward and dQ, 1 in dK/dV)."""
        rows = self.arch.broadcast(q_hash, shape, [q_axis])
        cols = self.arch.broadcast(kv_hash, shape, [1 - q_axis])
        return _dropout.keep_from_hashes(rows, cols, self.rate)


def _seed(seed):
    """The kernels' seed operand: (2,) int32 with the bits of the (2,) uint32 seed words."""
    return (lax.bitcast_convert_type(jnp.asarray(seed, jnp.uint32).reshape(2), jnp.int32),)


def _store(ref, accs, scale=None, factor=None):
    """Writes the chunks ``accs`` (times the per-row ``scale`` and the scalar ``factor``) into the
    (rows, D) shared-memory ``ref``; ``accs`` may be a generator (sm_100a: each chunk loaded from
    tensor memory as it is stored, so one chunk is live at a time)."""
    for c, acc in enumerate(accs):
        x = acc if scale is None else acc * lax.broadcast_in_dim(scale, acc.shape, [0])
        x = x if factor is None else x * factor
        w = acc.shape[1]
        ref.at[:, pl.ds(c * w, w)][...] = x.astype(ref.dtype)


def _span(ref, lead: tuple, at, w: int, n: int):
    """``ref.at[lead]``'s entries ``at .. at + w`` along its next axis (of ``n``; all of it where
    ``w`` is ``n``): a chunk of a key tile, a sub-step's queries of a query tile."""
    return ref.at[lead] if w == n else ref.at[(*lead, pl.ds(at, w))]


def p_buffers(arch) -> int:
    """The forward's P tiles per consumer: none where P·V takes P from registers (sm_90a); two on
    sm_100a, where the softmax writes each chunk of P to shared memory as it is computed, while
    P·V of the previous step reads the other (``_mma._InTmem``); one in the sm_90a interpreter form."""
    if arch.register_a:
        return 0
    return 2 if arch.name == "sm_100a" else 1


def _p_smem(arch, R: int, tk: int, dtype, tr):
    """The forward's P tiles (``p_buffers`` per consumer), laid out by ``_p_transforms``."""
    n = p_buffers(arch)
    if n == 0:
        return ()
    tr = _p_transforms(arch, dtype, tk, tr)
    return plgpu.SMEM((CONSUMERS, R, tk) if n == 1 else (CONSUMERS, 2, R, tk), dtype, transforms=tr)


def _p_transforms(arch, dtype, tk: int, tr):
    """The layout of the forward's P tiles and of the V tiles P·V takes with them (Mosaic GPU's
    MMAs take both operands with one swizzle): ``tr``, but on sm_100a tiles ``SCORE_CHUNK``
    columns wide (a 64-byte swizzle), so each chunk of P is stored whole tiles."""
    return _transforms(dtype, min(tk, SCORE_CHUNK)) if p_buffers(arch) == 2 else tr


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
            block_kv: int, arch, rate: float = 0.0, seed=None):
    """q (B, sq, Hq, D), k/v (B, skv, Hkv, D), 16-bit, padded (sq a multiple of ``cta_rows(arch)``, skv of
    ``block_kv``); ``arch``: ``_mma.Hopper()`` or ``_mma.Blackwell()``.

    ``rows`` / ``cols``: the hoisted values of both mods, (B', H', sq) / (B', H', skv), float32
    or int32, score_mod's first. ``rate`` > 0: dropout on P with the (2,) uint32 ``seed`` (the
    row statistics stay those of all probabilities). Returns out (B, sq, Hq, D) and each row's
    max and sum (B, Hq, sq) float32 (``Residuals``' format: -inf and 0 on a row with no allowed
    key).
    """
    B, Hq, D, tk, R = g.B, g.Hq, q.shape[-1], block_kv, arch.rows
    dtype = q.dtype
    kv_n, kv_i, fkv_n, fkv_i = lists.by_q
    n_srows = len(mods.score.rows) if mods.score is not None else 0
    n_scols = len(mods.score.cols) if mods.score is not None else 0
    n_rows, n_cols = len(rows), len(cols)

    def kernel(*refs):
        it = iter(refs)
        kv_n_r, kv_i_r, fkv_n_r, fkv_i_r, order_r, q_ref, kt_ref, v_ref = (next(it) for _ in range(8))
        row_refs = tuple(next(it) for _ in range(n_rows))
        col_refs = tuple(next(it) for _ in range(n_cols))
        seed_ref = next(it) if rate else None
        o_ref, m_ref, l_ref = next(it), next(it), next(it)
        (qo_smem, k_smem, v_smem, p_smem, stat_smem, row_smem, col_smem), bars, mma = next(it), next(it), next(it)
        nb = 1 + n_rows
        (k_bar, v_bar, q_bar, col_bar, k_free, v_free, sched) = bars
        h, b = lax.axis_index("h"), lax.axis_index("b")
        wg = lax.axis_index("wg")
        kvh = _div(h, g.G)
        bm = b if g.Bm > 1 else 0
        hm = h if g.Hm > 1 else 0
        i = order_r[bm, hm, lax.axis_index("q")]
        walk = _Lists(kv_n_r, kv_i_r, fkv_n_r, fkv_i_r, bm, hm, _div(i, g.sub_q), g.sub_k)

        def rb(ref):  # (B', H', n) -> this program's (n,) slice
            return ref.at[b if ref.shape[0] > 1 else 0, h if ref.shape[1] > 1 else 0]

        @pl.when(wg == CONSUMERS)
        def _producer():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

            @pl.loop(0, walk.n)
            def _(t):
                ks = walk.tile(t) * tk
                _refill(t, stages, k_free, _kt_src(arch, kt_ref, b, kvh, ks, tk), k_smem, k_bar)
                _refill(t, stages, v_free, v_ref.at[b, pl.ds(ks, tk), kvh], v_smem, v_bar)
                # Column values are read before the consumers release V's slot.
                _copy_cols([rb(ref) for ref in col_refs], col_smem, col_bar, _rem(t, stages), stages, ks, tk)

            _drain(walk.n, stages, k_free, v_free)

        @pl.when(wg < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
            q0 = i * R * CONSUMERS + wg * R
            my_q, my_p = qo_smem.at[wg], (None if arch.register_a else p_smem.at[wg])
            chunked = p_buffers(arch) == 2  # the softmax writes P to shared memory as it goes
            unit = arch.unit(mma, wg, tk, {"o": D})
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, R), h], my_q, q_bar.at[wg * nb])
            for r, ref in enumerate(row_refs):
                plgpu.copy_gmem_to_smem(rb(ref).at[pl.ds(q0, R)], row_smem[r].at[wg], q_bar.at[wg * nb + 1 + r])
            for r in range(nb):
                plgpu.barrier_wait(q_bar.at[wg * nb + r])
            # Per-row vectors stay vectors across the walk; the (rows, n) tiles made from them and
            # the index tiles are formed in each step (held across it, each costs n / 2 registers a
            # thread on sm_90a, whose n is the key tile, and n on sm_100a, whose n is a chunk of it).
            row_vecs = tuple(_load(arch, row_smem[r].at[wg], 0) for r in range(n_rows))
            drop = _Drop(arch, rate, seed_ref, b, h) if rate else None
            q_hash = drop.q_hash(q0, R, 0, g.q_len) if drop else None

            def sched_barrier():
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(sched)

            pl.when(wg == 1)(sched_barrier)

            def softmax(t, ks, scores, masked, m, l):
                """Step t's scores (keys ``ks ..``; ``_mma._Held`` or ``_InTmem``) -> its
                probabilities (16-bit, dropout applied: the tile itself where P·V takes it from
                registers, else written to the step's P buffer and ``()``) and the new row max /
                sum / rescale factor; ``masked``: a partial tile. Two passes over the scores' column
                chunks (one chunk, the register tile, on sm_90a): the mods and the row max, then
                the exponents."""
                slot = _rem(t, stages)
                for c in range(n_cols):
                    plgpu.barrier_wait(col_bar.at[c * stages + slot])
                # Scores in base-2 units: log2(e) folded into the scale (one multiply) where no
                # score_mod reads the natural-unit score, else applied after it.
                base = scale * LOG2E if mods.score is None else scale
                # Chunks in tensor memory that nothing but the scale changes are not written back:
                # the second pass scales them again.
                rewrite = mods.score is not None or masked or not scores.chunked

                def modded(at, w, s):
                    shape = (R, w)
                    s = s * base
                    q_iota = q0 + arch.iota(shape, 0)
                    q_idx = jnp.minimum(q_iota, g.q_len - 1)
                    row_vals = tuple(arch.broadcast(x, shape, [0]) for x in row_vecs)
                    kv_iota = ks + at + arch.iota(shape, 1)
                    kv_idx = jnp.minimum(kv_iota, g.kv_len - 1)
                    col_vals = [arch.broadcast(_load(arch, _span(col_smem[c], (slot,), at, w, tk), 1), shape, [1])
                                for c in range(n_cols)]
                    srows, mrows = row_vals[:n_srows], row_vals[n_srows:]
                    scols, mcols = tuple(col_vals[:n_scols]), tuple(col_vals[n_scols:])
                    if mods.score is not None:
                        s = _mod_tile(mods.score, s, b, h, q_idx, kv_idx,
                                      _cast_back(mods.score, srows, mods.score.rows),
                                      _cast_back(mods.score, scols, mods.score.cols)) * LOG2E
                    if masked:
                        ok = (q_iota < g.q_len) & (kv_iota < g.kv_len)
                        if mods.mask is not None:
                            ok = ok & _mod_tile(mods.mask, None, b, h, q_idx, kv_idx,
                                                _cast_back(mods.mask, mrows, mods.mask.rows),
                                                _cast_back(mods.mask, mcols, mods.mask.cols))
                        s = jnp.where(ok, s, -jnp.inf)
                    return s

                m_new = m
                for at, w in scores.spans():
                    x = scores.load(at, w)
                    x = modded(at, w, x) if rewrite else x * base
                    m_new = jnp.maximum(m_new, x.max(axis=1))
                    if rewrite:
                        scores.store(at, w, x)
                scores.commit()
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                alpha = jnp.exp2(m - m_use)
                l = l * alpha
                ps = []
                for at, w in scores.spans():
                    x = scores.load(at, w)
                    x = x if rewrite else x * base
                    p = arch.exp2(x - arch.broadcast(m_use, (R, w), [0]))
                    l = l + p.sum(axis=1)
                    if drop is not None:
                        p = jnp.where(drop.keep(q_hash, drop.kv_hash(ks + at, w, 1, g.kv_len), (R, w), 0), p, 0.0)
                    if scores.chunked:
                        _span(p_buf(t), (slice(None),), at, w, tk)[...] = p.astype(dtype)
                    else:
                        ps.append(p.astype(dtype))
                if scores.chunked:
                    plgpu.commit_smem()
                    return (), m_new, l, alpha
                return ps[0], m_new, l, alpha

            def p_buf(t):  # sm_100a: step t's P tile, two buffers (P·V of step t - 1 may read the other)
                return my_p.at[_rem(t, 2)]

            def a_of(p, t):  # the A operand of step t's P·V
                return p_buf(t) if chunked else arch.a_operand(p, my_p, dtype)

            overlap = fwd_overlap(arch)
            chain_all = overlap and fwd_chain_partial(arch, D)  # the partial tiles chained too
            m0, l0 = arch.full(R, -jnp.inf), arch.full(R, 0.0)

            def pipelined_step(masked):
                def body(t, carry):  # Q K^T of tile t with P·V of tile t - 1
                    p, m, l, acc = carry
                    slot, prev = _rem(t, stages), _rem(t - 1, stages)
                    plgpu.barrier_wait(k_bar.at[slot])
                    plgpu.barrier_wait(v_bar.at[prev])
                    (p, m, l, alpha), acc = unit.qk_pv(
                        my_q, _t(arch, k_smem.at[slot]), acc, "o", a_of(p, t - 1),
                        v_smem.at[prev], lambda s: softmax(t, walk.tile(t) * tk, s, masked, m, l), (p, m, l, m),
                        after=sched_barrier)
                    plgpu.barrier_arrive(k_free.at[slot])
                    plgpu.barrier_arrive(v_free.at[prev])
                    return p, m, l, unit.scale(acc, "o", alpha)

                return body

            def qk_softmax(t, masked, wait_k, m, l, acc):
                """Q K^T of step t alone, its softmax, and O rescaled: a serial step's first half,
                and the pipelined part's first tile."""
                slot = _rem(t, stages)
                ks = walk.tile(t) * tk
                if wait_k:
                    plgpu.barrier_wait(k_bar.at[slot])
                s = unit.scores(my_q, _t(arch, k_smem.at[slot]), after=sched_barrier)
                plgpu.barrier_arrive(k_free.at[slot])
                p, m, l, alpha = softmax(t, ks, s, masked, m, l)
                return p, m, l, unit.scale(acc, "o", alpha)

            def pipelined(carry):
                """FlashAttention-3's intra-warpgroup overlap: the first tile's Q K^T and softmax, then
                each step's Q K^T with the previous tile's P·V (``unit.qk_pv``), then the last P·V.
                sm_90a: the full tiles (steps n_partial .. n); sm_100a (``chain_all``): every tile,
                the partial ones (steps 0 .. n_partial) masked."""
                if chain_all:
                    carry = lax.cond(walk.n_partial > 0, lambda c: qk_softmax(0, True, True, *c),
                                     lambda c: qk_softmax(0, False, True, *c), carry)
                    split = jnp.maximum(walk.n_partial, 1)
                    carry = lax.fori_loop(1, split, pipelined_step(True), carry)
                else:
                    carry = qk_softmax(walk.n_partial, False, True, *carry)
                    split = walk.n_partial + 1
                p, m, l, acc = lax.fori_loop(split, walk.n, pipelined_step(False), carry)
                last = _rem(walk.n - 1, stages)
                plgpu.barrier_wait(v_bar.at[last])
                acc = unit.add(acc, "o", a_of(p, walk.n - 1), v_smem.at[last], after=sched_barrier)
                plgpu.barrier_arrive(v_free.at[last])
                return m, l, acc

            # One tile per step: Q K^T, the softmax, P·V. sm_90a waits for the next K tile while P·V
            # runs; sm_100a's serial steps wait for each MMA as soon as it is issued, so there it
            # waits at the step's start (the early wait spilled 8 B per thread in the sm_100a
            # forward, "padding", D = 128).
            early_k = arch.name == "sm_90a"

            def serial_step(masked):
                def body(t, carry):
                    slot = _rem(t, stages)
                    # On sm_90a K's tile was waited for while the previous step's P·V ran (``pv_issued``).
                    p, m, l, acc = qk_softmax(t, masked, not early_k, *carry)
                    pa = a_of(p, t)
                    plgpu.barrier_wait(v_bar.at[slot])

                    def pv_issued():  # while P·V runs: hand over the tensor cores, wait for the next K
                        sched_barrier()
                        if early_k:
                            @pl.when(t + 1 < early_end)
                            def _():
                                plgpu.barrier_wait(k_bar.at[_rem(t + 1, stages)])

                    acc = unit.add(acc, "o", pa, v_smem.at[slot], after=pv_issued)
                    plgpu.barrier_arrive(v_free.at[slot])
                    return m, l, acc

                return body

            # Unless chained (``fwd_chain_partial``), the partial tiles one step each; with overlap
            # the full tiles then run pipelined (``pipelined`` waits for its own K tiles, so the
            # early waits stop at the last partial tile). A row with no tile to pipeline skips it.
            early_end = walk.n_partial if overlap else walk.n
            if early_k:
                @pl.when(early_end > 0)
                def _():
                    plgpu.barrier_wait(k_bar.at[0])

            carry = (m0, l0, unit.zeros("o"))
            if chain_all:
                carry = lax.cond(walk.n > 0, pipelined, lambda c: c, carry)
            else:
                carry = lax.fori_loop(0, walk.n_partial, serial_step(True), carry)
                if overlap:
                    carry = lax.cond(walk.n > walk.n_partial, pipelined, lambda c: c, carry)
                else:
                    carry = lax.fori_loop(walk.n_partial, walk.n, serial_step(False), carry)
            m, l, acc = carry
            pl.when(wg == 0)(sched_barrier)
            alive = l > 0
            inv = jnp.where(alive, 1.0 / jnp.where(alive, l, 1.0), 0.0)
            _store(my_q, unit.chunks(acc, "o"), inv, factor=drop.inv_keep if drop else None)
            stat_smem[wg, 0] = jnp.where(alive, m * LN2, 0.0)  # back to natural units
            stat_smem[wg, 1] = l
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(my_q, o_ref.at[b, pl.ds(q0, R), h])
            plgpu.copy_smem_to_gmem(stat_smem.at[wg, 0], m_ref.at[b, h, pl.ds(q0, R)])
            plgpu.copy_smem_to_gmem(stat_smem.at[wg, 1], l_ref.at[b, h, pl.ds(q0, R)])
            plgpu.wait_smem_to_gmem(0)

    tr = _transforms(dtype, tk)
    scratch = (
        (plgpu.SMEM((CONSUMERS, R, D), dtype, transforms=tr),
         _kt_smem(arch, stages, D, tk, dtype, tr),
         plgpu.SMEM((stages, tk, D), dtype, transforms=_p_transforms(arch, dtype, tk, tr)),
         _p_smem(arch, R, tk, dtype, tr),
         plgpu.SMEM((CONSUMERS, 2, R), jnp.float32),
         tuple(plgpu.SMEM((CONSUMERS, R), r.dtype) for r in rows),
         tuple(plgpu.SMEM((stages, tk), c.dtype) for c in cols)),
        (plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_barriers=CONSUMERS * (1 + n_rows)),
         plgpu.Barrier(num_barriers=max(n_cols, 1) * stages),
         plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
         plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
         plgpu.Barrier(num_arrivals=CONSUMERS)),
        arch.scratch(CONSUMERS, tk, {"o": D}),
    )
    vec = jax.ShapeDtypeStruct((B, Hq, g.sq), jnp.float32)
    call = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((B, g.sq, Hq, D), dtype), vec, vec),
        scratch_types=scratch,
        grid=(Hq, g.sq // (R * CONSUMERS), B),
        grid_names=("h", "q", "b"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        kernel_name="flexjax_mgpu_fwd",
        compiler_params=compiler_params(),
        interpret=_interpret_params() if interpret else None,
    )
    order = heaviest_first(kv_n, fkv_n, g.sub_q)
    return call(kv_n, kv_i, fkv_n, fkv_i, order, q, _kt(arch, k), v, *rows, *cols, *(_seed(seed) if rate else ()))



# -- backward --------------------------------------------------------------------------------

def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _without_add_any(fn, *args):
    """``fn(*args)`` traced and replayed with ``add_any`` (the cotangent sum of a value used twice)
    bound as ``lax.add``: Mosaic GPU has no lowering rule for it, and it is an elementwise add."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    jaxpr = closed.jaxpr
    env = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, jax.tree.leaves(args)))

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if eqn.primitive.name == "add_any":
            outs = [lax.add(*ins)]
        else:
            params = eqn.primitive.get_bind_params(eqn.params)
            # JAX 0.10 returns the params; older releases (subfuns, params).
            subfuns, params = params if isinstance(params, tuple) else ((), params)
            outs = eqn.primitive.bind(*subfuns, *ins, **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return jax.tree.unflatten(jax.tree.structure(out_shape), [read(v) for v in jaxpr.outvars])


def _score_vjp(cm, s_raw, b, h, q_idx, kv_idx, rows, cols):
    """The score_mod on a tile and its VJP in the raw scores and the float hoisted tiles.

    Returns ``(s, vjp)`` with ``vjp(ds) -> (ds_raw, d_rows, d_cols)``, None for non-float
    rows / columns. ``rows`` / ``cols`` are the kernels' float32 / int32 tiles; the mod
    sees its own dtypes.
    """
    fr = [i for i, x in enumerate(rows) if _is_float(x)]
    fc = [i for i, x in enumerate(cols) if _is_float(x)]

    def f(s, frows, fcols):
        r, c = list(rows), list(cols)
        for i, x in zip(fr, frows):
            r[i] = x
        for i, x in zip(fc, fcols):
            c[i] = x
        return cm.evaluate(s, b, h, q_idx, kv_idx, _cast_back(cm, r, cm.rows), _cast_back(cm, c, cm.cols), None)

    s, pull = jax.vjp(f, s_raw, [rows[i] for i in fr], [cols[i] for i in fc])

    def vjp(ds):
        ds_raw, d_fr, d_fc = _without_add_any(pull, ds)
        d_rows, d_cols = [None] * len(rows), [None] * len(cols)
        for i, d in zip(fr, d_fr):
            d_rows[i] = d
        for i, d in zip(fc, d_fc):
            d_cols[i] = d
        return ds_raw, d_rows, d_cols

    return s, vjp


def _tile_probs(arch, mods, qk, scale, lse2, delta, dp, b, h, q_idx, kv_idx, valid, masked, rows, cols, n_srows,
                n_scols, on_p=None, keep=None, inv_keep=1.0):
    """P (the probabilities that multiply dO: P, or under dropout P * keep / (1 - rate)) and dS
    (of the raw scores) of one tile, and the score_mod's row / column tile gradients.

    ``qk``: the tile's unscaled Q K^T; ``lse2`` (the rows' log-sum-exp in base-2 units, ``lse *
    LOG2E``) and ``delta`` are already broadcast to the tile; ``valid`` the padding test. ``dp``:
    dO V^T's tile, or a function that computes it, called after ``on_p(p)`` (so S^T and dP^T
    need not be live together); ``delta`` may be a function too, called after it. ``keep``:
    dropout's keep tile (then dP = dO V^T * keep / (1 - rate) and dS = P (dP - delta), with delta
    from the dropped output).
    """
    srows, mrows = rows[:n_srows], rows[n_srows:]
    scols, mcols = cols[:n_scols], cols[n_scols:]
    vjp = slope = None
    if mods.score is not None:
        s, vjp = _score_vjp(mods.score, qk * scale, b, h, q_idx, kv_idx, srows, scols)
        s2 = s * LOG2E
        if not any(_is_float(x) for x in (*srows, *scols)):
            # No hoisted float to differentiate: the VJP is the mod's elementwise slope times dS
            # (scalar semantics), so the slope is taken now and folded into P below; the mod's
            # residuals (soft-cap's tanh tile) need not live across dP.
            slope = vjp(plgpu.layout_cast(jnp.full(qk.shape, 1.0, jnp.float32), arch.layout(None)))[0]
            vjp = None
    else:
        s2 = qk * (scale * LOG2E)  # log2(e) folded into the scale
    p = arch.exp2(s2 - lse2)
    if masked:
        ok = valid
        if mods.mask is not None:
            ok = ok & _mod_tile(mods.mask, None, b, h, q_idx, kv_idx, _cast_back(mods.mask, mrows, mods.mask.rows),
                                _cast_back(mods.mask, mcols, mods.mask.cols))
        p = jnp.where(ok, p, 0.0)
    pv = p if keep is None else jnp.where(keep, p * inv_keep, 0.0)
    if on_p is not None:
        on_p(pv)
    if slope is not None:
        p = p * slope
    dp = dp() if callable(dp) else dp
    delta = delta() if callable(delta) else delta
    if keep is not None:
        dp = jnp.where(keep, dp * inv_keep, 0.0)
    ds = p * (dp - delta)
    if vjp is None:
        return pv, ds, [None] * n_srows, [None] * n_scols
    ds, d_rows, d_cols = vjp(ds)
    return pv, ds, d_rows, d_cols


def backward(gq: Geom, gk: Geom, mods: Mods, scale: float, q, k, v, do, lse, delta, lists_q, lists_kv, rows, cols,
             *, stages: int, interpret: bool, arch, rate: float = 0.0, seed=None):
    """dQ, dK, dV (padded) and the score_mod's row / column gradients.

    ``gq``: the dQ kernel's geometry (``cta_rows(arch)`` query rows per CTA, ``gq.tk`` keys per step);
    ``gk``: the dK/dV kernel's (``gk.tq`` queries per step, ``dkv_rows(arch)`` key rows per CTA); both with
    the same padded lengths. ``lse`` / ``delta`` (B, Hq, sq) float32; ``do`` in q's dtype.
    Returns ``(dq, dk, dv, d_rows, d_cols, ())``: per float score_mod row (B, Hq, sq, 1) and
    column (B, Hq, 1, skv) float32, None for the others.
    """
    n_srows = len(mods.score.rows) if mods.score is not None else 0
    n_scols = len(mods.score.cols) if mods.score is not None else 0
    d_row_ids = [i for i in range(n_srows) if _is_float(rows[i])]
    d_col_ids = [i for i in range(n_scols) if _is_float(cols[i])]
    dq, *d_rows = _dq(gq, mods, scale, q, k, v, do, lse, delta, lists_q, rows, cols, d_row_ids, n_srows, n_scols,
                      stages=stages, interpret=interpret, arch=arch, rate=rate, seed=seed)
    dk, dv, *d_cols = _dkv(gk, mods, scale, q, k, v, do, lse, delta, lists_kv, rows, cols, d_col_ids, n_srows,
                           n_scols, stages=stages, interpret=interpret, arch=arch, rate=rate, seed=seed)
    it_r, it_c = iter(d_rows), iter(d_cols)
    out_rows = tuple(next(it_r)[..., None] if i in d_row_ids else None for i in range(n_srows))
    out_cols = tuple(next(it_c)[..., None, :] if i in d_col_ids else None for i in range(n_scols))
    return dq, dk, dv, out_rows, out_cols, ()


def _call(kernel, out_type, scratch, grid, names, interpret, name, consumers=CONSUMERS):
    return plgpu.kernel(kernel, out_type=out_type, scratch_types=scratch, grid=grid, grid_names=names,
                        num_threads=consumers + 1, thread_name="wg", kernel_name=name,
                        compiler_params=compiler_params(), interpret=_interpret_params() if interpret else None)


def _dq(g: Geom, mods, scale, q, k, v, do, lse, delta, lists, rows, cols, d_row_ids, n_srows, n_scols, *,
        stages, interpret, arch, rate=0.0, seed=None):
    """dQ: per CTA two consumers of ``arch.rows`` query rows over the row's kv tiles; the producer
    streams K and V through the ring (S = Q K^T and dP = dO V^T through their transposed views, dS K),
    in the interpreter K^T, V^T (transposed in XLA) and K."""
    B, Hq, D, tk, R = g.B, g.Hq, q.shape[-1], g.tk, arch.rows
    dtype = q.dtype
    n_rows, n_cols, n_dr = len(rows), len(cols), len(d_row_ids)

    def kernel(*refs):
        it = iter(refs)
        kv_n_r, kv_i_r, fkv_n_r, fkv_i_r, order_r, q_ref, kt_ref, vt_ref, k_ref, do_ref, lse_ref, delta_ref = (
            next(it) for _ in range(12))
        row_refs = tuple(next(it) for _ in range(n_rows))
        col_refs = tuple(next(it) for _ in range(n_cols))
        seed_ref = next(it) if rate else None
        dq_ref = next(it)
        drow_refs = tuple(next(it) for _ in range(n_dr))
        (q_smem, do_smem, ds_smem, kt_smem, vt_smem, k_smem, vec_smem, row_smem, col_smem), bars, mma = (
            next(it), next(it), next(it))
        kt_bar, vt_bar, k_bar, q_bar, col_bar, kt_free, vt_free, k_free = bars
        nb = 4 + n_rows
        h, b = lax.axis_index("h"), lax.axis_index("b")
        wg = lax.axis_index("wg")
        kvh = _div(h, g.G)
        bm, hm = b if g.Bm > 1 else 0, h if g.Hm > 1 else 0
        i = order_r[bm, hm, lax.axis_index("q")]
        walk = _Lists(kv_n_r, kv_i_r, fkv_n_r, fkv_i_r, bm, hm, _div(i, g.sub_q), g.sub_k)

        def rb(ref):
            return ref.at[b if ref.shape[0] > 1 else 0, h if ref.shape[1] > 1 else 0]

        @pl.when(wg == CONSUMERS)
        def _producer():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

            @pl.loop(0, walk.n)
            def _(t):
                ks = walk.tile(t) * tk
                if not arch.views:  # the GPU form reads S's K^T from K's ring
                    _refill(t, stages, kt_free, kt_ref.at[b, kvh, :, pl.ds(ks, tk)], kt_smem, kt_bar)
                _refill(t, stages, vt_free, _kt_src(arch, vt_ref, b, kvh, ks, tk), vt_smem, vt_bar)
                _refill(t, stages, k_free, k_ref.at[b, pl.ds(ks, tk), kvh], k_smem, k_bar)
                # Column values are read before the consumers release K's slot (the step's last).
                _copy_cols([rb(ref) for ref in col_refs], col_smem, col_bar, _rem(t, stages), stages, ks, tk)

            _drain(walk.n, stages, *((vt_free, k_free) if arch.views else (kt_free, vt_free, k_free)))

        @pl.when(wg < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
            q0 = i * R * CONSUMERS + wg * R
            my_q, my_do = q_smem.at[wg], do_smem.at[wg]
            my_ds = None if arch.register_a else ds_smem.at[wg]
            unit = arch.unit(mma, wg, tk, {"dq": D})
            sl = pl.ds(q0, R)
            plgpu.copy_gmem_to_smem(q_ref.at[b, sl, h], my_q, q_bar.at[wg * nb])
            plgpu.copy_gmem_to_smem(do_ref.at[b, sl, h], my_do, q_bar.at[wg * nb + 1])
            plgpu.copy_gmem_to_smem(lse_ref.at[b, h, sl], vec_smem.at[wg, 0], q_bar.at[wg * nb + 2])
            plgpu.copy_gmem_to_smem(delta_ref.at[b, h, sl], vec_smem.at[wg, 1], q_bar.at[wg * nb + 3])
            for r, ref in enumerate(row_refs):
                plgpu.copy_gmem_to_smem(rb(ref).at[sl], row_smem[r].at[wg], q_bar.at[wg * nb + 4 + r])
            for r in range(nb):
                plgpu.barrier_wait(q_bar.at[wg * nb + r])
            shape = (R, tk)
            lse_v, delta_v = _load(arch, vec_smem.at[wg, 0], 0) * LOG2E, _load(arch, vec_smem.at[wg, 1], 0)
            row_vecs = [_load(arch, row_smem[r].at[wg], 0) for r in range(n_rows)]
            drop = _Drop(arch, rate, seed_ref, b, h) if rate else None
            q_hash = drop.q_hash(q0, R, 0, g.q_len) if drop else None

            def step(masked):
                def body(t, carry):
                    dq, drs = carry
                    slot = _rem(t, stages)
                    ks = walk.tile(t) * tk
                    if arch.views:
                        plgpu.barrier_wait(k_bar.at[slot])
                        qk = unit.fresh(my_q, _t(arch, k_smem.at[slot]))
                    else:
                        plgpu.barrier_wait(kt_bar.at[slot])
                        qk = unit.fresh(my_q, kt_smem.at[slot])
                        plgpu.barrier_arrive(kt_free.at[slot])
                    plgpu.barrier_wait(vt_bar.at[slot])
                    dp = unit.fresh(my_do, _t(arch, vt_smem.at[slot]))
                    plgpu.barrier_arrive(vt_free.at[slot])
                    q_iota = q0 + arch.iota(shape, 0)
                    q_idx = jnp.minimum(q_iota, g.q_len - 1)
                    row_vals = [arch.broadcast(x, shape, [0]) for x in row_vecs]
                    lse_t = arch.broadcast(lse_v, shape, [0])
                    delta_t = arch.broadcast(delta_v, shape, [0])
                    kv_iota = ks + arch.iota(shape, 1)
                    kv_idx = jnp.minimum(kv_iota, g.kv_len - 1)
                    col_vals = []
                    for c in range(n_cols):
                        plgpu.barrier_wait(col_bar.at[c * stages + slot])
                        col_vals.append(arch.broadcast(_load(arch, col_smem[c].at[slot], 1), shape, [1]))
                    valid = (q_iota < g.q_len) & (kv_iota < g.kv_len)
                    keep = drop.keep(q_hash, drop.kv_hash(ks, tk, 1, g.kv_len), shape, 0) if drop else None
                    _, ds, d_rows, _ = _tile_probs(arch, mods, qk, scale, lse_t, delta_t, dp, b, h, q_idx, kv_idx,
                                                   valid, masked, row_vals, col_vals, n_srows, n_scols, keep=keep,
                                                   inv_keep=drop.inv_keep if drop else 1.0)
                    dsa = arch.a_operand(ds, my_ds, dtype)
                    if not arch.views:  # else waited for S
                        plgpu.barrier_wait(k_bar.at[slot])

                    dq = unit.add(dq, "dq", dsa, k_smem.at[slot])
                    plgpu.barrier_arrive(k_free.at[slot])
                    drs = tuple(a + d_rows[r].sum(axis=1) for a, r in zip(drs, d_row_ids))
                    return dq, drs

                return body

            carry = (unit.zeros("dq"), tuple(arch.full(R, 0.0) for _ in d_row_ids))
            carry = lax.fori_loop(0, walk.n_partial, step(True), carry)
            dq, drs = lax.fori_loop(walk.n_partial, walk.n, step(False), carry)
            _store(my_q, unit.chunks(dq, "dq"), factor=scale)
            for r, d in enumerate(drs):
                vec_smem[wg, 2 + r] = d
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(my_q, dq_ref.at[b, sl, h])
            for r, ref in enumerate(drow_refs):
                plgpu.copy_smem_to_gmem(vec_smem.at[wg, 2 + r], ref.at[b, h, sl])
            plgpu.wait_smem_to_gmem(0)

    # One swizzle for every tile (wgmma takes both operands with the same): the key tile's.
    tr = _transforms(dtype, tk)
    scratch = (
        (plgpu.SMEM((CONSUMERS, R, D), dtype, transforms=tr),
         plgpu.SMEM((CONSUMERS, R, D), dtype, transforms=tr),
         () if arch.register_a else plgpu.SMEM((CONSUMERS, R, tk), dtype, transforms=tr),
         () if arch.views else plgpu.SMEM((stages, D, tk), dtype, transforms=tr),
         _kt_smem(arch, stages, D, tk, dtype, tr),
         plgpu.SMEM((stages, tk, D), dtype, transforms=tr),
         plgpu.SMEM((CONSUMERS, 2 + n_dr, R), jnp.float32),
         tuple(plgpu.SMEM((CONSUMERS, R), r.dtype) for r in rows),
         tuple(plgpu.SMEM((stages, tk), c.dtype) for c in cols)),
        (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_barriers=CONSUMERS * (4 + n_rows)),
         plgpu.Barrier(num_barriers=max(n_cols, 1) * stages),
         plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
         plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
         plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages)),
        arch.scratch(CONSUMERS, tk, {"dq": D}),
    )
    vec = jax.ShapeDtypeStruct((B, Hq, g.sq), jnp.float32)
    out_type = (jax.ShapeDtypeStruct((B, g.sq, Hq, D), dtype), *(vec for _ in d_row_ids))
    call = _call(kernel, out_type, scratch, (Hq, g.sq // (R * CONSUMERS), B), ("h", "q", "b"), interpret,
                 "flexjax_mgpu_dq")
    kv_n, kv_i, fkv_n, fkv_i = lists.by_q
    order = heaviest_first(kv_n, fkv_n, g.sub_q)
    # The GPU form passes K twice (one operand, read as S's K^T through views and as dS K's K).
    return call(kv_n, kv_i, fkv_n, fkv_i, order, q, _kt(arch, k), _kt(arch, v), k, do, lse, delta, *rows, *cols,
                *(_seed(seed) if rate else ()))


def _dkv(g: Geom, mods, scale, q, k, v, do, lse, delta, lists, rows, cols, d_col_ids, n_srows, n_scols, *,
         stages, interpret, arch, rate=0.0, seed=None):
    """dK, dV: per CTA ``dkv_consumers(arch)`` consumers of ``arch.rows`` key rows over the query heads of the
    GQA group and each head's column of q tiles; the producer streams Q and dO (S^T = K Q^T and dP^T =
    V dO^T through their transposed views; dS^T Q and P^T dO), lse, delta and the hoisted rows through
    the ring; in the interpreter also Q^T and dO^T, transposed in XLA."""
    B, Hq, Hkv, D, tq, R = g.B, g.Hq, g.Hkv, q.shape[-1], g.tq, arch.rows
    W = dkv_consumers(arch)
    tq_m = dkv_masked_q(arch, D, tq)
    dtype = q.dtype
    n_rows, n_cols, n_dc = len(rows), len(cols), len(d_col_ids)
    q_n, q_i, fq_n, fq_i = lists.by_kv

    def kernel(*refs):
        it = iter(refs)
        (q_n_r, q_i_r, fq_n_r, fq_i_r, order_r, qt_ref, dot_ref, q_ref, do_ref, k_ref, v_ref, lse_ref, delta_ref,
         pos_ref) = (next(it) for _ in range(14))
        row_refs = tuple(next(it) for _ in range(n_rows))
        col_refs = tuple(next(it) for _ in range(n_cols))
        seed_ref = next(it) if rate else None
        dk_ref, dv_ref = next(it), next(it)
        dcol_refs = tuple(next(it) for _ in range(n_dc))
        (k_smem, v_smem, p_smem, ring, vec_ring, pos_smem, col_smem, dcol_smem), bars, mma = (
            next(it), next(it), next(it))
        qt_smem, dot_smem, q_smem, do_smem = ring
        ring_bar, ring_free, vec_bar, kv_bar = bars
        kvh, b = lax.axis_index("h"), lax.axis_index("b")
        j = order_r[b if order_r.shape[0] > 1 else 0, 0, lax.axis_index("k")]
        wg = lax.axis_index("wg")
        col = _div(j, g.sub_k)

        def walk_of(h):
            return _Lists(q_n_r, q_i_r, fq_n_r, fq_i_r, b if g.Bm > 1 else 0, h if g.Hm > 1 else 0, col, g.sub_q)

        def rb(ref, h):
            return ref.at[b if ref.shape[0] > 1 else 0, h if ref.shape[1] > 1 else 0]

        n_vec = 2 + n_rows

        @pl.when(wg == W)
        def _producer():
            if W > 1:
                plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

            def head(gi, t0):
                h = kvh * g.G + gi
                walk = walk_of(h)

                @pl.loop(0, walk.n)
                def _(u):
                    t = t0 + u
                    slot = _rem(t, stages)
                    qs = walk.tile(u) * tq

                    @pl.when(t >= stages)
                    def _():
                        plgpu.barrier_wait(ring_free.at[slot])

                    if not arch.views:  # the GPU form reads Q^T and dO^T from Q's and dO's rings
                        for n, (src, dst) in enumerate(((qt_ref, qt_smem), (dot_ref, dot_smem))):
                            plgpu.copy_gmem_to_smem(src.at[b, h, :, pl.ds(qs, tq)], dst.at[slot],
                                                    ring_bar.at[n * stages + slot])
                    for n, (src, dst) in enumerate(((q_ref, q_smem), (do_ref, do_smem))):
                        plgpu.copy_gmem_to_smem(src.at[b, pl.ds(qs, tq), h], dst.at[slot],
                                                ring_bar.at[(2 + n) * stages + slot])
                    vecs = (lse_ref.at[b, h], delta_ref.at[b, h]) + tuple(rb(r, h) for r in row_refs)
                    for n, src in enumerate(vecs):
                        plgpu.copy_gmem_to_smem(src.at[pl.ds(qs, tq)], vec_ring[n].at[slot],
                                                vec_bar.at[n * stages + slot])

                return t0 + walk.n

            _drain(lax.fori_loop(0, g.G, head, jnp.int32(0)), stages, ring_free)

        @pl.when(wg < W)
        def _consumer():
            if W > 1:
                plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
            k0 = j * R * W + wg * R
            sl = pl.ds(k0, R)
            my_k, my_v = k_smem.at[wg], v_smem.at[wg]
            my_p = None if arch.register_a else p_smem.at[wg]
            unit = arch.unit(mma, wg, tq, {"dk": D, "dv": D})
            plgpu.copy_gmem_to_smem(k_ref.at[b, sl, kvh], my_k, kv_bar.at[wg * 2])
            plgpu.copy_gmem_to_smem(v_ref.at[b, sl, kvh], my_v, kv_bar.at[wg * 2 + 1])
            plgpu.copy_gmem_to_smem(pos_ref, pos_smem.at[wg], kv_bar.at[W * 3 + wg])
            plgpu.barrier_wait(kv_bar.at[wg * 2])
            plgpu.barrier_wait(kv_bar.at[wg * 2 + 1])
            plgpu.barrier_wait(kv_bar.at[W * 3 + wg])

            def head(gi, carry):
                dk, dv, t0 = carry
                h = kvh * g.G + gi
                walk = walk_of(h)
                drop = _Drop(arch, rate, seed_ref, b, h) if rate else None
                kv_hash = drop.kv_hash(k0, R, 0, g.kv_len) if drop else None
                # Column values (per key) of this head: fixed over the head's walk.
                col_vals = []
                for c, ref in enumerate(col_refs):
                    plgpu.copy_gmem_to_smem(rb(ref, h).at[sl], col_smem[c].at[wg], kv_bar.at[W * 2 + wg])
                    plgpu.barrier_wait(kv_bar.at[W * 2 + wg])
                    col_vals.append(_load(arch, col_smem[c].at[wg], 0))

                def step(masked):
                    # A masked step runs as sub-steps of ``tq_m`` queries (``dkv_masked_q``) over
                    # slices of its ring slot; a full step is one tile of ``tq``.
                    w = tq_m if masked else tq

                    def part(dk, dv, dcs, slot, qs, off):
                        def q_at(ref, *lead):  # ``ref.at[lead]``'s queries off .. off + w (the next axis)
                            return _span(ref, lead, off, w, tq)

                        def q_cols(ref):  # the same queries of a (D, tq) slot of Q^T or dO^T (interpreter)
                            return q_at(ref, slot, slice(None))

                        def vec(n):
                            return q_at(vec_ring[n], slot)

                        shape = (R, w)
                        q_tile, do_tile = q_at(q_smem, slot), q_at(do_smem, slot)
                        # S^T = K Q^T and dP^T = V dO^T: on the GPU through the transposed views of
                        # the Q and dO tiles, in the interpreter from Q^T and dO^T's.
                        qkt = unit.fresh(my_k, _t(arch, q_tile) if arch.views else q_cols(qt_smem))
                        lse_t = arch.broadcast(_load(arch, vec(0), 1) * LOG2E, shape, [1])

                        def delta_t():  # read once dP^T is formed: the tile is not live across the MMAs
                            return arch.broadcast(_load(arch, vec(1), 1), shape, [1])
                        row_vals = [arch.broadcast(_load(arch, vec(2 + r), 1), shape, [1]) for r in range(n_rows)]
                        col_tiles = [arch.broadcast(x, shape, [0]) for x in col_vals]
                        kv_iota = k0 + arch.iota(shape, 0)
                        kv_idx = jnp.minimum(kv_iota, g.kv_len - 1)
                        # The queries' offsets in the step (off .. off + w - 1, one per column) are read
                        # from shared memory each step, not an iota: an iota's values are fixed over the
                        # walk and LLVM held them in registers across it (16 a thread at w = 64); on JAX
                        # 0.11.2's stack causal + soft-cap (GQA) then spilled in its steps.
                        pos = _load(arch, q_at(pos_smem, wg), 1)
                        q_iota = qs + arch.broadcast(pos, shape, [1])
                        q_idx = jnp.minimum(q_iota, g.q_len - 1)
                        valid = (q_iota < g.q_len) & (kv_iota < g.kv_len)
                        keep = drop.keep(drop.q_hash(qs + off, w, 1, g.q_len), kv_hash, shape, 1) if drop else None
                        p_at = None if my_p is None else (my_p if w == tq else my_p.at[:, pl.ds(0, w)])
                        dvs = [dv]

                        def dv_step(pt):  # dV += P^T dO, before dP^T is formed (S^T and dP^T never both live)
                            dvs[0] = unit.add(dvs[0], "dv", arch.a_operand(pt, p_at, dtype), do_tile)

                        def dpt():
                            return unit.fresh(my_v, _t(arch, do_tile) if arch.views else q_cols(dot_smem))

                        _, dst, _, d_cols = _tile_probs(arch, mods, qkt, scale, lse_t, delta_t, dpt, b, h, q_idx,
                                                        kv_idx, valid, masked, row_vals, col_tiles, n_srows, n_scols,
                                                        on_p=dv_step, keep=keep,
                                                        inv_keep=drop.inv_keep if drop else 1.0)
                        dk = unit.add(dk, "dk", arch.a_operand(dst, p_at, dtype), q_tile)
                        dcs = tuple(a + d_cols[c].sum(axis=1) for a, c in zip(dcs, d_col_ids))
                        return dk, dvs[0], dcs

                    def body(u, c):
                        t = t0 + u
                        slot = _rem(t, stages)
                        qs = walk.tile(u) * tq
                        for n in range(2 if arch.views else 0, 4):  # (Q^T, dO^T in the interpreter), Q, dO
                            plgpu.barrier_wait(ring_bar.at[n * stages + slot])
                        for n in range(n_vec):
                            plgpu.barrier_wait(vec_bar.at[n * stages + slot])
                        for off in range(0, tq, w):
                            c = part(*c, slot, qs, off)
                        plgpu.barrier_arrive(ring_free.at[slot])
                        return c

                    return body

                c = (dk, dv, tuple(arch.full(R, 0.0) for _ in d_col_ids))
                c = lax.fori_loop(0, walk.n_partial, step(True), c)
                dk, dv, dcs = lax.fori_loop(walk.n_partial, walk.n, step(False), c)
                for n, d in enumerate(dcs):
                    dcol_smem[wg, n] = d
                if dcs:
                    plgpu.commit_smem()
                    for n, ref in enumerate(dcol_refs):
                        plgpu.copy_smem_to_gmem(dcol_smem.at[wg, n], ref.at[b, h, sl])
                    plgpu.wait_smem_to_gmem(0)
                return dk, dv, t0 + walk.n

            dk, dv, _ = lax.fori_loop(0, g.G, head, (unit.zeros("dk"), unit.zeros("dv"), jnp.int32(0)))
            _store(my_k, unit.chunks(dk, "dk"), factor=scale)
            _store(my_v, unit.chunks(dv, "dv"))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(my_k, dk_ref.at[b, sl, kvh])
            plgpu.copy_smem_to_gmem(my_v, dv_ref.at[b, sl, kvh])
            plgpu.wait_smem_to_gmem(0)

    # One swizzle for every tile (wgmma takes both operands with the same): that of a partial
    # sub-step's query tile (P^T dO and dS^T Q take K = tq_m; a 128-byte swizzle needs K >= 64).
    tr = tr_q = _transforms(dtype, tq_m)
    vec_dtypes = (jnp.float32, jnp.float32) + tuple(r.dtype for r in rows)
    transposed = () if arch.views else plgpu.SMEM((stages, D, tq), dtype, transforms=tr_q)
    scratch = (
        (plgpu.SMEM((W, R, D), dtype, transforms=tr),
         plgpu.SMEM((W, R, D), dtype, transforms=tr),
         () if arch.register_a else plgpu.SMEM((W, R, tq), dtype, transforms=tr_q),
         (transposed, transposed,
          plgpu.SMEM((stages, tq, D), dtype, transforms=tr), plgpu.SMEM((stages, tq, D), dtype, transforms=tr)),
         tuple(plgpu.SMEM((stages, tq), dt) for dt in vec_dtypes),
         plgpu.SMEM((W, tq), jnp.int32),
         tuple(plgpu.SMEM((W, R), c.dtype) for c in cols),
         plgpu.SMEM((W, max(n_dc, 1), R), jnp.float32)),
        (plgpu.Barrier(num_barriers=4 * stages),
         plgpu.Barrier(num_arrivals=W, num_barriers=stages),
         plgpu.Barrier(num_barriers=len(vec_dtypes) * stages),
         plgpu.Barrier(num_barriers=W * 4)),
        arch.scratch(W, tq, {"dk": D, "dv": D}),
    )
    vec = jax.ShapeDtypeStruct((B, Hq, g.skv), jnp.float32)
    out_type = (jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype),
                *(vec for _ in d_col_ids))
    call = _call(kernel, out_type, scratch, (g.skv // (R * W), Hkv, B), ("k", "h", "b"), interpret,
                 "flexjax_mgpu_dkv", consumers=W)
    # Heaviest key columns first, weighed over every head (a CTA walks the heads of its group).
    order = heaviest_first(q_n, fq_n, g.sub_k, axis_sum=1)
    # The GPU form passes Q and dO twice (read through transposed views; no XLA transposes).
    # ``pos``: 0 .. tq - 1, the query offsets within a step (``q_iota`` above).
    return call(q_n, q_i, fq_n, fq_i, order, _kt(arch, q), _kt(arch, do), q, do, k, v, lse, delta,
                jnp.arange(tq, dtype=jnp.int32), *rows, *cols,
                *(_seed(seed) if rate else ()))


def smem_bytes(D: int, tk: int, tq_dkv: int, stages: int, arch, itemsize: int = 2) -> dict[str, int]:
    """Shared memory of each kernel, from its scratch (barriers and the mods' row/column vectors aside),
    in ``arch``'s form: ``arch.rows`` rows per consumer (64 on sm_90a, 128 on sm_100a); no P / dS
    tile where the MMAs take A from registers, no transposed copies where they read views.

    Each 16-bit tile is rounded up to 1 KiB (a 128-byte swizzle's alignment).
    """
    R = rows = arch.rows
    a_tiles = 0 if arch.register_a else 1
    def tile(r, c, n=1):
        return n * -(-(r * c * itemsize) // 1024) * 1024

    # The forward's row statistics (max and sum, float32) count too: at the edge of the limit
    # (sm_100a, D = 64, block_kv = 128: 224 KiB of tiles) Mosaic GPU refused the kernel.
    fwd = (tile(R, D, CONSUMERS) + 2 * tile(tk, D, stages) + p_buffers(arch) * tile(R, tk, CONSUMERS)
           + CONSUMERS * 2 * R * 4)
    dq = (2 * tile(R, D, CONSUMERS) + a_tiles * tile(R, tk, CONSUMERS)
          + (2 if arch.views else 3) * tile(tk, D, stages))
    W = dkv_consumers(arch)
    dkv = (2 * tile(rows, D, W) + a_tiles * tile(rows, tq_dkv, W)
           + (2 if arch.views else 4) * tile(tq_dkv, D, stages))
    return {"fwd": fwd, "dq": dq, "dkv": dkv}


def tmem_columns(D: int, tk: int, tk_dq: int, tq_dkv: int) -> dict[str, int]:
    """Tensor-memory columns of each sm_100a kernel (128 lanes each): per consumer, a fresh slot as
    wide as its key (query) tile and ``D`` columns per accumulator (``_mma.Blackwell.columns``)."""
    from ._mma import Blackwell

    return {"fwd": CONSUMERS * Blackwell.columns(tk, {"o": D}),
            "dq": CONSUMERS * Blackwell.columns(tk_dq, {"dq": D}),
            "dkv": dkv_consumers(Blackwell()) * Blackwell.columns(tq_dkv, {"dk": D, "dv": D})}


# Tensor memory of an sm_100 SM: 128 lanes of 512 32-bit columns.
TMEM_COLUMNS = 512

# What an sm_90 / sm_100 block may opt into (cudaDevAttrMaxSharedMemoryPerBlockOptin on H100 / H200 / B200),
# less 2 KiB for the barriers and the per-row vectors.
SMEM_LIMIT = 232448 - 2048

__all__ = ["forward", "backward", "smem_bytes", "tmem_columns", "SMEM_LIMIT", "TMEM_COLUMNS", "cta_rows", "dkv_rows",
           "dkv_consumers", "CONSUMERS", "heaviest_first", "LN2", "fwd_chain_partial", "p_buffers"]
