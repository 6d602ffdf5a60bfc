"""The compile suite's Hopper-shape check (tests_compile/ptx_shape.py) on PTX fragments.

The fragments follow what Triton 3.6 emits for sm_90: labels ``$L__BB0_n:``, loops closed by
a branch back to an earlier label, ``cp.async`` copies committed in groups and waited for
with ``cp.async.wait_group N``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests_compile"))

from ptx_shape import (  # noqa: E402
    bare_ex2,
    fa3_shape,
    hlo_transposes,
    hopper_exempt,
    hopper_shape,
    instruction_mix,
    sass_spills,
    tcgen05_chained,
    tcgen05_shapes,
    tensor_core_ops,
    wgmma_forms,
    wgmma_serialized,
    wgmma_waits,
)


def _loop(label: str, body: str) -> str:
    return f"$L__BB0_{label}:\n{body}\n\t@%p1 bra $L__BB0_{label};\n"


COPY = "\tcp.async.cg.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 16;\n\tcp.async.commit_group;"
WGMMA = "\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1}, %rd2, %rd3, 1, 1, 1, 0, 1;"
MMA = "\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f2};"


def _wait(n: int) -> str:
    return f"\tcp.async.wait_group {n};"


def test_a_pipelined_loop_is_hopper_shaped():
    ptx = COPY + "\n" + _loop("1", "\n".join([_wait(1), WGMMA, COPY])) + _wait(0)
    mix = instruction_mix(ptx)
    assert mix["wgmma"] == 1 and mix["mma_sync"] == 0 and mix["waits"] == [0, 1] and mix["loop_waits"] == [1]
    assert hopper_shape("fwd", mix) == []


def test_a_loop_that_waits_for_every_copy_fails():
    ptx = _loop("1", "\n".join([COPY, _wait(0), WGMMA])) + _loop("2", "\n".join([COPY, _wait(2), WGMMA]))
    mix = instruction_mix(ptx)
    assert mix["loop_waits"] == [0, 2]
    (fail,) = hopper_shape("fwd", mix)
    assert "waits for all its copies" in fail and "[0, 2]" in fail


def test_mma_sync_and_missing_wgmma_fail():
    mix = instruction_mix(_loop("1", "\n".join([COPY, _wait(1), MMA])))
    fails = hopper_shape("dq", mix)
    assert any("no wgmma" in f for f in fails) and any("1 mma.sync" in f for f in fails)


def test_a_loop_that_only_starts_and_drains_nested_loops_is_not_judged():
    # The dK/dV kernel's loop over a group's heads: prologue copies, an inner pipelined loop,
    # the drain (wait 0) after it; only the inner loop is a copying loop.
    inner = _loop("2", "\n".join([_wait(2), WGMMA, COPY]))
    outer = _loop("1", "\n".join([COPY, inner, _wait(0)]))
    mix = instruction_mix(outer)
    assert mix["loop_waits"] == [2]
    assert hopper_shape("dkv", mix) == []


def test_a_loop_without_copies_fails_unless_it_reduces_a_gathered_gradient():
    # Plain loads only (not pipelined): a loop nested in it (the one-hot reduction) has no copies.
    reduction = _loop("3", "\tadd.f32 %f1, %f1, %f2;")
    ptx = _loop("1", "\n".join(["\tld.global.b32 %r1, [%rd1];", WGMMA, reduction]))
    mix = instruction_mix(ptx)
    assert mix["loop_waits"] == []
    assert any("no copying loop" in f for f in hopper_shape("dq", mix))
    assert hopper_shape("dq", {**mix, "scatter": True}) == []


def test_the_one_exemption():
    scatter = {"kernels": {"dq": {"scatter": True}}}
    assert hopper_exempt({"head_dim": 256, **scatter}, "dq") and hopper_exempt({"head_dim": 256, **scatter}, "dkv")
    assert not hopper_exempt({"head_dim": 256, **scatter}, "fwd")
    assert not hopper_exempt({"head_dim": 128, **scatter}, "dq")
    assert not hopper_exempt({"head_dim": 256, "kernels": {"dq": {"scatter": False}}}, "dq")


def test_tensor_core_ops_reads_instructions_not_names():
    ptx = """
    // tcgen05.mma in a comment is not an instruction
    .visible .entry k_tcgen05_mma_kernel(
    tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%r1], 512;
    @%p3 tcgen05.mma.cta_group::1.kind::f16 [%r2], %rd1, %rd2, %r3, %p1;
    @%p3 tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%rd4];
    tcgen05.ld.sync.aligned.16x256b.x4.b32 {%r5, %r6}, [%r7];
    tcgen05.wait::ld.sync.aligned;
    """
    assert tensor_core_ops(ptx) == {"tcgen05.alloc", "tcgen05.mma", "tcgen05.commit", "tcgen05.ld",
                                    "tcgen05.wait::ld"}
    wgmma = "\t{ .reg .pred p; setp.ne.b32 p, 1, 0; wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r1}, p;}"
    assert tensor_core_ops(wgmma) == {"wgmma.mma_async"}


# What Mosaic GPU emits for sm_90a (LLVM's NVPTX backend, an inline-asm wgmma in braces).
SMEM_A = ("\t{ .reg .pred p; setp.ne.b32 p, 1, 0; wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16 "
          "{%r1,%r2}, %rd102, %rd103, p, 1, 1, 0, 1; }\n")
REG_A = ("\t{ .reg .pred p; setp.ne.b32 p, 1, 0; wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16 "
         "{%r1,%r2}, {%r5,%r6,%r7,%r8}, %rd103, p, 1, 1, 1; }\n")


def _n(form: str, n: int) -> str:
    return form.replace("nN", f"n{n}")
# libdevice's expf: a range reduction (one fma.rm.f32) around the ex2.approx.ftz.
EXPF = ("\tfma.rm.f32 \t%r537, %r534, %r536, %r535;\n\tadd.rn.f32 \t%r538, %r537, 0fCB40007F;\n"
        "\tex2.approx.ftz.f32 \t%r543, %r541;\n")
EX2 = "\tex2.approx.ftz.f32 \t%r9, %r8;\n"


def test_wgmma_forms_tell_register_a_from_shared_memory_a():
    ptx = _n(SMEM_A, 128) + _n(REG_A, 64)
    assert wgmma_forms(ptx) == [(128, False), (64, True)]


def test_bare_ex2_does_not_count_precise_expf():
    assert bare_ex2(EXPF * 3) == 0
    assert bare_ex2(EXPF + EX2 * 2) == 2


WAIT0 = "\twgmma.wait_group.sync.aligned \t0;\n"


def test_fa3_shape():
    good = _n(SMEM_A, 128) + _n(REG_A, 128) + EX2 * 64
    assert fa3_shape("fwd", good, qk_n=128, min_bare_ex2=64) == []
    # The FA2 shape: 64-key score wgmmas, P from shared memory, the precise exp.
    old = _n(SMEM_A, 64) * 2 + EXPF * 64
    fails = fa3_shape("fwd", old, qk_n=128, min_bare_ex2=64)
    assert any("N = 64 < 128" in f for f in fails)
    assert any("no register-A" in f for f in fails)
    assert any("bare ex2" in f for f in fails)
    # The intra-warpgroup overlap: a wait that leaves the P·V group in flight.
    waits = "\twgmma.commit_group.sync.aligned;\n\twgmma.wait_group.sync.aligned \t1;\n"
    assert wgmma_waits(waits + WAIT0) == [1, 0]
    assert fa3_shape("fwd", good + waits, qk_n=128, min_bare_ex2=64, overlap=True) == []
    assert any("no MMA overlaps" in f for f in fa3_shape("fwd", good + WAIT0, qk_n=128, min_bare_ex2=64,
                                                         overlap=True))
    # dK/dV at head dim 128: m64n32 score wgmmas on the partial tiles' sub-steps, m64n64 on the full tiles.
    split = _n(SMEM_A, 32) * 2 + _n(SMEM_A, 64) * 2 + _n(REG_A, 128) + EX2 * 32
    assert fa3_shape("dkv", split, qk_n=32, full_n=64, min_bare_ex2=32) == []
    narrow = _n(SMEM_A, 32) * 2 + _n(REG_A, 128) + EX2 * 32
    assert any("widest score wgmma has N = 32 < 64" in f
               for f in fa3_shape("dkv", narrow, qk_n=32, full_n=64, min_bare_ex2=32))
    assert fa3_shape("dkv", narrow, qk_n=32, min_bare_ex2=32) == []


def test_hlo_transposes_counts_4d_ones():
    hlo = """
  %transpose.13.3 = bf16[1024,2]{1,0} transpose(%bitcast.3.3), dimensions={1,0}
  ROOT %transpose.2.1 = bf16[1,2,128,1024]{3,2,1,0} transpose(%param_0.68), dimensions={0,2,3,1}
  %t = f32[1,1024,2,128]{3,2,1,0} convert(%param_0.64), metadata={op_name="transpose(jvp(x))"}
