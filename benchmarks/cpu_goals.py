"""Issue 15's CPU goals, measured side by side: rounds of the runner on the goal specs,
each round beside the machine's matmul limit measured in a fresh JAX process.

    python -m benchmarks.cpu_goals [--rounds 3] [--out bench_results/cpu_goals]

The dense baselines are skipped (FLEXJAX_BENCH_MAX_DENSE_GIB=0): the goals compare with
PyTorch's compiled flex_attention (forward) and SDPA (causal forward + backward).
Prints one JSON line per round and writes each round's tables under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SPECS = ("causal_fwd_S4096", "sw256_fwd_S8192", "docs4_fwd_S8192", "causal_fwdbwd_S4096",
         "sw256_fwdbwd_S8192", "docs4_fwdbwd_S8192")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_MATMUL = r"""
import json, time, jax, jax.numpy as jnp
n = 2048
a = jax.random.normal(jax.random.key(0), (n, n)); b = jax.random.normal(jax.random.key(1), (n, n))
f = jax.jit(jnp.dot); f(a, b).block_until_ready()
ts = []
for _ in range(15):
    t = time.perf_counter(); f(a, b).block_until_ready(); ts.append(time.perf_counter() - t)
ts.sort()
print(json.dumps({"matmul_gflops": 2 * n**3 / ts[len(ts) // 2] / 1e9}))
"""


def matmul_limit() -> float:
    out = subprocess.run([sys.executable, "-c", _MATMUL], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["matmul_gflops"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.path.join("bench_results", "cpu_goals"))
    args = p.parse_args(argv)
    env = dict(os.environ, FLEXJAX_BENCH_MAX_DENSE_GIB="0")
    for r in range(args.rounds):
        limit = matmul_limit()
        out = os.path.join(args.out, f"round{r + 1}")
        subprocess.run([sys.executable, "-m", "benchmarks.run", "--suite", "full", "--torch", "--no-memory",
                        "--only", ",".join(SPECS), "--out", out], cwd=ROOT, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        recs = [json.loads(line) for line in open(os.path.join(out, "results.jsonl"))]
        row = {"round": r + 1, "matmul_gflops": round(limit, 1)}
        for rec in recs:
            if rec.get("kind") != "attention" or rec.get("status") != "ok":
                continue
            key = f"{rec['spec']}/{rec['impl']}"
            row[key] = round(rec["median_ms"], 2)
            if rec["impl"] == "flexjax":
                row[f"{rec['spec']}/eff_gflops"] = round(rec["eff_gflops"], 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
