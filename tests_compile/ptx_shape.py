"""The Hopper shape of a kernel's PTX: its tensor-core instructions and how deep its copies are waited for.

Used by ``triton_suite.py`` on every 16-bit sm_90 kernel (issue 29); no side effects, so
``tests/test_ptx_shape.py`` checks it on PTX fragments.
"""

from __future__ import annotations

import re

# The PTX instruction mix of a kernel: tensor-core instructions and how deep its cp.async
# copies are waited for. A pipelined loop waits with ``cp.async.wait_group N`` for N >= 1
# (N copies stay in flight); a loop that only waits with 0 double-buffers at best.
_WGMMA = re.compile(r"^\s*wgmma\.mma_async", re.M)
_MMA_SYNC = re.compile(r"^\s*mma\.sync", re.M)
_WAIT = re.compile(r"^\s*cp\.async\.wait_group\s+(\d+)", re.M)
_BULK_WAIT = re.compile(r"^\s*cp\.async\.bulk\.wait_group(?:\.read)?\s+(\d+)", re.M)
_TMA = re.compile(r"^\s*cp\.async\.bulk\.tensor", re.M)


# Tensor-core instructions by name, for telling which arch's kernel a PTX holds: sm_90a's wgmma;
# sm_100a's tcgen05 (tensor memory allocated, MMAs issued and committed to a barrier, results
# loaded and waited for, the memory freed).
TENSOR_CORE_OPS = ("wgmma.mma_async", "tcgen05.alloc", "tcgen05.mma", "tcgen05.commit", "tcgen05.ld",
                   "tcgen05.wait::ld", "tcgen05.dealloc")
# An instruction starts a line or follows a ";" or "{" (inline asm puts wgmma after a predicate
# set-up in braces), after an optional guard predicate.
_TENSOR_CORE = re.compile(r"(?:^|[;{])\s*(?:@!?%?\w+\s+)?(" + "|".join(re.escape(op) for op in TENSOR_CORE_OPS)
                          + r")[.\s;]", re.M)


def tensor_core_ops(ptx: str) -> set[str]:
    """The ``TENSOR_CORE_OPS`` that a PTX's instructions (not its comments or names) use."""
    return set(_TENSOR_CORE.findall(ptx))


_LABEL = re.compile(r"^(\$L__\w+):", re.M)
_BRANCH = re.compile(r"^\s*(?:@%p\d+\s+)?bra(?:\.uni)?\s+(\$L__\w+);", re.M)


def _loops(ptx: str) -> list[tuple[int, int]]:
    """(start, end) offsets of the loops of a PTX function: a branch back to an earlier label."""
    labels = {m.group(1): m.start() for m in _LABEL.finditer(ptx)}
    return [(labels[m.group(1)], m.end()) for m in _BRANCH.finditer(ptx)
            if m.group(1) in labels and labels[m.group(1)] < m.start()]


def instruction_mix(ptx: str) -> dict:
    """Counts of ``wgmma.mma_async``, ``mma.sync`` and TMA copies; the distinct
    ``cp.async.wait_group`` depths; and ``loop_waits``: for each loop that issues cp.async
    copies (outside the loops nested in it, none of which copies), the deepest wait there
    (0: the loop waits for every copy it issued; -1: none)."""
    waits = [(m.start(), int(m.group(1))) for m in _WAIT.finditer(ptx)]
    commits = [m.start() for m in re.finditer(r"^\s*cp\.async\.commit_group", ptx, re.M)]
    loops = sorted(set(_loops(ptx)))

    def own(a, b, at):  # inside loop (a, b) and not inside a loop nested in it
        return a <= at <= b and not any((c, d) != (a, b) and a <= c and d <= b and c <= at <= d for c, d in loops)

    def nested(a, b):
        return [(c, d) for c, d in loops if (c, d) != (a, b) and a <= c and d <= b]

    # A loop that only starts and drains the copies of the loops nested in it (the dK/dV
    # kernel's loop over a group's query heads) is not one of them.
    loop_waits = [max((n for at, n in waits if own(a, b, at)), default=-1) for a, b in loops
                  if any(own(a, b, at) for at in commits)
                  and not any(c <= at <= d for c, d in nested(a, b) for at in commits)]
    return {"wgmma": len(_WGMMA.findall(ptx)), "mma_sync": len(_MMA_SYNC.findall(ptx)),
            "tma": len(_TMA.findall(ptx)),
            "waits": sorted({n for _, n in waits} | {int(n) for n in _BULK_WAIT.findall(ptx)}),
            "loop_waits": loop_waits}


