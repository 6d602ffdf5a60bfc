"""The kernels' matrix units: Hopper's ``wgmma`` and Blackwell's ``tcgen05``, behind one interface.

Each consumer warpgroup of a kernel owns a ``Unit``; the kernels call only these methods, so the
producer, the block-sparse walk, the mods, the softmax and the epilogues are one code for both
architectures:

- ``fresh(a, b, after)``: ``a @ b`` (float32, ``(rows, n)``, in the arch's register layout),
  read by the caller; ``after`` runs once the MMA is issued (the forward's ping-pong barrier);
- ``scores(a, b, after)``: the same product as the forward's softmax reads it, in column spans
  (``spans``, ``load``, ``store``, ``commit``): ``_Held``, the register tile itself, on sm_90a;
  ``_InTmem``, left in tensor memory and read ``SCORE_CHUNK`` columns at a time, on sm_100a;
- ``zeros(name)``, ``add(acc, name, a, b, after)``, ``scale(acc, name, alpha)``,
  ``chunks(acc, name)``: a running ``(rows, D)`` float32 accumulator (``O``, ``dQ``, ``dK``,
  ``dV``) that the caller threads through its loops as ``acc``;
- ``qk_pv(...)``: a fresh product and an accumulating one issued together, with a function of
  the fresh one (its ``scores``) computed while the other runs (the forward's intra-warpgroup
  overlap).

Each arch has a GPU form and an interpreter form (``emulate=True``), for what Mosaic GPU's
interpreter cannot run. The GPU form reads K, V, Q and dO tiles through transposed views of their
shared-memory tiles (``views``: ``ref.transpose``; the interpreter has no transposed view,
so there the kernels take tiles transposed in XLA), and computes the softmax's exponent as one
``ex2.approx`` per element (``exp2``; exact ``jnp.exp2`` in the interpreter).

``Hopper`` (sm_90a): 64 rows per warpgroup (wgmma's M), each accumulator one (64, D) register
array that the accumulating wgmmas add into in place (``pl.run_state``), with the A operand of
P·V, dS·K, P^T·dO and dS^T·Q in registers (``register_a``: wgmma's register-A form; P never
goes to shared memory). ``Hopper(emulate=True)``, the interpreter's form (it has no
``run_state`` and takes no register operand): each MMA writes a fresh (64, 64) accumulator that
is added in registers, and A operands go through shared memory.

``Blackwell`` (sm_100a): 128 rows per warpgroup (tcgen05's M, one tensor-memory lane per
thread); the accumulators live in tensor memory (TMEM), so they cost no registers: ``add`` is an
MMA that accumulates there, ``scale`` a TMEM load, multiply and store, ``chunks`` the loads of
the epilogue (``acc`` is an empty tuple). Each MMA is issued by one thread, committed to a
barrier that orders the tensor core, and waited on before its result or inputs are touched;
``qk_pv`` commits its two MMAs to two barriers and waits for the second after the softmax.
The consumer's TMEM columns: one ``fresh`` slot as wide as the widest fresh product, then each
accumulator's ``D`` columns.

``Blackwell(emulate=True)``: the same kernels in Mosaic GPU's interpreter, which has no tcgen05
or TMEM: TMEM is a float32 shared-memory buffer and each MMA a (128-row) wgmma whose result is
stored or added there. Everything but the tcgen05 and TMEM operations runs as on the GPU.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# Columns of an accumulator per MMA / TMEM access: 64 (32 registers a thread at 64 rows, 64 at 128).
CHUNK = 64
# Columns of a TMEM accumulator per rescale (``_Tcgen05Unit.scale``).
SCALE_CHUNK = 8
# Columns of a score tile in tensor memory per load (``_InTmem``): 32 registers a thread. At
# 64 (the whole tile loaded at once) the sm_100a forward spilled 40-104 B per thread.
SCORE_CHUNK = 32


# log2(e): the kernels keep scores in base-2 units (``x * LOG2E``) so each exponent is one ``ex2``.
LOG2E = math.log2(math.e)


class _Arch:
    name: str
    rows: int
    tile_layout: object
    emulate: bool
    # MMAs take their A operand from registers (else from a shared-memory tile).
    register_a: bool = False

    @property
    def views(self) -> bool:
        """Tiles are read through transposed shared-memory views (the GPU form), not transposed in XLA."""
        return not self.emulate

    def exp2(self, x):
        """``2 ** x`` of a tile in the arch's layout: ``ex2.approx.ftz`` on the GPU (the softmax's
        exponent, as FlashAttention-3's; the mods' own math stays exact), ``jnp.exp2`` in the interpreter."""
        if self.emulate:
            return jnp.exp2(x)

        @plgpu.inline_mgpu(arg_types=(self.tile_layout,),
                           return_type=plgpu.ShapeDtypeStruct(x.shape, x.dtype, layout=self.tile_layout))
        def ex2(ctx, v):
            return v.exp2(approx=True)

        return ex2(x)

    def a_operand(self, x, smem, dtype):
        """The A operand of an MMA from the (rows, n) float32 tile ``x``: ``x`` in ``dtype`` itself
        where the MMA takes registers, else stored to the shared-memory tile ``smem``."""
        if self.register_a:
            return x.astype(dtype)
        smem[...] = x.astype(dtype)
        plgpu.commit_smem()
        return smem

    def layout(self, axis_kept: int | None):
        """The register layout of a tile (None) or of its rows (0: one value per row) / columns (1)."""
        if axis_kept is None:
            return self.tile_layout
        return self.tile_layout.reduce(1 - axis_kept)

    def iota(self, shape, dim: int):
        return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=self.tile_layout)

    def broadcast(self, x, shape, dims):
        """``lax.broadcast_in_dim`` into the arch's tile layout: a column vector's layout is the same
        for wgmma and tcgen05 tiles, so Mosaic GPU needs the result's layout named."""
        return plgpu.layout_cast(lax.broadcast_in_dim(x, shape, dims), self.tile_layout)

    def full(self, n: int, value: float):
        """A (rows,) float32 vector of ``value`` in the layout of a tile's rows."""
        return plgpu.layout_cast(jnp.full((n,), value, jnp.float32), self.layout(0))


