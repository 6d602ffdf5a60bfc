"""The pallas backend: block-sparse FlashAttention kernels with the user's mods compiled in.

GPU kernels go through Pallas' Triton lowering, TPU kernels through Mosaic with the tile
lists as scalar prefetch; on a CPU host the GPU template runs with ``interpret=True``.
``kernel_options={"target": "cuda" | "tpu"}`` emits that platform's kernel whatever the
host, so lowering and AOT compilation work from a CPU machine.
"""

from __future__ import annotations

import dataclasses
import sys

import jax.numpy as jnp

from ..._modcompiler import compile_mod
from .. import current_platform
from .._contract import Implementation, always, planned, planner
from .._frontend import (
    TILE_FIELDS,
    KernelOptionsBase,
    backward_inputs,
    backward_results,
    basic_reason,
    check_options,
    dropout_args,
    fill,
    forward_results,
    pow2_dim,
    prepare,
    target_and_interpret,
)
from .._layout import Mods, prologues
from .._tile_tables import PALLAS_SM90
from . import _decode, _gpu, _tpu

NAME = "pallas"

_TARGETS = ("cuda", "tpu")


@dataclasses.dataclass(frozen=True)
class KernelOptions(KernelOptionsBase):
    """Options of the pallas backend (``flex_attention(..., kernel_options={...})``): those of
    ``_frontend.KernelOptionsBase``.

    ``target`` is "cuda" or "tpu"; on a host without a GPU, JAX 0.11 lowers "cuda" kernels
    only inside ``jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",),
    abstract_device=AbstractDevice("NVIDIA H100", 1, "cuda")))``, which names the GPU to
    compile for (0.10 assumed sm_90), with ``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``.
    From JAX 0.11 that mesh's axes are Explicit, where eager ops fail: build inputs and other
    arrays before entering it (``create_block_mask`` steps out of it by itself). On a CPU host
    without a target the GPU template runs in Pallas' interpreter.
    """


_FIELDS = tuple(f.name for f in dataclasses.fields(KernelOptions))


def heuristics(target: str, block_size: tuple[int, int], head_dim: int, dtype=jnp.bfloat16) -> KernelOptions:
    """Default tiles and launch parameters for ``target`` ("cuda", "tpu" or "interpret").

    cuda: per dtype width and head dim from the sm_90 compile suite (``_tile_tables.PALLAS_SM90``; not yet
    timed on hardware: benchmarks/gpu_check.sh measures on a GPU).
    """
    bq, bkv = block_size
    if target == "cuda":
        # Triton pads the head dim to a power of two (>= 16); above 256, the 256 row.
        d = min(max(64, 1 << (int(head_dim) - 1).bit_length()), 256)
        fwd, bwd = PALLAS_SM90[(min(jnp.dtype(dtype).itemsize, 4), d)]
        return KernelOptions(target=target, interpret=False, block_q=_fit(fwd.block_q, bq),
                             block_kv=_fit(fwd.block_kv, bkv), bwd_block_q=_fit(bwd.block_q, bq),
                             bwd_block_kv=_fit(bwd.block_kv, bkv), num_warps=fwd.num_warps,
                             num_stages=fwd.num_stages, bwd_num_warps=bwd.num_warps, bwd_num_stages=bwd.num_stages)
    if target == "tpu":
        # Splash attention's defaults are 512-wide tiles; 128 is the lane width that every
        # kv tile must be a multiple of, and the smallest that keeps the MXU busy.
        return KernelOptions(target=target, interpret=False, block_q=max(bq, 128), block_kv=max(bkv, 128),
                             bwd_block_q=max(bq, 128), bwd_block_kv=max(bkv, 128))
    # Interpret mode: the mask's own block, so each interpreted step is one mask tile.
    return KernelOptions(target=None, interpret=True, block_q=bq, block_kv=bkv, bwd_block_q=bq,
                         bwd_block_kv=bkv)


def _fit(tile: int, block: int) -> int:
    """``tile`` if it divides ``block``, else the block itself (a coarser tile is not needed)."""
    return tile if block % tile == 0 else block


def _host_target() -> str | None:
    platform = current_platform()
    return {"gpu": "cuda", "cuda": "cuda", "rocm": None, "tpu": "tpu"}.get(platform)


def _resolve(spec, head_dim: int, dtype) -> KernelOptions:
    target, interpret = target_and_interpret(spec, _host_target())
    default = heuristics("interpret" if interpret else target, spec.block_size, head_dim, dtype)
    return fill(KernelOptions, spec, default, target=target, interpret=interpret)


def _compile_target(o: KernelOptions) -> str:
    return o.target if o.target is not None else "interpret"


def _mods(spec, o: KernelOptions) -> Mods:
    t = _compile_target(o)
    return Mods(score=compile_mod(spec.score, t) if spec.score is not None else None,
                mask=compile_mod(spec.mask, t) if spec.mask is not None else None)


