"""Launch plumbing of the triton templates: operands, constexprs, grids and output shapes."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from ... import _dropout
from .._layout import Geom, Prologue, is_float
from . import _templates
from ._launch import launch
from ._templates import Plan


@dataclasses.dataclass(frozen=True)
class Launch:
    """How kernels run: interpreter or GPU, and the Triton launch parameters."""

    interpret: bool
    num_warps: int
    num_stages: int
    compute_capability: int
    autotune: tuple | None = None
    # Flat indices per step of the dQ kernel's one-hot reduction of array-read gradients
    # (see pallas/_gpu.py: on sm_90 2 kept the (tq, tk, chunk) comparison out of spills);
    # the interpreter takes bigger steps, as each one costs Python overhead.
    chunk: int = 2


def _pro_args(pro: Prologue, p: str) -> dict:
    """A mod's rows, columns and arrays by kernel parameter name (``_templates.mod_pointers``)."""
    # Kernels cannot load booleans on every target: bool arrays go in as int32.
    arrays = tuple(a.astype(jnp.int32) if a.dtype == jnp.bool_ else a for a in pro.arrays)
    return {**{f"{p}R{k}": x for k, x in enumerate(pro.rows)}, **{f"{p}C{k}": x for k, x in enumerate(pro.cols)},
            **{f"{p}A{k}": x for k, x in enumerate(arrays)}}


def _call(source: str, name: str, params, args: dict, out_shapes, grid, consts: dict, run: Launch,
          zeroed_outputs=()):
    """Launches kernel ``name`` with ``args`` and ``consts`` ordered by its parameters ``params``."""
    ins, outs, const_names = params
    assert set(args) == set(ins) and set(consts) == set(const_names) and len(outs) == len(out_shapes), name
    return launch(source, name, [args[n] for n in ins], out_shapes, grid, consts, interpret=run.interpret,
                  num_warps=run.num_warps, num_stages=run.num_stages, compute_capability=run.compute_capability,
                  zeroed_outputs=zeroed_outputs, autotune=run.autotune)


def _pro_consts(pro: Prologue, p: str) -> dict:
    out = {}
    for kind, vals in (("R", pro.rows), ("C", pro.cols)):
        for k, x in enumerate(vals):
            out[f"{p}{kind}{k}_B"], out[f"{p}{kind}{k}_H"] = int(x.shape[0]), int(x.shape[1])
    return out


def _dropout_args(plan: Plan, rate: float, seed) -> tuple[dict, dict]:
    """(args, constexprs) of dropout: the seed bitcast to int32 (a plain integer operand on
    every path), the uint32 threshold and 1 / (1 - rate)."""
    if not plan.dropout:
        return {}, {}
    seed = lax.bitcast_convert_type(jnp.asarray(seed, jnp.uint32).reshape(2), jnp.int32)
    return {"SEED": seed}, {"DROP_T": _dropout.threshold(rate), "DROP_INV": 1.0 / (1.0 - rate)}


def _lists(n, idx):
    # A list of width 0 (no tile of that kind anywhere) still gets a pointer to a valid entry.
    if idx.shape[-1] == 0:
        idx = jnp.zeros((*idx.shape[:-1], 1), idx.dtype)
    return n.astype(jnp.int32), idx.astype(jnp.int32)


def _common(g: Geom, scale: float, D: int, Dv: int, n_idx, idx, f_idx, s_pro, m_pro, dtype) -> dict:
    return {"SCALE": float(scale), "HQ": g.Hq, "HKV": g.Hkv, "G": g.G, "SQ": g.sq, "SKV": g.skv, "Q_LEN": g.q_len,
            "KV_LEN": g.kv_len, "D": D, "DV": Dv, "TQ": g.tq, "TK": g.tk, "SUB_Q": g.sub_q, "SUB_K": g.sub_k,
            "LB": g.Bm, "LH": g.Hm, "LN": int(n_idx.shape[2]), "W_P": int(idx.shape[3]), "W_F": int(f_idx.shape[3]),
            # float32 inputs: exact float32 products (Triton's default would be TF32).
            "PREC": "ieee" if dtype == jnp.float32 else "tf32",
            **_pro_consts(s_pro, "S"), **_pro_consts(m_pro, "M")}


# Grids are (tiles, heads, batch): CUDA stops a grid's y and z dimensions at 65535, which
# B * H folded into one dimension passes at, say, a batch of 2048 with 32 heads.


