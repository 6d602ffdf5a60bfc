"""GPU correctness check for gpu_check.sh: the kernels at the shapes gpu_bench.py times, against the reference.

    python benchmarks/gpu_tests.py --out gpu_tests.jsonl [--shard 0/4] [--cases causal,dropout]
        [--backends pallas,triton] [--shapes 2:1999x2011,1:8192] [--rehearsal]

Each case is a production training call (bfloat16, head dim 128, GQA with 16 query heads
over 4 kv heads, the BlockMask's default 128 blocks): causal, causal + ALiBi, a relative
bias over the full mask with the gradient of its table, a causal sliding window of 1024,
causal documents of ragged lengths, and causal with dropout (0.1). Each runs at a ragged
length (1999 queries over 2011 keys, B=2) and at S=8192 (B=1), for each kernel backend:
``pallas`` (Pallas' Triton lowering) and ``triton`` (the Triton templates through jax-triton).

The truth is the ``reference`` backend (dense, float32) on the same bfloat16-rounded inputs
cast to float32; a backend may be off by ``FUDGE`` times the error of the reference run on
the bfloat16 inputs plus ``RTOL`` of the truth's largest magnitude (tests/checks.py, as the
CPU suite). Compared: out, lse, dq, dk, dv and the gradient of every array the score_mod
captures, of the loss ``<out, dO> + 0.1 * sum(finite lse)``. Dropout needs no dense mask of
its own: the keep mask is a hash of (key, b, h, q, kv), which the reference backend
evaluates densely from the same key.

The reference is computed once per (case, shape) and process, and each of its backends is
compared with it. Its memory is a few (B, Hq, Sq, Skv) float32 arrays (the CPU compiler's
estimate: 4.4 of them, 7.3 with the relative bias's gather and scatter): about 18-29 GiB at
S=8192, B=1, Hq=16, which is why that shape has B=1, why the shards, which run in parallel
(one GPU, several compiling processes), run their ragged cases first, and why gpu_check.sh
runs no more of them at once than the GPU's memory holds (~30 GiB each). gpu_check.sh gives
each backend its own processes (``--backends`` one at a time; the reference is computed in
each), so that a backend that hangs takes none of the others' results with it.

A case a backend refuses (for triton, where jax-triton does not import) is "unsupported",
with the reason, and counts as not passed. Each result appends one JSON line to ``--out``
as soon as it exists, so a run that is cut still reports.

``--interpret`` runs the same kernels in Pallas' and Triton's interpreters (to rehearse the
script on CPU); ``--rehearsal`` is ``--interpret`` with tiny shapes in float16 (Triton's
interpreter computes bfloat16 dot products wrong, and the triton backend refuses them there).
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
import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "tests"))
sys.path.insert(0, _ROOT)

from checks import FUDGE, RTOL, _err, _scale  # noqa: E402  (the CPU suite's tolerances, without pytest)

import flexjax  # noqa: E402
from benchmarks.gpu_smoke import hang_if_injected  # noqa: E402  (FLEXJAX_GPU_INJECT_HANG, a test hook)
from flexjax import masks, mods  # noqa: E402

CASES = ("causal", "alibi", "relative_bias", "sliding_window", "documents", "dropout")
BACKENDS = ("mosaic_gpu", "pallas", "triton")
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}
WINDOW = 1024
DROPOUT = 0.1
# The Triton lowering is flexjax's GPU path; JAX 0.11 warns that it is deprecated.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

DEFAULTS = {"shapes": "2:1999x2011,1:8192", "heads": "16,4", "head_dim": 128, "dtype": "bfloat16", "block": 128,
            "window": WINDOW}
# Tiny shapes in the interpreters (a few seconds a case on 2 CPU cores): one ragged, one whole block.
REHEARSAL = {"shapes": "2:61x75,1:128", "heads": "4,2", "head_dim": 32, "dtype": "float16", "block": 32,
             "window": 40, "interpret": True}


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """"B:Sq[xSkv],..." as [(B, Sq, Skv)].

    Raises:
      SystemExit: a malformed or non-positive entry, naming it.
    """
    shapes = []
    for item in text.split(","):
        try:
            b, _, lengths = item.partition(":")
            sq, _, skv = lengths.partition("x")
            shape = (int(b), int(sq), int(skv or sq))
        except ValueError:
            raise SystemExit(f"--shapes entries are B:Sq or B:SqxSkv, got {item!r}") from None
        if min(shape) < 1:
            raise SystemExit(f"--shapes entries must be positive, got {item!r}")
        shapes.append(shape)
    return shapes


def _doc_ids(B: int, S: int, seed: int) -> jax.Array:
    """(B, S) segment ids of 3-6 documents per row with ragged, row-dependent boundaries."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(B):
        cuts = np.sort(rng.choice(np.arange(1, S), size=min(S - 1, int(rng.integers(2, 6))), replace=False))
        rows.append(np.searchsorted(cuts, np.arange(S), side="right"))
    return jnp.asarray(np.stack(rows), jnp.int32)


