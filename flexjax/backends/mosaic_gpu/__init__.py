"""The mosaic_gpu backend: warp-specialized block-sparse kernels in Pallas' Mosaic GPU dialect.

For NVIDIA GPUs of compute capability 9.0 (Hopper: ``wgmma`` from shared memory, accumulators
in registers) and 10.0 (Blackwell: ``tcgen05`` MMAs, accumulators in tensor memory), with TMA
copies and mbarriers on both; one kernel code, with the matrix unit picked by the compute
capability (``_mma``). On a CPU host the same kernels run in Mosaic GPU's interpreter (sm_100a's
with tcgen05 and tensor memory emulated), and ``kernel_options={"target": "cuda"}`` lowers them
for the GPU whatever the host. The kernels are ``_kernels``; what surrounds them (options,
padding, residuals, the gradients of captured arrays) is the kernel backends' shared front end.

What it takes, and what it refuses with a reason that ``backend=None`` falls past:
- 16-bit inputs (float16, bfloat16): the MMAs read 16-bit tiles; float32 is refused;
- head dims that are multiples of 64 and the value head dim equal to it, where the three kernels'
  shared memory fits a block (``_kernels.smem_bytes``) and, on sm_100a, their accumulators an
  SM's tensor memory (``_kernels.tmem_columns``): 64 and 128 (at 192 and 256 the backward's
  double-buffered Q, dO, Q^T and dO^T tiles do not fit);
- mods that read captured arrays only through hoisted rows and columns (indexed by b, h
  and q_idx, or b, h and kv_idx) and scalars; a read indexed by both q_idx and kv_idx
  (a relative-position table) is a gather, which the kernels do not do;
- compute capabilities 9.0 and 10.0 only;
- dropout is taken: the keep mask is ``_dropout``'s hash, regenerated per tile in the forward,
  dQ and dK/dV.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp

from ..._modcompiler import compile_mod
from .. import current_platform, platform_overridden
from .._contract import Implementation, always, planned, planner
from .._frontend import (
    TileOptions,
    backward_inputs,
    backward_results,
    basic_reason,
    check_options,
    dropout_args,
    fill,
    forward_results,
    prepare,
    target_and_interpret,
)
from .._layout import Mods, geometry, pad_axis, prologues

NAME = "mosaic_gpu"

# Mosaic GPU (jax.experimental.pallas.mosaic_gpu) imports absl-py, which JAX does not install, and a
# bare `pip install flexjax` must still serve every CPU call: the kernels load where their packages
# import, and elsewhere ``resolve`` refuses with the extra that brings them.
try:
    from . import _kernels, _mma
except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] in ("flexjax", "jax"):  # a flexjax bug, or a JAX too old: not a missing extra
        raise
    _kernels = _mma = None
    MISSING = (f"the mosaic_gpu backend needs the {e.name!r} package (Mosaic GPU imports it; JAX does not install "
               "it): pip install 'flexjax[gpu]'")
else:
    MISSING = None

_TARGETS = ("cuda",)
# Compute capabilities the kernels are written for: sm_90a (wgmma) and sm_100a (tcgen05, TMEM).
CAPABILITIES = (90, 100)


@dataclasses.dataclass(frozen=True)
class KernelOptions(TileOptions):
    """Options of the mosaic_gpu backend (no warps: every kernel runs three warpgroups, a producer and two
    consumers).

    Attributes (beyond ``target``, ``interpret`` and the tiles):
      block_q: the forward's and dQ's CTA: two consumer warpgroups of 64 query rows on sm_90a (128),
        of 128 on sm_100a (256).
      block_kv: the key tile the forward walks (32, 64 or 128; default ``heuristics``': 128 on sm_90a, 64 on sm_100a).
      bwd_block_kv: the key tile the dQ kernel walks (32, 64 or 128; default 64 on sm_90a).
      bwd_block_q: the query tile the dK/dV kernel walks (32 or 64; default 64 at head dim 64 on
        sm_90a, else 32); it owns 64 key rows per consumer warpgroup on sm_90a, 128 on sm_100a.
      num_stages, bwd_num_stages: depth of the TMA ring (>= 2).
      compute_capability: the GPU to compile for (90 or 100); default the device's, 90 from a CPU
        host. In the interpreter, 100 runs the sm_100a kernels with tcgen05 and tensor memory
        emulated (``_mma.Blackwell(emulate=True)``).
    """

    compute_capability: int | None = None


_FIELDS = tuple(f.name for f in dataclasses.fields(KernelOptions))


def _device_capability() -> int | None:
    if platform_overridden():
        return None
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return None
    major, _, minor = str(getattr(dev, "compute_capability", "")).partition(".")
    if not (major.isdigit() and (minor or "0").isdigit()):
        return None
    return int(major) * 10 + int(minor or 0)


def _host_target() -> str | None:
    return "cuda" if current_platform() in ("gpu", "cuda") else None


def heuristics(compute_capability: int = 90, head_dim: int = 128, dropout: bool = False) -> KernelOptions:
    """Default tiles (``_tile_reason`` checks that they fit the BlockMask's block), chosen from the compile
    suite's register and spill counts (tests_compile/mosaic_gpu_suite.py, every catalog entry).

    sm_90a: 128 query rows per CTA, 128 keys per forward step (FlashAttention-3's tile: the Q K^T
    wgmma is m64n128, P stays in registers as the P·V wgmma's A operand; with dropout at head dim
    128, 64 keys: at 128, 5 of the 10 catalog entries spilled 4-288 B per thread, mask-only ones
    too, so no rule by mod kind keeps it). The backward's
    dQ takes 64-key steps (S and dP m64n64). dK/dV (two consumer warpgroups, ``_kernels.
    dkv_consumers``) takes 64-query steps (S^T and dP^T m64n64). At head dim 128, where a thread's
    dK and dV accumulators take 128 of its 240 registers, its partial tiles run as two 32-query
    sub-steps (``_kernels.dkv_masked_q``: whole, they spilled 12-80 B per thread in the steps), and
    with dropout every step takes 32 queries (at 64 the full steps spilled 32-160 B in the loop).
    sm_100a: 256 query rows per CTA (two warpgroups of 128, tcgen05's M), 64 keys per forward
    step (Q K^T a tcgen05 MMA of N = 64; the scores stay in tensor memory and the softmax reads them
    32 columns at a time, ``_mma._InTmem``: loaded whole, a 64-key tile spilled 40-104 B per
    thread; 128 keys do not fit shared memory beside P's two buffers). On JAX 0.10 at head dim 128,
    32 keys: its Mosaic GPU lowering spilled 12-40 B per thread at 64, in the steps, on 17 of the
    18 configurations (JAX 0.11.2's compiles all 36 spill-free). The backward's tiles are 32 (a
    (128, n) tile loaded costs a thread n registers)."""
    if MISSING is not None:
        raise NotImplementedError(MISSING)
    arch = _mma.for_capability(compute_capability, False)
    if compute_capability >= 100:
        tk = 32 if head_dim > 64 and _kernels.JAX_010 else 64
        bwd_q, bwd_k = 32, 32
    else:
        tk = 64 if dropout and head_dim > 64 else 128
        bwd_q, bwd_k = (32 if dropout and head_dim > 64 else 64), 64
    return KernelOptions(target="cuda", interpret=False, block_q=_kernels.cta_rows(arch), block_kv=tk,
                         bwd_block_q=bwd_q, bwd_block_kv=bwd_k, num_stages=2, bwd_num_stages=2,
                         compute_capability=compute_capability)


def _resolve(spec, head_dim: int) -> KernelOptions:
    target, interpret = target_and_interpret(spec, _host_target())
    cc = spec.options.get("compute_capability") or _device_capability() or 90
    default = heuristics(100 if cc >= 100 else 90, head_dim, spec.dropout_rate > 0)
    return fill(KernelOptions, spec, default, target=target, interpret=interpret, compute_capability=cc)


def _arch(o: KernelOptions):
    return _mma.for_capability(o.compute_capability, o.interpret)


def _mods(spec) -> Mods:
    return Mods(score=compile_mod(spec.score, "mosaic_gpu") if spec.score is not None else None,
                mask=compile_mod(spec.mask, "mosaic_gpu") if spec.mask is not None else None)


def validate_options(spec) -> None:
    """Raises ValueError for an invalid value of one of this backend's kernel_options."""
    check_options(spec.options, spec.block_size, _TARGETS)
    cc = spec.options.get("compute_capability")
    if cc is not None and (isinstance(cc, bool) or not isinstance(cc, int) or cc <= 0):
        raise ValueError(f"kernel_options['compute_capability'] must be a positive int such as 90, got {cc!r}")
    for f in ("num_stages", "bwd_num_stages"):
        val = spec.options.get(f)
        if val is not None and val < 2:
            raise ValueError(f"kernel_options[{f!r}] must be >= 2 (the depth of the TMA ring), got {val}")


def _tile_reason(spec, o: KernelOptions) -> str | None:
    arch = _arch(o)
    cta, dkv = _kernels.cta_rows(arch), _kernels.dkv_rows(arch)
    if o.block_q != cta:
        return (f"the mosaic_gpu forward takes block_q={cta} on {arch.name} (two warpgroups of {arch.rows} rows), "
                f"got {o.block_q}")
    if o.bwd_block_q not in (32, 64):
        return f"the mosaic_gpu dK/dV kernel walks bwd_block_q of 32 or 64 queries, got {o.bwd_block_q}"
    if o.block_kv not in (32, 64, 128):
        return f"the mosaic_gpu forward takes block_kv of 32, 64 or 128, got {o.block_kv}"
    if o.bwd_block_kv not in (32, 64, 128):
        return f"the mosaic_gpu dQ kernel takes bwd_block_kv of 32, 64 or 128, got {o.bwd_block_kv}"
    bq, bk = spec.block_size
    for tile, base, what in ((o.block_q, bq, "block_q"), (o.bwd_block_q, bq, "bwd_block_q"),
                             (o.block_kv, bk, "block_kv"), (o.bwd_block_kv, bk, "bwd_block_kv"),
                             (dkv, bk, f"the dK/dV kernel's {dkv} key rows")):
        if tile % base and base % tile:
            return (f"{what} ({tile}) must divide the BlockMask's block ({base}) or be a multiple of it; rebuild "
                    "the BlockMask with a power-of-two block_size")
    return None


def resolve(spec, q, k, v) -> KernelOptions | str:
    """The call's options (``_resolve``) if the mosaic_gpu backend can serve it, else why not
    (``validate_options`` has run)."""
    if MISSING is not None:
        return MISSING
    basic = basic_reason(NAME, spec, q, _FIELDS, _host_target())
    if basic is not None:
        return basic
    if q.dtype not in (jnp.float16, jnp.bfloat16):
        return f"the mosaic_gpu backend takes float16 or bfloat16 inputs (wgmma reads 16-bit tiles), got {q.dtype}"
    D, Dv = q.shape[-1], v.shape[-1]
    if D % 64 or D > 256:
        return f"the mosaic_gpu backend takes head dims that are multiples of 64 up to 256, got {D}"
    if Dv != D:
        return f"the mosaic_gpu backend takes a value head dim equal to the query's ({D}), got {Dv}"
    o = _resolve(spec, D)
    if o.target == "cuda" and o.compute_capability not in CAPABILITIES:
        return (f"the mosaic_gpu kernels are written for compute capabilities 9.0 (wgmma) and 10.0 (tcgen05), got "
                f"{o.compute_capability / 10:.1f}")
    if o.interpret and _xla_cpu_threads() < _INTERPRETER_THREADS:
        return (f"Mosaic GPU's interpreter needs at least {_INTERPRETER_THREADS} XLA:CPU threads (its simulated "
                f"warpgroups block on barriers), and this host gives XLA {_xla_cpu_threads()}; set NPROC=16 in the "
                "environment before JAX starts, or use backend='pallas' or 'xla' on CPU")
    reason = _tile_reason(spec, o)
    if reason is not None:
        return reason
    smem = _kernels.smem_bytes(D, o.block_kv, o.bwd_block_q, o.num_stages, _arch(o))
    smem_bwd = _kernels.smem_bytes(D, o.bwd_block_kv, o.bwd_block_q, o.bwd_num_stages, _arch(o))
    for kernel, need in (("forward", smem["fwd"]), ("dQ", smem_bwd["dq"]), ("dK/dV", smem_bwd["dkv"])):
        if need > _kernels.SMEM_LIMIT:
            return (f"the mosaic_gpu {kernel} kernel needs {need // 1024} KiB of shared memory at head dim {D} "
                    f"(tiles block_kv={o.block_kv}, bwd_block_kv={o.bwd_block_kv}, stages {o.num_stages}/"
                    f"{o.bwd_num_stages}), over the {_kernels.SMEM_LIMIT // 1024} KiB a block has; head dims "
                    "64 and 128 fit, or use backend='triton'")
    if isinstance(_arch(o), _mma.Blackwell):
        tmem = _kernels.tmem_columns(D, o.block_kv, o.bwd_block_kv, o.bwd_block_q)
        for kernel, need in tmem.items():
            if need > _kernels.TMEM_COLUMNS:
                return (f"the mosaic_gpu sm_100a {kernel} kernel needs {need} tensor-memory columns at head dim {D} "
                        f"(tiles block_kv={o.block_kv}, bwd_block_kv={o.bwd_block_kv}, bwd_block_q={o.bwd_block_q}), "
                        f"over the {_kernels.TMEM_COLUMNS} an SM has; use smaller tiles")
    try:
        _mods(spec)
    except NotImplementedError as e:
        return str(e)
    return o


plan = planner(__name__)


# XLA:CPU threads that Mosaic GPU's interpreter needs: each simulated warpgroup is a computation
# whose barrier waits block one of XLA:CPU's pool threads (sized by the cores, or NPROC); with 2 the
# three warpgroups of a kernel hung, with 4 they ran (tests/conftest.py sets NPROC=16).
_INTERPRETER_THREADS = 4


def _xla_cpu_threads() -> int:
    nproc = os.environ.get("NPROC", "")
    if nproc.isdigit() and int(nproc) > 0:
        return int(nproc)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


FORWARD = (Implementation("warp_specialized", always),)
BACKWARD = (Implementation("warp_specialized", always),)


def _hoisted(pros):
    """The kernels' row and column operands: (B', H', n), float32 or int32 (bools as int32)."""
    rows, cols = [], []
    for pro in pros:
        rows += [_as_kernel(r[..., 0]) for r in pro.rows]
        cols += [_as_kernel(c[..., 0, :]) for c in pro.cols]
    return tuple(rows), tuple(cols)


def _as_kernel(x):
    return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.int32)


def forward_with_residuals(spec, q, k, v, score_consts, mask_consts, lists, dropout_seed=None, plan=None):
    """out, lse and the rows' ``Residuals`` (B, Hq, Sq) float32, with ``plan``'s options."""
    o = planned(sys.modules[__name__], plan, spec, q, k, v, score_consts, mask_consts, lists, dropout_seed).options
    mods = _mods(spec)
    g, lists, qp, kp, vp = prepare(spec, q, k, v, lists, o.block_q, o.block_kv)
    rows, cols = _hoisted(prologues(mods, score_consts, mask_consts, g))
    out, row_max, row_sum = _kernels.forward(g, mods, spec.scale, qp, kp, vp, lists, rows, cols,
                                             stages=o.num_stages, interpret=o.interpret, block_kv=o.block_kv,
                                             arch=_arch(o), **dropout_args(spec, dropout_seed))
    return forward_results(q, v, out, row_max, row_sum)


def backward(spec, q, k, v, out, lse, dout, dlse, score_consts, mask_consts, lists, grad_consts, residuals,
             dropout_seed=None, plan=None):
    """dq, dk, dv and the score_mod's captured-array gradients (through the prologue's VJP)."""
    o = planned(sys.modules[__name__], plan, spec, q, k, v, score_consts, mask_consts, lists, dropout_seed).options
    mods = _mods(spec)
    # dQ walks (block_q query rows, bwd_block_kv keys) tiles, dK/dV (bwd_block_q, the consumer's key
    # rows): both pad to the larger of their sequence lengths, with the lists regrouped for each.
    arch = _arch(o)
    gq, lists_q = geometry(spec, q, k, lists, _kernels.cta_rows(arch), o.bwd_block_kv)
    gk, lists_kv = geometry(spec, q, k, lists, o.bwd_block_q, _kernels.dkv_rows(arch))
    sq, skv = max(gq.sq, gk.sq), max(gq.skv, gk.skv)
    g, gk = dataclasses.replace(gq, sq=sq, skv=skv), dataclasses.replace(gk, sq=sq, skv=skv)
    qp, kp, vp = pad_axis(q, 1, sq), pad_axis(k, 1, skv), pad_axis(v, 1, skv)
    rows, cols = _hoisted(prologues(mods, score_consts, mask_consts, g))
    lse_safe, delta, dop = backward_inputs(q, out, lse, dout, dlse, residuals, g, vp.shape[-1])
    grads = _kernels.backward(g, gk, mods, spec.scale, qp, kp, vp, dop, lse_safe, delta, lists_q, lists_kv,
                              rows, cols, stages=o.bwd_num_stages, interpret=o.interpret, arch=arch,
                              **dropout_args(spec, dropout_seed))
    return backward_results(spec, q, v, g, mods.score, score_consts, any(grad_consts), grads)
