"""AOT-compiles the pallas kernels for sm_90 and TPU v5e from a CPU host and checks their resources.

Run by ``make test-compile`` inside ``build/venv-compile`` (jax-cuda12-plugin, the nvcc wheel's ptxas,
libtpu; kept out of ``.venv`` because the CUDA plugin logs an error at every ``import jax``
on a machine without a GPU). For every catalog entry x {bf16, f16, f32} x {D=64, 128, 256}
x {MHA, GQA} it compiles ``jax.grad`` of the attention (forward, dQ and dK/dV kernels in
one XLA module), and the same for a few entries with fused dropout (``DROPOUT_ENTRIES``,
named ``<entry>+dropout``):

- cuda: for an H100 (``h100_target_config.txtpb``, sm_90a) through
  ``jax.experimental.topologies``; shared memory per kernel from XLA's thunk sequence,
  registers and spills from ``ptxas -v`` on the PTX XLA emitted.
- tpu: for one chip of a ``v5e:2x2`` topology through pip ``libtpu``. Entries the
  compiler rejects for Mosaic TPU (captured-table gathers) are listed as unsupported.

It fails on any compile error, on shared memory above the opt-in limit, and on spills
above ``SPILL_BUDGET``. Workers are separate processes (one jax per process, nothing
cached between runs: XLA's and JAX's compilation caches stay off). The table goes to
``--out`` (markdown): one row per kernel, then a summary per (kernel, dtype, D).

    python tests_compile/compile_suite.py --jobs 2 --out tests_compile/last_table.md
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
TARGET_CONFIG = os.path.join(HERE, "h100_target_config.txtpb")
# Set before jax is first imported (by the catalog): no GPU here, and the CUDA plugin
# must not check for one. libtpu lets one process at a time load it unless told otherwise
# (with 2 workers the second died on /tmp/libtpu_lockfile); these workers only compile.
ENV = {"JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1", "JAX_ENABLE_COMPILATION_CACHE": "false",
       "TF_CPP_MIN_LOG_LEVEL": "2", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
os.environ.update(ENV)

DTYPES = ("bfloat16", "float16", "float32")
HEAD_DIMS = (64, 128, 256)
# (B, S, Hq, Hkv): the kernels' resources do not depend on S or B (they only size the grid);
# 1024 keeps the block masks cheap to build on CPU.
HEADS = {"mha": (1, 1024, 2, 2), "gqa": (1, 1024, 4, 2)}
BLOCK_SIZE = 128
# Per-thread spill bytes (stores + loads, as ptxas -v reports them) a kernel may use:
# none in 16-bit dtypes, a little in float32, whose tiles are twice the registers.
SPILL_BUDGET = {"bfloat16": 0, "float16": 0, "float32": 1024}
# H100 shared memory a block may opt into (shared_memory_per_block_optin in the config).
SMEM_LIMIT = 232448
TPU_TOPOLOGY = "v5e:2x2"
# Entries also compiled with dropout (the hash adds registers to every tile), as (case, dtype,
# head dim, heads): a plain mask, and a mask with a table-reading score_mod (the heaviest on
# registers) at the tile table's register edges (f32 D=128 and 256, bf16 D=256). Not the
# whole grid: Pallas' Triton lowering takes ~60-80 s per dropout entry here (3 s without
# dropout; the triton backend's kernels ~10 s), so its 36 entries would add ~40 min. When
# this was set, the grid's 24 bf16/f32 entries compiled for TPU v5e (f16 is refused there)
# and its 8 bf16/f32 D=256 entries for sm_90, all without failures.
DROPOUT_ENTRIES = (
    ("causal", "bfloat16", 128, "gqa"),
    ("prefix_lm+relative_bias", "bfloat16", 256, "gqa"),
    ("prefix_lm+relative_bias", "float32", 128, "gqa"),
    ("prefix_lm+relative_bias", "float32", 256, "gqa"),
)
DROPOUT = "+dropout"
DROPOUT_RATE = 0.1
KERNELS = ("flexjax_fwd", "flexjax_bwd_dq", "flexjax_bwd_dkv")


@dataclasses.dataclass(frozen=True)
class Config:
    target: str
    case: str
    dtype: str
    head_dim: int
    heads: str

    @property
    def key(self):
        return f"{self.target}/{self.case}/{self.dtype}/D{self.head_dim}/{self.heads}"


def configs(targets, only=None):
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    from catalog import CATALOG

    out = [Config(t, c.name, dt, d, h)
           for t, c, dt, d, h in itertools.product(targets, CATALOG, DTYPES, HEAD_DIMS, HEADS)]
    out += [Config(t, c + DROPOUT, dt, d, h) for t in targets for c, dt, d, h in DROPOUT_ENTRIES]
    return [c for c in out if only is None or re.search(only, c.key)]


# -- worker ----------------------------------------------------------------------------------

def _ptxas():
    import nvidia.cuda_nvcc

    base = os.path.dirname(nvidia.cuda_nvcc.__file__) if nvidia.cuda_nvcc.__file__ else list(
        nvidia.cuda_nvcc.__path__)[0]
    return os.path.join(base, "bin", "ptxas")


def _ptx_resources(ptx_files, ptxas):
    """{entry: (registers, spill_stores, spill_loads)} from ptxas -v."""
    res = {}
    for f in ptx_files:
        text = open(f).read()
        if ".entry" not in text:
            continue  # XLA's constants module with nothing to assemble (empty when every constant is folded)
        target = re.search(r"^\.target\s+(\S+)", text, re.M)
        arch = target.group(1).split(",")[0] if target else "sm_90a"
        p = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", f, "-o", os.devnull],
                           capture_output=True, text=True)
        entry = None
        for line in p.stderr.splitlines():
            m = re.search(r"Compiling entry function '([^']+)'", line)
            if m:
                entry = m.group(1)
            m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
            if m and entry:
                res.setdefault(entry, {})["spill_stores"] = int(m.group(1))
                res[entry]["spill_loads"] = int(m.group(2))
            m = re.search(r"Used (\d+) registers", line)
            if m and entry:
                res.setdefault(entry, {})["registers"] = int(m.group(1))
        if p.returncode:
            raise RuntimeError(f"ptxas failed on {f}: {p.stderr[-2000:]}")
    return res


def _thunk_resources(files):
    """{kernel: (threads, shared_memory)} from XLA's thunk sequence dump."""
    res = {}
    for f in files:
        for line in open(f):
            m = re.search(r"\] (\S+) grid: \[[^]]*\] threads: \[(\d+), (\d+), (\d+)\]\s+shared_memory: (\d+) bytes",
                          line)
            if m:
                res[m.group(1)] = {"threads": int(m.group(2)) * int(m.group(3)) * int(m.group(4)),
                                   "smem": int(m.group(5))}
    return res