def case_call(name: str, B: int, Sq: int, Skv: int, Hq: int, block: int, window: int):
    """(block_mask, params, kwargs, score_mod(params) or None) of case ``name``.

    ``params`` are the float arrays the score_mod captures (their gradients are compared);
    ``kwargs`` extra flex_attention arguments (dropout).
    """
    params, kwargs, score = {}, {}, None
    mask = masks.causal
    uses_b = False
    if name == "alibi":
        score = lambda p: mods.alibi(Hq)
    elif name == "relative_bias":
        # Over the full mask (bidirectional, as an encoder's): the timed "full" variant's tiles.
        mask = None
        params = {"table": 0.3 * jax.random.normal(jax.random.key(7), (Hq, 2 * max(Sq, Skv) - 1), jnp.float32)}
        score = lambda p: mods.relative_bias(p["table"])
    elif name == "sliding_window":
        mask = masks.sliding_window(window)
    elif name == "documents":
        ids = _doc_ids(B, max(Sq, Skv), seed=Sq)
        mask = flexjax.and_masks(masks.causal, masks.document(ids[:, :Sq], ids[:, :Skv]))
        uses_b = B > 1
    elif name == "dropout":
        kwargs = {"dropout_rate": DROPOUT, "dropout_rng": jax.random.key(11)}
    elif name != "causal":
        raise ValueError(f"unknown case {name!r}; choose from {CASES}")
    bm = flexjax.create_block_mask(mask, B if uses_b else None, None, Sq, Skv, block_size=block)
    return bm, params, kwargs, score


def inputs(B, Sq, Skv, Hq, Hkv, D, dtype, seed=0):
    """q, k, v, dO drawn in float32 and rounded to ``dtype``."""
    ks = jax.random.split(jax.random.key(seed), 4)
    shapes = ((B, Sq, Hq, D), (B, Skv, Hkv, D), (B, Skv, Hkv, D), (B, Sq, Hq, D))
    return tuple(jax.random.normal(kk, s, jnp.float32).astype(dtype) for kk, s in zip(ks, shapes))


def results(bm, params, kwargs, score, q, k, v, do, **options) -> dict[str, np.ndarray]:
    """{"out", "lse", "dq", "dk", "dv", "d<param>"...} of one backend, on the host.

    The loss is ``<out, dO> + 0.1 * sum(finite lse)``, so the lse's own gradient path is
    exercised too.
    """

    def loss(q, k, v, params):
        out, lse = flexjax.flex_attention(q, k, v, score(params) if score else None, bm, return_lse=True,
                                          **kwargs, **options)
        total = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))
        total = total + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
        return total, (out, lse)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    (_, (out, lse)), (dq, dk, dv, dparams) = grad(q, k, v, params)
    named = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv, **{f"d{n}": g for n, g in dparams.items()}}
    return {n: np.asarray(jnp.asarray(x, jnp.float32)) for n, x in named.items()}


def compare(got: dict, truth: dict, ref: dict, dtype) -> dict[str, dict]:
    """Per output: the error against the truth, the tolerance and whether it holds (tests/checks.py's rule)."""
    rtol = RTOL[dtype]
    table = {}
    for name, t in truth.items():
        g = got[name]
        if g.shape != t.shape:
            table[name] = {"ok": False, "error": f"shape {g.shape} != {t.shape}"}
            continue
        tol = FUDGE * _err(ref[name], t) + rtol * max(_scale(t), 1.0)
        err = _err(g, t)
        table[name] = {"err": float(f"{err:.4g}"), "tol": float(f"{tol:.4g}"), "scale": float(f"{_scale(t):.4g}"),
                       "ok": bool(err <= tol and not np.isnan(g).any())}
    return table


def _write(path: str, record: dict) -> None:
    # One write per line in append mode: lines from parallel shards do not interleave.
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def _classify(e: Exception) -> dict:
    if isinstance(e, NotImplementedError):
        # The backend refused (for triton: jax-triton missing, say); not a pass.
        return {"outcome": "unsupported", "error": str(e)[:2000]}
    return {"outcome": "error", "error": f"{type(e).__name__}: {str(e)[:2000]}",
            "traceback": traceback.format_exc()[-4000:]}


