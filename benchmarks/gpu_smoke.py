"""Smoke test of one kernel backend for gpu_check.sh's step 0: a tiny causal forward and backward.

    python benchmarks/gpu_smoke.py --backend triton --out smoke.jsonl [--rehearsal]

gpu_check.sh runs this once per kernel backend, each in its own process under a short
timeout, before anything else; a backend whose process fails or does not finish in time is
left out of every later step (a kernel that deadlocks here would otherwise take a whole step,
and the other backends' results in it, with it). The call: B=1, S=256, 2 query heads over 1
kv head, D=128, bfloat16, causal, the BlockMask's default 128 blocks (on the GPU); with
``--rehearsal`` the CPU rehearsal's shapes of benchmarks/gpu_tests.py (S=128, 4/2 heads,
D=32, float16, 32 blocks) in the kernels' interpreters. Compared, as benchmarks/gpu_tests.py
compares: out, lse, dq, dk, dv of ``<out, dO> + 0.1 * sum(lse)`` against the float32 reference.

One JSON line in ``--out`` (appended: the backends' processes share it) says the outcome:
``passed``; ``inaccurate`` (finite but off by more than the tests' tolerance: kept, so that the
tests step says where, and flagged in the summary); ``unsupported`` (the backend refused) or
``failed`` (an error, or a NaN): exit status 1, and the backend is dropped.

Test hook: ``FLEXJAX_GPU_INJECT_HANG=name[@step],...`` makes the named backends' processes
(this one's, benchmarks/gpu_tests.py's and benchmarks/gpu_bench.py's, on a GPU or not) sleep
forever where they would first call that backend, after writing an ``injected_hang`` line:
``name`` alone everywhere (so it is dropped here, at step 0); ``name@step`` only in that step
(smoke, tests, timing, sparsity or sweep), to rehearse a hang later on. `make
gpu-check-rehearsal` injects one into mosaic_gpu. The part of this module above ``main`` is
standard library only (the other scripts and their tests import it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

INJECT_ENV = "FLEXJAX_GPU_INJECT_HANG"
STEPS = ("smoke", "tests", "timing", "sparsity", "sweep")
# The smoke call: (B, S, Hq, Hkv, D, dtype, block), on the GPU and in the CPU rehearsal.
GPU_SHAPE = {"B": 1, "S": 256, "Hq": 2, "Hkv": 1, "D": 128, "dtype": "bfloat16", "block": 128}
REHEARSAL_SHAPE = {"B": 1, "S": 128, "Hq": 4, "Hkv": 2, "D": 32, "dtype": "float16", "block": 32}


def injected(backend: str, step: str, spec: str | None = None) -> bool:
    """Whether ``FLEXJAX_GPU_INJECT_HANG`` (or ``spec``) asks ``backend`` to hang in ``step``."""
    spec = os.environ.get(INJECT_ENV, "") if spec is None else spec
    for entry in spec.split(","):
        name, _, where = entry.strip().partition("@")
        if name and name == backend and where in ("", step):
            return True
    return False


def _sleep_forever():  # pragma: no cover  (replaced in tests)
    while True:
        time.sleep(3600)


def hang_if_injected(backend: str, step: str, out: str | None = None, **record) -> None:
    """Sleeps forever, after saying so (on stdout and as an ``injected_hang`` line in ``out``),
    where ``FLEXJAX_GPU_INJECT_HANG`` names ``backend`` for ``step``; else returns at once."""
    if not injected(backend, step):
        return
    line = {"kind": "injected_hang", "backend": backend, "step": step, **record,
            "note": f"{INJECT_ENV}={os.environ.get(INJECT_ENV, '')}: sleeping until killed (a test hook)"}
    if out:
        with open(out, "a") as fh:
            fh.write(json.dumps(line) + "\n")
    print(json.dumps(line), flush=True)
    _sleep_forever()


def _write(path: str, record: dict) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", required=True, help="the kernel backend to smoke-test")
    p.add_argument("--out", required=True, help="JSON lines file to append the outcome to")
    p.add_argument("--rehearsal", action="store_true", help="the CPU rehearsal's shapes in the interpreters")
    args = p.parse_args(argv)
    shape = REHEARSAL_SHAPE if args.rehearsal else GPU_SHAPE
    start = time.perf_counter()
    base = {"kind": "smoke", "backend": args.backend, **shape, "variant": "causal", "passes": "fwd+bwd"}

    import warnings

    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gpu_tests  # the tests step's case, inputs, call and comparison

    if not args.rehearsal and jax.default_backend() != "gpu":
        _write(args.out, {**base, "outcome": "failed", "error": f"no GPU visible to JAX ({jax.default_backend()})"})
        return 1
    dtype = gpu_tests.DTYPES[shape["dtype"]]
    B, S = shape["B"], shape["S"]
    record = dict(base)
    try:
        bm, params, kwargs, score = gpu_tests.case_call("causal", B, S, S, shape["Hq"], shape["block"], S)
        q, k, v, do = gpu_tests.inputs(B, S, S, shape["Hq"], shape["Hkv"], shape["D"], dtype)
        truth = gpu_tests.results(bm, params, kwargs, score, *(x.astype(jnp.float32) for x in (q, k, v, do)),
                                  backend="reference")
        ref = gpu_tests.results(bm, params, kwargs, score, q, k, v, do, backend="reference")
        record["reference_s"] = round(time.perf_counter() - start, 2)
        hang_if_injected(args.backend, "smoke", args.out, shape=[B, S, shape["Hq"], shape["D"]])
        t = time.perf_counter()
        options = {"interpret": True} if args.rehearsal else {"target": "cuda"}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
            got = gpu_tests.results(bm, params, kwargs, score, q, k, v, do, backend=args.backend,
                                    kernel_options=options)
        record["call_s"] = round(time.perf_counter() - t, 2)
        table = gpu_tests.compare(got, truth, ref, dtype)
        nan = sorted(n for n, x in got.items() if np.isnan(x).any())
        off = sorted(n for n, row in table.items() if not row["ok"] and n not in nan)
        record["errors"] = table
        if nan:
            record.update(outcome="failed", error="NaN in " + ", ".join(nan))
        elif off:
            record.update(outcome="inaccurate", error="; ".join(
                f"{n}: " + (table[n].get("error") or f"max error {table[n]['err']:.3g} > tolerance "
                            f"{table[n]['tol']:.3g}") for n in off))
        else:
            record["outcome"] = "passed"
    except Exception as e:  # noqa: BLE001  (the backend's refusal or error is the smoke test's result)
        record.update(gpu_tests._classify(e))
        record["outcome"] = "unsupported" if record["outcome"] == "unsupported" else "failed"
    record["wall_s"] = round(time.perf_counter() - start, 2)
    _write(args.out, record)
    print(f"smoke {args.backend}: {record['outcome']} ({record['wall_s']} s)"
          + (f": {record['error'][:300]}" if record.get("error") else ""), flush=True)
    return 0 if record["outcome"] in ("passed", "inaccurate") else 1


if __name__ == "__main__":
    sys.exit(main())
