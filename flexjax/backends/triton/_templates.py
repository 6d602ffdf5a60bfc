"""Triton source of the three kernels (forward, dQ, dK/dV) with the user's mods spliced in.

One module per (score mod, mask mod, whether captured-array gradients are wanted) holds
the mods' generated ``@triton.jit`` functions (``_codegen``) and the kernels. Every size
is a ``tl.constexpr``, so one source serves every shape. Layouts (row-major, padded):
q / dO ``(B, SQ, HQ, D|DV)``, k / v ``(B, SKV, HKV, D|DV)``, per-row statistics
``(B, HQ, SQ)`` float32, the tile lists as the BlockMask holds them ``(LB, LH, rows,
width)`` int32, a mod's hoisted rows ``(B', H', SQ)`` and columns ``(B', H', SKV)`` with B'
(H') 1 where the value does not depend on b (h).

Forward: one program per (q tile, batch x query head) walks its row of the partial then
full tile lists with an online softmax (the semantics of ``pallas._tile``). Backward
(FlashAttention-2, https://arxiv.org/abs/2307.08691): a dQ kernel over the same lists,
which also reduces the score_mod's row and array-read gradients; a dK/dV kernel per (kv
tile, batch x kv head) over the transposed lists and the G query heads of its group (K/V
are never copied per query head), which also reduces the column gradients. The dK/dV
kernel's tiles are kv-major (``K Q^T``, [TK, TQ]), so P^T and dS^T are the left operands
of its two products as computed (a warpgroup MMA on sm_90 takes them from registers; a
``tl.trans`` of a register tile would not). Every list walk reads the next entry one step
ahead (``_walk``), so Triton's pipeliner keeps copies in flight. With dropout
(``Plan.dropout``) each kernel hashes its tiles' keep mask from ``SEED`` (``flexjax_fmix``,
the hash of ``flexjax._dropout``): row hashes per q tile, column hashes per kv tile.
"""

from __future__ import annotations

import dataclasses

from ... import _dropout
from ._codegen import GeneratedMod

