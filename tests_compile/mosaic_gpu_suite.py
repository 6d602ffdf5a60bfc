"""AOT compile of the mosaic_gpu kernels for sm_90a and sm_100a from a CPU host, with ptxas' resource report.

Run by ``make test-compile`` inside ``build/venv-compile``. Every catalog entry the backend takes
is compiled forward and backward (``jax.grad`` through the three kernels: forward, dQ, dK/dV) for
an H100 (``h100_target_config.txtpb``, sm_90a: the wgmma kernels) and a B200
(``b200_target_config.txtpb``, sm_100a: the tcgen05 kernels, accumulators in tensor memory), at
head dims 64 and 128, bfloat16 and float16, MHA and GQA, and two entries with dropout (the
keep-mask hash in each kernel). Mosaic GPU writes each kernel's
``ptxas -v`` report (``MOSAIC_GPU_DUMP_PTXAS``); a kernel fails the suite if ptxas did not
compile it for the configuration's arch or its PTX lacks the arch's tensor-core instructions
(``EXPECTED_OPS``), if it spills inside its MMA loops or more than a few bytes outside them
(``SPILL_OUTSIDE_LIMIT``; located in its SASS), if ptxas serialized its wgmmas (``ptx_shape.wgmma_serialized``),
if its registers exceed what the launch
allows (three warpgroups of 128 threads: 65536 / 384 = 170 per thread before ``setmaxnreg``), if
its shared memory (``_kernels.smem_bytes``) exceeds the opt-in limit (227 KiB on both), or, on
sm_100a, if its tensor memory exceeds 512 columns, its forward never has two tcgen05 MMAs in flight
(``ptx_shape.tcgen05_chained``) or has one narrower than ``tcgen05_fwd_n``
(``ptx_shape.tcgen05_shapes``); on sm_90a, also if its PTX is not in FlashAttention-3's shape
(``ptx_shape.fa3_shape``). The table (``--out``) lists each kernel's warpgroup layout: one
producer warpgroup (TMA, 32 registers after ``setmaxnreg``) and two consumer warpgroups (240);
the dK/dV kernel, a producer and two consumers on sm_90a, one on sm_100a.

The topology's devices carry no compute capability, which Mosaic GPU reads to name the arch in
its module; the backend is told the arch by ``kernel_options["compute_capability"]`` (90 / 100)
and the suite checks the arch ptxas compiled for in its report.
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import re
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ENV = {"JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1", "JAX_ENABLE_COMPILATION_CACHE": "false",
       "TF_CPP_MIN_LOG_LEVEL": "2", "MOSAIC_GPU_DUMP_PTXAS": "1"}
os.environ.update(ENV)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from ptx_shape import (  # noqa: E402
    TENSOR_CORE_OPS,
    bare_ex2,
    fa3_shape,
    hlo_transposes,
    sass_spills,
    tcgen05_chained,
    tcgen05_shapes,
    tensor_core_ops,
    wgmma_forms,
    wgmma_serialized,
)

# (B, S, Hq, Hkv)
HEADS = {"mha": (1, 1024, 2, 2), "gqa": (1, 1024, 4, 2)}
HEAD_DIMS = (64, 128)
# (arch, target config, compute capability)
ARCHS = (("sm_90a", "h100_target_config.txtpb", 90), ("sm_100a", "b200_target_config.txtpb", 100))
DTYPES = ("bfloat16", "float16")
BLOCK_SIZE = 128
REG_LIMIT = {"fwd": 65536 // 384, "dq": 65536 // 384, "dkv": 255}
# Rows per consumer warpgroup (wgmma's M on sm_90a, tcgen05's on sm_100a).
R_OF = {"sm_90a": 64, "sm_100a": 128}
KERNELS = ("flexjax_mgpu_fwd", "flexjax_mgpu_dq", "flexjax_mgpu_dkv")
# Spills: none in a kernel's steps. A kernel fails if ptxas spilled inside one of its MMA loops (the
# innermost loops that issue a wgmma or tcgen05 MMA: its walk over the tiles), located in the SASS of
# its PTX (``ptx_shape.sass_spills``: ptxas, then nvdisasm), or more than SPILL_OUTSIDE_LIMIT bytes per
# thread outside them (a register stored before a walk and loaded after it, once per head or kernel),
# or any spill at all where the SASS cannot be had (no ptxas that takes the PTX, or no nvdisasm).
# Seen outside the loops, on the GPU machine's ptxas (JAX 0.11.2, CUDA 13): the sm_90a forward at
# D = 128 with "sliding_window+alibi" (4 B, with its full tiles pipelined), the sm_90a dK/dV at
# D = 128 with "neg_inf_score" (12 B stored, 20 B loaded) and with "causal+soft_cap" GQA (8 B, 16 B),
# around each head's partial and full walks since its full steps took 64 queries, and the sm_100a
# forward at D = 64 with "full" (4 B, since its full tiles run pipelined).
SPILL_OUTSIDE_LIMIT = 32
# Kernels allowed a spill inside their MMA loops, keyed by (arch, kernel, head dim, catalog entry) to
# bytes per thread: none. (Until 2026-12-07 the sm_100a forward at D = 128 with "neg_inf_score" loaded
# one spilled register once per step on CUDA 13's ptxas; with its full tiles pipelined it spills none.)
SPILL_IN_LOOPS: dict = {}


def _configs(quick: bool, all_dropout: bool = False):
    """The suite's (entry, head dim, dtype, heads, dropout) configurations; ``all_dropout``: every entry with
    dropout instead (bfloat16, MHA, both head dims), an experiment."""
    from test_mosaic_gpu import TAKEN

    if all_dropout:
        return [(name, D, "bfloat16", "mha", True) for name in TAKEN for D in HEAD_DIMS]
    out = []
    for name in TAKEN:
        for D in HEAD_DIMS:
            for dtype in DTYPES:
                for heads in HEADS:
                    # Every entry at bfloat16 MHA; float16 and GQA for the entries with a score_mod.
                    if (dtype != "bfloat16" or heads != "mha") and name not in ("causal+soft_cap",
                                                                               "sliding_window+alibi"):
                        continue
                    out.append((name, D, dtype, heads, False))
    # Dropout (the keep-mask hash in every kernel): two entries, both head dims, bfloat16 MHA.
    out += [(name, D, "bfloat16", "mha", True) for name in ("causal", "sliding_window+alibi") for D in HEAD_DIMS]
    return out[:6] if quick else out


def _parse_ptxas(text: str) -> dict:
    """{kernel name: {"arch", "registers", "spill_stores", "spill_loads"}} from a ``ptxas -v`` report."""
    out = {}
    for block in re.split(r"Compiling entry function ", text)[1:]:
        name = block.split("'")[1]
        arch = re.match(r"'[^']*' for '(sm_\w+)'", block)
        regs = re.search(r"Used (\d+) registers", block)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block)
        out[name] = {"arch": arch.group(1) if arch else None, "registers": int(regs.group(1)) if regs else None,
                     "spill_stores": int(spill.group(1)) if spill else 0,
                     "spill_loads": int(spill.group(2)) if spill else 0}
    return out


@functools.cache
def _sass_tools():
    """(ptxas candidates, nvdisasm) for locating spills: the PATH's, the CUDA root Mosaic GPU points at,
    and the pip packages' (nvidia's ptxas, Triton's nvdisasm); None where no nvdisasm is found."""
    import shutil

    roots = [os.environ.get("MOSAIC_GPU_CUDA_ROOT", ""), "/usr/local/cuda"]
    ptxas = [shutil.which("ptxas")] + [os.path.join(r, "bin", "ptxas") for r in roots if r]
    nvdisasm = [shutil.which("nvdisasm")] + [os.path.join(r, "bin", "nvdisasm") for r in roots if r]
    try:
        import nvidia

        for base in nvidia.__path__:
            ptxas += sorted(glob.glob(os.path.join(base, "*", "bin", "ptxas")), reverse=True)
    except ImportError:
        pass
    try:
        import triton

        nvdisasm.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm"))
    except ImportError:
        pass
    found = [p for p in nvdisasm if p and os.access(p, os.X_OK)]
    return [p for p in dict.fromkeys(ptxas) if p and os.access(p, os.X_OK)], (found[0] if found else None)


