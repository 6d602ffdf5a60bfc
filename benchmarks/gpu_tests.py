"""GPU correctness check for gpu_check.sh: the catalog's compiled GPU kernels against the reference.

    python benchmarks/gpu_tests.py --out gpu_tests.jsonl [--shard 0/4] [--cases causal,padding]
        [--backends pallas,triton]

The check of ``test_catalog_on_gpu`` in tests/test_pallas.py (bfloat16, forward and
backward, GQA with ragged lengths) without pytest, which the GPU machine may lack, for
each kernel backend: ``pallas`` (Pallas' Triton lowering) and ``triton`` (the Triton
templates through jax-triton). A case the backend refuses (for triton, where jax-triton
does not import) is "unsupported", with the reason, and counts as not passed.
Shards split the catalog so that several processes compile at once; each case appends
one JSON line to ``--out`` as soon as it finishes, so a run that is cut still reports.
``--interpret`` runs the same kernels in Pallas' interpreter (to try this script on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "tests"))
sys.path.insert(0, _ROOT)

from catalog import CATALOG, SHAPES, check_case  # noqa: E402


def check(name: str, backend: str, kernel_options: dict) -> None:
    """``backend`` in bfloat16 against the float32 reference on the same rounded inputs.

    Raises:
      AssertionError: an output or gradient is off by more than the same-dtype
        reference's own error allows (tests/checks.py).
    """
    check_case(backend, name, SHAPES["gqa_unequal"], jnp.bfloat16, kernel_options, 64)


def _shard(names, spec: str):
    i, n = (int(x) for x in spec.split("/"))
    if not 0 <= i < n:
        raise SystemExit(f"--shard must be i/n with 0 <= i < n, got {spec!r}")
    return names[i::n]


def _write(path: str, record: dict) -> None:
    # One write per line in append mode: lines from parallel shards do not interleave.
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON lines file to append to")
    parser.add_argument("--shard", default="0/1", help="i/n: run every n-th case from the i-th")
    parser.add_argument("--cases", default="", help="comma-separated catalog names (default: all)")
    parser.add_argument("--backends", default="pallas,triton", help="comma-separated kernel backends")
    parser.add_argument("--interpret", action="store_true", help="the backends' interpreters instead of the GPU")
    args = parser.parse_args()
    if not args.interpret and jax.default_backend() != "gpu":
        print(f"no GPU visible to JAX (backend {jax.default_backend()!r}); pass --interpret to run on CPU")
        return 2
    names = [c.name for c in CATALOG]
    if args.cases:
        wanted = args.cases.split(",")
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            raise SystemExit(f"unknown --cases {unknown}; the catalog has {names}")
        names = [n for n in names if n in wanted]
    names = _shard(names, args.shard)
    backends = args.backends.split(",")
    unknown = sorted(set(backends) - {"pallas", "triton"})
    if unknown:
        raise SystemExit(f"unknown --backends {unknown}; choose from pallas, triton")
    options = {"interpret": True} if args.interpret else {"target": "cuda"}
    _write(args.out, {"kind": "start", "shard": args.shard, "cases": names, "backends": backends,
                      "jax": jax.__version__, "device": str(jax.devices()[0]), "kernel_options": options})
    failed = 0
    for name, backend in ((n, b) for n in names for b in backends):
        start = time.perf_counter()
        record = {"kind": "test", "case": name, "backend": backend, "shard": args.shard}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                check(name, backend, options)
                record["outcome"] = "passed"
            except AssertionError as e:
                record.update(outcome="failed", error=str(e)[:2000])
            except NotImplementedError as e:
                # The backend refused (for triton: jax-triton missing, say); not a pass.
                record.update(outcome="unsupported", error=str(e)[:2000])
            except Exception as e:  # noqa: BLE001  (a compile error is this case's result, not the run's end)
                record.update(outcome="error", error=f"{type(e).__name__}: {str(e)[:2000]}",
                              traceback=traceback.format_exc()[-4000:])
        record["wall_s"] = round(time.perf_counter() - start, 2)
        record["warnings"] = sorted({f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught})
        failed += record["outcome"] != "passed"
        _write(args.out, record)
        print(f"{record['outcome']:7s} {name} [{backend}] ({record['wall_s']} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
