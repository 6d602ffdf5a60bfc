"""The kernel backends' measured tile tables: one row per (dtype width, padded head dim).

Each row is a named config (``Launch``: a kernel's tiles and Triton launch parameters;
``PallasRow``: the pallas forward's and backward's; ``TritonRow``: the triton forward's, dQ's
and dK/dV's), chosen from the compile suites' figures (``make test-compile``: ptxas -v
registers, spills and shared memory), which each row's comment cites. The backends'
``heuristics`` read them and fit the tiles to the BlockMask's block.
"""

from __future__ import annotations

from typing import NamedTuple


class Launch(NamedTuple):
    """One kernel's tiles (query rows, key rows) and Triton launch parameters."""

    block_q: int
    block_kv: int
    num_warps: int
    num_stages: int


class PallasRow(NamedTuple):
    """The pallas GPU template's forward and backward (dQ and dK/dV share their tiles)."""

    fwd: Launch
    bwd: Launch


class TritonRow(NamedTuple):
    """The triton backend's forward, dQ and dK/dV kernels."""

    fwd: Launch
    dq: Launch
    dkv: Launch

# -- pallas (Pallas' Triton lowering) ------------------------------------------------------------

# sm_90 tiles and launch parameters per (16-bit or float32, padded head dim). Each row is the
# measured choice of `make test-compile` (H100 target, ptxas -v; worst case over the catalog
# and MHA/GQA, usually a table-reading score_mod: relative_bias or t5; the regs/spills
# quoted are per thread, bwd as dQ / dK/dV). The limit is 227 KiB of shared memory per
# block and 255 registers per thread; a spill in bf16/f16 fails the suite, f32 may use 1 KB.
PALLAS_SM90 = {
    # fwd 128x64/4w/3st: 255 regs, 0 spills, 128 KiB smem. bwd 64x64/4w: dQ spilled 668 B
    # (document+t5), dK/dV 8 B; 32x64/8w/2st: 217 / 142 regs, 0 spills.
    (2, 64): PallasRow(fwd=Launch(128, 64, 4, 3), bwd=Launch(32, 64, 8, 2)),
    # fwd 128x64/8w/3st: 254 regs, 0 spills, 192 KiB. bwd 64x64/8w: dQ spilled 148 B
    # (document+t5), dK/dV 32 B; 32x64/8w/2st: 248 / 200 regs, 0 spills.
    (2, 128): PallasRow(fwd=Launch(128, 64, 8, 3), bwd=Launch(32, 64, 8, 2)),
    # fwd 128x64/3st needs 256 KiB; 128x32/8w/3st: 250 regs, 192 KiB. bwd 32x64/8w: dK/dV
    # spilled 24 B (neg_inf_score); 16x64/8w/2st: 179 / 212 regs, 0 spills, 86 KiB.
    (2, 256): PallasRow(fwd=Launch(128, 32, 8, 3), bwd=Launch(16, 64, 8, 2)),
    # fwd 128x64/4w spilled 88-292 B, 8w 0 B; 128x32/8w: 204 regs, 104 KiB. bwd 64x64/4w:
    # dQ spilled 752 B (relative_bias), 8w 116 B (document+t5); 32x64/8w/2st: 244 / 234
    # regs, 0 spills.
    (4, 64): PallasRow(fwd=Launch(128, 32, 8, 3), bwd=Launch(32, 64, 8, 2)),
    # fwd 128x64/3st needs 288 KiB with relative_bias (its table gather stages in smem),
    # 128x32/8w spilled 24 B; 32x64/8w/2st: 173 regs, 96 KiB. bwd 16x32/8w: dK/dV spilled
    # 16 B (neg_inf_score GQA, ptxas stopped at 128 regs), 32x32/8w 24 B; 16x64/8w/1st:
    # 244 / 254 regs, 0 spills, 84 KiB.
    (4, 128): PallasRow(fwd=Launch(32, 64, 8, 2), bwd=Launch(16, 64, 8, 1)),
    # fwd 64x32/8w spilled 1.9 KB; 32x64/8w/2st: 253 regs, 176 KiB. bwd 16x16/4w: 255 /
    # 255 regs, 0 spills (the edge), 8w: dK/dV 40 B; 32x32/8w 32 B; 16x64/8w 1.4 KB;
    # 16x32/8w/1st: 255 / 182 regs, 0 spills, 96 KiB.
    (4, 256): PallasRow(fwd=Launch(32, 64, 8, 2), bwd=Launch(16, 32, 8, 1)),
}


# -- triton --------------------------------------------------------------------------------------