class Hopper(_Arch):
    name, rows, tile_layout = "sm_90a", 64, plgpu.Layout.WGMMA

    def __init__(self, emulate: bool = False):
        self.emulate = emulate
        self.register_a = not emulate

    def scratch(self, units: int, fresh: int, accs: dict[str, int]):
        return ()

    def unit(self, scratch, index, fresh: int, accs: dict[str, int]):
        return _WgmmaUnit(self, accs)


class _WgmmaUnit:
    def __init__(self, arch, accs):
        self.arch, self.accs = arch, accs
        # On the GPU an accumulating wgmma adds into the live accumulator (``pl.run_state`` over
        # ``plgpu.ACC.init``); the interpreter has no ``run_state``, so there it writes a fresh
        # accumulator that is added in registers (32 more registers a thread while it lives).
        self.in_place = not arch.emulate

    def fresh(self, a, b, after=None):
        def mma(acc_ref):
            plgpu.wgmma(acc_ref, a, b)
            if after is not None:
                after()
            return acc_ref[...]

        return pl.run_scoped(mma, plgpu.ACC((self.arch.rows, b.shape[1]), jnp.float32))

    def scores(self, a, b, after=None):
        """``fresh``'s product as the forward's softmax reads it: held in registers (``_Held``)."""
        return _Held(self.fresh(a, b, after))

    def _width(self, name):
        # In place, one wgmma of N = D per step (FlashAttention-3's P·V shape); the interpreter's
        # fresh accumulators are (64, 64) chunks (each live beside the sum while it is added).
        return self.accs[name] if self.in_place else CHUNK

    def zeros(self, name):
        w = self._width(name)
        shape = (self.arch.rows, w)
        return tuple(plgpu.layout_cast(jnp.full(shape, 0.0, jnp.float32), self.arch.layout(None))
                     for _ in range(self.accs[name] // w))

    def add(self, acc, name, a, b, after=None):
        """``acc[c] + a @ b[:, c * w:(c + 1) * w]`` for each chunk ``c``; ``after`` once the last is issued.
        ``a``: a (rows, k) 16-bit array (``register_a``) or shared-memory tile."""
        w = self._width(name)
        if self.in_place:
            def mma(refs):
                for c, ref in enumerate(refs):
                    plgpu.wgmma(ref, a, b if len(refs) == 1 else b.at[:, pl.ds(c * w, w)])
                if after is not None:
                    after()

            return tuple(pl.run_state(mma)(tuple(plgpu.ACC.init(x) for x in acc)))
        out = []
        for c, x in enumerate(acc):
            last = after if c == len(acc) - 1 else None
            out.append(x + self.fresh(a, b.at[:, pl.ds(c * CHUNK, CHUNK)], last))
        return tuple(out)

    def qk_pv(self, a, b, acc, name, pa, v, soft, like, after=None):
        """FlashAttention-3's intra-warpgroup overlap: ``s = a @ b`` and ``acc += pa @ v`` issued
        together (``after`` once both are), then ``soft(_Held(s))`` computed while the second MMA runs.
        Returns (``soft(s)``, the new ``acc``); ``like``: arrays of ``soft``'s output shapes,
        dtypes and layouts.

        In place, both accumulators live in one ``pl.run_state``: ``s`` is read with
        ``wgmma_accumulator_load(wait_n=...)``, which waits for the Q K^T group only, and
        ``soft``'s outputs leave through plain state the run discharges. The interpreter's form
        issues P·V then Q K^T one after the other."""
        if not self.in_place:
            return _serial_qk_pv(self, a, b, acc, name, pa, v, soft, after)
        n, w = len(acc), self._width(name)
        s0 = plgpu.layout_cast(jnp.full((self.arch.rows, b.shape[1]), 0.0, jnp.float32),
                               self.arch.layout(None))

        def mma(refs):
            o_refs, s_ref, out_refs = refs[:n], refs[n], refs[n + 1:]
            plgpu.wgmma(s_ref, a, b)
            for c, ref in enumerate(o_refs):
                plgpu.wgmma(ref, pa, v if n == 1 else v.at[:, pl.ds(c * w, w)])
            if after is not None:
                after()
            s = plgpu.wgmma_accumulator_load(s_ref, wait_n=n)
            for ref, x in zip(out_refs, soft(_Held(s))):
                ref[...] = x

        outs = pl.run_state(mma)((*(plgpu.ACC.init(x) for x in acc), plgpu.ACC.init(s0), *like))
        # P·V reads ``pa``'s registers until the run's closing wait: an optimization barrier after
        # that wait keeps them live, so the new P is not computed into them while P·V runs (ptxas
        # then serializes every wgmma, C7513: "non wgmma instructions defining input registers").
        _, first = lax.optimization_barrier((pa, outs[n + 1]))
        return (first, *outs[n + 2:]), tuple(outs[:n])

    def scale(self, acc, name, alpha):
        return tuple(x * self.arch.broadcast(alpha, x.shape, [0]) for x in acc)

    def chunks(self, acc, name):
        return acc


def _serial_qk_pv(unit, a, b, acc, name, pa, v, soft, after):
    """``qk_pv`` in the interpreters' forms: P·V, then Q K^T and ``soft`` of it, one after the other."""
    acc = unit.add(acc, name, pa, v)
    return soft(unit.scores(a, b, after)), acc


class _Held:
    """A fresh product held in registers (sm_90a): one span, the tile itself; ``store`` replaces it."""
    chunked = False

    def __init__(self, x):
        self.x = x

    def spans(self):
        return ((0, self.x.shape[1]),)

    def load(self, at, w):
        return self.x

    def store(self, at, w, x):
        self.x = x

    def commit(self):
        pass


class _InTmem:
    """A fresh product of ``n`` columns left in its unit's fresh slot of tensor memory (sm_100a),
    read and rewritten ``SCORE_CHUNK`` columns at a time (``_Tcgen05Unit._cols``), so one chunk is
    live in registers (``SCORE_CHUNK`` a thread) however wide the tile."""
    chunked = True

    def __init__(self, unit, n: int):
        self.unit, self.n = unit, n

    def spans(self):
        return tuple((at, min(SCORE_CHUNK, self.n - at)) for at in range(0, self.n, SCORE_CHUNK))

    def load(self, at, w):
        return self.unit._load(self.unit._cols(self.unit.fresh_at + at, w))

    def store(self, at, w, x):
        self.unit._store(self.unit._cols(self.unit.fresh_at + at, w), x)

    def commit(self):
        """The stores visible to this thread's later loads."""
        self.unit._commit()


class Blackwell(_Arch):
    name, rows, tile_layout = "sm_100a", 128, plgpu.Layout.TCGEN05

    def __init__(self, emulate: bool = False):
        self.emulate = emulate

    @staticmethod
    def columns(fresh: int, accs: dict[str, int]) -> int:
        """TMEM columns of one unit: the fresh slot, then the accumulators."""
        return fresh + sum(accs.values())

    def scratch(self, units: int, fresh: int, accs: dict[str, int]):
        cols = units * self.columns(fresh, accs)
        # Two tensor-core barriers a unit: one for each MMA of ``qk_pv`` in flight together.
        if self.emulate:
            return (plgpu.SMEM((self.rows, cols), jnp.float32), plgpu.Barrier(num_barriers=2 * units))
        # Tensor memory is allocated in powers of two columns (32 to 512).
        alloc = max(32, 1 << (cols - 1).bit_length())
        return (plgpu.TMEM((self.rows, alloc), jnp.float32),
                plgpu.Barrier(num_barriers=2 * units, orders_tensor_core=True))

    def unit(self, scratch, index, fresh: int, accs: dict[str, int]):
        mem, bar = scratch
        base = index * self.columns(fresh, accs)
        offsets, at = {}, base + fresh
        for name, width in accs.items():
            offsets[name] = at
            at += width
        return _Tcgen05Unit(self, mem, (bar.at[2 * index], bar.at[2 * index + 1]), base, offsets, accs)


class _Tcgen05Unit:
    def __init__(self, arch, mem, bars, fresh_at, offsets, accs):
        self.arch, self.mem, (self.bar, self.bar2) = arch, mem, bars
        self.fresh_at, self.offsets, self.accs = fresh_at, offsets, accs
        self.emulate = arch.emulate

    def _cols(self, at: int, n: int):
        return self.mem.at[:, pl.ds(at, n)]

    def _mma(self, dst, a, b, accumulate: bool, after=None):
        if self.emulate:
            def mma(acc_ref):
                plgpu.wgmma(acc_ref, a, b)
                if after is not None:
                    after()
                return acc_ref[...]

            x = pl.run_scoped(mma, plgpu.ACC((self.arch.rows, b.shape[1]), jnp.float32))
            dst[...] = dst[...] + x if accumulate else x
            return
        self._issue(dst, a, b, accumulate, self.bar)
        if after is not None:
            after()
        plgpu.barrier_wait(self.bar)

    @staticmethod
    def _issue(dst, a, b, accumulate: bool, bar):
        """A tcgen05 MMA committed to ``bar``, not waited for."""
        plgpu.tcgen05_mma(dst, a, b, accumulate=accumulate)
        plgpu.tcgen05_commit_arrive(bar)

    def _load(self, ref):
        if self.emulate:
            return plgpu.layout_cast(ref[...], self.arch.layout(None))
        x = plgpu.async_load_tmem(ref, layout=self.arch.layout(None))
        plgpu.wait_load_tmem()
        return x

    def _store(self, ref, x):
        if self.emulate:
            ref[...] = x
        else:
            plgpu.async_store_tmem(ref, x)

    def _commit(self):
        if not self.emulate:
            plgpu.commit_tmem()

    def fresh(self, a, b, after=None):
        n = b.shape[1]
        return self.scores(a, b, after).load(0, n)

    def scores(self, a, b, after=None):
        """``a @ b`` left in the fresh slot of tensor memory, read in chunks by the softmax (``_InTmem``)."""
        n = b.shape[1]
        self._mma(self._cols(self.fresh_at, n), a, b, False, after)
        return _InTmem(self, n)

    def qk_pv(self, a, b, acc, name, pa, v, soft, like, after=None):
        """``s = a @ b`` into the fresh slot and ``acc += pa @ v`` issued together (``after`` once
        both are), each committed to its own tensor-core barrier; ``soft(_InTmem(s))`` runs once the first
        is waited for, while the second is in flight (FlashAttention-3's intra-warpgroup overlap,
        FlashAttention-4's asynchronous MMA chain). Returns (``soft(s)``, ``acc``); the second MMA
        is waited for before it returns (its A, P in shared memory, is then free). In the
        interpreter the two run one after the other."""
        if self.emulate:
            return _serial_qk_pv(self, a, b, acc, name, pa, v, soft, after)
        n = b.shape[1]
        self._issue(self._cols(self.fresh_at, n), a, b, False, self.bar)
        self._issue(self._cols(self.offsets[name], self.accs[name]), pa, v, True, self.bar2)
        if after is not None:
            after()
        plgpu.barrier_wait(self.bar)
        out = soft(_InTmem(self, n))
        plgpu.barrier_wait(self.bar2)
        return out, acc

    def zeros(self, name):
        z = plgpu.layout_cast(jnp.full((self.arch.rows, CHUNK), 0.0, jnp.float32), self.arch.layout(None))
        for c in range(self.accs[name] // CHUNK):
            self._store(self._cols(self.offsets[name] + c * CHUNK, CHUNK), z)
        self._commit()
        return ()

    def add(self, acc, name, a, b, after=None):
        self._mma(self._cols(self.offsets[name], self.accs[name]), a, b, True, after)
        return ()

    def scale(self, acc, name, alpha):
        # In the loop, 8 columns at a time: at 32 or 64 the sm_100a forward spilled 8 B per
        # thread at D = 128 (the "full" catalog entry), none at 16; with the exponent a bare
        # ex2.approx, 16 spilled 8 B ("padding", D = 128), none at 8.
        for c in range(self.accs[name] // SCALE_CHUNK):
            ref = self._cols(self.offsets[name] + c * SCALE_CHUNK, SCALE_CHUNK)
            x = self._load(ref)
            self._store(ref, x * self.arch.broadcast(alpha, x.shape, [0]))
        self._commit()
        return ()

    def chunks(self, acc, name):
        """A generator: each chunk is loaded when the caller takes it."""
        return (self._load(self._cols(self.offsets[name] + c * CHUNK, CHUNK))
                for c in range(self.accs[name] // CHUNK))


def for_capability(cc: int, interpret: bool) -> _Arch:
    """The matrix unit of compute capability ``cc`` (90 or 100), in its interpreter form when ``interpret``."""
    return Blackwell(emulate=interpret) if cc >= 100 else Hopper(emulate=interpret)
