"""Block-mask build benchmarks: one JSON line per spec, each measured in a fresh process.

    .venv/bin/python benchmarks/bench_block_mask.py                 # every spec
    .venv/bin/python benchmarks/bench_block_mask.py --specs causal-64k,docs64-64k

PyTorch's compiled builder runs on the same masks in its own process:
``build/venv-compile/bin/python benchmarks/torch_block_mask.py``.

Specs (block 128, B = H = None unless said):
  causal-64k, docs64-64k: causal, and causal within 64 equal documents (captured ids),
    S = 65536: first call (trace + compile) and the median of 5 warm calls.
  causal-1m, window4096-1m, docs256-1m: causal, sliding window 4096, 256 documents at
    S = 1,048,576: first call, one warm call, and the process's peak RSS.
  docs64-64k-jit: causal within 64 documents, the ids an argument of a jitted function
    (known only at run time), S = 65536: warm median, analysis against enumeration
    (``analyse=False``, the builder before the analysis).
  window4096-fwd-1m: flex_attention forward, sliding window 4096, S = 1,048,576, B = H = 1,
    D = 64, float32, xla backend: wall time of one call (compile included) and peak RSS.
  causal-8k, checkpointed-8k: causal, plain and wrapped in jax.checkpoint (a remat2 call
    the analysis enters), S = 8192: first call and the median of 5 warm calls.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

SPECS = ["causal-64k", "docs64-64k", "docs64-64k-jit", "causal-1m", "window4096-1m", "docs256-1m",
         "window4096-fwd-1m", "causal-8k", "checkpointed-8k"]


def _mask(kind: str, S: int):
    import jax
    import jax.numpy as jnp

    import flexjax
    from flexjax import masks

    if kind == "causal":
        return masks.causal
    if kind == "checkpointed":
        return jax.checkpoint(masks.causal)
    if kind == "window4096":
        return masks.sliding_window(4096)
    docs = {"docs64": 64, "docs256": 256}[kind]
    ids = jnp.arange(S, dtype=jnp.int32) // (S // docs)
    if docs == 64:
        return flexjax.and_masks(masks.causal, masks.document(ids))
    return masks.document(ids)


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed(fn, repeats: int) -> tuple[float, float]:
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times) if times else float("nan")


def run_one(name: str) -> dict:
    import jax
    import jax.numpy as jnp

    import flexjax
    from flexjax import masks

    kind = name.split("-")[0]
    S = 65536 if "-64k" in name else 8192 if "-8k" in name else 1 << 20
    out = {"side": "flexjax", "spec": name, "S": S}
    if name == "docs64-64k-jit":
        ids = jnp.arange(S, dtype=jnp.int32) // (S // 64)
        def builder(analyse):
            def build(ids):
                mm = flexjax.and_masks(masks.causal, masks.document(ids))
                return flexjax.create_block_mask(mm, None, None, S, S, analyse=analyse).kv_num_blocks

            return jax.jit(build)

        for label, analyse in (("analysis", True), ("enumeration", False)):
            f = builder(analyse)
            first, warm = _timed(lambda f=f: f(ids), 5 if analyse else 2)
            out[f"{label}_first_s"], out[f"{label}_warm_ms"] = round(first, 3), round(1e3 * warm, 2)
        out["speedup"] = round(out["enumeration_warm_ms"] / out["analysis_warm_ms"], 1)
        return out
    if name == "window4096-fwd-1m":
        bm = flexjax.create_block_mask(masks.sliding_window(4096), None, None, S, S)
        q = jax.random.normal(jax.random.key(0), (1, S, 1, 64), jnp.float32)
        t0 = time.perf_counter()
        o = jax.block_until_ready(flexjax.flex_attention(q, q, q, block_mask=bm, backend="xla"))
        out.update(fwd_s=round(time.perf_counter() - t0, 2), finite=bool(jnp.isfinite(o).all()),
                   peak_rss_mib=round(_peak_mib()))
        return out
    mm = _mask(kind, S)

    def build():
        # All eight lists: large ones are written on the device, asynchronously.
        return flexjax.create_block_mask(mm, None, None, S, S).tree_flatten()[0][:8]

    first, warm = _timed(build, 5 if S <= 65536 else 1)
    bm = jax.block_until_ready(flexjax.create_block_mask(mm, None, None, S, S))
    index_mib = sum(x.nbytes for x in bm.tree_flatten()[0][:8]) / 2**20
    out.update(first_s=round(first, 3), warm_ms=round(1e3 * warm, 2), sparsity=round(bm.sparsity(), 2),
               kv_indices=list(bm.kv_indices.shape), index_mib=round(index_mib, 1), peak_rss_mib=round(_peak_mib()))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--specs", default=",".join(SPECS))
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one)), flush=True)
        return
    for name in args.specs.split(","):
        # A fresh process per spec: first calls include tracing and compiling, and the
        # peak RSS is this spec's alone.
        res = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True)
        line = res.stdout.strip().splitlines()[-1:] or [json.dumps({"spec": name, "error": res.stderr[-500:]})]
        print(line[0], flush=True)


if __name__ == "__main__":
    main()
