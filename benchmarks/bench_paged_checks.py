"""The cost of the run-time page-table check: one jitted paged decode step traced with the check and one
without (``paged.set_runtime_checks``), timed alternately in one process (median of ``--reps`` calls each).

    .venv/bin/python benchmarks/bench_paged_checks.py [--lengths 256 1024 4096]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from flexjax import paged


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="*", default=[256, 1024, 4096])
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args(argv)
    B, HQ, HKV, D, PAGE = 8, 8, 2, 64, 16
    print(f"paged decode step, B={B} Hq={HQ} Hkv={HKV} D={D} page {PAGE}, float32, {jax.devices()[0].platform}")
    print("| cached tokens | checked (ms) | unchecked (ms) | check's cost (us) |")
    print("|---|---|---|---|")
    for L in args.lengths:
        max_pages = L // PAGE
        table = jnp.asarray(paged.page_table_for([L] * B, PAGE, max_pages, seed=0))
        keys = jax.random.split(jax.random.key(0), 3)
        k_pages, v_pages = (jax.random.normal(k, (B * max_pages, PAGE, HKV, D)) for k in keys[:2])
        q = jax.random.normal(keys[2], (B, 1, HQ, D))
        lengths = jnp.full((B,), L - 3, jnp.int32)

        def step(q, k_pages, v_pages, table, lengths):
            return paged.flex_attention(q, k_pages, v_pages, table, lengths)

        steps = {}
        for checked in (True, False):
            previous = paged.set_runtime_checks(checked)
            fn = jax.jit(step)
            jax.block_until_ready(fn(q, k_pages, v_pages, table, lengths))  # traced and compiled here
            paged.set_runtime_checks(previous)
            steps[checked] = fn
        times = {True: [], False: []}
        for _ in range(args.reps):
            for checked, fn in steps.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(q, k_pages, v_pages, table, lengths))
                times[checked].append(time.perf_counter() - t0)
        on, off = (float(np.median(times[c])) * 1e3 for c in (True, False))
        print(f"| {L} | {on:.3f} | {off:.3f} | {(on - off) * 1e3:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