FWD, DQ, DKV = "flexjax_fwd", "flexjax_dq", "flexjax_dkv"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the kernels' source depends on besides sizes.

    Attributes:
      score, mask: the generated mods (None when absent).
      grads: whether the backward reduces the score_mod's row / column / array-read
        gradients (only when a captured float array is differentiated).
      dropout: whether the kernels drop probabilities (rate > 0); the rate itself is a
        constexpr (``DROP_T``, ``DROP_INV``), the seed an input (``SEED``).
      paged: the forward reads K and V from page pools through a page table (``PT``,
        ``(B, MAXP)``; pages of ``PS`` rows), as ``flexjax.paged`` calls it.
      quant: the pools hold int8 / float8_e4m3fn codes, dequantized as each tile loads with
        its page's scale (``KS``, ``VS``: float32 (num_pages, HKV)).
    """

    score: GeneratedMod | None
    mask: GeneratedMod | None
    grads: bool = False
    dropout: bool = False
    paged: bool = False
    quant: bool = False

    @property
    def float_rows(self) -> tuple[int, ...]:
        return tuple(k for k, f in enumerate(self.score.row_float) if f) if self.score else ()

    @property
    def float_cols(self) -> tuple[int, ...]:
        return tuple(k for k, f in enumerate(self.score.col_float) if f) if self.score else ()

    @property
    def grad_arrays(self) -> tuple[int, ...]:
        """The arrays whose read gradients the dQ kernel scatters, ascending."""
        return tuple(sorted(set(self.score.grad_reads))) if self.score else ()


def mod_pointers(gm: GeneratedMod | None, p: str) -> list[str]:
    """Pointer parameters of one mod: its rows, columns and arrays (``p``: "S" or "M")."""
    if gm is None:
        return []
    return ([f"{p}R{k}" for k in range(gm.rows)] + [f"{p}C{k}" for k in range(gm.cols)]
            + [f"{p}A{k}" for k in range(gm.arrays)])


def mod_constexprs(gm: GeneratedMod | None, p: str) -> list[str]:
    """Constexpr parameters of one mod: each row's / column's B' and H'."""
    if gm is None:
        return []
    return ([f"{p}R{k}_{x}" for k in range(gm.rows) for x in "BH"]
            + [f"{p}C{k}_{x}" for k in range(gm.cols) for x in "BH"])


_COMMON = ["SCALE", "HQ", "HKV", "G", "SQ", "SKV", "Q_LEN", "KV_LEN", "D", "DV", "TQ", "TK", "SUB_Q", "SUB_K",
           "LB", "LH", "LN", "W_P", "W_F", "PREC"]


def fwd_params(plan: Plan) -> tuple[list[str], list[str], list[str]]:
    """(input pointers, output pointers, constexprs) of the forward kernel, in call order."""
    ins = ["KV_N", "KV_I", "FKV_N", "FKV_I", "Q", "K", "V"]
    ins += (["PT"] if plan.paged else []) + (["KS", "VS"] if plan.quant else [])
    consts = _mod_consts(plan) + (["PS", "MAXP"] if plan.paged else [])
    return ins + _mod_pointers(plan), ["OUT", "ROW_MAX", "ROW_SUM"], consts


def _mod_pointers(plan: Plan) -> list[str]:
    return mod_pointers(plan.score, "S") + mod_pointers(plan.mask, "M") + (["SEED"] if plan.dropout else [])


def _mod_consts(plan: Plan) -> list[str]:
    return (_COMMON + mod_constexprs(plan.score, "S") + mod_constexprs(plan.mask, "M")
            + (["DROP_T", "DROP_INV"] if plan.dropout else []))


def _bwd_ins(plan: Plan, lists: str) -> list[str]:
    return ([f"{lists}_N", f"{lists}_I", f"F{lists}_N", f"F{lists}_I", "Q", "K", "V", "DO", "LSE", "DELTA"]
            + _mod_pointers(plan))


def dq_params(plan: Plan) -> tuple[list[str], list[str], list[str]]:
    """(input pointers, output pointers, constexprs) of the dQ kernel."""
    outs = ["DQ"]
    consts = _mod_consts(plan) + ["NBH", "CHUNK"]
    if plan.grads:
        outs += [f"DR{k}" for k in plan.float_rows] + [f"DA{k}" for k in plan.grad_arrays]
        consts += [f"NPAD{k}" for k in plan.grad_arrays]
    return _bwd_ins(plan, "KV"), outs, consts


def dkv_params(plan: Plan) -> tuple[list[str], list[str], list[str]]:
    """(input pointers, output pointers, constexprs) of the dK/dV kernel."""
    outs = ["DK", "DV_"] + ([f"DC{k}" for k in plan.float_cols] if plan.grads else [])
    return _bwd_ins(plan, "Q"), outs, _mod_consts(plan)


def _signature(name: str, params) -> list[str]:
    ins, outs, consts = params
    args = ins + outs + [f"{c}: tl.constexpr" for c in consts]
    return ["@triton.jit", f"def {name}(", *[f"    {a}," for a in args], "):"]


# The kernels call only builtins of triton.language: its @triton.jit functions (tl.max,
# tl.sum, tl.min, tl.zeros, ...) stay compiled JITFunctions, which the interpreter cannot
# call, when triton was imported without TRITON_INTERPRET (jax_triton imports it). So
# reductions are tl.reduce with tl.standard's combine functions (what tl.max / tl.sum /
# tl.min do for 32-bit inputs, and what the interpreter runs with NumPy), and zeros tl.full.
_COMBINE = {"max": "tl.standard._elementwise_max", "min": "tl.standard._elementwise_min",
            "sum": "tl.standard._sum_combine"}


def _red(op: str, expr: str, axis: int) -> str:
    return f"tl.reduce({expr}, {axis}, {_COMBINE[op]})"


class _Lines:
    def __init__(self, plan: Plan):
        self.plan = plan
        self.lines: list[str] = []

    def __call__(self, indent: int, *lines: str):
        self.lines.extend("    " * indent + ln for ln in lines)


# Tiles are [q rows, kv columns] in the forward and dQ kernels; the dK/dV kernel computes
# the transposed tiles [kv rows, q columns] (``T=True``), so that P^T and dS^T feed its two
# products directly. The mods are elementwise with broadcasting, so they take either
# orientation from the shapes of the index tiles and hoisted values they are given.
def _as_rows(T: bool) -> str:
    """Indexing that makes a q-indexed vector a tile of per-q values: [TQ, 1], or [1, TQ] transposed."""
    return "[None, :]" if T else "[:, None]"


def _as_cols(T: bool) -> str:
    """Indexing that makes a kv-indexed vector a tile of per-kv values: [1, TK], or [TK, 1] transposed."""
    return "[:, None]" if T else "[None, :]"


def _row_loads(gm: GeneratedMod | None, p: str, T: bool = False) -> list[str]:
    """Loads of a mod's hoisted rows for (b, h) and the q tile at ``offs_q`` as [TQ, 1] tiles
    ([1, TQ] transposed; a row that does not depend on q_idx as one scalar)."""
    if gm is None:
        return []
    loads = []
    for k in range(gm.rows):
        at = f"{p}R{k} + ((b % {p}R{k}_B) * {p}R{k}_H + h % {p}R{k}_H) * SQ"
        load = f"tl.load({at})" if gm.row_scalar[k] else f"tl.load({at} + offs_q){_as_rows(T)}"
        loads.append(f"{p.lower()}r{k} = {load}")
    return loads


def _col_loads(gm: GeneratedMod | None, p: str, T: bool = False) -> list[str]:
    """Loads of a mod's hoisted columns for (b, h) and the kv tile at ``offs_k`` as [1, TK] tiles
    ([TK, 1] transposed)."""
    if gm is None:
        return []
    return [f"{p.lower()}c{k} = tl.load({p}C{k} + ((b % {p}C{k}_B) * {p}C{k}_H + h % {p}C{k}_H) * SKV + offs_k)"
            f"{_as_cols(T)}" for k in range(gm.cols)]


def _mod_args(gm: GeneratedMod, p: str) -> str:
    s = p.lower()
    return ", ".join([f"{s}r{k}" for k in range(gm.rows)] + [f"{s}c{k}" for k in range(gm.cols)]
                     + [f"{p}A{k}" for k in range(gm.arrays)])


def _call(gm: GeneratedMod, fn: str, lead: str, p: str, tail: str = "") -> str:
    args = ", ".join(x for x in (lead, _mod_args(gm, p), tail) if x)
    return f"{fn}({args})"


# The dropout hash of ``flexjax._dropout``, spelled in Triton on uint32: ``>>`` on an
# unsigned tensor is a logical shift and products wrap mod 2**32, as in jnp (the literals
# above 2**31 are uint32 constants, so every operand stays unsigned).
_FMIX = f"""@triton.jit
def flexjax_fmix(x):
    x = x ^ (x >> 16)
    x = x * {_dropout._M1:#x}
    x = x ^ (x >> 13)
    x = x * {_dropout._M2:#x}
    return x ^ (x >> 16)"""


def _seed_lines(plan: Plan) -> list[str]:
    """The seed's two words as uint32 scalars (``SEED`` holds them bitcast to int32)."""
    if not plan.dropout:
        return []
    return ["seed0 = tl.load(SEED).to(tl.uint32, bitcast=True)",
            "seed1 = tl.load(SEED + 1).to(tl.uint32, bitcast=True)"]


def _row_hash_lines(plan: Plan) -> list[str]:
    """``drow`` [TQ, 1]: ``_dropout.row_hash`` of (b, h, q_idx)."""
    if not plan.dropout:
        return []
    return ["drow = flexjax_fmix(q_idx.to(tl.uint32) ^ seed1)",
            "drow = flexjax_fmix(h.to(tl.uint32) + drow)",
            "drow = flexjax_fmix(b.to(tl.uint32) + drow)",
            "drow = flexjax_fmix(seed0 ^ drow)"]


def _col_hash_lines(plan: Plan) -> list[str]:
    """``dcol`` [1, TK]: ``_dropout.col_hash`` of kv_idx."""
    if not plan.dropout:
        return []
    return [f"dcol = flexjax_fmix((kv_idx.to(tl.uint32) * {_dropout._GOLDEN:#x}) ^ seed1)"]


_KEEP = "keep = flexjax_fmix(drow ^ dcol) >= DROP_T"


def _mask_lines(plan: Plan, T: bool = False) -> list[str]:
    """``ok``: the in-range test and the mask_mod, for a partial tile."""
    lines = [f"ok = q_in & (offs_k < KV_LEN){_as_cols(T)}"]
    if plan.mask is not None:
        lines.append("ok = ok & " + _call(plan.mask, plan.mask.fwd, "b, h, q_idx, kv_idx", "M"))
    return lines


def _kv_tile(lines: _Lines, ind: int, T: bool = False):
    """Index tiles of the kv tile starting at ``kv_start``, and its K and V."""
    lines(ind,
          "offs_k = kv_start + tl.arange(0, TK)",
          f"kv_idx = tl.minimum(offs_k, KV_LEN - 1){_as_cols(T)}")
    if lines.plan.paged:
        # The tile's page (a tile never crosses one: TK divides PS); an unassigned page (-1)
        # reads page 0, whose keys the lengths mask.
        lines(ind,
              "page = tl.maximum(tl.load(PT + b.to(tl.int64) * MAXP + kv_start // PS), 0)",
              "kv_off = (page.to(tl.int64) * PS + kv_start % PS) * HKV + kvh")
    else:
        lines(ind, "kv_off = (b.to(tl.int64) * SKV + kv_start) * HKV + kvh")
    lines(ind,
          "k = tl.load(K + kv_off * D + ar_k[:, None] * (HKV * D) + ar_d[None, :])",
          "v = tl.load(V + kv_off * DV + ar_k[:, None] * (HKV * DV) + ar_dv[None, :])")
    if lines.plan.quant:
        lines(ind,
              "k = (k.to(tl.float32) * tl.load(KS + page * HKV + kvh)).to(Q.dtype.element_ty)",
              "v = (v.to(tl.float32) * tl.load(VS + page * HKV + kvh)).to(Q.dtype.element_ty)")
    lines(ind, *_col_hash_lines(lines.plan))


def _q_tile(lines: _Lines, ind: int, do: bool, T: bool = False):
    """Index tiles of the q tile starting at ``q_start`` for head ``h``, its Q (and dO, lse, delta).

    ``lse`` is in the units of the exponent the kernel takes (``_exp``): log2 units for
    kernels without a score_mod."""
    lines(ind,
          "offs_q = q_start + tl.arange(0, TQ)",
          f"q_idx = tl.minimum(offs_q, Q_LEN - 1){_as_rows(T)}",
          f"q_in = (offs_q < Q_LEN){_as_rows(T)}",
          "q_off = (b.to(tl.int64) * SQ + q_start) * HQ + h",
          "q = tl.load(Q + q_off * D + ar_q[:, None] * (HQ * D) + ar_d[None, :])")
    lines(ind, *_row_hash_lines(lines.plan))
    if do:
        lines(ind,
              "do = tl.load(DO + q_off * DV + ar_q[:, None] * (HQ * DV) + ar_dv[None, :])",
              "st = (b * HQ + h).to(tl.int64) * SQ + offs_q",
              "lse = tl.load(LSE + st)" + ("" if lines.plan.score is not None else f" * {_LOG2E}"),
              "delta = tl.load(DELTA + st)")


def _walk(lines: _Lines, ind: int, n_ptr: str, i_ptr: str, width: str, sub: str, start: str, tile: str,
          row: str, body):
    """A loop over one row of a tile list, ``sub`` kernel tiles per list entry.

    The entry of the next step is read one step ahead and carried across iterations
    (``blk``), so a tile's address never waits on a load of its own iteration: Triton's
    software pipeliner can then keep ``num_stages - 1`` tiles' copies in flight (with the
    read in the same iteration, the loops of the full tiles and of the backward waited for
    every copy). Lists have at least one entry per row (``_launch._lists``), so the first
    read and the clamped last one stay in bounds.
    """
    lines(ind,
          f"n = tl.load({n_ptr} + {row}) * {sub}",
          f"blk = tl.load({i_ptr} + {row} * {width})",
          "for t in range(0, n):")
    lines(ind + 1,
          f"{start} = (blk * {sub} + t % {sub}) * {tile}",
          f"blk = tl.load({i_ptr} + {row} * {width} + tl.minimum((t + 1) // {sub}, {width} - 1))")
    body(ind + 1)


# Softmax in base 2 where no score_mod sits between the product and the exponent: the scale
# carries log2(e) (``QK``, a compile-time constant), so each score takes one multiply and
# exp2 takes it as is (``tl.exp`` multiplies by log2(e) inside). A score_mod's output keeps
# natural units: its row max is subtracted before anything multiplies it, so a row of
# equal huge scores (-1e30) still gives exactly 1 at its max.
_LOG2E, _LN2 = "1.4426950408889634", "0.6931471805599453"


def _exp(plan: Plan) -> str:
    return "tl.exp" if plan.score is not None else "tl.exp2"


def _scores(plan: Plan, T: bool = False) -> str:
    """The product of the scores' tile (transposed: K Q^T), scaled (in log2 units without a score_mod)."""
    dot = "tl.dot(k, tl.trans(q), input_precision=PREC)" if T else "tl.dot(q, tl.trans(k), input_precision=PREC)"
    return f"{dot} * {'SCALE' if plan.score is not None else 'QK'}"


# The forward and dQ programs take their q tiles last first: under a causal mask the last
# tiles have the most kv tiles, and launching them first leaves the short ones to fill the
# machine's last wave (FlashAttention-2's order). Other masks are indifferent to it.
_HEAVIEST_FIRST = "i = tl.num_programs(0) - 1 - tl.program_id(0)"


def _common_head(lines: _Lines):
    lines(1, f"QK = SCALE * {_LOG2E}",
          "ar_q = tl.arange(0, TQ)",
          "ar_k = tl.arange(0, TK)",
          "ar_d = tl.arange(0, D)",
          "ar_dv = tl.arange(0, DV)",
          *_seed_lines(lines.plan))


# -- forward -----------------------------------------------------------------------------------

def _fwd(plan: Plan) -> str:
    lines = _Lines(plan)
    lines.lines += _signature(FWD, fwd_params(plan))
    lines(1,
          _HEAVIEST_FIRST,
          "h = tl.program_id(1)",
          "b = tl.program_id(2)",
          "kvh = h // G",
          "q_start = i * TQ")
    _common_head(lines)
    _q_tile(lines, 1, do=False)
    lines(1, *_row_loads(plan.score, "S"), *_row_loads(plan.mask, "M"))
    lines(1,
          "row = ((b % LB) * LH + h % LH) * LN + i // SUB_Q",
          # The running max starts at -inf; a row that has seen no allowed key keeps it and
          # subtracts 0 instead (m_use), so exp() gives exactly 0 there rather than NaN.
          "m_i = tl.full([TQ], float(\"-inf\"), tl.float32)",
          "l_i = tl.full([TQ], 0.0, tl.float32)",
          "acc = tl.full([TQ, DV], 0.0, tl.float32)")

    def body(masked):
        def emit(ind):
            _kv_tile(lines, ind)
            lines(ind, f"s = {_scores(plan)}")
            if plan.score is not None:
                lines(ind, *_col_loads(plan.score, "S"),
                      "s = " + _call(plan.score, plan.score.fwd, "s, b, h, q_idx, kv_idx", "S"))
            if masked:
                lines(ind, *_col_loads(plan.mask, "M"), *_mask_lines(plan),
                      "s = tl.where(ok, s, float(\"-inf\"))")
            lines(ind,
                  f"m_new = tl.maximum(m_i, {_red('max', 's', 1)})",
                  "m_use = tl.where(m_new == float(\"-inf\"), 0.0, m_new)",
                  f"p = {_exp(plan)}(s - m_use[:, None])",
                  f"alpha = {_exp(plan)}(m_i - m_use)",
                  f"l_i = l_i * alpha + {_red('sum', 'p', 1)}")
            if plan.dropout:
                # The row statistics are of all probabilities; V takes the kept ones (the
                # 1 / (1 - rate) is applied once, to the output).
                lines(ind, _KEEP, "p = tl.where(keep, p, 0.0)")
            lines(ind,
                  "acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)",
                  "m_i = m_new")

        return emit

    _walk(lines, 1, "KV_N", "KV_I", "W_P", "SUB_K", "kv_start", "TK", "row", body(True))
    _walk(lines, 1, "FKV_N", "FKV_I", "W_F", "SUB_K", "kv_start", "TK", "row", body(False))
    # Empty rows: out 0, max 0, sum 0. Max and sum stay apart (lse is formed outside): at
    # |max| ~ 1e30, float32 lse has lost log(sum), which the backward needs.
    lines(1,
          "alive = l_i > 0",
          "out = acc / tl.where(alive, l_i, 1.0)[:, None]" + (" * DROP_INV" if plan.dropout else ""),
          "tl.store(OUT + q_off * DV + ar_q[:, None] * (HQ * DV) + ar_dv[None, :], out.to(OUT.dtype.element_ty))",
          "st = (b * HQ + h).to(tl.int64) * SQ + offs_q",
          "tl.store(ROW_MAX + st, tl.where(alive, m_i" + ("" if plan.score is not None else f" * {_LN2}")
          + ", 0.0))",
          "tl.store(ROW_SUM + st, l_i)")
    return "\n".join(lines.lines)


# -- backward ----------------------------------------------------------------------------------

def _bwd_tile(lines: _Lines, ind: int, plan: Plan, masked: bool, T: bool = False):
    """P and dS of one tile (transposed: P^T and dS^T); with a score_mod, ``g`` holds its VJP
    (dS first)."""
    rows = _as_rows(T)
    if plan.score is not None:
        lines(ind, f"s_raw = {_scores(plan, T)}",
              "s = " + _call(plan.score, plan.score.fwd, "s_raw, b, h, q_idx, kv_idx", "S"))
    else:
        lines(ind, f"s = {_scores(plan, T)}")
    lines(ind, f"p = {_exp(plan)}(s - lse{rows})")
    if masked:
        lines(ind, *_col_loads(plan.mask, "M", T), *_mask_lines(plan, T), "p = tl.where(ok, p, 0.0)")
    lines(ind, "dp = " + ("tl.dot(v, tl.trans(do), input_precision=PREC)" if T
                          else "tl.dot(do, tl.trans(v), input_precision=PREC)"))
    if plan.dropout:
        # pv: what multiplies dO in dV; dP only reaches the kept probabilities.
        lines(ind, _KEEP,
              "pv = tl.where(keep, p * DROP_INV, 0.0)",
              "dp = tl.where(keep, dp * DROP_INV, 0.0)")
    lines(ind, f"ds = p * (dp - delta{rows})")
    if plan.score is not None:
        lines(ind, "g = " + _call(plan.score, plan.score.bwd, "s_raw, b, h, q_idx, kv_idx", "S", "ds"),
              "ds = g[0]")


def _dq(plan: Plan) -> str:
    lines = _Lines(plan)
    lines.lines += _signature(DQ, dq_params(plan))
    lines(1,
          _HEAVIEST_FIRST,
          "h = tl.program_id(1)",
          "b = tl.program_id(2)",
          "kvh = h // G",
          "q_start = i * TQ")
    _common_head(lines)
    _q_tile(lines, 1, do=True)
    lines(1, *_row_loads(plan.score, "S"), *_row_loads(plan.mask, "M"))
    lines(1,
          "row = ((b % LB) * LH + h % LH) * LN + i // SUB_Q",
          "dq = tl.full([TQ, D], 0.0, tl.float32)")
    gm = plan.score
    n_fr = len(plan.float_rows)
    n_fc = len(plan.float_cols)
    if plan.grads:
        lines(1, *[f"dr{k} = tl.full([TQ], 0.0, tl.float32)" for k in plan.float_rows])
        # This program's own slab of each array gradient (summed over programs outside).
        lines(1, *[f"da{k} = DA{k} + (i * NBH + b * HQ + h).to(tl.int64) * NPAD{k}" for k in plan.grad_arrays])

    def body(masked):
        def emit(ind):
            _kv_tile(lines, ind)
            if gm is not None:
                lines(ind, *_col_loads(gm, "S"))
            _bwd_tile(lines, ind, plan, masked)
            lines(ind, "dq = dq + tl.dot(ds.to(k.dtype), k, input_precision=PREC)")
            if not plan.grads:
                return
            for pos, k in enumerate(plan.float_rows):
                lines(ind, f"dr{k} = dr{k} + {_red('sum', f'g[{1 + pos}]', 1)}")
            for r, k in enumerate(gm.grad_reads):
                base = 1 + n_fr + n_fc + 2 * r
                # A one-hot reduction per chunk of flat indices, only over the chunks this
                # tile's indices reach, in a fixed order: deterministic, no atomics.
                lines(ind,
                      f"fi = g[{base}]",
                      f"fd = g[{base + 1}]",
                      f"lo = {_red('min', _red('min', 'fi', 1), 0)} // CHUNK",
                      f"hi = {_red('max', _red('max', 'fi', 1), 0)} // CHUNK",
                      "for c in range(lo, hi + 1):")
                lines(ind + 1,
                      "tgt = c * CHUNK + tl.arange(0, CHUNK)",
                      "hit = fi[:, :, None] == tgt[None, None, :]",
                      f"part = {_red('sum', _red('sum', 'tl.where(hit, fd[:, :, None], 0.0)', 0), 0)}",
                      f"tl.store(da{k} + tgt, tl.load(da{k} + tgt) + part)")

        return emit

    _walk(lines, 1, "KV_N", "KV_I", "W_P", "SUB_K", "kv_start", "TK", "row", body(True))
    _walk(lines, 1, "FKV_N", "FKV_I", "W_F", "SUB_K", "kv_start", "TK", "row", body(False))
    lines(1, "tl.store(DQ + q_off * D + ar_q[:, None] * (HQ * D) + ar_d[None, :], "
             "(dq * SCALE).to(DQ.dtype.element_ty))")
    if plan.grads:
        lines(1, *[f"tl.store(DR{k} + st, dr{k})" for k in plan.float_rows])
    return "\n".join(lines.lines)


def _dkv(plan: Plan) -> str:
    lines = _Lines(plan)
    lines.lines += _signature(DKV, dkv_params(plan))
    lines(1,
          "j = tl.program_id(0)",
          "kvh = tl.program_id(1)",
          "b = tl.program_id(2)",
          "kv_start = j * TK")
    _common_head(lines)
    _kv_tile(lines, 1, T=True)
    lines(1,
          "dk = tl.full([TK, D], 0.0, tl.float32)",
          "dv = tl.full([TK, DV], 0.0, tl.float32)",
          "for gi in range(0, G):")
    gm = plan.score
    n_fr = len(plan.float_rows)
    lines(2,
          "h = kvh * G + gi",
          "col = ((b % LB) * LH + h % LH) * LN + j // SUB_K")
    if gm is not None:
        lines(2, *_col_loads(gm, "S", T=True))
    if plan.grads:
        lines(2, *[f"dc{k} = tl.full([TK], 0.0, tl.float32)" for k in plan.float_cols])

    def body(masked):
        def emit(ind):
            _q_tile(lines, ind, do=True, T=True)
            lines(ind, *_row_loads(gm, "S", T=True), *(_row_loads(plan.mask, "M", T=True) if masked else []))
            _bwd_tile(lines, ind, plan, masked, T=True)
            # P^T and dS^T are the left operands as computed: no transpose of a register tile.
            lines(ind,
                  f"dv = dv + tl.dot({'pv' if plan.dropout else 'p'}.to(do.dtype), do, input_precision=PREC)",
                  "dk = dk + tl.dot(ds.to(q.dtype), q, input_precision=PREC)")
            if plan.grads:
                for pos, k in enumerate(plan.float_cols):
                    lines(ind, f"dc{k} = dc{k} + {_red('sum', f'g[{1 + n_fr + pos}]', 1)}")

        return emit

    _walk(lines, 2, "Q_N", "Q_I", "W_P", "SUB_Q", "q_start", "TQ", "col", body(True))
    _walk(lines, 2, "FQ_N", "FQ_I", "W_F", "SUB_Q", "q_start", "TQ", "col", body(False))
    if plan.grads:
        lines(2, *[f"tl.store(DC{k} + (b * HQ + h).to(tl.int64) * SKV + offs_k, dc{k})" for k in plan.float_cols])
    lines(1,
          "tl.store(DK + kv_off * D + ar_k[:, None] * (HKV * D) + ar_d[None, :], (dk * SCALE).to(DK.dtype.element_ty))",
          "tl.store(DV_ + kv_off * DV + ar_k[:, None] * (HKV * DV) + ar_dv[None, :], dv.to(DV_.dtype.element_ty))")
    return "\n".join(lines.lines)


def source(plan: Plan) -> str:
    """The module: imports, the mods' functions, and the forward, dQ and dK/dV kernels."""
    parts = ["import triton\nimport triton.language as tl"]
    parts += [gm.source.strip("\n") for gm in (plan.score, plan.mask) if gm is not None]
    parts += [_FMIX] if plan.dropout else []
    parts += [_fwd(plan), _dq(plan), _dkv(plan)]
    return "\n\n\n".join(parts) + "\n"
