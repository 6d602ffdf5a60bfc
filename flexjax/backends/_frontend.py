"""The front end the kernel backends share (pallas, triton, mosaic_gpu): options, layout, residuals.

A kernel backend differs from another in its kernels and its tile tables. What surrounds
them is the same and lives here: checking kernel_options, filling unset options from a
heuristics row, padding q/k/v to whole tiles and power-of-two head dims, turning the
kernels' row statistics into ``Residuals``, the per-row inputs of the backward, and
slicing the padded gradients back (pulling hoisted-value gradients back to the
captured arrays on the way).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import jax.numpy as jnp
import numpy as np

from . import current_platform
from ._contract import Residuals
from ._layout import geometry, pad_axis, score_const_grads

KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class TileOptions:
    """The kernel_options every kernel backend takes; a backend's ``KernelOptions`` adds its own.

    Tiles must divide the BlockMask's block or be multiples of it.

    Attributes:
      target: the platform to emit kernels for whatever the host; default the host's (the
        interpreter on a CPU host).
      interpret: run the kernels in an interpreter on the host; default True on a CPU host
        when no target is given.
      block_q, block_kv: forward tile.
      bwd_block_q, bwd_block_kv: tile of the backward kernels (the triton backend's dQ kernel;
        its dK/dV kernel has its own ``dkv_*`` options).
      num_stages, bwd_num_stages: pipeline depth of the forward's and the backward's loads
        (Triton's stages, Mosaic GPU's TMA ring).
    """

    target: str | None = None
    interpret: bool | None = None
    block_q: int | None = None
    block_kv: int | None = None
    bwd_block_q: int | None = None
    bwd_block_kv: int | None = None
    num_stages: int | None = None
    bwd_num_stages: int | None = None


@dataclasses.dataclass(frozen=True)
class KernelOptionsBase(TileOptions):
    """``TileOptions`` and the warps a Triton launch takes (pallas' Triton lowering, triton).

    Attributes:
      num_warps, bwd_num_warps: the forward's and the backward's Triton launch parameter (GPU).
    """

    num_warps: int | None = None
    bwd_num_warps: int | None = None


def target_and_interpret(spec, host_target: str | None) -> tuple[str | None, bool]:
    """The call's target (the option, else the host's) and whether it runs interpreted (the
    option, else when there is no target)."""
    target = spec.options.get("target") or host_target
    interpret = spec.options.get("interpret")
    return target, bool(target is None if interpret is None else interpret)

# kernel_options of the kernel backends (pallas, triton): tiles and Triton launch parameters.
TILE_FIELDS = ("block_q", "block_kv", "bwd_block_q", "bwd_block_kv")
LAUNCH_FIELDS = ("num_warps", "num_stages", "bwd_num_warps", "bwd_num_stages")


def check_tiles_and_launch(opts: dict, block_size, tiles=TILE_FIELDS, launch=LAUNCH_FIELDS) -> None:
    """Tiles and launch parameters are positive ints; a tile divides the BlockMask's block or is a multiple of it.

    ``tiles`` / ``launch``: the keys checked (a backend with more tiles passes its own);
    a tile key ending in ``block_q`` is checked against the block's rows, others its columns.

    Raises:
      ValueError: naming the key.
    """
    for f in tuple(tiles) + tuple(launch):
        val = opts.get(f)
        if val is None:
            continue
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val <= 0:
            raise ValueError(f"kernel_options[{f!r}] must be a positive int, got {val!r}")
        if f in tiles:
            base = block_size[0] if f.endswith("block_q") else block_size[1]
            if val % base and base % val:
                raise ValueError(
                    f"kernel_options[{f!r}]={val} must divide the BlockMask's block ({base}) or be a "
                    f"multiple of it")


def dropout_args(spec, dropout_seed) -> dict:
    """The kernel templates' dropout keywords (pallas, triton): none at rate 0, so the
    kernels are then the plain ones; else ``rate`` and the (2,) uint32 ``seed``."""
    rate = spec.dropout_rate
    if not rate:
        return {}
    if dropout_seed is None:
        raise ValueError(f"dropout_rate={rate} needs dropout_seed, a (2,) uint32 array")
    return {"rate": rate, "seed": jnp.asarray(dropout_seed, jnp.uint32).reshape(2)}


def check_options(opts: dict, block_size, targets: tuple[str, ...], bools: Iterable[str] = ("interpret",)) -> None:
    """Tiles and launch parameters (``check_tiles_and_launch``), ``target`` among
    ``targets``, and the ``bools`` keys bools.

    Raises:
      ValueError: naming the key.
    """
    check_tiles_and_launch(opts, block_size)
    target = opts.get("target")
    if target is not None and target not in targets:
        raise ValueError(f"kernel_options['target'] must be one of {targets} or None, got {target!r}")
    for f in bools:
        val = opts.get(f)
        if val is not None and not isinstance(val, (bool, np.bool_)):
            raise ValueError(f"kernel_options[{f!r}] must be a bool, got {val!r}")


def basic_reason(name: str, spec, q, fields: tuple[str, ...], host_target: str | None,
                 platform_hint: str = "") -> str | None:
    """The refusals every kernel backend starts with: another backend's option keys, dtypes
    the kernels do not take, and a platform with no kernel (a CPU host runs the interpreter)."""
    unknown = sorted(set(spec.options) - set(fields))
    if unknown:
        return f"unknown kernel_options {unknown} for the {name} backend; it takes {list(fields)}"
    if q.dtype not in KERNEL_DTYPES:
        return f"the {name} backend takes float32, bfloat16 or float16 inputs, got {q.dtype}"
    platform = current_platform()
    if not spec.options.get("target") and host_target is None and platform != "cpu":
        return f"the {name} backend has no kernel for platform {platform!r}{platform_hint}"
    return None


def fill(options_type, spec, default, **fixed):
    """``options_type`` with the user's options, the ``default`` row's values where unset, and ``fixed``."""
    opts = spec.options
    values = {f: opts[f] if opts.get(f) is not None else getattr(default, f) for f in options_type.__dataclass_fields__}
    values.update(fixed)
    return options_type(**values)


def pow2_dim(n: int) -> int:
    """Triton tiles need power-of-two sizes; tl.dot at least 16. Zero columns change no dot product."""
    return max(16, 1 << (int(n) - 1).bit_length())


def prepare(spec, q, k, v, lists, tq: int, tk: int, pad_dim=lambda n: n):
    """Geometry for tiles (tq, tk) with the lists regrouped to match, and q/k/v padded to whole
    tiles along the sequences and to ``pad_dim`` along the head dims."""
    g, lists = geometry(spec, q, k, lists, tq, tk)
    D, Dv = pad_dim(q.shape[-1]), pad_dim(v.shape[-1])
    qp = pad_axis(pad_axis(q, 1, g.sq), 3, D)
    kp = pad_axis(pad_axis(k, 1, g.skv), 3, D)
    vp = pad_axis(pad_axis(v, 1, g.skv), 3, Dv)
    return g, lists, qp, kp, vp


def forward_results(q, v, out, row_max, row_sum):
    """(out, lse, Residuals) from the kernels' padded output and (B, Hq, >= Sq) row max and sum."""
    Sq = q.shape[1]
    res = Residuals.from_running(row_max[:, :, :Sq], row_sum[:, :, :Sq])
    return out[:, :Sq, :, : v.shape[-1]], res.lse(), res