def hopper_shape(kind: str, mix: dict) -> list[str]:
    """What keeps a 16-bit sm_90 kernel's PTX from being Hopper-shaped: no ``wgmma.mma_async``,
    any ``mma.sync``, or a loop whose copies are only ever waited for with depth 0 (no
    prefetch in flight).

    The one exception to the last: a dQ kernel that reduces the gradient of a captured
    array read by a gather (``scatter``: its deterministic one-hot reduction is a loop over
    the chunks of each tile's indices, nested in the kv loop, and Triton's software
    pipeliner pipelines innermost loops only). It still must use wgmma and no mma.sync.
    """
    fails = []
    if not mix["wgmma"]:
        fails.append(f"{kind}: no wgmma.mma_async")
    if mix["mma_sync"]:
        fails.append(f"{kind}: {mix['mma_sync']} mma.sync")
    if not mix["tma"] and not mix.get("scatter") and (not mix["loop_waits"] or min(mix["loop_waits"]) < 1):
        fails.append(f"{kind}: a loop waits for all its copies (deepest cp.async.wait_group per copying loop: "
                     f"{mix['loop_waits'] or 'no copying loop'})")
    return fails


def hopper_exempt(row, kind: str) -> bool:
    """The one exemption from the Hopper shape: the backward kernels (``kind`` "dq" or "dkv")
    at head dim 256 with a table-gather mod whose gradient the dQ kernel reduces. There every
    warpgroup tile of dQ tried spilled (1.4 KB and more) and dK/dV spilled at 3 stages, so the
    tile table keeps the spill-free tiles (``flexjax/backends/_tile_tables.py``,
    TRITON_SM90[(2, 256)]); the forward is checked as every other."""
    return (kind in ("dq", "dkv") and row["head_dim"] == 256
            and bool(row["kernels"].get("dq", {}).get("scatter")))


# -- the FlashAttention-3 shape of the mosaic_gpu kernels (issue 44) --------------------------------