def _first_error_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    for line in text:
        if "RESOURCE_EXHAUSTED" in line or "Error" in line or "error" in line:
            return line.strip()[:400]
    return (text[0] if text else type(e).__name__)[:400]


def worker(cfgs, dump_dir, results_path, overrides, keep_dump=None):
    import catalog_target
    import jax
    import jax.numpy as jnp
    import numpy as np
    from catalog import BY_NAME, build
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from flexjax.backends import pallas as pallas_backend

    launches = []

    def record(mod, name):
        fn = getattr(mod, name)

        def wrapped(g, *a, **kw):
            launches.append({"pass": name, "tile": f"{g.tq}x{g.tk}", "warps": kw.get("warps"),
                             "stages": kw.get("stages")})
            return fn(g, *a, **kw)

        setattr(mod, name, wrapped)

    for mod in (pallas_backend._gpu, pallas_backend._tpu):
        record(mod, "forward")
        record(mod, "backward")

    meshes = {}
    if any(c.target == "cuda" for c in cfgs):
        topo = topologies.get_topology_desc("", "cuda", target_config=open(TARGET_CONFIG).read(),
                                            topology="1x1x1")
        meshes["cuda"] = Mesh(np.array(topo.devices), ("x",))
        ptxas = _ptxas()
    if any(c.target == "tpu" for c in cfgs):
        topo = topologies.get_topology_desc(TPU_TOPOLOGY, "tpu")
        # One chip: a Mosaic kernel cannot be auto-partitioned over a replicated mesh.
        meshes["tpu"] = Mesh(np.array(topo.devices[:1]), ("x",))

    with open(results_path, "a") as out:
        for cfg in cfgs:
            B, S, Hq, Hkv = HEADS[cfg.heads]
            D = cfg.head_dim
            shape = (B, S, S, Hq, Hkv, D, D)
            mesh = meshes[cfg.target]
            sh = NamedSharding(mesh, P())
            dtype = jnp.dtype(cfg.dtype)
            row = {"key": cfg.key, **dataclasses.asdict(cfg)}
            launches.clear()
            t0 = time.perf_counter()
            compile_ = None
            try:
                base = cfg.case.removesuffix(DROPOUT)
                _, params, attention = build(BY_NAME[base], shape, block_size=BLOCK_SIZE)
                drop = ({"dropout_rate": DROPOUT_RATE, "dropout_rng": jax.random.key(0)} if base != cfg.case
                        else {})

                def flexjax_case_fwd(q, k, v, params):
                    options = {"target": cfg.target, **overrides}
                    return attention(q, k, v, params, backend="pallas", kernel_options=options, **drop)

                # XLA's dump is filtered by the module's name (--xla_dump_hlo_module_re below).
                flexjax_case = catalog_target.grads(flexjax_case_fwd, name="flexjax_case")
                args = catalog_target.abstract_args(B, S, Hq, Hkv, D, dtype, sh, params)

                def compile_(f):
                    with jax.set_mesh(mesh):
                        lowered = jax.jit(f).trace(*args).lower()
                    lowered.compile()

                compile_(flexjax_case)
                row["status"] = "ok"
            except NotImplementedError as e:
                row["status"] = "unsupported" if (cfg.target == "tpu" and "Mosaic TPU" in str(e)) else "error"
                row["error"] = _first_error_line(e)
            except Exception as e:  # noqa: BLE001  (every compile error is a reported failure)
                row["status"] = "error"
                row["error"] = _first_error_line(e)
                # XLA's message does not name the kernel: the forward alone tells which pass it is.
                try:
                    if compile_ is None:
                        raise RuntimeError("the case could not be built")
                    compile_(flexjax_case_fwd)
                    row["error"] += " [the forward alone compiles: a backward kernel]"
                except Exception as e2:  # noqa: BLE001
                    row["error"] += f" [the forward alone fails too: {_first_error_line(e2)[:120]}]"
            row["seconds"] = round(time.perf_counter() - t0, 2)
            row["launches"] = list(launches)
            if cfg.target == "cuda":
                files = glob.glob(os.path.join(dump_dir, "*flexjax_case*"))
                try:
                    regs = _ptx_resources([f for f in files if f.endswith(".ptx")], ptxas) if row[
                        "status"] == "ok" else {}
                except RuntimeError as e:
                    row["status"], row["error"] = "error", str(e)[:400]
                    regs = {}
                smem = _thunk_resources([f for f in files if f.endswith("thunk_sequence.txt")])
                row["kernels"] = {k: {**smem.get(k, {}), **regs.get(k, {})} for k in KERNELS
                                  if k in smem or k in regs}
            if keep_dump:
                shutil.copytree(dump_dir, os.path.join(keep_dump, cfg.key.replace("/", "_")), dirs_exist_ok=True)
            for f in glob.glob(os.path.join(dump_dir, "*")):
                shutil.rmtree(f) if os.path.isdir(f) else os.remove(f)
            out.write(json.dumps(row) + "\n")
            out.flush()


