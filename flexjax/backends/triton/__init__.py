"""The triton backend: FlashAttention kernels written as Triton source, with the user's mods generated into them.

The mod compiler splits each mod into an XLA prologue and a kernel part; ``_codegen``
writes the kernel part (and its VJP) as ``@triton.jit`` functions, ``_templates`` splices
them into the forward, dQ and dK/dV kernels, and ``_launch`` runs those through
``jax_triton.triton_call`` on GPU, or under Triton's interpreter (torch CPU tensors
through ``jax.pure_callback``) on a CPU host. ``kernel_options={"target": "cuda"}`` emits
the GPU kernels whatever the host, so lowering works from a CPU machine.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ..._modcompiler import compile_mod
from .. import _frontend, current_platform, platform_overridden
from .._contract import Implementation, always, planned, planner
from .._layout import Mods, geometry, pad_axis, prologues
from .._tile_tables import TRITON_DROPOUT_BWD_KV, TRITON_SM80, TRITON_SM90, TRITON_SM90_NO_GATHER
from . import _codegen, _kernels, _launch, _templates, _versions

NAME = "triton"

_TARGETS = ("cuda",)


@dataclasses.dataclass(frozen=True)
class KernelOptions(_frontend.KernelOptionsBase):
    """Options of the triton backend (``flex_attention(..., kernel_options={...})``): those of
    ``_frontend.KernelOptionsBase`` and the two below.

    ``target`` is "cuda" (jax_triton GPU kernels whatever the host); on a CPU host without
    one the kernels run under Triton's interpreter. Tiles are multiples of 16 that divide
    the BlockMask's block or are multiples of it. The lists are walked at the tile's
    granularity; a tile that is not a power of two (192, or a BlockMask block of 48) runs
    as power-of-two kernel tiles, the largest dividing it (``_kernel_tile``), a few
    sub-steps per tile, as the pallas backend walks sub-tiles. Unset tiles and launch
    parameters come from the heuristics' table row, fitted to the BlockMask's block by ``_fit``.

    The backward's two kernels take their own tiles: ``bwd_block_q`` / ``bwd_block_kv`` /
    ``bwd_num_warps`` / ``bwd_num_stages`` are the dQ kernel's, ``dkv_*`` the dK/dV kernel's
    (a warpgroup MMA needs 64 rows of the tile a kernel accumulates: q rows in dQ, kv rows
    in dK/dV). A ``dkv_*`` option left unset takes the ``bwd_*`` option when that is given,
    so ``bwd_*`` alone still sets both kernels; else the table's value.

    Attributes:
      dkv_block_q, dkv_block_kv, dkv_num_warps, dkv_num_stages: the dK/dV kernel's tile and
        launch parameters.
      compute_capability: the GPU to compile for, as 80 (sm_80) or 90 (sm_90); default
        the device's, 90 when lowering from a CPU host. Also selects the heuristics' table.
      autotune: search a few (num_warps, num_stages) configs per kernel with
        ``triton.autotune`` at the first run (GPU only); given warps / stages restrict
        the search to those values.
    """

    dkv_block_q: int | None = None
    dkv_block_kv: int | None = None
    dkv_num_warps: int | None = None
    dkv_num_stages: int | None = None
    compute_capability: int | None = None
    autotune: bool | None = None


_FIELDS = tuple(f.name for f in dataclasses.fields(KernelOptions))

# The (num_warps, num_stages) pairs autotune searches, besides the heuristics' own.
_AUTOTUNE = ((4, 2), (4, 3), (8, 2), (8, 3))


def heuristics(compute_capability: int, block_size: tuple[int, int], head_dim: int, dtype=jnp.bfloat16,
               gathers: bool = True) -> KernelOptions:
    """Default tiles and launch parameters for sm_``compute_capability`` (sm_80 and sm_90 tables).

    Capabilities from 90 up take the sm_90 row, 80 to 89 the sm_80 row; head dims above 256
    the 256 row. ``gathers``: whether a mod reads a captured array inside the kernels (a
    table gather holds its indices and values per score element, so such mods take the
    tables' rows; mods without one can take ``TRITON_SM90_NO_GATHER``'s larger tiles). Each
    table tile is fitted to the BlockMask's block by ``_fit``.
    """
    bq, bkv = block_size
    d = min(max(64, _frontend.pow2_dim(head_dim)), 256)
    key = (min(jnp.dtype(dtype).itemsize, 4), d)
    if compute_capability >= 90:
        row = TRITON_SM90[key] if gathers else TRITON_SM90_NO_GATHER.get(key, TRITON_SM90[key])
    else:
        row = TRITON_SM80[key]
    fwd, dq, dkv = row.fwd, row.dq, row.dkv
    return KernelOptions(target="cuda", interpret=False, compute_capability=int(compute_capability),
                         block_q=_fit(fwd.block_q, bq), block_kv=_fit(fwd.block_kv, bkv), num_warps=fwd.num_warps,
                         num_stages=fwd.num_stages, bwd_block_q=_fit(dq.block_q, bq),
                         bwd_block_kv=_fit(dq.block_kv, bkv), bwd_num_warps=dq.num_warps,
                         bwd_num_stages=dq.num_stages, dkv_block_q=_fit(dkv.block_q, bq),
                         dkv_block_kv=_fit(dkv.block_kv, bkv), dkv_num_warps=dkv.num_warps,
                         dkv_num_stages=dkv.num_stages, autotune=False)


def _pow2_part(n: int) -> int:
    """The largest power of two dividing ``n``."""
    return n & -n


def _fit(tile: int, block: int) -> int:
    """The tile (list granularity) that serves a table's power-of-two ``tile`` on a BlockMask of ``block``.

    - ``tile`` divides the block: the tile; each block is walked in ``block // tile`` steps.
    - the block divides ``tile`` (a smaller power-of-two block): the tile, the lists
      regrouped, since tiles of 16 or 32 rows leave most of a tensor-core MMA idle.
    - otherwise (a block that is not a power of two, such as 48 or 80): the block regrouped
      by the largest power of two that stays within ``tile``, and at least until its
      power-of-two part reaches 16 (``tl.dot``'s minimum); the kernel walks it in
      power-of-two sub-tiles (``_kernel_tile``). 48 under a tile of 128 groups to 96 and
      runs 32-row tiles; 80 under 64 stays 80 and runs 16-row tiles.
    """
    if block % tile == 0 or tile % block == 0:
        return tile
    group = block
    while group * 2 <= tile or _pow2_part(group) < 16:
        group *= 2
    return group


def _kernel_tile(tile: int) -> int:
    """The power-of-two Triton tile that walks a (multiple of 16) tile: the largest dividing it."""
    return _pow2_part(tile)


def _device_capability() -> int | None:
    """The compute capability of JAX's first GPU, or None without one."""
    if current_platform() not in ("gpu", "cuda") or platform_overridden():
        return None
    major, _, minor = str(getattr(jax.devices()[0], "compute_capability", "")).partition(".")
    if not (major.isdigit() and (minor or "0").isdigit()):
        return None  # not an NVIDIA GPU (ROCm names its targets gfx...)
    return int(major) * 10 + int(minor or 0)


def _host_target() -> str | None:
    if current_platform() not in ("gpu", "cuda"):
        return None
    return "cuda" if platform_overridden() or _device_capability() is not None else None


_DKV_FIELDS = {"dkv_block_q": "bwd_block_q", "dkv_block_kv": "bwd_block_kv", "dkv_num_warps": "bwd_num_warps",
               "dkv_num_stages": "bwd_num_stages"}


def _resolve(spec, head_dim: int, dtype) -> KernelOptions:
    opts = spec.options
    target, interpret = _frontend.target_and_interpret(spec, _host_target())
    cc = opts.get("compute_capability") or _device_capability() or 90
    if interpret:
        # Interpret mode: the mask's own block (regrouped only where its power-of-two part is
        # under 16), so each interpreted step is at most one mask tile.
        bq, bkv = (b if _pow2_part(b) >= 16 else _fit(16, b) for b in spec.block_size)
        default = KernelOptions(block_q=bq, block_kv=bkv, bwd_block_q=bq, bwd_block_kv=bkv, num_warps=4,
                                num_stages=1, bwd_num_warps=4, bwd_num_stages=1, dkv_block_q=bq, dkv_block_kv=bkv,
                                dkv_num_warps=4, dkv_num_stages=1)
    else:
        default = heuristics(cc, spec.block_size, head_dim, dtype, gathers=_gathers(spec))
        key = (90 if cc >= 90 else 80, min(jnp.dtype(dtype).itemsize, 4),
               min(max(64, _frontend.pow2_dim(head_dim)), 256))
        if spec.dropout_rate > 0 and key in TRITON_DROPOUT_BWD_KV:
            dq_kv, dkv_kv = TRITON_DROPOUT_BWD_KV[key]
            default = dataclasses.replace(default, bwd_block_kv=min(_fit(dq_kv, spec.block_size[1]),
                                                                    default.bwd_block_kv))
            if dkv_kv is not None:
                default = dataclasses.replace(default, dkv_block_kv=min(_fit(dkv_kv, spec.block_size[1]),
                                                                        default.dkv_block_kv))
    # A dK/dV option left unset follows the user's bwd_* option (which sets both kernels).
    default = dataclasses.replace(default, **{d: opts[b] for d, b in _DKV_FIELDS.items()
                                              if opts.get(d) is None and opts.get(b) is not None})
    return _frontend.fill(KernelOptions, spec, default, target=target, interpret=bool(interpret),
                          compute_capability=int(cc), autotune=bool(opts.get("autotune")))


def _gathers(spec) -> bool:
    """Whether a mod of the call reads a captured array inside the kernels (``heuristics``)."""
    try:
        _, template, _ = _generated(spec.score, spec.mask, False)
    except NotImplementedError:
        return True
    return any(gm is not None and gm.arrays for gm in (template.score, template.mask))


def _check_options(opts: dict, block_size):
    _frontend.check_options(opts, block_size, _TARGETS, bools=("interpret", "autotune"))
    _frontend.check_tiles_and_launch(opts, block_size, ("dkv_block_q", "dkv_block_kv"),
                                     ("dkv_num_warps", "dkv_num_stages"))
    for f in _frontend.TILE_FIELDS + ("dkv_block_q", "dkv_block_kv"):
        val = opts.get(f)
        if val is not None and val % 16:
            raise ValueError(f"kernel_options[{f!r}] must be a multiple of 16 (Triton's tl.dot takes tiles of at "
                             f"least 16), got {val}")
    cc = opts.get("compute_capability")
    if cc is not None and (isinstance(cc, bool) or not isinstance(cc, (int, np.integer)) or cc < 80):
        raise ValueError(f"kernel_options['compute_capability'] must be an int >= 80 such as 80 (sm_80) or 90 "
                         f"(sm_90), got {cc!r}")


def _missing_modules(interpret: bool) -> str | None:
    needed = ("triton", "torch") if interpret else ("triton", "jax_triton")
    for name in needed:
        try:
            __import__(name)
        except Exception as e:  # jax_triton also fails to import without a CUDA jaxlib plugin
            use = "Triton's interpreter" if interpret else "GPU kernels"
            fix = ("pip install torch (Triton's interpreter holds its tensors in torch's)" if name == "torch" else
                   "pip install 'flexjax[gpu]' (Triton 3.6 with jax-triton 0.3.1, the pair flexjax is tested with)")
            return f"the triton backend needs the {name!r} package for {use} ({e}); {fix}"
    return None


@functools.lru_cache(maxsize=256)
def _generated(score, mask, grads: bool, dropout: bool = False, paged: bool = False, quant: bool = False):
    """The compiled mods, the template plan and its source (the codegen raises NotImplementedError)."""
    cms = Mods(score=compile_mod(score, "triton") if score is not None else None,
               mask=compile_mod(mask, "triton") if mask is not None else None)
    template = _templates.Plan(score=_codegen.generate(cms.score, prefix="score") if cms.score is not None else None,
                           mask=_codegen.generate(cms.mask, prefix="mask") if cms.mask is not None else None,
                           grads=grads and cms.score is not None, dropout=dropout, paged=paged, quant=quant)
    return cms, template, _templates.source(template)


def validate_options(spec) -> None:
    """Raises ValueError for an invalid value of one of this backend's kernel_options."""
    _check_options(spec.options, spec.block_size)


def resolve(spec, q, k, v) -> KernelOptions | str:
    """The call's options (``_resolve``) if the triton backend can serve it, else why not (``validate_options``
    has run)."""
    basic = _frontend.basic_reason(NAME, spec, q, _FIELDS, _host_target(), "; it runs on NVIDIA GPUs")
    if basic is not None:
        return basic
    o = _resolve(spec, q.shape[-1], q.dtype)
    if not o.interpret and o.target is None:
        return ("kernel_options['interpret']=False needs GPU kernels: pass kernel_options={'target': 'cuda'} to lower "
                "for a GPU from this host, or run on a GPU host")
    missing = _missing_modules(o.interpret)
    if missing:
        return missing
    wrong = _versions.version_problem(o.interpret)
    if wrong:
        return wrong
    if o.interpret and q.dtype == jnp.bfloat16 and not _launch.interpreter_bf16_dot_ok():
        import triton

        return (f"Triton's interpreter (Triton {triton.__version__}) computes bfloat16 dot products wrong, so the "
                "triton backend runs float32 and float16 only in it; cast the inputs, or lower for the GPU with "
                "kernel_options={'target': 'cuda'}")
    if o.autotune and o.interpret:
        return "kernel_options['autotune'] needs GPU kernels; it does nothing in Triton's interpreter"
    try:
        _generated(spec.score, spec.mask, False)
    except NotImplementedError as e:
        return str(e)
    return o


plan = planner(__name__)


# One way to serve each pass: the generated kernels (``_contract.make_plan``).
FORWARD = BACKWARD = (Implementation("kernels", always),)


_PASS_FIELDS = {"fwd": ("num_warps", "num_stages"), "dq": ("bwd_num_warps", "bwd_num_stages"),
                "dkv": ("dkv_num_warps", "dkv_num_stages")}


def _autotune_configs(spec, o: KernelOptions, kernel: str):
    """The autotune search: the heuristics' pair and ``_AUTOTUNE``, restricted to given warps / stages."""
    opts = spec.options
    w_key, s_key = _PASS_FIELDS[kernel]
    warps, stages = getattr(o, w_key), getattr(o, s_key)
    configs = {(warps, stages), *_AUTOTUNE}
    return tuple(sorted((w, s) for w, s in configs
                        if (opts.get(w_key) is None or w == warps) and (opts.get(s_key) is None or s == stages)))


def _run(spec, o: KernelOptions, kernel: str):
    """The launch parameters of ``kernel``: "fwd", "dq" or "dkv"."""
    w_key, s_key = _PASS_FIELDS[kernel]
    return _kernels.Launch(interpret=o.interpret, num_warps=getattr(o, w_key), num_stages=getattr(o, s_key),
                           compute_capability=o.compute_capability,
                           autotune=_autotune_configs(spec, o, kernel) if o.autotune else None,
                           chunk=16 if o.interpret else 2)


def _prepare(spec, q, k, v, lists, o: KernelOptions, backward: bool):
    """Geometry (per kernel), lists and padded inputs of one pass.

    The backward's lists and padding take both kernels' tiles (the least common multiple of
    each pair, a divisor or multiple of the block as both are); each kernel walks them in
    its own power-of-two kernel tiles. Returns ``(geoms, lists, q, k, v)``, ``geoms`` the
    forward's one ``Geom`` or the backward's (dQ, dK/dV) pair.
    """
    if not backward:
        g, lists, qp, kp, vp = _frontend.prepare(spec, q, k, v, lists, o.block_q, o.block_kv, _frontend.pow2_dim)
        return dataclasses.replace(g, tq=_kernel_tile(o.block_q), tk=_kernel_tile(o.block_kv)), lists, qp, kp, vp
    cq, ck = math.lcm(o.bwd_block_q, o.dkv_block_q), math.lcm(o.bwd_block_kv, o.dkv_block_kv)
    g, lists, qp, kp, vp = _frontend.prepare(spec, q, k, v, lists, cq, ck, _frontend.pow2_dim)
    g_dq = dataclasses.replace(g, tq=_kernel_tile(o.bwd_block_q), tk=_kernel_tile(o.bwd_block_kv))
    g_dkv = dataclasses.replace(g, tq=_kernel_tile(o.dkv_block_q), tk=_kernel_tile(o.dkv_block_kv))
    return (g_dq, g_dkv), lists, qp, kp, vp


def forward_with_residuals(spec, q, k, v, score_consts, mask_consts, lists, dropout_seed=None, plan=None):
    """out, lse and, for the backward, the rows' ``Residuals`` (B, Hq, Sq) float32, with ``plan``'s options.

    ``dropout_seed``: (2,) uint32 when ``spec.dropout_rate`` > 0 (the statistics are those
    of the undropped probabilities).
    """
    o = planned(sys.modules[__name__], plan, spec, q, k, v, score_consts, mask_consts, lists, dropout_seed).options
    mods, template, source = _generated(spec.score, spec.mask, False, bool(spec.dropout_rate))
    g, lists, qp, kp, vp = _prepare(spec, q, k, v, lists, o, backward=False)
    s_pro, m_pro = prologues(mods, score_consts, mask_consts, g)
    out, row_max, row_sum = _kernels.forward(template, source, g, spec.scale, qp, kp, vp, lists, s_pro, m_pro,
                                             _run(spec, o, "fwd"),
                                             **_frontend.dropout_args(spec, dropout_seed))
    return _frontend.forward_results(q, v, out, row_max, row_sum)


def supports_paged(spec, q, k, v, lists, options) -> str | None:
    """None where the forward kernel serves a paged call (``k`` / ``v`` stand for the logical
    cache): its kv tiles must not cross a page, and the pools, which are read in place, need
    head dims the kernel takes unpadded (powers of two >= 16)."""
    o = options
    ck = max(spec.block_size[1], _kernel_tile(o.block_kv))
    if spec.kv_len % ck:
        return (f"the triton paged kernel reads kv tiles of {ck} rows, which must divide the page size; set "
                "kernel_options block_kv to a divisor of the page size")
    for name, d in (("head_dim", q.shape[-1]), ("value head_dim", v.shape[-1])):
        if d != _frontend.pow2_dim(d):
            return f"the triton paged kernel reads the pools unpadded: {name} {d} must be a power of two >= 16"
    return None


def ragged_rows(dtype, kernel_options: dict) -> int:
    """Query rows (heads x tokens) a ragged call packs in a tile: 128."""
    return 128


def supports_quantized(spec, q, pages, options) -> str | None:
    """None where the forward kernel dequantizes the pools' tiles as it loads them (to the
    query's dtype, with their page's scale): int8, and float8_e4m3fn on GPUs (Triton's
    interpreter takes its operands through torch, which cannot convert float8 arrays)."""
    o = options
    if o.interpret and pages.dtype == jnp.float8_e4m3fn:
        return ("Triton's interpreter cannot take float8_e4m3fn pools (torch converts no float8 array); lower for "
                "the GPU with kernel_options={'target': 'cuda'}, or pass backend='xla' or 'pallas'")
    return None


# The paged forward's implementations (``explain``): the forward kernel reading pages through the table.
PAGED_FORWARD = (Implementation("paged", always),)


def paged_forward(spec, q, k_pages, v_pages, page_table, score_consts, mask_consts, lists, scales=None, *, plan):
    """``forward_with_residuals`` over page pools (num_pages, page_size, Hkv, .) read through
    ``page_table`` (B, max_pages) by the forward kernel (``spec.kv_len`` = max_pages *
    page_size); ``scales``: a quantized pool's (k_scale, v_scale) (num_pages, Hkv). ``plan``: its options."""
    o = plan.options
    mods, template, source = _generated(spec.score, spec.mask, False, False, True, scales is not None)
    k_like = jax.ShapeDtypeStruct((q.shape[0], spec.kv_len) + k_pages.shape[2:], q.dtype)
    g, lists = geometry(spec, q, k_like, lists, o.block_q, o.block_kv)
    g = dataclasses.replace(g, tq=_kernel_tile(o.block_q), tk=_kernel_tile(o.block_kv))
    qp = pad_axis(q, 1, g.sq)
    s_pro, m_pro = prologues(mods, score_consts, mask_consts, g)
    out, row_max, row_sum = _kernels.forward(template, source, g, spec.scale, qp, k_pages, v_pages, lists, s_pro, m_pro,
                                             _run(spec, o, "fwd"), page_table=page_table, scales=scales)
    return _frontend.forward_results(q, v_pages, out, row_max, row_sum)


def backward(spec, q, k, v, out, lse, dout, dlse, score_consts, mask_consts, lists, grad_consts, residuals,
             dropout_seed=None, plan=None):
    """dq, dk, dv and the score_mod's captured-array gradients.

    ``residuals``: the ``Residuals`` of ``forward_with_residuals``; ``dropout_seed`` the
    forward's (the kernels regenerate its keep mask). The per-row inputs and the exactness of
    rows with a huge max are ``_frontend.backward_rows``'. The row / column / array-read
    gradients are only reduced when a captured float array is differentiated (``grad_consts``).
    """
    o = planned(sys.modules[__name__], plan, spec, q, k, v, score_consts, mask_consts, lists, dropout_seed).options
    wanted = any(grad_consts)
    mods, template, source = _generated(spec.score, spec.mask, wanted, bool(spec.dropout_rate))
    (g, g_dkv), lists, qp, kp, vp = _prepare(spec, q, k, v, lists, o, backward=True)
    s_pro, m_pro = prologues(mods, score_consts, mask_consts, g)
    lse_safe, delta, dop = _frontend.backward_inputs(q, out, lse, dout, dlse, residuals, g, vp.shape[-1])
    grads = _kernels.backward(template, source, (g, g_dkv), spec.scale, qp, kp, vp, dop, lse_safe, delta, lists, s_pro,
                              m_pro, (_run(spec, o, "dq"), _run(spec, o, "dkv")),
                              **_frontend.dropout_args(spec, dropout_seed))
    return _frontend.backward_results(spec, q, v, g, mods.score, score_consts, template.grads, grads)