# A wgmma's instruction (its N in the shape) and what follows its accumulator: a second register
# list is the register-A form (A in registers), a descriptor the shared-memory form.
_WGMMA_FORM = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k\d+\.\S+\s*\{[^}]*\}\s*,\s*(\{?)")
# libdevice's expf (the precise exponent): a range reduction with one ``fma.rm.f32`` before its
# ``ex2.approx.ftz.f32``. A bare ``ex2.approx`` (``exp2(approx=True)``) has none.
_EX2 = re.compile(r"^\s*ex2\.approx\.ftz\.f32", re.M)
_EXPF = re.compile(r"^\s*fma\.rm\.f32", re.M)


def wgmma_forms(ptx: str) -> list[tuple[int, bool]]:
    """(N, register_a) of each ``wgmma.mma_async`` in a PTX, in order."""
    return [(int(n), bool(brace)) for n, brace in _WGMMA_FORM.findall(ptx)]


_WGMMA_WAIT = re.compile(r"^\s*wgmma\.wait_group\.sync\.aligned\s+(\d+)\s*;", re.M)


def wgmma_waits(ptx: str) -> list[int]:
    """The N of each ``wgmma.wait_group N`` in a PTX: N >= 1 leaves N groups in flight (an MMA still
    running while the code after the wait does; the forward's intra-warpgroup overlap)."""
    return [int(n) for n in _WGMMA_WAIT.findall(ptx)]


def bare_ex2(ptx: str) -> int:
    """How many ``ex2.approx.ftz.f32`` are bare exponents, not the core of a precise ``expf``."""
    return len(_EX2.findall(ptx)) - len(_EXPF.findall(ptx))


_SERIALIZED = re.compile(r"wgmma\.mma_async instructions are serialized due to (.+?) (?:in|for) the function '([^']+)'")


def wgmma_serialized(ptxas_report: str) -> dict[str, str]:
    """{kernel: reason} for each kernel whose wgmmas ptxas serialized (its C7510-C7515 "Potential
    Performance Loss" notes): each wgmma then waits for the previous one, so no MMA overlaps anything,
    whatever the PTX's wait_group depths say. Reasons seen: "insufficient register resources",
    "non wgmma instructions defining input registers of a wgmma between start and end of the
    pipeline stage" (a register-A operand or accumulator written while its wgmma is in flight)."""
    return {name: reason for reason, name in _SERIALIZED.findall(ptxas_report)}


_TC_EVENT = re.compile(r"^\s*(?:@!?%?\w+\s+)?(tcgen05\.mma|tcgen05\.commit|mbarrier\.try_wait)", re.M)


def tcgen05_chained(ptx: str) -> bool:
    """Whether an sm_100a kernel's PTX issues a tcgen05 MMA after committing another with no
    barrier wait between them: two MMAs in flight (the forward's Q K^T and the previous tile's
    P·V, the softmax running before the second is waited for)."""
    committed = False
    for op in _TC_EVENT.findall(ptx):
        if op == "tcgen05.commit":
            committed = True
        elif op == "mbarrier.try_wait":
            committed = False
        elif committed:
            return True
    return False


_MOV_IMM = re.compile(r"\bmov\.b32\s+(%r\d+),\s*(\d+);")
_TC_MMA_IDESC = re.compile(r"\btcgen05\.mma\.cta_group::\d\.kind::\w+\s+\[[^\]]*\],\s*[^,]+,\s*[^,]+,\s*(%r\d+)")


def tcgen05_shapes(ptx: str) -> list[tuple[int, int]]:
    """The (M, N) of each tcgen05 MMA in an sm_100a kernel's PTX, from its instruction descriptor:
    the 32-bit register after the two smem descriptors, set from an immediate (``mov.b32``), with
    N / 8 in bits 17-22 and M / 16 in bits 24-28 (PTX ISA, "Instruction descriptor" of
    ``kind::f16``). An MMA whose descriptor is not an immediate is left out."""
    imm = dict(_MOV_IMM.findall(ptx))
    out = []
    for reg in _TC_MMA_IDESC.findall(ptx):
        if reg in imm:
            d = int(imm[reg])
            out.append((((d >> 24) & 0x1F) << 4, ((d >> 17) & 0x3F) << 3))
    return out


_SASS_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_SASS_BRANCH = re.compile(r"\bBRA\s+`\((\.L_x_\d+)\)")
_SASS_EXIT = re.compile(r"\bEXIT\b")
_SASS_SPILL = re.compile(r"\b(STL|LDL)(?:\.[\w.]+)?\s")
# sm_90a's wgmma and sm_100a's tcgen05 MMAs in SASS.
_SASS_MMA = re.compile(r"\b(HGMMA|UTC\w*MMA)\b")


def sass_spills(sass: str) -> dict[str, int]:
    """Where a kernel's spill instructions (``STL`` / ``LDL``) are in its SASS (``nvdisasm -c``):
    ``{"in_mma_loops": n, "outside": m}``. The MMA loops are the innermost loops that issue a
    tensor-core MMA (``HGMMA``, ``UTC*MMA``): a kernel's steps over its tiles. A loop is a branch
    back to a label at or above it, before the kernel's last ``EXIT`` (after it are the
    out-of-line retries of barrier waits, which branch back into the code they came from)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _SASS_LABEL.match(line))}
    exits = [i for i, line in enumerate(lines) if _SASS_EXIT.search(line)]
    end = exits[-1] if exits else len(lines)
    loops = []
    for i, line in enumerate(lines[:end]):
        m = _SASS_BRANCH.search(line)
        if m and labels.get(m.group(1), i + 1) <= i:
            loops.append((labels[m.group(1)], i))
    mma = [(a, b) for a, b in loops if any(_SASS_MMA.search(x) for x in lines[a:b + 1])]
    inner = [(a, b) for a, b in mma if not any((c, d) != (a, b) and a <= c and d <= b for c, d in mma)]
    spills = [i for i, line in enumerate(lines) if _SASS_SPILL.search(line)]
    n_in = sum(any(a <= i <= b for a, b in inner) for i in spills)
    return {"in_mma_loops": n_in, "outside": len(spills) - n_in}


_HLO_TRANSPOSE = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*\w+\[([\d,]*)\]\S*\s+transpose\(", re.M)


def hlo_transposes(hlo: str, rank: int = 4) -> list[str]:
    """The shapes of an optimized HLO's ``transpose`` instructions of ``rank`` dimensions: around the
    attention kernels, a copy of a (batch, seq, heads, head_dim) operand."""
    return [shape for shape in _HLO_TRANSPOSE.findall(hlo) if shape.count(",") == rank - 1]


def fa3_shape(kind: str, ptx: str, *, qk_n: int, min_bare_ex2: int, overlap: bool = False,
              full_n: int | None = None) -> list[str]:
    """What keeps an sm_90a mosaic_gpu kernel's PTX from FlashAttention-3's shape.

    ``kind``: "fwd", "dq" or "dkv". ``qk_n``: the least N its score products (Q K^T in the forward,
    S and dP in dQ, S^T and dP^T in dK/dV: the wgmmas that read A from shared memory) must have;
    ``full_n`` (default ``qk_n``): the N the widest of them must reach (the full tiles' product,
    where a kernel's partial tiles run narrower sub-steps).
    Each kernel needs at least one register-A wgmma (P·V, dS·K, P^T·dO and dS^T·Q take A from
    registers) and ``min_bare_ex2`` bare ``ex2.approx`` exponents (a tile's elements per thread);
    with ``overlap``, a ``wgmma.wait_group`` that leaves a group in flight (the softmax running
    while P·V does)."""
    forms = wgmma_forms(ptx)
    fails = []
    smem_a = [n for n, reg in forms if not reg]
    if not smem_a:
        fails.append(f"{kind}: no shared-memory-A wgmma (the score product)")
    elif min(smem_a) < qk_n:
        fails.append(f"{kind}: score wgmma N = {min(smem_a)} < {qk_n}")
    elif max(smem_a) < (qk_n if full_n is None else full_n):
        fails.append(f"{kind}: the widest score wgmma has N = {max(smem_a)} < {full_n} (the full tiles' product)")
    if not any(reg for _, reg in forms):
        fails.append(f"{kind}: no register-A wgmma")
    if overlap and not any(n >= 1 for n in wgmma_waits(ptx)):
        fails.append(f"{kind}: every wgmma.wait_group waits for all groups (no MMA overlaps the softmax)")
    if bare_ex2(ptx) < min_bare_ex2:
        fails.append(f"{kind}: {bare_ex2(ptx)} bare ex2.approx < {min_bare_ex2} (the softmax's exponent is not "
                     "exp2(approx))")
    return fails