def forward(plan: Plan, source: str, g: Geom, scale, q, k, v, lists, s_pro: Prologue, m_pro: Prologue,
            run: Launch, rate: float = 0.0, seed=None, page_table=None, scales=None):
    """q (B, sq, Hq, D), k/v (B, skv, Hkv, .) padded; returns out (B, sq, Hq, Dv) and each row's
    max and sum (B, Hq, sq) float32 (max 0 on empty rows). With ``plan.dropout``, ``rate`` and
    the (2,) uint32 ``seed`` of the mask. With ``plan.paged``, k / v are page pools
    (num_pages, page_size, Hkv, .) read through ``page_table`` (B, max_pages); with
    ``plan.quant``, ``scales`` are their (k_scale, v_scale) float32 (num_pages, Hkv)."""
    kv_n, kv_i = _lists(lists.kv_num, lists.kv_idx)
    fkv_n, fkv_i = _lists(lists.full_kv_num, lists.full_kv_idx)
    D, Dv = q.shape[-1], v.shape[-1]
    drop_args, drop_consts = _dropout_args(plan, rate, seed)
    consts = {**_common(g, scale, D, Dv, kv_n, kv_i, fkv_i, s_pro, m_pro, q.dtype), **drop_consts}
    args = {"KV_N": kv_n, "KV_I": kv_i, "FKV_N": fkv_n, "FKV_I": fkv_i, "Q": q, "K": k, "V": v,
            **_pro_args(s_pro, "S"), **_pro_args(m_pro, "M"), **drop_args}
    if plan.paged:
        args["PT"] = jnp.asarray(page_table, jnp.int32)
        consts.update(PS=int(k.shape[1]), MAXP=int(page_table.shape[1]))
    if plan.quant:
        args["KS"], args["VS"] = (jnp.asarray(x, jnp.float32) for x in scales)
    vec = jax.ShapeDtypeStruct((g.B, g.Hq, g.sq), jnp.float32)
    out_shapes = [jax.ShapeDtypeStruct((g.B, g.sq, g.Hq, Dv), q.dtype), vec, vec]
    out, row_max, row_sum = _call(source, _templates.FWD, _templates.fwd_params(plan), args, out_shapes,
                                  (g.sq // g.tq, g.Hq, g.B), consts, run)
    return out, row_max, row_sum


def backward(plan: Plan, source: str, geoms: tuple[Geom, Geom], scale, q, k, v, do, lse, delta, lists,
             s_pro: Prologue, m_pro: Prologue, runs: tuple[Launch, Launch], rate: float = 0.0, seed=None):
    """Padded inputs as in ``forward``; lse (-inf replaced by 0) and delta (B, Hq, sq) float32.

    ``geoms`` and ``runs``: the dQ and the dK/dV kernel's tiles and launch parameters (the
    same lists and padding, their own kernel tiles).

    Returns dq, dk, dv (padded) and, when ``plan.grads``, the score_mod's gradients: per row
    / col (B, Hq, sq, 1) / (B, Hq, 1, skv) float32 (None for non-float ones), per array its
    flat-shaped gradient (None for non-float ones); else three tuples of None.
    """
    D, Dv = q.shape[-1], v.shape[-1]
    drop_args, drop_consts = _dropout_args(plan, rate, seed)
    common = {"Q": q, "K": k, "V": v, "DO": do, "LSE": lse, "DELTA": delta, **_pro_args(s_pro, "S"),
              **_pro_args(m_pro, "M"), **drop_args}
    (g, g_kv), (run, run_kv) = geoms, runs
    nq, nk = g.sq // g.tq, g_kv.skv // g_kv.tk

    # dQ, and the row and array-read gradients.
    kv_n, kv_i = _lists(lists.kv_num, lists.kv_idx)
    fkv_n, fkv_i = _lists(lists.full_kv_num, lists.full_kv_idx)
    consts = {**_common(g, scale, D, Dv, kv_n, kv_i, fkv_i, s_pro, m_pro, q.dtype), **drop_consts}
    consts.update(NBH=g.B * g.Hq, CHUNK=run.chunk)
    out_shapes = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    if plan.grads:
        out_shapes += [jax.ShapeDtypeStruct((g.B, g.Hq, g.sq), jnp.float32) for _ in plan.float_rows]
        for kk in plan.grad_arrays:
            n = -(-math.prod(s_pro.arrays[kk].shape) // run.chunk) * run.chunk
            consts[f"NPAD{kk}"] = n
            out_shapes.append(jax.ShapeDtypeStruct((nq, g.B * g.Hq, n), jnp.float32))
    args = {"KV_N": kv_n, "KV_I": kv_i, "FKV_N": fkv_n, "FKV_I": fkv_i, **common}
    slabs = tuple(range(1 + len(plan.float_rows), len(out_shapes)))
    dq, *rest = _call(source, _templates.DQ, _templates.dq_params(plan), args, out_shapes, (nq, g.Hq, g.B),
                      consts, run, zeroed_outputs=slabs)

    # dK/dV, and the column gradients.
    q_n, q_i = _lists(lists.q_num, lists.q_idx)
    fq_n, fq_i = _lists(lists.full_q_num, lists.full_q_idx)
    consts = {**_common(g_kv, scale, D, Dv, q_n, q_i, fq_i, s_pro, m_pro, q.dtype), **drop_consts}
    out_shapes = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    if plan.grads:
        out_shapes += [jax.ShapeDtypeStruct((g.B, g.Hq, g.skv), jnp.float32) for _ in plan.float_cols]
    args = {"Q_N": q_n, "Q_I": q_i, "FQ_N": fq_n, "FQ_I": fq_i, **common}
    dk, dv, *dcols = _call(source, _templates.DKV, _templates.dkv_params(plan), args, out_shapes,
                           (nk, g.Hkv, g.B), consts, run_kv)

    if not plan.grads:
        none = lambda xs: tuple(None for _ in xs)  # noqa: E731
        return dq, dk, dv, none(s_pro.rows), none(s_pro.cols), none(s_pro.arrays)
    it = iter(rest)
    d_rows = [None] * len(s_pro.rows)
    for kk in plan.float_rows:
        d_rows[kk] = next(it)[..., None]
    d_arrays = [None] * len(s_pro.arrays)
    for kk, a in enumerate(s_pro.arrays):
        if is_float(a):
            d_arrays[kk] = jnp.zeros(a.shape, jnp.float32)
    for kk in plan.grad_arrays:
        shape = s_pro.arrays[kk].shape
        d_arrays[kk] = next(it).sum((0, 1))[: math.prod(shape)].reshape(shape)
    d_cols = [None] * len(s_pro.cols)
    for kk, d in zip(plan.float_cols, dcols):
        d_cols[kk] = d[:, :, None, :]
    return dq, dk, dv, tuple(d_rows), tuple(d_cols), tuple(d_arrays)