def _spill_places(ptx_path: str, arch: str):
    """``ptx_shape.sass_spills`` of one dumped kernel, or None if no ptxas / nvdisasm here compiles it."""
    import subprocess

    ptxas, nvdisasm = _sass_tools()
    if nvdisasm is None:
        return None
    cubin = ptx_path + ".cubin"
    for tool in ptxas:
        if subprocess.run([tool, f"-arch={arch}", ptx_path, "-o", cubin], capture_output=True).returncode == 0:
            sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True)
            return sass_spills(sass.stdout) if sass.returncode == 0 else None
    return None


def _compile(f, args, mesh, dump_dir):
    import jax

    os.environ["MOSAIC_GPU_DUMP_TO"] = dump_dir
    with jax.set_mesh(mesh):
        compiled = jax.jit(f).trace(*args).lower().compile()
    text = "".join(open(p).read() for p in sorted(glob.glob(os.path.join(dump_dir, "*.ptxas"))))
    report = _parse_ptxas(text)
    for name, reason in wgmma_serialized(text).items():
        if name in report:
            report[name]["wgmma_serialized"] = reason
    report["hlo_transposes"] = hlo_transposes(compiled.as_text())
    # Which tensor-core instructions each kernel's PTX holds (the dump names kernels "<name>_<n>.ptx").
    for path in glob.glob(os.path.join(dump_dir, "*.ptx")):
        ptx = open(path).read()
        kernel = os.path.basename(path).rsplit("_", 1)[0]
        found = tensor_core_ops(ptx)
        for name, res in report.items():
            if name.startswith(kernel):
                res["ptx_ops"] = sorted(found)
                forms = wgmma_forms(ptx)
                res["score_n"] = min((n for n, reg in forms if not reg), default=None)
                res["score_n_full"] = max((n for n, reg in forms if not reg), default=None)
                shapes = tcgen05_shapes(ptx)
                if shapes:  # sm_100a: the least N of its MMAs (the forward's: Q K^T's, the key tile)
                    res["score_n"] = res["score_n_full"] = min(n for _, n in shapes)
                res["register_a"] = sum(reg for _, reg in forms)
                res["bare_ex2"] = bare_ex2(ptx)
                res["fa3"] = ptx  # judged in _compile_config, then dropped
                if res["spill_stores"] or res["spill_loads"]:
                    res["spill_places"] = _spill_places(path, res["arch"] or "sm_90a")
    return report