def run_unit(name, shape, args, dtype, options, out_path) -> int:
    """One (case, shape): the reference once, then each backend against it; returns the failures."""
    B, Sq, Skv = shape
    Hq, Hkv = args.heads
    base = {"kind": "test", "case": name, "B": B, "Sq": Sq, "Skv": Skv, "Hq": Hq, "Hkv": Hkv, "D": args.head_dim,
            "dtype": args.dtype, "shard": args.shard}
    start = time.perf_counter()
    try:
        bm, params, kwargs, score = case_call(name, B, Sq, Skv, Hq, args.block, args.window)
        q, k, v, do = inputs(B, Sq, Skv, Hq, Hkv, args.head_dim, dtype)
        f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
        truth = results(bm, params, kwargs, score, *f32, backend="reference")
        ref = truth if dtype == jnp.float32 else results(bm, params, kwargs, score, q, k, v, do,
                                                         backend="reference")
        reference = {"reference_s": round(time.perf_counter() - start, 2)}
    except Exception as e:  # noqa: BLE001  (an OOM of the dense reference is this case's result)
        failure = _classify(e)
        failure["error"] = "reference: " + failure["error"]
        for backend in args.backends:
            _write(out_path, {**base, "backend": backend, **failure, "wall_s": round(time.perf_counter() - start, 2)})
            print(f"{failure['outcome']:11s} {name} {shape} [{backend}] (the reference failed)", flush=True)
        return len(args.backends)
    failed = 0
    for backend in args.backends:
        t = time.perf_counter()
        record = {**base, "backend": backend, **reference}
        hang_if_injected(backend, "tests", out_path, case=name, shape=list(shape), shard=args.shard)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
            try:
                got = results(bm, params, kwargs, score, q, k, v, do, backend=backend, kernel_options=options)
                table = compare(got, truth, ref, dtype)
                bad = [n for n, row in table.items() if not row["ok"]]
                record.update(outcome="failed" if bad else "passed", errors=table)
                if bad:
                    record["error"] = "; ".join(
                        f"{n}: " + (table[n].get("error") or f"max error {table[n]['err']:.3g} > tolerance "
                                    f"{table[n]['tol']:.3g}") for n in bad)
            except Exception as e:  # noqa: BLE001  (a compile error is this case's result, not the run's end)
                record.update(_classify(e))
        record["wall_s"] = round(time.perf_counter() - t, 2)
        record["warnings"] = sorted({f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught})
        failed += record["outcome"] != "passed"
        _write(out_path, record)
        print(f"{record['outcome']:11s} {name} {shape} [{backend}] ({record['wall_s']} s)", flush=True)
    return failed


def _shard(units, spec: str):
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise SystemExit(f"--shard must be i/n, got {spec!r}") from None
    if not 0 <= i < n:
        raise SystemExit(f"--shard must be i/n with 0 <= i < n, got {spec!r}")
    return units[i::n]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON lines file to append to")
    p.add_argument("--shard", default="0/1", help="i/n: run every n-th (case, shape) from the i-th")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated kernel backends")
    p.add_argument("--shapes", help=f"B:Sq[xSkv],... (default {DEFAULTS['shapes']})")
    p.add_argument("--heads", help=f"query heads,kv heads (default {DEFAULTS['heads']})")
    p.add_argument("--head-dim", type=int)
    p.add_argument("--dtype", choices=sorted(DTYPES))
    p.add_argument("--block", type=int, help="the BlockMask's block (default 128, flexjax's)")
    p.add_argument("--window", type=int, help="the sliding window's keys back (default 1024)")
    p.add_argument("--interpret", action="store_true", default=None,
                   help="the backends' interpreters instead of the GPU")
    p.add_argument("--rehearsal", action="store_true",
                   help="tiny float16 shapes in the interpreters (to rehearse gpu_check.sh on CPU)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The arguments, with the defaults (or the rehearsal's) for those not given."""
    args = parser().parse_args(argv)
    for key, value in (REHEARSAL if args.rehearsal else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.interpret = bool(args.interpret)
    try:
        args.heads = tuple(int(x) for x in str(args.heads).split(","))
    except ValueError:
        raise SystemExit(f"--heads is 'query heads,kv heads', got {args.heads!r}") from None
    if len(args.heads) != 2 or args.heads[1] < 1 or args.heads[0] % args.heads[1]:
        raise SystemExit(f"--heads must be two positive ints, the first a multiple of the second, got {args.heads}")
    args.shapes = parse_shapes(args.shapes)
    args.cases = args.cases.split(",")
    args.backends = args.backends.split(",")
    for what, given, known in (("cases", args.cases, CASES), ("backends", args.backends, BACKENDS)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise SystemExit(f"unknown --{what} {unknown}; choose from {list(known)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.interpret and jax.default_backend() != "gpu":
        print(f"no GPU visible to JAX (backend {jax.default_backend()!r}); pass --interpret or --rehearsal to run "
              "on CPU")
        return 2
    dtype = DTYPES[args.dtype]
    # Shapes in the outer loop: every shard starts with the small shapes, so the dense S=8192
    # references of parallel shards overlap as little as they can.
    units = _shard([(c, s) for s in args.shapes for c in args.cases], args.shard)
    options = {"interpret": True} if args.interpret else {"target": "cuda"}
    _write(args.out, {"kind": "start", "shard": args.shard, "units": [[c, list(s)] for c, s in units],
                      "backends": args.backends, "heads": list(args.heads), "D": args.head_dim, "dtype": args.dtype,
                      "block": args.block, "window": args.window, "jax": jax.__version__,
                      "device": str(jax.devices()[0]), "kernel_options": options,
                      "tolerance": f"err <= {FUDGE} * err(reference on {args.dtype} inputs) + "
                                   f"{RTOL[dtype]} * max|truth| (truth: the float32 reference)"})
    failed = sum(run_unit(name, shape, args, dtype, options, args.out) for name, shape in units)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