# Defaults per (sm, 16-bit or float32 inputs, padded head dim), each chosen from the compile suite
# (tests_compile/triton_suite.py: ptxas -v on jax_triton's PTX, catalog x MHA / GQA with
# gradients; budget 0 B spilled per thread for 16-bit, 1 KiB for float32, and the arch's
# shared memory; on sm_90 16-bit also the Hopper shape: wgmma and no mma.sync, loops that keep
# copies in flight, which takes 3 stages). Each comment gives the worst catalog entry's
# registers / spills / shared memory for the row, and what the larger tiles tried spilled.
# A warpgroup MMA takes 64 rows of the tile a kernel accumulates: q rows in the forward and
# dQ, kv rows in dK/dV (its tiles are kv-major, K Q^T), so dQ tiles are 64+ x n and dK/dV
# tiles n x 64+. TRITON_SM90 serves every mod, so its rows are those of the table-gather
# mods (relative_bias, t5: each score element holds a gathered index and value, and the dQ
# kernel reduces the table's gradient); TRITON_SM90_NO_GATHER has the larger tiles of mods
# that read no captured array inside the kernels. The forward rows start from PyTorch
# FlexAttention's (torch/_inductor/kernel/flex_attention.py). float32 products are exact
# (FMA, no tensor cores), which holds whole operand rows per thread: its tiles are small,
# and stages matter (sm_90 f32 D=128 32x64/8w: 3 stages spilled 1268 B, 2 none).
# Not yet timed on hardware.
TRITON_SM90 = {
    # fwd 128x64/4w/3st spilled 520 B (document+t5) once the list entry is carried across
    # iterations; 8w: 183 regs, 0 spills, 129 KiB. dQ 64x32/8w/3st: 230 regs, dK/dV
    # 32x64/8w/3st: 226 regs, 0 spills.
    (2, 64): TritonRow(fwd=Launch(128, 64, 8, 3), dq=Launch(64, 32, 8, 3), dkv=Launch(32, 64, 8, 3)),
    # fwd 128x64/8w/3st: 253 regs, 0 spills, 193 KiB (torch's 128x128 needs 241 KiB: a table
    # gather stages its tile in shared memory). dQ 64x64/8w/3st spilled 872 B (document+t5),
    # 64x32 8 B (captured_scalars); dK/dV 64x64 168 B, 32x64 16 B (document+t5 GQA); dQ
    # 64x16/8w/3st: 241 regs, dK/dV 16x64/8w/3st: 224 regs, 0 spills, 64 KiB.
    (2, 128): TritonRow(fwd=Launch(128, 64, 8, 3), dq=Launch(64, 16, 8, 3), dkv=Launch(16, 64, 8, 3)),
    # fwd 64x32/4w/3st: 255 regs, then 32 B spilled (document+t5 GQA) with the q tiles taken
    # heaviest first; 64x32/8w/3st: 188 regs, 0 spills, 145 KiB. dQ with a table gradient spills at every
    # warpgroup tile tried (64x32/8w 2.2 KB, 64x16/8w 1.4-1.5 KB at 1, 2 or 3 stages, 64x32/4w
    # 2.8 KB), and dK/dV 16x64/8w/3st 16 B: this row keeps the tiles that do not spill, dQ
    # 32x64/8w/2st (mma.sync, 255 regs) and dK/dV 16x64/8w/2st (wgmma, 255 regs; 2 stages
    # wait for every copy), the compile suite's one exemption from the Hopper shape.
    (2, 256): TritonRow(fwd=Launch(64, 32, 8, 3), dq=Launch(32, 64, 8, 2), dkv=Launch(16, 64, 8, 2)),
    # fwd 128x32/4w/3st spilled 6.5 KB, 8w 1.5 KB, 64x64/8w 1048 B (neg_inf_score);
    # 64x32/8w/3st: 218 regs, 24 B spilled, 73 KiB. bwd 32x32/8w/2st: 158 / 200 regs, 0 spills.
    (4, 64): TritonRow(fwd=Launch(64, 32, 8, 3), dq=Launch(32, 32, 8, 2), dkv=Launch(32, 32, 8, 2)),
    # fwd 32x64/8w/3st spilled 1268 B, 4w 13.6 KB; 32x64/8w/2st: 94 regs, 0 spills, 96 KiB.
    # bwd 32x32/8w/2st: dK/dV spilled 1208 B, 16x32/8w/2st 1012 B (the edge); 32x16/8w/1st:
    # 91 / 80 regs, 64 / 48 B spilled.
    (4, 128): TritonRow(fwd=Launch(32, 64, 8, 2), dq=Launch(32, 16, 8, 1), dkv=Launch(32, 16, 8, 1)),
    # fwd 32x32/4w/3st spilled 13.6 KB, 64x32/8w 15.7 KB; 32x32/8w/3st: 181 regs until the
    # loops pipelined (list entry carried across iterations), then 16-35 KB spilled at 3 and
    # 2 stages (float32 operands are pipelined in registers); 32x32/8w/1st: 183 regs, 0
    # spills, 96 KiB. bwd 32x32/8w/2st: dK/dV spilled 8.2 KB, 16x32/8w 8 KB; 32x16/8w/1st:
    # 127 / 112 regs, 0 spills.
    (4, 256): TritonRow(fwd=Launch(32, 32, 8, 1), dq=Launch(32, 16, 8, 1), dkv=Launch(32, 16, 8, 1)),
}
# Mods that read no captured array inside the kernels (full, causal, sliding window,
# documents, padding, ALiBi, soft-cap, ...): no gathered index or value per score element,
# so larger tiles fit. Keys as TRITON_SM90's; a key missing here takes that table's row.
TRITON_SM90_NO_GATHER = {
    # fwd 128x64/8w/3st: 162 regs, 0 spills. dQ 128x64/8w/3st: 177 regs; dK/dV 32x128/8w/3st:
    # 213 regs, 0 spills.
    (2, 64): TritonRow(fwd=Launch(128, 64, 8, 3), dq=Launch(128, 64, 8, 3), dkv=Launch(32, 128, 8, 3)),
    # fwd 128x128/8w takes 2 stages at most (3 need more than 227 KiB), which wait for every
    # copy: 128x64/8w/3st stays. dQ 128x64/8w/3st: 164-227 regs (causal+dropout), 0 spills,
    # 160 KiB; dK/dV 64x64/8w/3st spilled 16-24 B (causal, GQA), 32x128/8w/3st: 226-255 regs,
    # 0 spills, 112 KiB.
    (2, 128): TritonRow(fwd=Launch(128, 64, 8, 3), dq=Launch(128, 64, 8, 3), dkv=Launch(32, 128, 8, 3)),
    # dQ 64x32/8w/3st: 207 regs, 0 spills, 161 KiB; dK/dV 32x64/8w/3st spilled 16-128 B
    # (neg_inf_score, MHA), 16x64/8w/3st: 255 regs, 0 spills, 112 KiB.
    (2, 256): TritonRow(fwd=Launch(64, 32, 4, 3), dq=Launch(64, 32, 8, 3), dkv=Launch(16, 64, 8, 3)),
}
TRITON_SM80 = {
    # fwd 128x64/4w/2st spilled 24 B (document+t5); 8w: 195 regs, 0 spills, 64 KiB. bwd
    # 64x64/8w: dQ spilled 380 B (per_head_mask+relative_bias), 32x64/8w dK/dV 64 B,
    # 32x64/4w 8 B; 64x32/8w/2st: 255 / 153 regs, 0 spills.
    (2, 64): TritonRow(fwd=Launch(128, 64, 8, 2), dq=Launch(64, 32, 8, 2), dkv=Launch(64, 32, 8, 2)),
    # fwd 128x64/8w/2st: 245 regs until the list entry was carried across iterations, then
    # 8 B spilled (document+t5 GQA); 128x32/8w/2st: 196 regs, 0 spills, 64 KiB. bwd 64x64/4w:
    # dK/dV spilled 12 B (full, MHA); 32x64/8w/2st: 254 / 216 regs, 0 spills.
    (2, 128): TritonRow(fwd=Launch(128, 32, 8, 2), dq=Launch(32, 64, 8, 2), dkv=Launch(32, 64, 8, 2)),
    # fwd 32x64/4w/2st: 254 regs, 0 spills, 92 KiB. dQ 32x64/8w/2st spilled 24 B with a table
    # gradient (captured_scalars, relative_bias; dQ since the loops pipeline), 32x32/8w/2st:
    # 255 regs, 0 spills, 64 KiB; dK/dV 32x64/8w/2st: 255 regs, 0 spills, 108 KiB.
    (2, 256): TritonRow(fwd=Launch(32, 64, 4, 2), dq=Launch(32, 32, 8, 2), dkv=Launch(32, 64, 8, 2)),
    # fwd 128x32/4w/2st spilled 4.8 KB; 64x32/8w/2st: 124 regs, 36 B spilled, 48 KiB. bwd
    # 32x32/8w/2st: 128 / 209 regs, 0 spills.
    (4, 64): TritonRow(fwd=Launch(64, 32, 8, 2), dq=Launch(32, 32, 8, 2), dkv=Launch(32, 32, 8, 2)),
    # fwd 64x32/8w/2st: 128 regs, 0 spills, 80 KiB. bwd 32x32/8w/2st: dK/dV spilled 1192 B;
    # 32x16/8w/1st: 110 / 66 regs, dK/dV 12 B spilled.
    (4, 128): TritonRow(fwd=Launch(64, 32, 8, 2), dq=Launch(32, 16, 8, 1), dkv=Launch(32, 16, 8, 1)),
    # fwd 64x32/8w/2st spilled 2.5 KB (per_head_mask+relative_bias); 32x32/8w/2st: 128
    # regs, 0 spills, 104 KiB. bwd 32x32/8w/2st: dK/dV spilled 8.2 KB; 32x16/8w/1st: 128 /
    # 115 regs, 0 spills.
    (4, 256): TritonRow(fwd=Launch(32, 32, 8, 2), dq=Launch(32, 16, 8, 1), dkv=Launch(32, 16, 8, 1)),
}

# The backward's kv tiles under dropout, where the table's row has no registers left for the
# hash, per (sm, bytes, head dim): (dQ's, dK/dV's or None to keep the row's). bf16 D=256 at
# 32x64/8w, dQ of prefix_lm+relative_bias spilled 88+164 B (sm_90) and 92+132 B (sm_80) with
# dropout (255 registers without it); on sm_80 its dK/dV 32x64 spilled 88 B, 32x32: 178 regs,
# 0 spills. 32x32 is the measured fallback.
TRITON_DROPOUT_BWD_KV = {(90, 2, 256): (32, None), (80, 2, 256): (32, 32)}