def score_n_floor(kernel: str, D: int, dropout: bool) -> tuple[int, int]:
    """The least N of an sm_90a kernel's score wgmmas, and the N its full tiles' score wgmma must
    reach (``ptx_shape.fa3_shape``'s ``qk_n`` and ``full_n``): FlashAttention-3's 128 keys in the
    forward and 64 in the backward's S and dP, except where the heuristics (``mosaic_gpu.
    heuristics``) keep narrower tiles because the wider ones spilled: the forward with dropout at
    head dim 128 (64 keys: 5 of the 10 entries spilled 4-288 B at 128); dK/dV at head dim 128, whose
    partial tiles run 32-query sub-steps (``_kernels.dkv_masked_q``; one tile of 64 spilled 12-80 B
    there), and with dropout 32-query steps throughout (at 64 the full ones spilled 32-160 B per
    thread, in the loop; BENCHMARKS.md)."""
    if kernel == "fwd":
        return (64, 64) if dropout and D > 64 else (128, 128)
    if kernel == "dkv" and D > 64:
        return (32, 32) if dropout else (32, 64)
    return 64, 64


def tcgen05_fwd_n(D: int) -> int:
    """The least N of the sm_100a forward's tcgen05 MMAs (``ptx_shape.tcgen05_shapes``): Q K^T's N
    is the key tile, 64 (32 until 2026-12-07; 128 with P in shared memory does not fit a block's),
    but 32 at head dim 128 on JAX 0.10, whose lowering spilled in the steps at 64 (``heuristics``)."""
    from flexjax.backends.mosaic_gpu import _kernels

    return 32 if D > 64 and _kernels.JAX_010 else 64

# The tensor-core instructions (``ptx_shape.TENSOR_CORE_OPS``) that say which kernel ptxas got.
EXPECTED_OPS = {"sm_90a": {"wgmma.mma_async"}, "sm_100a": set(TENSOR_CORE_OPS) - {"wgmma.mma_async"}}


