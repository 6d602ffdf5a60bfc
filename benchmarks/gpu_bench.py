"""GPU benchmark: flexjax ``pallas`` and ``triton`` vs cuDNN (``jax.nn.dot_product_attention``) and ``xla``.

    python benchmarks/gpu_bench.py --out bench.jsonl [--summary bench.json] [--deadline-s 240]

bfloat16, B=4, H=16, D=128, S in {4096, 16384}; no mask, causal, sliding window 1024,
causal documents, causal + ALiBi, causal + soft-cap; forward and forward+backward.
Effective TFLOP/s count only unmasked pairs (backward = 2.5x forward), as in
benchmarks/specs.py.

cuDNN gets each variant in the form it runs natively: causal and the sliding window as
flags; the documents (equal, so no segment ids are needed) as B*docs causal sequences of
S/docs, the same attention; ALiBi as a dense (1, H, S, S) bias where one fits in memory
(the comparison for "variants cuDNN cannot express"). Soft-cap has no cuDNN form. Masks,
biases and BlockMasks are arguments of the timed function, never compile-time constants:
a captured dense mask cost 25-59 s of compile each.

Each length's functions are traced in turn and compiled concurrently on a thread pool
(XLA compiles without the GIL); all of them finish compiling before the first is timed,
so no compile or autotuning runs beside a measurement. Each result is one JSON line in
``--out``, written as soon as it exists; after ``--deadline-s`` no new measurement starts.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flexjax  # noqa: E402
from benchmarks.specs import FWD_BWD_FACTOR, FWD_FLOPS_PER_PAIR_PER_DIM, document_ids, unmasked_pairs  # noqa: E402

WINDOW = 1024
DOCS = 8
# name -> (mask family for flop counting, score_mod)
VARIANTS = {"none": ("full", None), "causal": ("causal", None), "sliding_window": ("sliding_window", None),
            "documents": ("causal_documents", None), "alibi": ("causal", "alibi"),
            "soft_cap": ("causal", "soft_cap")}
MODES = ("fwd", "fwd+bwd")
IMPLS = ("pallas", "triton", "cudnn", "xla")
# Timed in this order within a length: the two kernel backends beside their cuDNN baseline
# for every variant first, the xla fallback last, so a deadline drops the least important
# measurements.
IMPL_GROUPS = (("pallas", "triton", "cudnn"), ("xla",))
# Dense cuDNN biases above this many bytes are skipped (they are the O(S^2) cost that
# flexjax avoids; at S=16384 a bf16 (1, H, S, S) bias is 8 GiB).
DENSE_LIMIT_BYTES = 4 << 30
# A length starts only with this much time to the deadline: its compiles all finish before
# its first measurement, so a length started later would compile and then time nothing.
MIN_LENGTH_S = 60
# Timed calls per measurement: enough for ~TARGET_S of timing, within [MIN_RUNS, MAX_RUNS].
TARGET_S, MIN_RUNS, MAX_RUNS = 1.0, 3, 10
# The Triton lowering is flexjax's GPU path (DESIGN.md); JAX 0.11 warns that it is deprecated.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)


def _flex(S, H, variant, backend):
    """(f(q, k, v, *extra), extra): flexjax with the BlockMask passed as an argument."""
    family, score = VARIANTS[variant]
    if family == "full":
        mask = None
    elif family == "causal":
        mask = flexjax.masks.causal
    elif family == "sliding_window":
        mask = flexjax.masks.sliding_window(WINDOW)
    else:
        mask = flexjax.and_masks(flexjax.masks.causal, flexjax.masks.document(document_ids(S, DOCS)))
    score_mod = {None: None, "alibi": flexjax.mods.alibi(H), "soft_cap": flexjax.mods.soft_cap(30.0)}[score]
    if mask is None:
        return (lambda q, k, v: flexjax.flex_attention(q, k, v, score_mod, backend=backend)), ()
    bm = flexjax.create_block_mask(mask, None, None, S, S)
    return (lambda q, k, v, bm: flexjax.flex_attention(q, k, v, score_mod, bm, backend=backend)), (bm,)


def _cudnn(S, H, variant):
    """(f(q, k, v, *extra), extra), or a string: why cuDNN has no form of the variant."""

    def attention(q, k, v, bias=None, **kw):
        return jax.nn.dot_product_attention(q, k, v, bias, implementation="cudnn", **kw)

    if variant == "none":
        return attention, ()
    if variant == "causal":
        return (lambda q, k, v: attention(q, k, v, is_causal=True)), ()
    if variant == "sliding_window":
        return (lambda q, k, v: attention(q, k, v, is_causal=True, local_window_size=(WINDOW, 0))), ()
    if variant == "documents":
        if S % DOCS:
            return f"documents of unequal length (S={S}, {DOCS} documents) need segment ids"

        def packed(q, k, v):
            B = q.shape[0]
            split = lambda x: x.reshape(B * DOCS, S // DOCS, *x.shape[2:])  # noqa: E731
            return attention(split(q), split(k), split(v), is_causal=True).reshape(q.shape)

        return packed, ()
    if variant == "alibi":
        if 2 * H * S * S > DENSE_LIMIT_BYTES:
            return "dense (1, H, S, S) ALiBi bias too large"
        slopes = jnp.asarray(flexjax.mods.alibi_slopes(H), jnp.float32)
        rel = (jnp.arange(S)[None, :] - jnp.arange(S)[:, None]).astype(jnp.float32)
        bias = (slopes[:, None, None] * rel)[None].astype(jnp.bfloat16)
        return (lambda q, k, v, bias: attention(q, k, v, bias, is_causal=True)), (bias,)
    return "cuDNN has no soft-cap; see causal for its causal time"


def _fwd_bwd(f):
    def loss(q, k, v, *extra):
        return jnp.sum(f(q, k, v, *extra).astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))


def _time(compiled, args) -> tuple[float, int]:
    """(median ms, runs) after one warm-up call; as many runs as fit in about TARGET_S."""
    jax.block_until_ready(compiled(*args))
    t = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times = [time.perf_counter() - t]
    runs = max(MIN_RUNS, min(MAX_RUNS, int(TARGET_S / max(times[0], 1e-6))))
    for _ in range(runs - 1):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times), len(times)


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}"


class _Log:
    """Appends one JSON line per record and keeps them for the summary."""

    def __init__(self, path: str):
        self.path, self.records = path, []
        open(path, "w").close()

    def __call__(self, **record):
        self.records.append(record)
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)


def _length(S, shape, variants, impls, log, pool, deadline):
    """Compiles every (variant, mode, impl) at length S concurrently, then times them in turn."""
    B, H, D = shape
    ks = jax.random.split(jax.random.key(S), 3)
    q, k, v = (jax.random.normal(kk, (B, S, H, D), jnp.bfloat16) for kk in ks)
    start = time.perf_counter()
    jobs = []
    for group in IMPL_GROUPS:
        for variant, mode, impl in ((v, m, i) for v in variants for m in MODES for i in group if i in impls):
            key = {"S": S, "variant": variant, "mode": mode, "impl": impl}
            if time.perf_counter() > deadline:
                log(kind="skip", **key, reason="deadline")
                continue
            try:
                built = _cudnn(S, H, variant) if impl == "cudnn" else _flex(S, H, variant, impl)
                if isinstance(built, str):
                    log(kind="skip", **key, reason=built)
                    continue
                f, extra = built
                args = (q, k, v, *extra)
                lowered = jax.jit(f if mode == "fwd" else _fwd_bwd(f)).lower(*args)
            except Exception as e:  # noqa: BLE001  (an unsupported variant is a result too)
                log(kind="skip", **key, reason=_error(e))
                continue

            def compile_(lowered=lowered):
                t = time.perf_counter()
                return lowered.compile(), time.perf_counter() - t

            jobs.append((key, args, pool.submit(compile_)))
    concurrent.futures.wait([job[2] for job in jobs])
    log(kind="compiled", S=S, functions=len(jobs), wall_s=round(time.perf_counter() - start, 1))
    family_pairs = {n: unmasked_pairs(VARIANTS[n][0], S, window=WINDOW, docs=DOCS) for n in variants}
    for key, args, future in jobs:
        try:
            compiled, compile_s = future.result()
        except Exception as e:  # noqa: BLE001
            log(kind="skip", **key, reason=_error(e))
            continue
        if time.perf_counter() > deadline:
            log(kind="skip", **key, reason="deadline")
            continue
        pairs = family_pairs[key["variant"]]
        flops = FWD_FLOPS_PER_PAIR_PER_DIM * pairs * D * H * B * (FWD_BWD_FACTOR if key["mode"] != "fwd" else 1.0)
        try:
            ms, runs = _time(compiled, args)
        except Exception as e:  # noqa: BLE001  (an OOM at run time is a result too)
            log(kind="skip", **key, reason=_error(e))
            continue
        log(kind="time", **key, ms=round(ms, 3), tflops=round(flops / (ms * 1e-3) / 1e12, 2), runs=runs,
            compile_s=round(compile_s, 1), density=round(pairs / S**2, 4))


def summary(records) -> dict:
    """The timings as rows of (S, variant, mode) with ms and TFLOP/s per impl."""
    rows = {}
    for r in records:
        if r["kind"] not in ("time", "skip"):
            continue
        row = rows.setdefault((r["S"], r["variant"], r["mode"]),
                              {"S": r["S"], "variant": r["variant"], "mode": r["mode"], "ms": {}, "tflops": {},
                               "skipped": {}})
        if r["kind"] == "time":
            row["ms"][r["impl"]], row["tflops"][r["impl"]] = r["ms"], r["tflops"]
        else:
            row["skipped"][r["impl"]] = r["reason"]
    for row in rows.values():
        for impl in ("pallas", "triton"):
            if "cudnn" in row["ms"] and impl in row["ms"]:
                row[f"{impl}_vs_cudnn"] = round(row["ms"]["cudnn"] / row["ms"][impl], 3)
    return {"rows": list(rows.values())}


def table(rows, impls) -> str:
    """One line per (S, variant, mode): ms per impl ("-" where skipped) and kernel/cuDNN speed."""
    lines = ["== ms (lower is better); <impl>_vs_cudnn = cuDNN ms / <impl> ms"]
    for row in rows:
        cells = " ".join(f"{i} {row['ms'][i]:9.3f}" if i in row["ms"] else f"{i} {'-':>9}" for i in impls)
        ratio = "".join(f"  {k} {row[k]:.2f}" for k in ("pallas_vs_cudnn", "triton_vs_cudnn") if k in row)
        lines.append(f"S={row['S']:<6d} {row['variant']:15s} {row['mode']:8s} {cells}{ratio}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON lines, one per result")
    parser.add_argument("--summary", help="also write the results as a table of rows (JSON) at the end")
    parser.add_argument("--deadline-s", type=float, default=240.0,
                        help="start no compile or measurement after this many seconds")
    parser.add_argument("--lengths", default="4096,16384")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--shape", default="4,16,128", help="B,H,D")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                        help="concurrent compiles")
    args = parser.parse_args()
    start = time.perf_counter()
    deadline = start + args.deadline_s
    shape = tuple(int(x) for x in args.shape.split(","))
    variants, impls = args.variants.split(","), args.impls.split(",")
    for name, given, known in (("variants", variants, VARIANTS), ("impls", impls, IMPLS)):
        if set(given) - set(known):
            parser.error(f"unknown --{name} {sorted(set(given) - set(known))}; choose from {list(known)}")
    log = _Log(args.out)
    B, H, D = shape
    log(kind="env", device=str(jax.devices()[0]), jax=jax.__version__, B=B, H=H, D=D, dtype="bfloat16",
        deadline_s=args.deadline_s)
    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
        for S in (int(x) for x in args.lengths.split(",")):
            if deadline - time.perf_counter() < MIN_LENGTH_S:
                log(kind="skip_length", S=S, reason=f"deadline: under {MIN_LENGTH_S} s left for this length")
                continue
            _length(S, shape, variants, impls, log, pool, deadline)
    log(kind="done", wall_s=round(time.perf_counter() - start, 1))
    rows = summary(log.records)
    print(table(rows["rows"], impls), flush=True)
    if args.summary:
        with open(args.summary, "w") as fh:
            json.dump(rows | {"device": str(jax.devices()[0]), "jax": jax.__version__, "B": B, "H": H, "D": D,
                              "dtype": "bfloat16"}, fh, indent=1)


if __name__ == "__main__":
    main()