"""
    assert hlo_transposes(hlo) == ["1,2,128,1024"]


def test_wgmma_serialized_names_the_kernel_and_the_reason():
    report = (
        "ptxas info    : (C7513) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
        "non wgmma instructions defining input registers of a wgmma between start and end of the pipeline "
        "stage in the function 'flexjax_mgpu_fwd_mosaic_gpu_kernel'\n"
        "ptxas info    : Compiling entry function 'flexjax_mgpu_fwd_mosaic_gpu_kernel' for 'sm_90a'\n"
        "ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem\n"
        "ptxas info    : Compiling entry function 'flexjax_mgpu_dq_mosaic_gpu_kernel' for 'sm_90a'\n"
        "ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem\n")
    assert wgmma_serialized(report) == {
        "flexjax_mgpu_fwd_mosaic_gpu_kernel": "non wgmma instructions defining input registers of a wgmma between "
                                              "start and end of the pipeline stage"}
    assert wgmma_serialized(report.split("\n", 1)[1]) == {}
    assert wgmma_serialized(
        "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
        "insufficient register resources for the function 'k'\n") == {"k": "insufficient register resources"}


SASS = """
        /*0000*/                   STL [R1], R7 ;
.L_x_0:
        /*0010*/                   BAR.SYNC.DEFER_BLOCKING 0x1, 0x100 ;