def _compile_config(name, D, dtype_name, heads, dropout, arch, cc, mesh, sh):
    """Compiles one configuration's forward and backward; its table row."""
    import catalog_target
    import jax
    import jax.numpy as jnp
    from catalog import BY_NAME, build

    from flexjax.backends.mosaic_gpu import _kernels, _mma, heuristics

    B, S, Hq, Hkv = HEADS[heads]
    dtype = jnp.dtype(dtype_name)
    _, params, attention = build(BY_NAME[name], (B, S, S, Hq, Hkv, D, D), block_size=BLOCK_SIZE)

    drop = {"dropout_rate": 0.1, "dropout_rng": jax.random.PRNGKey(0)} if dropout else {}
    grads = catalog_target.grads(lambda q, k, v, params: attention(
        q, k, v, params, backend="mosaic_gpu", kernel_options={"target": "cuda", "compute_capability": cc}, **drop))
    shapes = catalog_target.abstract_args(B, S, Hq, Hkv, D, dtype, sh, params)
    o = heuristics(cc, D, dropout)
    unit = _mma.for_capability(cc, False)
    smem = {**_kernels.smem_bytes(D, o.block_kv, o.bwd_block_q, o.num_stages, unit),
            **{k: v for k, v in _kernels.smem_bytes(D, o.bwd_block_kv, o.bwd_block_q, o.bwd_num_stages,
                                                    unit).items() if k != "fwd"}}
    tmem = _kernels.tmem_columns(D, o.block_kv, o.bwd_block_kv, o.bwd_block_q) if arch == "sm_100a" else {}
    row = {"case": name + ("+dropout" if dropout else ""), "head_dim": D, "dtype": dtype_name, "heads": heads,
           "arch": arch,
           # producer + consumers x rows, per kernel (forward, dQ, dK/dV)
           "warpgroups": f"1+{_kernels.CONSUMERS}x{unit.rows}, 1+{_kernels.CONSUMERS}x{unit.rows}, "
                         f"1+{_kernels.dkv_consumers(unit)}x{unit.rows}"}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as dump:
        try:
            report = _compile(grads, shapes, mesh, dump)
            row["status"] = "ok"
        except Exception as e:  # noqa: BLE001  (a compile error is a reported failure)
            report = {}
            row["status"] = "error"
            row["error"] = str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__
    row["seconds"] = round(time.perf_counter() - t0, 1)
    problems = []
    row["hlo_transposes"] = report.pop("hlo_transposes", [])
    if row["status"] == "ok" and row["hlo_transposes"]:
        problems.append(f"XLA transposes of 4-D operands around the kernels: {row['hlo_transposes']}")
    for short, kernel in zip(("fwd", "dq", "dkv"), KERNELS):
        found = [v for k, v in report.items() if k.startswith(kernel)]
        res = found[0] if found else None
        ptx = res.pop("fa3", "") if res else ""
        if res is not None and row["status"] == "ok":
            # Every kernel's softmax exponent is a bare ex2.approx: at least one per element of a tile.
            tile = (R_OF[arch] * {"fwd": o.block_kv, "dq": o.bwd_block_kv, "dkv": o.bwd_block_q}[short]) // 128
            if arch == "sm_90a":
                least, full = score_n_floor(short, D, dropout)
                problems += fa3_shape(short, ptx, qk_n=least, full_n=full, min_bare_ex2=tile,
                                      overlap=short == "fwd" and _kernels.fwd_overlap(unit))
            else:
                if res["bare_ex2"] < tile:
                    problems.append(f"{short}: {res['bare_ex2']} bare ex2.approx < {tile}")
                if short == "fwd" and (res.get("score_n") or 0) < tcgen05_fwd_n(D):
                    problems.append(f"fwd: least tcgen05 MMA N {res.get('score_n')} < {tcgen05_fwd_n(D)}")
                if short == "fwd" and _kernels.fwd_overlap(unit) and not tcgen05_chained(ptx):
                    problems.append("fwd: no tcgen05 MMA issued while another is in flight (the full tiles' "
                                    "Q K^T with the previous P·V)")
        row[short] = {**(res or {}), "smem": smem[short], **({"tmem": tmem[short]} if tmem else {})}
        if row["status"] != "ok":
            continue
        if res is None:
            problems.append(f"{short}: no ptxas report")
            continue
        if res["arch"] != arch:
            problems.append(f"{short}: compiled for {res['arch']}, not {arch}")
        if set(res.get("ptx_ops", ())) != EXPECTED_OPS[arch]:
            problems.append(f"{short}: PTX tensor-core instructions {res.get('ptx_ops')}, not "
                            f"{sorted(EXPECTED_OPS[arch])}")
        if res.get("wgmma_serialized"):
            problems.append(f"{short}: ptxas serialized its wgmmas ({res['wgmma_serialized']})")
        spilled = max(res["spill_stores"], res["spill_loads"])
        places = res.get("spill_places")
        if spilled and places is None:
            problems.append(f"{short}: spills {res['spill_stores']} B stored, {res['spill_loads']} B loaded, "
                            "which no ptxas and nvdisasm here could locate")
        elif spilled and places["in_mma_loops"] and spilled > SPILL_IN_LOOPS.get((arch, short, D, name), 0):
            problems.append(f"{short}: spills {res['spill_stores']} B stored, {res['spill_loads']} B loaded, "
                            f"{places['in_mma_loops']} of its spill instructions in its MMA loops")
        elif spilled > SPILL_OUTSIDE_LIMIT:
            problems.append(f"{short}: spills {res['spill_stores']} B stored, {res['spill_loads']} B loaded outside "
                            f"its MMA loops (more than {SPILL_OUTSIDE_LIMIT} B)")
        if res["registers"] is not None and res["registers"] > REG_LIMIT[short]:
            problems.append(f"{short}: {res['registers']} registers > {REG_LIMIT[short]}")
        if smem[short] > _kernels.SMEM_LIMIT:
            problems.append(f"{short}: {smem[short]} B shared memory")
        if tmem and tmem[short] > _kernels.TMEM_COLUMNS:
            problems.append(f"{short}: {tmem[short]} tensor-memory columns")
    if problems:
        row["status"] = "error"
        row["error"] = "; ".join(problems)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="markdown table")
    ap.add_argument("--quick", action="store_true", help="the first few configurations only")
    ap.add_argument("--arch", choices=[a for a, _, _ in ARCHS], help="one arch, in this process")
    ap.add_argument("--rows", default=None, help="with --arch: where to write the rows (JSON)")
    # Experiments (with --arch): a subset of the configurations, and other tiles than the defaults.
    experiments = [
        ap.add_argument("--case", default="", help="with --arch: the configurations whose case name contains this"),
        ap.add_argument("--head-dim", type=int, choices=HEAD_DIMS, help="with --arch: one head dim"),
        ap.add_argument("--bwd-block-q", type=int, help="with --arch: dK/dV's query step instead of the heuristics'"),
        ap.add_argument("--block-kv", type=int, help="with --arch: the forward's key step instead of the heuristics'"),
        ap.add_argument("--dkv-consumers", type=int, choices=(1, 2), help="with --arch: dK/dV's consumer warpgroups"),
        ap.add_argument("--all-dropout", action="store_true",
                        help="with --arch: every catalog entry with dropout (bfloat16, MHA) instead of the "
                             "configurations")]
    args = ap.parse_args(argv)
    experiment = [a.option_strings[0] for a in experiments if getattr(args, a.dest)]
    if args.arch is None and experiment:
        ap.error(f"{', '.join(experiment)}: only with --arch (one arch in this process)")
    if args.arch is None:
        return _each_arch(args)
    _experiment(args)

    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    def mesh_for(config):
        topo = topologies.get_topology_desc("", "cuda", target_config=open(os.path.join(HERE, config)).read(),
                                            topology="1x1x1")
        return Mesh(np.array(topo.devices), ("x",))

    rows = []
    for arch, config, cc in ARCHS:
        if arch != args.arch:
            continue
        mesh = mesh_for(config)
        sh = NamedSharding(mesh, P())
        for config in _configs(args.quick, args.all_dropout):
            name, D, *_, dropout = config
            if args.case not in name + ("+dropout" if dropout else "") or args.head_dim not in (None, D):
                continue
            rows.append(_compile_config(*config, arch, cc, mesh, sh))
            print(json.dumps(rows[-1]), flush=True)
    if args.rows:
        with open(args.rows, "w") as f:
            json.dump(rows, f)
    return 0