# Rows whose max score is at least this large in magnitude are recomputed in the kernels'
# backward from their max and sum rather than from lse: in float32, lse = max + log(sum)
# keeps log(sum) only to ulp(max) (at 2**12, 2.4e-4 relative in P; at 1e30, not at all).
HUGE_ROW = 2.0**12


def backward_rows(out, lse, dout, dlse, residuals: Residuals):
    """Per-row inputs of kernels that recompute P from lse: (lse, delta, dO), float32.

    delta = rowsum(dO * O) - dlse (a cotangent on lse adds P * dlse to dS). lse -inf (no
    allowed key) becomes 0, so exp(s - lse) cannot overflow before the mask zeroes it. Rows
    with a huge max (``HUGE_ROW``) get their max in lse's place, which gives P * sum, and dO
    and delta divided by the sum: dV = P^T dO and dS = P (dP - delta) come out exact.
    """
    delta = jnp.einsum("bqhd,bqhd->bhq", dout.astype(jnp.float32), out.astype(jnp.float32))
    delta = delta - dlse.astype(jnp.float32)
    lse_safe = jnp.where(lse == -jnp.inf, 0.0, lse)
    row_max, row_sum = residuals
    huge = (jnp.abs(row_max) >= HUGE_ROW) & (row_sum > 0)
    inv_sum = jnp.where(huge, 1.0 / jnp.where(huge, row_sum, 1.0), 1.0)
    lse_safe = jnp.where(huge, row_max, lse_safe)
    dout = inv_sum.transpose(0, 2, 1)[..., None] * dout.astype(jnp.float32)
    return lse_safe, delta * inv_sum, dout


def backward_inputs(q, out, lse, dout, dlse, residuals: Residuals, g, dv_padded: int):
    """(lse, delta) padded to the tiles' rows (B, Hq, sq) and dO padded like v, in q's dtype."""
    lse_safe, delta, dout = backward_rows(out, lse, dout, dlse, residuals)
    dop = pad_axis(pad_axis(dout.astype(q.dtype), 1, g.sq), 3, dv_padded)
    return pad_axis(lse_safe, 2, g.sq), pad_axis(delta, 2, g.sq), dop


def backward_results(spec, q, v, g, score_mod, score_consts, wanted: bool, grads):
    """(dq, dk, dv, dscore) from the kernels' padded gradients and hoisted-value partials.

    ``grads`` = (dq, dk, dv, d_rows, d_cols, d_arrays); the partials are pulled back to the
    score_mod's captured arrays only when one is differentiated (``wanted``).
    """
    dq, dk, dv, d_rows, d_cols, d_arrays = grads
    dscore = (score_const_grads(score_mod, score_consts, g, d_rows, d_cols, d_arrays) if wanted
              else tuple(None for _ in score_consts))
    D, Dv = q.shape[-1], v.shape[-1]
    return dq[:, :q.shape[1], :, :D], dk[:, : spec.kv_len, :, :D], dv[:, : spec.kv_len, :, :Dv], dscore