def validate_options(spec) -> None:
    """Raises ValueError for an invalid value of one of this backend's kernel_options."""
    check_options(spec.options, spec.block_size, _TARGETS)


def resolve(spec, q, k, v) -> KernelOptions | str:
    """The call's options (``_resolve``) if the pallas backend can serve it, else why not (``validate_options``
    has run)."""
    basic = basic_reason(NAME, spec, q, _FIELDS, _host_target())
    if basic is not None:
        return basic
    o = _resolve(spec, q.shape[-1], q.dtype)
    if o.target == "cuda" and not o.interpret:
        for f in TILE_FIELDS:
            val = getattr(o, f)
            if val < 16 or val & (val - 1):
                return (f"Triton tiles must be powers of two >= 16, got {f}={val}; set kernel_options "
                        f"{f!r} or build the BlockMask with block_size >= 16")
    if o.target == "tpu":
        for f in TILE_FIELDS:
            base = spec.block_size[0] if f.endswith("block_q") else spec.block_size[1]
            if getattr(o, f) % base:
                return (f"TPU tiles must be multiples of the BlockMask's block ({base}), got {f}={getattr(o, f)}; "
                        "set kernel_options or rebuild the BlockMask with a smaller block_size")
    if o.target == "tpu" and not o.interpret and q.dtype == jnp.float16:
        # Measured by tests_compile on v5e: every kernel fails in Mosaic with "Invalid vector type for load".
        return ("Mosaic TPU cannot load float16 vectors (TPU v5e: 'Invalid vector type for load'); pass "
                "bfloat16 or float32 inputs, or use backend='xla'")
    if o.target == "tpu" and not o.interpret:
        for f in TILE_FIELDS:
            val, unit = getattr(o, f), (128 if "kv" in f else 8)
            if val % unit:
                return (f"Mosaic TPU tiles need {'kv' if unit == 128 else 'q'} sizes that are multiples of "
                        f"{unit}, got {f}={val}; set kernel_options {f!r}")
    try:
        _mods(spec, o)
    except NotImplementedError as e:
        return str(e)
    return o


plan = planner(__name__)


def _prepare(spec, q, k, v, lists, o: KernelOptions, backward: bool):
    tq, tk = (o.bwd_block_q, o.bwd_block_kv) if backward else (o.block_q, o.block_kv)
    # Triton tiles need power-of-two head dims (``pow2_dim``); Mosaic takes the head dim as it is.
    return prepare(spec, q, k, v, lists, tq, tk, pow2_dim if o.target == "cuda" else (lambda n: n))


def _decode_reason(spec, q, k, v, lists, options, **_) -> str | None:
    """None where the decode kernel serves (few queries: KV split over programs, merged by lse).

    On TPU, calls the decode kernel cannot serve take the tiled kernels, which are exact too.
    """
    o = options
    if not _decode.serves(spec, q, o):
        return f"{spec.q_len} queries or options the decode kernel does not take"
    return _decode.tpu_reason(spec, q, v, lists, _mods(spec, o)) if o.target == "tpu" else None


# The ways this backend serves each pass, in the order they are tried (``_contract.make_plan``):
# the decode kernel, then the tiled kernels (``_gpu``: Pallas' Triton lowering or its interpreter;
# ``_tpu``: Mosaic), which serve every call ``resolve`` accepts.
FORWARD = (Implementation("decode", _decode_reason), Implementation("tiled", always))
BACKWARD = (Implementation("tiled", always),)


def supports_paged(spec, q, k, v, lists, options) -> str | None:
    """None where the decode kernel serves a paged call (``k`` / ``v`` stand for the logical cache) with the
    options ``resolve`` gave."""
    o = options
    if not _decode.serves(spec, q, o):
        return (f"the pallas paged kernel serves Sq <= {_decode.DECODE_MAX_Q}, got Sq={spec.q_len} on "
                f"{current_platform()}; pass backend='xla'")
    if o.target == "tpu":
        reason = _decode.tpu_reason(spec, q, v, lists, _mods(spec, o))
        if reason is None and not o.interpret and spec.block_size[1] % 128:
            # (Mosaic cannot prove a narrower tile's lane slices aligned, E2003: pages of 16,
            # 32 and 64 tokens failed to compile; tests_compile/decode_suite.py checks the refusal.)
            reason = (f"its kv tiles are the BlockMask's kv block, {spec.block_size[1]} here, which must be a "
                      "multiple of 128 on TPU: use pages of a multiple of 128 tokens (and such a kv block)")
        if reason is not None:
            return f"the pallas paged kernel cannot serve this call on TPU: {reason}"
    return None


def ragged_rows(dtype, kernel_options: dict) -> int:
    """Packed rows (queries x GQA group) of a ragged call's prefill tiles: 128, or 64 for
    float32 on cuda, where 128 rows of float32 q, K, V and scores passed an H100 block's
    shared memory (262656 of 232448 bytes, measured by tests_compile/decode_suite.py)."""
    target = kernel_options.get("target", _host_target())
    return 64 if target == "cuda" and jnp.dtype(dtype) == jnp.float32 else 128