.L_x_1:
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4].tnspB, R24 ;
        /*0030*/                   LDL R2, [R1] ;
        /*0040*/              @P0 BRA `(.L_x_1) ;
        /*0050*/                   STL [R1+0x4], R9 ;
        /*0060*/              @P2 BRA `(.L_x_0) ;
.L_x_2:
        /*0070*/                   IADD3 R3, R3, 0x1, RZ ;
        /*0080*/                   LDL.LU R4, [R1+0x4] ;
        /*0090*/              @P1 BRA `(.L_x_2) ;
        /*00a0*/                   EXIT ;
.L_x_3:
        /*00b0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R3+URZ], R10 ;
        /*00c0*/                   LDL R5, [R1] ;
        /*00d0*/              @!P1 BRA `(.L_x_3) ;
        /*00e0*/                   BRA `(.L_x_1) ;
"""


def test_sass_spills_finds_the_spills_in_the_mma_loops():
    # The inner loop (.L_x_1) issues the HGMMA: its LDL is in an MMA loop. The outer loop (.L_x_0)
    # holds the inner one, so its STL is outside (once per outer step); the loop at .L_x_2 issues no
    # MMA; after the EXIT, the barrier-wait retry and its branch back into the code are no loop.
    assert sass_spills(SASS) == {"in_mma_loops": 1, "outside": 4}
    assert sass_spills(SASS.replace("HGMMA.64x64x16.F32.BF16", "UTCHMMA")) == {"in_mma_loops": 1, "outside": 4}
    without = SASS.replace("        /*0030*/                   LDL R2, [R1] ;\n", "")
    assert sass_spills(without) == {"in_mma_loops": 0, "outside": 4}
    assert sass_spills("        /*0000*/                   EXIT ;\n") == {"in_mma_loops": 0, "outside": 0}


def test_tcgen05_chained():
    mma = "\ttcgen05.mma.cta_group::1.kind::f16 [%r1], %rd2, %rd3, %r4, %p5;\n"
    commit = "\t@%p1 tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%rd12];\n"
    wait = "\tmbarrier.try_wait.parity.shared.b64 P1, [%r3], %r4;\n"
    # Each MMA committed and waited for before the next: none in flight together.
    assert not tcgen05_chained((mma * 8 + commit + wait) * 2)
    # Q K^T committed, then P·V issued before the wait: two in flight.
    assert tcgen05_chained(wait + mma * 8 + commit + mma * 2 + commit + wait)


def test_tcgen05_shapes():
    """The (M, N) of each tcgen05 MMA from its instruction descriptor (the sm_100a forward's at
    D = 128, as Mosaic GPU emits them: Q K^T M128 N64, P·V M128 N128, their descriptors set once)."""
    ptx = ("\tmov.b32 \t%r165, 135267472;\n\tmov.b32 \t%r3219, 136381584;\n"
           "\t{\n\t.reg .b64 a_desc;\n"
           "\ttcgen05.mma.cta_group::1.kind::f16 [%r3250], a_desc, b_desc, %r165, %p43;\n\t}\n"
           "\ttcgen05.mma.cta_group::1.kind::f16 [%r4091], a_desc, b_desc, %r3219, %p244;\n"
           "\ttcgen05.mma.cta_group::1.kind::f16 [%r1], a_desc, b_desc, %r7, %p1;\n")
    assert tcgen05_shapes(ptx) == [(128, 64), (128, 128)]
    assert tcgen05_shapes("") == []