def _experiment(args) -> None:
    """Replaces the defaults that ``args`` overrides: ``heuristics``' tiles, ``dkv_consumers``; the score
    N floor is then the tiles' own (the row's ``score_n`` says what the PTX has)."""
    import dataclasses

    import flexjax.backends.mosaic_gpu as backend
    from flexjax.backends.mosaic_gpu import _kernels

    tiles = {k: v for k, v in (("bwd_block_q", args.bwd_block_q), ("block_kv", args.block_kv)) if v}
    if tiles:
        default = backend.heuristics
        backend.heuristics = lambda *a, **kw: dataclasses.replace(default(*a, **kw), **tiles)
        global score_n_floor
        score_n_floor = lambda kernel, D, dropout: (0, 0)  # noqa: E731
    if args.dkv_consumers:
        _kernels.dkv_consumers = lambda arch: args.dkv_consumers


def _each_arch(args) -> int:
    """Each arch in its own process: after an sm_90a compile, Mosaic GPU's ptxas step in the same
    process keeps sm_90a as its default and rejects the sm_100a PTX ("SM version specified by
    .target is higher than default SM version assumed"). The processes run side by side (each
    compile is mostly one thread: about 4 minutes on 2 cores where one after the other took 6.5); each prints its
    rows as JSON lines, and the table keeps ARCHS' order."""
    import subprocess

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for arch, _, _ in ARCHS:
            path = os.path.join(tmp, arch + ".json")
            cmd = [sys.executable, os.path.abspath(__file__), "--arch", arch, "--rows", path]
            procs.append((arch, path, subprocess.Popen(cmd + (["--quick"] if args.quick else []))))
        failed = False
        for arch, path, proc in procs:
            rc = proc.wait()
            if rc or not os.path.exists(path):
                print(f"mosaic_gpu suite: the {arch} process failed (exit {rc})", flush=True)
                failed = True
                continue
            rows += json.load(open(path))
        if failed:
            return 1
    failures = sum(r["status"] != "ok" for r in rows)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# mosaic_gpu kernels compiled for sm_90a and sm_100a (tests_compile/mosaic_gpu_suite.py)\n\n")
            f.write("Warpgroups per CTA: forward and dQ, 1 producer (TMA; setmaxnreg 32) + 2 consumers (setmaxnreg "
                    "240) of 64 query rows each on sm_90a (wgmma, accumulators in registers), 128 on sm_100a "
                    "(tcgen05, accumulators in tensor memory); dK/dV, 1 producer + 2 consumers of 64 key rows on "
                    "sm_90a, 1 producer + 1 consumer of 128 on sm_100a. "
                    "Per kernel: registers (ptxas' count per thread: at most 168 for 384 threads, 255 for 256) / "
                    "spill (bytes stored per thread; where none is in an MMA loop, from the SASS, it says so) / "
                    "shared memory KiB (`_kernels.smem_bytes`) [/ TMEM columns "
                    "of the sm_100a kernels, of 512]; then, from the PTX: the score MMA's N (sm_90a: the N "
                    "of the wgmmas that read A from shared memory: Q K^T, S, dP, S^T, dP^T; least-widest where "
                    "partial tiles run narrower sub-steps; sm_100a: the least N of the tcgen05 MMAs, from their "
                    "instruction descriptors) / register-A wgmmas / "
                    "bare `ex2.approx` exponents (not libdevice's range-reduced expf). XLA transposes: 4-D "
                    "transposes in the optimized HLO around the kernels.\n\n")
            f.write("| arch | case | D | dtype | heads | status | fwd: regs / spill / smem [/ TMEM] / score N / "
                    "reg-A / ex2 | dQ | dK/dV | XLA transposes | s |\n")
            f.write("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
            for r in rows:
                cells = []
                for k in ("fwd", "dq", "dkv"):
                    x = r[k]
                    where = x.get("spill_places")
                    spill = f"{x.get('spill_stores', '-')}" + (" (outside the loops)" if where and not
                                                               where["in_mma_loops"] else "")
                    cell = f"{x.get('registers')} / {spill} / {x['smem'] // 1024}"
                    cell += f" / {x['tmem']}" if "tmem" in x else ""
                    n, n_full = x.get("score_n", "-"), x.get("score_n_full", "-")
                    cell += f" / {n if n == n_full else f'{n}-{n_full}'}"
                    cell += f" / {x.get('register_a', '-')} / {x.get('bare_ex2', '-')}"
                    cells.append(cell)
                status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('error', '')}"
                f.write(f"| {r['arch']} | {r['case']} | {r['head_dim']} | {r['dtype']} | {r['heads']} | {status} | "
                        + " | ".join(cells) + f" | {len(r.get('hlo_transposes', []))} | {r['seconds']} |\n")
    print(f"mosaic_gpu suite: {len(rows)} configurations, {failures} failing", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