# Bytes of the TPU kernel's SMEM the two scale vectors may take (v5e has 1 MiB of SMEM, which
# also holds the lists and the page table; scales kept (num_pages, Hkv) there were padded to
# 128 words a row and passed it at 1024 pages x 8 heads, so they go in flat):
# tests_compile/decode_suite.py compiles at this size.
TPU_SCALE_BYTES = 512 * 1024


def supports_quantized(spec, q, pages, options) -> str | None:
    """None where the decode kernel dequantizes int8 / float8_e4m3fn tiles as it loads them (to
    the query's dtype, with their page's scale). On TPU the scales sit in SMEM, flat: at most
    ``TPU_SCALE_BYTES`` of them for k and v together."""
    o = options
    need = 2 * 4 * pages.shape[0] * pages.shape[2]
    if o.target == "tpu" and need > TPU_SCALE_BYTES:
        return (f"the TPU kernel keeps the pools' scales in SMEM: {pages.shape[0]} pages x {pages.shape[2]} kv heads "
                f"need {need} bytes, above {TPU_SCALE_BYTES}; use fewer, larger pages, or backend='xla'")
    return None


# The paged forward's implementations (``explain``): the decode kernel, as ``supports_paged`` admits it.
PAGED_FORWARD = (Implementation("decode", always),)


def paged_forward(spec, q, k_pages, v_pages, page_table, score_consts, mask_consts, lists, scales=None, *, plan):
    """``forward_with_residuals`` over page pools and a page table, with ``plan``'s options: the decode kernel
    reads each tile from its page (``scales``: a quantized pool's (k_scale, v_scale) (num_pages, Hkv))."""
    o = plan.options
    return _decode.forward_with_residuals(spec, q, k_pages, v_pages, score_consts, mask_consts, lists, o,
                                          _mods(spec, o), page_table=page_table, scales=scales)


def _template(o: KernelOptions):
    return _tpu if o.target == "tpu" else _gpu


def forward_with_residuals(spec, q, k, v, score_consts, mask_consts, lists, dropout_seed=None, plan=None):
    """out, lse and, for the backward, the rows' ``Residuals`` (B, Hq, Sq) float32, as ``plan`` says.

    ``dropout_seed``: (2,) uint32 when ``spec.dropout_rate`` > 0 (the statistics are those
    of the undropped probabilities).
    """
    plan = planned(sys.modules[__name__], plan, spec, q, k, v, score_consts, mask_consts, lists, dropout_seed)
    o = plan.options
    mods = _mods(spec, o)
    if plan.forward == "decode":
        return _decode.forward_with_residuals(spec, q, k, v, score_consts, mask_consts, lists, o, mods)
    g, lists, qp, kp, vp = _prepare(spec, q, k, v, lists, o, backward=False)
    s_pro, m_pro = prologues(mods, score_consts, mask_consts, g)
    out, row_max, row_sum = _template(o).forward(g, mods, spec.scale, qp, kp, vp, lists, s_pro, m_pro,
                                                 target=o.target, interpret=o.interpret,
                                                 warps=o.num_warps, stages=o.num_stages,
                                                 **dropout_args(spec, dropout_seed))
    return forward_results(q, v, out, row_max[..., 0], row_sum[..., 0])


def backward(spec, q, k, v, out, lse, dout, dlse, score_consts, mask_consts, lists, grad_consts, residuals,
             dropout_seed=None, plan=None):
    """dq, dk, dv and the score_mod's captured-array gradients.

    ``residuals``: the ``Residuals`` of ``forward_with_residuals``; ``dropout_seed`` the
    forward's (the kernels regenerate its keep mask). The per-row inputs and the exactness of
    rows with a huge max are ``_frontend.backward_rows``'.
    """
    o = planned(sys.modules[__name__], plan, spec, q, k, v, score_consts, mask_consts, lists, dropout_seed).options
    mods = _mods(spec, o)
    g, lists, qp, kp, vp = _prepare(spec, q, k, v, lists, o, backward=True)
    s_pro, m_pro = prologues(mods, score_consts, mask_consts, g)
    lse_safe, delta, dop = backward_inputs(q, out, lse, dout, dlse, residuals, g, vp.shape[-1])
    grads = _template(o).backward(
        g, mods, spec.scale, qp, kp, vp, dop, lse_safe[..., None], delta[..., None], lists, s_pro, m_pro,
        target=o.target, interpret=o.interpret, warps=o.bwd_num_warps, stages=o.bwd_num_stages,
        **dropout_args(spec, dropout_seed))
    # The kernels produce every float array's partial gradients; pulling them back to the
    # captured arrays is skipped when none is differentiated.
    return backward_results(spec, q, v, g, mods.score, score_consts, any(grad_consts), grads)