# -- checks and the table --------------------------------------------------------------------

def _tiles(row, kernel):
    """(tile, warps, stages) of ``kernel`` from the launches the worker recorded."""
    want = "forward" if kernel == "flexjax_fwd" else "backward"
    for launch in row.get("launches", []):
        if launch["pass"] == want:
            return launch["tile"], launch["warps"], launch["stages"]
    return "?", None, None


def check(row):
    """Failures of one result row (strings)."""
    if row["status"] == "error":
        return [row.get("error", "compile error")]
    if row["status"] != "ok" or row["target"] != "cuda":
        return []
    fails = []
    kernels = row.get("kernels", {})
    for k in KERNELS:
        r = kernels.get(k)
        if r is None or "registers" not in r:
            fails.append(f"{k}: no ptxas/thunk record")
            continue
        if r.get("smem", 0) > SMEM_LIMIT:
            fails.append(f"{k}: shared memory {r['smem']} > {SMEM_LIMIT}")
        spills = r["spill_stores"] + r["spill_loads"]
        if spills > SPILL_BUDGET[row["dtype"]]:
            fails.append(f"{k}: spills {r['spill_stores']}+{r['spill_loads']} B > budget "
                         f"{SPILL_BUDGET[row['dtype']]} B")
    return fails


_SHORT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def table(rows, seconds, jobs, overrides="{}"):
    rows = sorted(rows, key=lambda r: (r["target"], r["case"], DTYPES.index(r["dtype"]), r["head_dim"],
                                       r["heads"]))
    n_fail = sum(1 for r in rows if check(r))
    lines = [
        "# Compile suite: pallas kernels for sm_90 (H100) and TPU v5e",
        "",
        f"`make test-compile`: {len(rows)} compiles ({jobs} worker processes) in {seconds:.0f} s, "
        f"{n_fail} failing. S=1024, block 128, B=1, MHA Hq=Hkv=2, GQA Hq=4 Hkv=2, Dv=D. "
        f"Spill budget per thread (stores+loads): bf16/f16 {SPILL_BUDGET['bfloat16']} B, "
        f"f32 {SPILL_BUDGET['float32']} B; shared memory limit {SMEM_LIMIT} B."
        + (f" kernel_options over the heuristics: `{overrides}`." if overrides != "{}" else ""),
        "",
    ]
    cuda = [r for r in rows if r["target"] == "cuda"]
    if cuda:
        summary = {}
        for r in cuda:
            for k in KERNELS:
                res = r.get("kernels", {}).get(k)
                if not res or "registers" not in res:
                    continue
                tile, warps, stages = _tiles(r, k)
                s = summary.setdefault((k, r["dtype"], r["head_dim"]), {
                    "tiles": set(), "warps": set(), "stages": set(), "smem": 0, "regs": 0, "spill": 0,
                    "n": 0, "spilling": set()})
                s["tiles"].add(tile)
                s["warps"].add(str(warps))
                s["stages"].add(str(stages))
                s["smem"] = max(s["smem"], res.get("smem", 0))
                s["regs"] = max(s["regs"], res["registers"])
                sp = res["spill_stores"] + res["spill_loads"]
                s["spill"] = max(s["spill"], sp)
                s["n"] += 1
                if sp:
                    s["spilling"].add(r["case"])
        lines += ["## sm_90: worst case over the catalog and MHA/GQA, per kernel, dtype and head dim", "",
                  "| kernel | dtype | D | tiles | warps | stages | max smem (B) | max registers | "
                  "max spills (B) | entries spilling |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for (k, dt, d), s in sorted(summary.items(), key=lambda kv: (KERNELS.index(kv[0][0]),
                                                                        DTYPES.index(kv[0][1]), kv[0][2])):
            lines.append(f"| {k} | {_SHORT[dt]} | {d} | {','.join(sorted(s['tiles']))} | "
                         f"{','.join(sorted(s['warps']))} | {','.join(sorted(s['stages']))} | {s['smem']} | "
                         f"{s['regs']} | {s['spill']} | {', '.join(sorted(s['spilling'])) or '-'} |")
        lines += ["", "## sm_90: every kernel", "",
                  "| entry | dtype | D | heads | kernel | tiles | warps | stages | smem (B) | registers | "
                  "spills st+ld (B) | result |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in cuda:
            fails = check(r)
            if r["status"] == "error":
                lines.append(f"| {r['case']} | {_SHORT[r['dtype']]} | {r['head_dim']} | {r['heads']} | - | - | - "
                             f"| - | - | - | - | FAIL: {r.get('error', '')[:200].replace('|', '/')} |")
                continue
            for k in KERNELS:
                res = r.get("kernels", {}).get(k, {})
                tile, warps, stages = _tiles(r, k)
                kf = [f for f in fails if f.startswith(k)]
                lines.append(
                    f"| {r['case']} | {_SHORT[r['dtype']]} | {r['head_dim']} | {r['heads']} | {k} | {tile} | "
                    f"{warps} | {stages} | {res.get('smem', '?')} | {res.get('registers', '?')} | "
                    f"{res.get('spill_stores', '?')}+{res.get('spill_loads', '?')} | "
                    f"{'FAIL: ' + '; '.join(kf) if kf else 'ok'} |")
    tpu = [r for r in rows if r["target"] == "tpu"]
    if tpu:
        lines += ["", f"## TPU v5e ({TPU_TOPOLOGY}, one chip, libtpu)", "",
                  "| entry | dtype | D | heads | fwd tile | bwd tile | result |", "|---|---|---|---|---|---|---|"]
        for r in tpu:
            fwd = _tiles(r, "flexjax_fwd")[0]
            bwd = _tiles(r, "flexjax_bwd_dq")[0]
            result = {"ok": "ok", "unsupported": "unsupported: " + r.get("error", "").split("call: ", 1)[-1][:70]}.get(
                r["status"], "FAIL: " + r.get("error", "")[:200].replace("|", "/"))
            lines.append(f"| {r['case']} | {_SHORT[r['dtype']]} | {r['head_dim']} | {r['heads']} | {fwd} | {bwd} | "
                         f"{result} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    ap.add_argument("--targets", default="cuda,tpu")
    ap.add_argument("--only", default=None, help="regex over 'target/entry/dtype/D<d>/heads'")
    ap.add_argument("--out", default=os.path.join(HERE, "last_table.md"))
    ap.add_argument("--kernel-options", default="{}",
                    help="JSON of kernel_options over the heuristics, for tuning (e.g. '{\"bwd_num_warps\": 8}')")
    ap.add_argument("--keep-dump", default=None,
                    help="copy each entry's XLA dump (PTX, thunk sequence) to DIR/<target_entry_dtype_D_heads>")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    cfgs = configs(a.targets.split(","), a.only)
    if a.worker:
        i, n, dump_dir, results = a.worker.split(":", 3)
        worker(cfgs[int(i)::int(n)], dump_dir, results, json.loads(a.kernel_options), a.keep_dump)
        return 0
    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="flexjax_compile_")
    jobs = max(1, min(a.jobs, len(cfgs)))
    procs = []
    for i in range(jobs):
        dump = os.path.join(tmp, f"dump{i}")
        os.makedirs(dump)
        env = dict(os.environ, **ENV,
                   XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_module_re=.*flexjax_case.*",
                   PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, os.path.abspath(__file__), "--targets", a.targets, "--kernel-options", a.kernel_options,
               "--worker", f"{i}:{jobs}:{dump}:{os.path.join(tmp, f'results{i}.jsonl')}"]
        if a.only:
            cmd += ["--only", a.only]
        if a.keep_dump:
            cmd += ["--keep-dump", os.path.abspath(a.keep_dump)]
        log = open(os.path.join(tmp, f"worker{i}.log"), "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    codes = [p.wait() for p, _ in procs]
    rows = []
    for f in glob.glob(os.path.join(tmp, "results*.jsonl")):
        rows += [json.loads(line) for line in open(f)]
    done = {r["key"] for r in rows}
    for c in cfgs:
        if c.key not in done:
            rows.append({"key": c.key, **dataclasses.asdict(c), "status": "error",
                         "error": "worker died before reporting (see its log)"})
    seconds = time.perf_counter() - t0
    with open(a.out, "w") as f:
        f.write(table(rows, seconds, jobs, a.kernel_options))
    failures = [(r["key"], fl) for r in rows for fl in check(r)]
    for key, fl in failures:
        print(f"FAIL {key}: {fl}")
    for i, code in enumerate(codes):
        if code:
            print(f"worker {i} exited with {code}; log:\n" + open(os.path.join(tmp, f"worker{i}.log")).read()[-3000:])
    n_unsup = sum(r["status"] == "unsupported" for r in rows)
    print(f"{len(rows)} compiles, {len(failures)} failures, {n_unsup} unsupported on TPU, "
          f"{seconds:.0f} s with {jobs} workers; table in {a.out}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failures or any(codes) else 0


if __name__ == "__main__":
    sys.exit(main())
