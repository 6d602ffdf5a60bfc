"""Compiles the triton backend's kernels for sm_90 and sm_80 from a CPU host and checks their resources.

Run by ``make test-compile`` inside ``build/venv-compile`` (triton 3.6, jax-triton, the CUDA
plugin). For every catalog entry x {bf16, f16, f32} x {D=64, 128, 256} x {MHA, GQA} x
{sm_90, sm_80} (sm_80: GQA only, unless --all-heads), and for the pallas suite's
``DROPOUT_ENTRIES`` with dropout (``<entry>+dropout``), it lowers ``jax.grad`` of the
attention with ``backend="triton"`` and ``kernel_options={"target": "cuda",
"compute_capability": cc}``: jax-triton compiles each generated kernel (forward, dQ, dK/dV)
through Triton's own pipeline for that GPU and keeps its PTX and shared memory
(``JAX_TRITON_DUMP_DIR``); ``ptxas -v`` (Triton's bundled one) assembles the PTX for the
same architecture and reports registers and spills.

It fails on any compile error, on shared memory above the architecture's opt-in limit, and
on spills above ``SPILL_BUDGET``. Workers are separate processes; Triton's on-disk cache is
pointed at a fresh directory so nothing is reused between runs.

    python tests_compile/triton_suite.py --jobs 2 --out tests_compile/last_triton_table.md
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ENV = {"JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1", "JAX_ENABLE_COMPILATION_CACHE": "false",
       "TF_CPP_MIN_LOG_LEVEL": "2"}
os.environ.update(ENV)

sys.path.insert(0, HERE)
# The grid and the spill budget are the pallas suite's.
from compile_suite import (  # noqa: E402
    BLOCK_SIZE,
    DROPOUT,
    DROPOUT_ENTRIES,
    DROPOUT_RATE,
    DTYPES,
    HEAD_DIMS,
    HEADS,
    SPILL_BUDGET,
)
from ptx_shape import hopper_exempt, hopper_shape, instruction_mix  # noqa: E402

ARCHS = (90, 80)
# Shared memory a block may opt into: H100 (sm_90) 227 KiB, A100 (sm_80) 163 KiB.
SMEM_LIMIT = {90: 232448, 80: 166912}


@dataclasses.dataclass(frozen=True)
class Config:
    arch: int
    case: str
    dtype: str
    head_dim: int
    heads: str

    @property
    def key(self):
        return f"sm_{self.arch}/{self.case}/{self.dtype}/D{self.head_dim}/{self.heads}"


def configs(only=None, all_heads=False):
    """The entries: sm_80 takes GQA only unless ``all_heads`` (its MHA kernels differ only in G=1;
    the full 432-entry grid, 744 s here, had no failure there either), which keeps
    ``make test-compile`` well inside 20 minutes."""
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    from catalog import CATALOG

    names = [c.name for c in CATALOG]
    out = [Config(a, c, dt, d, h)
           for a, c, dt, d, h in itertools.product(ARCHS, names, DTYPES, HEAD_DIMS, HEADS)
           if all_heads or not (a == 80 and h == "mha")]
    out += [Config(a, c + DROPOUT, dt, d, h) for a in ARCHS for c, dt, d, h in DROPOUT_ENTRIES]
    return [c for c in out if only is None or re.search(only, c.key)]


def _ptxas():
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def _ptx_resources(path: str, arch: int, ptxas: str):
    """(registers, spill stores, spill loads) of the one entry in ``path``."""
    gpu = "sm_90a" if arch == 90 else f"sm_{arch}"
    p = subprocess.run([ptxas, "-v", f"--gpu-name={gpu}", path, "-o", os.devnull], capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"ptxas failed on {os.path.basename(path)}: {p.stderr[-1500:]}")
    regs = re.search(r"Used (\d+) registers", p.stderr)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", p.stderr)
    return (int(regs.group(1)) if regs else 0, int(spill.group(1)) if spill else 0,
            int(spill.group(2)) if spill else 0)


def _kernel_kind(name: str) -> str:
    for kind in ("dkv", "dq", "fwd"):
        if kind in name:
            return kind
    return name


def worker(cfgs, results_path):
    import jax
    import jax.numpy as jnp
    import jax_triton.triton_lib as jt_lib
    from catalog import BY_NAME, build, inputs

    ptxas = _ptxas()
    with open(results_path, "a") as out:
        for cfg in cfgs:
            B, S, Hq, Hkv = HEADS[cfg.heads]
            shape = (B, S, S, Hq, Hkv, cfg.head_dim, cfg.head_dim)
            dump = tempfile.mkdtemp(prefix="fj_triton_dump_")
            jt_lib._JAX_TRITON_DUMP_DIR = dump
            jt_lib._COMPILED_KERNEL_CACHE.clear()
            row = {"key": cfg.key, **dataclasses.asdict(cfg), "kernels": {}}
            t0 = time.perf_counter()
            try:
                base = cfg.case.removesuffix(DROPOUT)
                _, params, attention = build(BY_NAME[base], shape, block_size=BLOCK_SIZE)
                q, k, v, do = inputs(shape, getattr(jnp, cfg.dtype))
                opts = {"target": "cuda", "compute_capability": cfg.arch, **json.loads(os.environ.get(
                    "FLEXJAX_SUITE_OPTIONS", "{}"))}
                drop = ({"dropout_rate": DROPOUT_RATE, "dropout_rng": jax.random.key(0)} if base != cfg.case
                        else {})

                def loss(q, k, v, params):
                    out, _ = attention(q, k, v, params, backend="triton", kernel_options=opts, **drop)
                    return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))

                jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(q, k, v, params).lower(
                    lowering_platforms=("cuda",))
                for info in glob.glob(os.path.join(dump, "*", "*.compile_info")):
                    name = os.path.basename(info)[: -len(".compile_info")]
                    with open(info) as f:
                        smem = int(re.search(r"shared_mem_bytes:\s*(\d+)", f.read()).group(1))
                    with open(os.path.join(os.path.dirname(info), "config")) as f:
                        conf = f.read()
                    # The dump's config holds the constexprs as ('TQ', 64) pairs and the
                    # launch options as CUDAOptions(num_warps=8, ..., num_stages=3, ...).
                    warps = re.search(r"\bnum_warps=(\d+)", conf)
                    stages = re.search(r"\bnum_stages=(\d+)", conf)
                    tq, tk = (re.search(rf"\('{t}', (\d+)\)", conf) for t in ("TQ", "TK"))
                    tiles = f"{tq.group(1)}x{tk.group(1)}" if tq and tk else "?"
                    ptx_path = os.path.join(os.path.dirname(info), name + ".ptx")
                    regs, st, ld = _ptx_resources(ptx_path, cfg.arch, ptxas)
                    with open(ptx_path) as f:
                        mix = instruction_mix(f.read())
                    if os.environ.get("FLEXJAX_KEEP_PTX"):  # keep the PTX to read it
                        keep = os.path.join(os.environ["FLEXJAX_KEEP_PTX"], cfg.key.replace("/", "_"))
                        os.makedirs(keep, exist_ok=True)
                        shutil.copy(ptx_path, os.path.join(keep, _kernel_kind(name) + ".ptx"))
                    row["kernels"][_kernel_kind(name)] = {
                        "name": name, "smem": smem, "regs": regs, "spill_st": st, "spill_ld": ld, "tiles": tiles,
                        "warps": int(warps.group(1)) if warps else None,
                        "stages": int(stages.group(1)) if stages else None,
                        "scatter": "('NPAD" in conf, **mix}
            except Exception as e:  # noqa: BLE001 - every failure becomes a table row
                msg = str(e).strip().splitlines()
                row["error"] = f"{type(e).__name__}: {msg[0][:300] if msg else ''}"
            finally:
                shutil.rmtree(dump, ignore_errors=True)
            row["seconds"] = round(time.perf_counter() - t0, 2)
            out.write(json.dumps(row) + "\n")
            out.flush()


def check(row) -> list[str]:
    if "error" in row:
        return [row["error"]]
    fails = []
    kinds = set(row["kernels"])
    if not {"fwd", "dq", "dkv"} <= kinds:
        fails.append(f"kernels compiled: {sorted(kinds)}, expected fwd, dq and dkv")
    for kind, r in sorted(row["kernels"].items()):
        if r["smem"] > SMEM_LIMIT[row["arch"]]:
            fails.append(f"{kind}: shared memory {r['smem']} B > {SMEM_LIMIT[row['arch']]} B")
        if r["spill_st"] + r["spill_ld"] > SPILL_BUDGET[row["dtype"]]:
            fails.append(f"{kind}: spills {r['spill_st']}+{r['spill_ld']} B > budget {SPILL_BUDGET[row['dtype']]} B")
        if row["arch"] == 90 and row["dtype"] != "float32" and "wgmma" in r and not hopper_exempt(row, kind):
            fails += hopper_shape(kind, r)
    return fails


def table(rows, seconds, jobs) -> str:
    short = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
    fails = {r["key"]: check(r) for r in rows}
    n_fail = sum(bool(f) for f in fails.values())
    lines = [f"Triton compile suite: {len(rows)} entries, {n_fail} failing, {seconds:.0f} s with {jobs} workers "
             f"(triton.compile through jax-triton for sm_90 and sm_80; ptxas -v from Triton's bundle).", "",
             "Worst case per (arch, kernel, dtype, D, tiles / warps / stages), over the catalog and MHA/GQA "
             "(on sm_90, 16-bit, mods that gather from a captured array take other tiles than those that do not):",
             "",
             "(wgmma / mma.sync: the most per kernel; cp.async waits: the depths `cp.async.wait_group` takes, over "
             "the entries.)", "",
             "| arch | kernel | dtype | D | tiles | warps | stages | max smem (B) | max registers | max spills (B) "
             "| wgmma | mma.sync | cp.async waits |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    summary = {}
    for r in rows:
        for kind, k in r.get("kernels", {}).items():
            s = summary.setdefault((r["arch"], kind, r["dtype"], r["head_dim"], k["tiles"], k["warps"], k["stages"]),
                                   [k["tiles"], k["warps"], k["stages"], 0, 0, 0, 0, 0, set()])
            s[3], s[4], s[5] = max(s[3], k["smem"]), max(s[4], k["regs"]), max(s[5], k["spill_st"] + k["spill_ld"])
            s[6], s[7] = max(s[6], k.get("wgmma", 0)), max(s[7], k.get("mma_sync", 0))
            s[8] |= set(k.get("waits", ()))
    for (arch, kind, dt, d, *_), (tiles, w, st, smem, regs, spill, wg, ms, waits) in sorted(
            summary.items(), key=lambda x: (-x[0][0], ("fwd", "dq", "dkv").index(x[0][1]) if x[0][1] in (
                "fwd", "dq", "dkv") else 9, x[0][2], x[0][3], str(x[0][4:]))):
        depth = ",".join(map(str, sorted(waits))) or "-"
        lines.append(f"| sm_{arch} | {kind} | {short[dt]} | {d} | {tiles} | {w} | {st} | {smem} | {regs} | {spill} "
                     f"| {wg} | {ms} | {depth} |")
    lines += ["", "Failures:" if n_fail else "No failures.", ""]
    lines += [f"- {k}: {'; '.join(f)}" for k, f in sorted(fails.items()) if f]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", default=None, help="regex over 'sm_<arch>/entry/dtype/D<d>/heads'")
    ap.add_argument("--all-heads", action="store_true", help="also MHA at sm_80 (432 entries instead of 324)")
    ap.add_argument("--out", default=os.path.join(HERE, "last_triton_table.md"))
    ap.add_argument("--options", default=None,
                    help='kernel_options added to every entry, as JSON (to measure other tiles: '
                         '\'{"bwd_block_q": 64, "bwd_num_stages": 3}\')')
    ap.add_argument("--rows", default=None, help="also write every entry's row (JSON lines) here")
    ap.add_argument("--table-from", default=None, help="only print the table of rows written by --rows")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
        worker([Config(**c) for c in spec["cfgs"]], spec["results"])
        return 0
    if args.table_from:
        with open(args.table_from) as f:
            print(table([json.loads(line) for line in f if line.strip()], 0, 0))
        return 0
    cfgs = configs(args.only, args.all_heads)
    t0 = time.perf_counter()
    work = tempfile.mkdtemp(prefix="fj_triton_suite_")
    env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(work, "triton_cache"))
    if args.options:
        env["FLEXJAX_SUITE_OPTIONS"] = json.dumps(json.loads(args.options))
    procs, results = [], []
    for j in range(args.jobs):
        chunk = cfgs[j::args.jobs]
        if not chunk:
            continue
        res = os.path.join(work, f"results_{j}.jsonl")
        results.append(res)
        spec = json.dumps({"cfgs": [dataclasses.asdict(c) for c in chunk], "results": res})
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", spec], env=env))
    codes = [p.wait() for p in procs]
    rows = []
    for res in results:
        if os.path.exists(res):
            with open(res) as f:
                rows += [json.loads(line) for line in f if line.strip()]
    done = {r["key"] for r in rows}
    rows += [{"key": c.key, **dataclasses.asdict(c), "kernels": {}, "error": "worker died before this entry"}
             for c in cfgs if c.key not in done]
    if args.rows:
        with open(args.rows, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in sorted(rows, key=lambda r: r["key"]))
    text = table(sorted(rows, key=lambda r: r["key"]), time.perf_counter() - t0, args.jobs)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    shutil.rmtree(work, ignore_errors=True)
    bad = sum(bool(check(r)) for r in rows)
    print(f"triton suite: {len(rows)} entries, {bad} failing, worker exit codes {codes}")
    return 1 if bad or any(codes) else 0


if __name__ == "__main__":
    sys.exit(main())
