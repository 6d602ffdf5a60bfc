"""GPU timing for gpu_check.sh: each pass against cuDNN, the sparsity payoff, and a sweep of triton tiles.

    python benchmarks/gpu_bench.py --section timing|sparsity|sweep --out FILE.jsonl [--deadline-s 100]
        [--rehearsal]

Sections (gpu_check.sh runs each as its own step, in this order):

- ``timing``: bfloat16, B=4, Hq=16 over Hkv=4 (GQA), S=8192, D=128, causal and full; the
  forward alone and the backward alone, for ``triton``, ``pallas`` and cuDNN
  (``jax.nn.dot_product_attention(implementation="cudnn")``, causal as its flag).
- ``sparsity``: a causal sliding window of 1024 and 8 causal documents at S=32768 (the judged
  length, first, so that a cut step still has it) and 16384 (B=1): the kernels against cuDNN
  given the same mask as a dense (1, 1, S, S) boolean (which it turns into an additive bias
  and computes in full; its backward also computes that bias's gradient, which JAX always asks
  cuDNN for, so the forward is the cleaner comparison), and against cuDNN's own form where it has one (the window as
  ``local_window_size``; the equal documents as B*8 causal sequences of S/8, the same
  attention).
- ``sweep``: triton, causal, the timing shape: a handful of (block_q, block_kv, num_warps,
  num_stages) points through ``kernel_options``, forward and backward (``bwd_*``: both
  backward kernels; ``dkv_*``, where the backend takes it: the dK/dV kernel alone), beside
  the heuristics' choice; a point the backend or Triton rejects is "refused", with the reason.

The backward alone is the call of a ``jax.vjp`` closure (its residuals computed once,
outside the timing) on dO: what a training step runs after its forward. Each measurement is
``--calls`` (20) back-to-back calls per synchronisation, ``--reps`` times after one warm-up
call; ms is the median per call. TFLOP/s count only unmasked (q, kv) pairs (benchmarks/
specs.py): a forward is 4 * D flops per pair per (batch, query head), a backward alone 2.5
times that (5 matmuls against 2); the dense-mask baseline is credited with the same
unmasked pairs, so its TFLOP/s are effective ones. ``vs_<baseline>`` = baseline ms / ms:
above 1 is faster than the baseline.

The functions run in groups, most important first (timing: causal, then full). A group's
functions are lowered first, then compiled concurrently on a thread pool (XLA compiles
without the GIL), then timed one at a time, so no compile runs beside a measurement. A
backward compiles in a second wave, after its residuals exist. Each result is one JSON line
in ``--out``, written as soon as it exists; after ``--deadline-s`` no compile or measurement
starts (those left are "skip" lines with reason "deadline"); gpu_check.sh passes its own
deadline as ``--deadline-at`` (its clock), so JAX's import counts too.

``--baselines-from FILE`` takes the baselines' ms from an earlier run's JSON lines (the same
section, shape and baseline) instead of timing them again: gpu_check.sh times mosaic_gpu in
a process of its own after the other kernels' (so that a hang of its kernels loses none of
their figures), with the ratios against the cuDNN timings of their step. A baseline the file
lacks is timed as usual. Where ``FLEXJAX_GPU_INJECT_HANG`` names a kernel backend (a test
hook: benchmarks/gpu_smoke.py), the process sleeps where it would first build that backend's
function. ``--impls ''`` times the baselines alone.

``--rehearsal`` runs the section on CPU: tiny float32 shapes, the kernels in their
interpreters, and ``jax.nn.dot_product_attention(implementation="xla")`` in cuDNN's place
(labelled "xla": the ratios are then against XLA, not cuDNN).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flexjax  # noqa: E402
from benchmarks.gpu_smoke import hang_if_injected  # noqa: E402  (FLEXJAX_GPU_INJECT_HANG, a test hook)
from benchmarks.specs import FWD_BWD_FACTOR, FWD_FLOPS_PER_PAIR_PER_DIM, document_ids, unmasked_pairs  # noqa: E402

SECTIONS = ("timing", "sparsity", "sweep")
KERNELS = ("mosaic_gpu", "triton", "pallas")
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}
PASSES = ("fwd", "bwd")
# The backward alone: forward + backward is 3.5x a forward (specs.py), the forward 1x.
BWD_FACTOR = FWD_BWD_FACTOR - 1.0
FLOP_CONVENTION = (f"effective: only unmasked (q, kv) pairs count; forward {FWD_FLOPS_PER_PAIR_PER_DIM} * D flops "
                   f"per pair per (batch, query head) (QK^T and PV); backward alone {BWD_FACTOR}x the forward "
                   "(5 matmuls against 2; benchmarks/specs.py); the dense-mask baseline is credited with the same "
                   "unmasked pairs")
DOCS = 8
# variant -> mask family of specs.unmasked_pairs
FAMILIES = {"full": "full", "causal": "causal", "sliding_window": "sliding_window", "documents": "causal_documents"}
# (block_q, block_kv, num_warps, num_stages) tried by the sweep, beside the heuristics' own
# (sm_90, 16-bit, D=128, mods without a table gather: forward 128x64 / 8 warps / 3 stages, dQ
# 128x64 / 8 / 3, dK/dV 32x128 / 8 / 3; flexjax/backends/_tile_tables.py). Tiles must divide
# the BlockMask's block (128) or be multiples of it; 128x128 forward tiles at 3 stages need
# more than sm_90's 227 KiB of shared memory, so expect a refusal or a failed compile there.
FWD_POINTS = "128,64,8,3;128,128,8,2;128,128,8,3;128,64,4,3;128,64,8,4;64,64,4,3;128,32,8,3"
# bwd_* points set both backward kernels (a dK/dV option left unset follows them).
BWD_POINTS = "128,64,8,3;64,64,8,3;64,32,8,3;128,32,8,3;64,128,8,3;128,64,8,2;64,64,4,3"
# The dK/dV kernel alone (dQ keeps the heuristics'): a warpgroup MMA wants 64+ kv rows.
DKV_POINTS = "32,128,8,3;64,64,8,3;64,128,8,3;16,64,8,3;32,64,8,3"
# A measurement is cut to fewer repetitions when its warm-up says it would take longer than this.
MAX_MEASURE_S = 10.0

DEFAULTS = {"timing": {"lengths": "8192", "batch": 4},
            "sparsity": {"lengths": "32768,16384", "batch": 1, "reps": 3},  # the judged length first
            "sweep": {"lengths": "8192", "batch": 4}}
COMMON = {"heads": "16,4", "head_dim": 128, "dtype": "bfloat16", "block": 128, "window": 1024, "calls": 20,
          "reps": 5, "baseline": "cudnn", "fwd_points": FWD_POINTS, "bwd_points": BWD_POINTS,
          "dkv_points": DKV_POINTS}
# CPU rehearsal: a few seconds a measurement in the interpreters on 2 cores, in float32 (XLA:CPU
# has no float16 dot with float32 accumulation; Triton's interpreter computes bfloat16 dots
# wrong). 48 is not a divisor of the 128 block: that point exercises the refusal path.
REHEARSAL = {"heads": "4,2", "head_dim": 32, "dtype": "float32", "window": 40, "calls": 2, "reps": 2,
             "baseline": "xla", "interpret": True, "fwd_points": "64,64,4,2;48,64,4,2", "bwd_points": "32,64,4,2",
             "dkv_points": "64,32,4,2"}
REHEARSAL_SECTIONS = {"timing": {"lengths": "128", "batch": 1}, "sparsity": {"lengths": "256", "batch": 1},
                      "sweep": {"lengths": "128", "batch": 1}}
# The Triton lowering is flexjax's GPU path; JAX 0.11 warns that it is deprecated.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)


class Log:
    """Appends one JSON line per record (the file starts empty) and echoes it."""

    def __init__(self, path: str, **common):
        self.path, self.common, self.records = path, common, []
        open(path, "w").close()

    def __call__(self, **record):
        record = {**self.common, **record}
        self.records.append(record)
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:600]}"


def flops(variant: str, S: int, B: int, Hq: int, D: int, pass_: str, window: int) -> tuple[float, int]:
    """(effective flops of one call, unmasked pairs per (batch, head)) by specs.py's rules."""
    pairs = unmasked_pairs(FAMILIES[variant], S, window=window, docs=DOCS)
    fwd = FWD_FLOPS_PER_PAIR_PER_DIM * pairs * D * Hq * B
    return fwd * (BWD_FACTOR if pass_ == "bwd" else 1.0), pairs


def mask_mod(variant: str, S: int, window: int):
    """The variant's mask_mod, or None for full attention."""
    if variant == "full":
        return None
    if variant == "causal":
        return flexjax.masks.causal
    if variant == "sliding_window":
        return flexjax.masks.sliding_window(window)
    if variant == "documents":
        return flexjax.and_masks(flexjax.masks.causal, flexjax.masks.document(document_ids(S, DOCS)))
    raise ValueError(f"unknown variant {variant!r}; choose from {list(FAMILIES)}")


def flex_fn(impl: str, variant: str, S: int, window: int, block: int, options: dict):
    """(f(q, k, v, *extra), extra): flexjax with the BlockMask passed as an argument (not a constant)."""
    bm = flexjax.create_block_mask(mask_mod(variant, S, window), None, None, S, S, block_size=block)
    kw = {"backend": impl, "kernel_options": options or None}
    return (lambda q, k, v, bm: flexjax.flex_attention(q, k, v, None, bm, **kw)), (bm,)


def baseline_fn(impl: str, form: str, variant: str, S: int, window: int):
    """(f(q, k, v, *extra), extra) of ``jax.nn.dot_product_attention(implementation=impl)``, or a
    string: why it has no such form.

    ``form``: "native" (its own flags: none, ``is_causal``, ``local_window_size``, documents
    packed as B*DOCS sequences) or "dense_mask" (the flexjax mask_mod evaluated densely, as a
    jit argument: a captured dense mask would be a compile-time constant of S*S bytes).
    """

    def attention(q, k, v, mask=None, **kw):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=impl, **kw)

    if form == "dense_mask":
        dense = flexjax.create_mask(mask_mod(variant, S, window), 1, 1, S, S)
        return (lambda q, k, v, m: attention(q, k, v, m)), (dense,)
    if variant == "full":
        return attention, ()
    if variant == "causal":
        return (lambda q, k, v: attention(q, k, v, is_causal=True)), ()
    if variant == "sliding_window":
        return (lambda q, k, v: attention(q, k, v, is_causal=True, local_window_size=(window, 0))), ()
    if variant == "documents":
        if S % DOCS:
            return f"documents of unequal length (S={S}, {DOCS} documents) need segment ids"

        def packed(q, k, v):
            split = lambda x: x.reshape(x.shape[0] * DOCS, S // DOCS, *x.shape[2:])
            return attention(split(q), split(k), split(v), is_causal=True).reshape(q.shape)

        return packed, ()
    raise ValueError(f"unknown variant {variant!r}")


def time_calls(fn, args, calls: int, reps: int) -> dict:
    """Per-call ms of ``calls`` back-to-back calls per synchronisation: median and min over ``reps``.

    One warm-up call first. ``reps`` shrinks (to 1 at least) where the warm-up says the
    measurement would take over MAX_MEASURE_S.
    """
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    warm = time.perf_counter() - t
    reps = max(1, min(reps, int(MAX_MEASURE_S / max(warm * calls, 1e-9))))
    per_call = []
    for _ in range(reps):
        t = time.perf_counter()
        outs = [fn(*args) for _ in range(calls)]
        jax.block_until_ready(outs)
        per_call.append((time.perf_counter() - t) / calls)
        del outs
    return {"ms": round(1e3 * statistics.median(per_call), 4), "ms_min": round(1e3 * min(per_call), 4),
            "reps": reps, "calls_per_sync": calls}


class Job:
    """One timed function: its key, how to build it, and (once built) its compiled form."""

    def __init__(self, key: dict, build):
        self.key, self.build = key, build
        self.args = self.compiled = self.future = self.reason = None
        self.compile_s = 0.0
        self.not_applicable = False  # the baseline has no form of this variant


def _lower_and_submit(job: Job, pool, fn, args):
    lowered = jax.jit(fn).lower(*args)

    def compile_(lowered=lowered):
        t = time.perf_counter()
        return lowered.compile(), time.perf_counter() - t

    job.args = args
    job.future = pool.submit(compile_)


def run_jobs(jobs: list[Job], args, log, pool, deadline: float, q, k, v, do):
    """Lowers every job, compiles them concurrently, then times them in order.

    A forward job builds ``(f, extra)``; its backward twin (``pass`` "bwd") first compiles the
    residuals of ``jax.vjp`` (first wave), runs them, then compiles ``vjp(dO)`` (second wave).
    A failure at any stage is that job's result: a "skip" line (for the sweep, "refused"); a job
    the deadline leaves out is a "skip" with reason "deadline".
    """
    failed_kind = "refused" if args.section == "sweep" else "skip"
    # First wave: forwards and the backwards' residual functions.
    for job in jobs:
        if time.perf_counter() > deadline:
            job.reason = "deadline"
            continue
        if job.key.get("role") != "baseline":
            hang_if_injected(job.key["impl"], args.section, args.out, variant=job.key["variant"],
                             **{"pass": job.key["pass"]})
        try:
            built = job.build()
            if isinstance(built, str):
                job.reason, job.not_applicable = built, True
                continue
            f, extra = built
            if job.key["pass"] == "fwd":
                _lower_and_submit(job, pool, f, (q, k, v, *extra))
            else:
                res = lambda q, k, v, *extra, f=f: jax.vjp(lambda q, k, v: f(q, k, v, *extra), q, k, v)[1]
                _lower_and_submit(job, pool, res, (q, k, v, *extra))
        except Exception as e:  # noqa: BLE001  (a rejected option or variant is a result too)
            job.reason = _error(e)
    concurrent.futures.wait([j.future for j in jobs if j.future is not None])
    # Second wave: each backward's vjp(dO), on its residuals.
    bwd = lambda vjp, do: vjp(do)
    for job in jobs:
        if job.future is None:
            continue
        try:
            job.compiled, job.compile_s = job.future.result()
            job.future = None
            if job.key["pass"] == "fwd":
                continue
            residuals, job.compiled = job.compiled, None
            if time.perf_counter() > deadline:
                job.reason = "deadline"
            else:
                vjp = residuals(*job.args)
                jax.block_until_ready(vjp)
                _lower_and_submit(job, pool, bwd, (vjp, do))
        except Exception as e:  # noqa: BLE001
            job.reason = _error(e)
            job.future = None
    concurrent.futures.wait([j.future for j in jobs if j.future is not None])
    for job in jobs:
        if job.future is not None:
            try:
                compiled, compile_s = job.future.result()
                job.compiled, job.compile_s = compiled, job.compile_s + compile_s
            except Exception as e:  # noqa: BLE001
                job.reason = _error(e)
    # Timing, one at a time, in the jobs' order (each baseline before the kernels it is compared with).
    baselines: dict[tuple, dict] = {where: dict(ms) for where, ms in args.known_baselines.items()}
    for job in jobs:
        key = job.key
        if job.not_applicable:
            log(kind="n/a", **key, reason=job.reason)
            continue
        if job.compiled is None:
            log(kind="skip" if job.reason == "deadline" else failed_kind, **key, reason=job.reason or "not compiled")
            continue
        if time.perf_counter() > deadline:
            log(kind="skip", **key, reason="deadline")
            continue
        try:
            measured = time_calls(job.compiled, job.args, args.calls, args.reps)
        except Exception as e:  # noqa: BLE001  (an out-of-memory at run time is a result too)
            log(kind=failed_kind, **key, reason=_error(e))
            continue
        fl, pairs = flops(key["variant"], key["S"], key["B"], key["Hq"], key["D"], key["pass"], args.window)
        record = {**key, **measured, "tflops": round(fl / (measured["ms"] * 1e-3) / 1e12, 3), "pairs": pairs,
                  "density": round(pairs / key["S"] ** 2, 5), "compile_s": round(job.compile_s, 1)}
        where = (key["S"], key["variant"], key["pass"])
        if key.get("role") == "baseline":
            baselines.setdefault(where, {})[key["impl"]] = measured["ms"]
        else:
            for name, ms in baselines.get(where, {}).items():
                record[f"vs_{name}"] = round(ms / measured["ms"], 3)
                if name in args.known_baselines.get(where, {}):
                    record.setdefault("baselines_from", {})[name] = os.path.basename(args.baselines_from)
        log(kind="time", **record)
        job.compiled = job.args = None  # frees the executable and its residuals before the next measurement


def _inputs(B, S, Hq, Hkv, D, dtype):
    ks = jax.random.split(jax.random.key(S), 4)
    shapes = ((B, S, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D), (B, S, Hq, D))
    return tuple(jax.random.normal(kk, s, jnp.float32).astype(dtype) for kk, s in zip(ks, shapes))


def section_jobs(args, S: int) -> list[list[Job]]:
    """The section's jobs at length S, in groups compiled and timed in turn, most important first
    (timing: causal, then full; sparsity: the window, then documents; sweep: forward, then
    backward), so that a step cut short has its first groups' results. In a group, each
    (variant, pass) has its baselines first."""
    B, (Hq, Hkv), D = args.batch, args.heads, args.head_dim
    common = {"section": args.section, "S": S, "B": B, "Hq": Hq, "Hkv": Hkv, "D": D, "dtype": args.dtype}
    base_options = {"interpret": True} if args.interpret else {}
    groups = []

    def flex(impl, variant, options):
        return lambda: flex_fn(impl, variant, S, args.window, args.block, options)

    def base(form, variant):
        return lambda: baseline_fn(args.baseline, form, variant, S, args.window)

    if args.section in ("timing", "sparsity"):
        variants = ("causal", "full") if args.section == "timing" else ("sliding_window", "documents")
        forms = ("native",) if args.section == "timing" else ("dense_mask", "native")
        for variant in variants:
            jobs = []
            groups.append(jobs)
            for pass_ in PASSES:
                for form in forms:
                    name = args.baseline if args.section == "timing" else f"{args.baseline}_{form}"
                    if name in args.known_baselines.get((S, variant, pass_), {}):
                        continue  # timed by an earlier process (--baselines-from)
                    jobs.append(Job({**common, "variant": variant, "pass": pass_, "impl": name, "role": "baseline"},
                                    base(form, variant)))
                for impl in args.impls:
                    jobs.append(Job({**common, "variant": variant, "pass": pass_, "impl": impl, "role": "kernel"},
                                    flex(impl, variant, base_options)))
        return groups
    # sweep: triton, causal, the heuristics' choice then each point. "bwd" points set both
    # backward kernels (bwd_*); "dkv" points the dK/dV kernel alone, where the backend takes
    # dkv_* options (the dQ kernel keeps its default).
    takes_dkv = "dkv_block_q" in flexjax.backends.kernel_option_names("triton")
    heuristics = _heuristics(args)
    for group, pass_, prefix, points in (("fwd", "fwd", "", args.fwd_points), ("bwd", "bwd", "bwd_", args.bwd_points),
                                         ("dkv", "bwd", "dkv_", args.dkv_points)):
        jobs = []
        groups.append(jobs)
        key = {**common, "variant": "causal", "pass": pass_, "impl": "triton", "kernels": group}
        if group == "dkv" and not takes_dkv:
            jobs += [Job({**key, "point": list(p)}, lambda: "the triton backend takes no dkv_* kernel_options")
                     for p in points]
            continue
        if group != "dkv":
            jobs.append(Job({**key, "point": "heuristics", "heuristics_sm90": heuristics},
                            flex("triton", "causal", base_options)))
        for point in points:
            options = {prefix + name: value for name, value in zip(("block_q", "block_kv", "num_warps", "num_stages"),
                                                                   point)}
            jobs.append(Job({**key, "point": list(point), "kernel_options": options},
                            flex("triton", "causal", {**base_options, **options})))
    return groups


def _heuristics(args) -> dict | None:
    """The triton backend's own (block_q, block_kv, num_warps, num_stages) per kernel on sm_90 for
    the sweep's shape (causal: no captured array), as its heuristics table gives them; None
    where that cannot be read. Informational: the backend's options change as it is tuned."""
    try:
        from flexjax.backends import triton as triton_backend

        o = triton_backend.heuristics(90, (args.block, args.block), args.head_dim, DTYPES[args.dtype], gathers=False)
        fields = {"fwd": "", "dq": "bwd_", "dkv": "dkv_"}
        return {kernel: [getattr(o, prefix + name) for name in ("block_q", "block_kv", "num_warps", "num_stages")]
                for kernel, prefix in fields.items()}
    except Exception:  # noqa: BLE001  (informational only)
        return None


def parse_points(text: str, flag: str) -> list[tuple[int, int, int, int]]:
    """"bq,bkv,warps,stages;..." as tuples of four positive ints.

    Raises:
      SystemExit: naming the malformed point.
    """
    points = []
    for item in filter(None, text.split(";")):
        try:
            point = tuple(int(x) for x in item.split(","))
        except ValueError:
            point = ()
        if len(point) != 4 or min(point) < 1:
            raise SystemExit(f"{flag} points are 'block_q,block_kv,num_warps,num_stages' separated by ';', "
                             f"got {item!r}")
        points.append(point)
    return points


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--section", required=True, choices=SECTIONS)
    p.add_argument("--out", required=True, help="JSON lines, one per result (the file is emptied first)")
    p.add_argument("--deadline-s", type=float, default=240.0,
                   help="start no compile or measurement after this many seconds")
    p.add_argument("--deadline-at", type=float, help="nor after this time (seconds since the epoch, as date +%%s)")
    p.add_argument("--lengths", help="comma-separated S (timing and sweep 8192; sparsity 32768,16384)")
    p.add_argument("--batch", type=int, help="B (timing and sweep 4; sparsity 1)")
    p.add_argument("--heads", help="query heads,kv heads (default 16,4)")
    p.add_argument("--head-dim", type=int, help="D (default 128)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default bfloat16")
    p.add_argument("--block", type=int, help="the BlockMask's block (default 128, flexjax's)")
    p.add_argument("--window", type=int, help="the sliding window's keys back (default 1024)")
    p.add_argument("--impls", default=",".join(KERNELS),
                   help="flexjax kernel backends (timing, sparsity); '' for the baselines alone")
    p.add_argument("--baselines-from", help="JSON lines of an earlier run of the section whose baseline timings "
                                            "to reuse (those it has) instead of timing them again")
    p.add_argument("--baseline", choices=("cudnn", "xla"), help="jax.nn.dot_product_attention's implementation")
    p.add_argument("--calls", type=int, help="back-to-back calls per synchronisation (default 20)")
    p.add_argument("--reps", type=int, help="synchronised repetitions, median reported (default 5; sparsity 3)")
    p.add_argument("--fwd-points", help=f"sweep: 'bq,bkv,warps,stages;...' (default {FWD_POINTS})")
    p.add_argument("--bwd-points", help=f"sweep: both backward kernels', as --fwd-points (default {BWD_POINTS})")
    p.add_argument("--dkv-points", help=f"sweep: the dK/dV kernel's alone (default {DKV_POINTS})")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="concurrent compiles")
    p.add_argument("--interpret", action="store_true", default=None, help="the kernels' interpreters (CPU)")
    p.add_argument("--rehearsal", action="store_true",
                   help="tiny float16 shapes, interpreters, XLA for cuDNN (to rehearse gpu_check.sh on CPU)")
    args = p.parse_args(argv)
    defaults = {**COMMON, **DEFAULTS[args.section]}
    if args.rehearsal:
        defaults.update(REHEARSAL, **REHEARSAL_SECTIONS[args.section])
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.interpret = bool(args.interpret)
    try:
        args.heads = tuple(int(x) for x in str(args.heads).split(","))
        args.lengths = [int(x) for x in str(args.lengths).split(",")]
    except ValueError:
        p.error(f"--heads and --lengths take comma-separated ints, got {args.heads!r}, {args.lengths!r}")
    if len(args.heads) != 2 or args.heads[1] < 1 or args.heads[0] % args.heads[1]:
        p.error(f"--heads must be two positive ints, the first a multiple of the second, got {args.heads}")
    for name in ("batch", "head_dim", "block", "window", "calls", "reps", "workers"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.impls = [impl for impl in args.impls.split(",") if impl]
    if set(args.impls) - set(KERNELS):
        p.error(f"unknown --impls {sorted(set(args.impls) - set(KERNELS))}; choose from {list(KERNELS)}")
    args.fwd_points = parse_points(args.fwd_points, "--fwd-points")
    args.bwd_points = parse_points(args.bwd_points, "--bwd-points")
    args.dkv_points = parse_points(args.dkv_points, "--dkv-points")
    args.known_baselines = known_baselines(args)
    return args


def known_baselines(args) -> dict[tuple, dict[str, float]]:
    """{(S, variant, pass): {baseline name: ms}} of ``--baselines-from``'s timings at this
    section's shapes ({} without it, or where the file is missing or has none)."""
    known: dict[tuple, dict[str, float]] = {}
    if not args.baselines_from or not os.path.exists(args.baselines_from):
        return known
    shape = {"section": args.section, "B": args.batch, "Hq": args.heads[0], "Hkv": args.heads[1],
             "D": args.head_dim, "dtype": args.dtype}
    with open(args.baselines_from) as fh:
        for line in fh:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:  # a torn last line of a cut run
                continue
            if (r.get("kind") == "time" and r.get("role") == "baseline" and r.get("S") in args.lengths
                    and all(r.get(k) == v for k, v in shape.items())):
                known.setdefault((r["S"], r["variant"], r["pass"]), {})[r["impl"]] = r["ms"]
    return known


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.interpret and jax.default_backend() != "gpu":
        print(f"no GPU visible to JAX (backend {jax.default_backend()!r}); pass --rehearsal to run on CPU")
        return 2
    start = time.perf_counter()
    deadline = start + args.deadline_s
    if args.deadline_at is not None:  # the caller's clock: JAX's import (seconds on a GPU machine) counts too
        deadline = min(deadline, start + args.deadline_at - time.time())
    log = Log(args.out)
    baseline = args.baseline if args.baseline == "cudnn" else (
        f"{args.baseline} (jax.nn.dot_product_attention(implementation={args.baseline!r}), a CPU rehearsal's "
        "stand-in for cuDNN)")
    log(kind="env", section=args.section, device=str(jax.devices()[0]), jax=jax.__version__, dtype=args.dtype,
        B=args.batch, Hq=args.heads[0], Hkv=args.heads[1], D=args.head_dim, lengths=args.lengths, block=args.block,
        window=args.window, docs=DOCS, baseline=baseline, calls_per_sync=args.calls, reps=args.reps,
        flops=FLOP_CONVENTION, deadline_s=args.deadline_s, interpret=args.interpret, impls=args.impls,
        baselines_from=args.baselines_from and os.path.basename(args.baselines_from),
        baselines_reused=sum(len(ms) for ms in args.known_baselines.values()))
    dtype = DTYPES[args.dtype]
    try:
        with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
            for S in args.lengths:
                q, k, v, do = _inputs(args.batch, S, *args.heads, args.head_dim, dtype)
                for group in section_jobs(args, S):
                    run_jobs(group, args, log, pool, deadline, q, k, v, do)
                del q, k, v, do
    except Exception as e:  # noqa: BLE001  (what was measured is already written; say why the rest is not)
        log(kind="error", reason=_error(e), traceback=traceback.format_exc()[-4000:])
        return 1
    log(kind="done", wall_s=round(time.perf_counter() - start, 1))
    cut = any(r.get("reason") == "deadline" for r in log.records)
    # Kernel or baseline measurements that did not happen make the step fail; a sweep point
    # Triton or the backend rejects is a result of the sweep, not a failure.
    missing = [r for r in log.records if r["kind"] == "skip"]
    # The sweep's reference points (the heuristics' own tiles) must be timed.
    unswept = [r for r in log.records if r["kind"] == "refused" and r.get("point") == "heuristics"]
    return 1 if cut or missing or unswept else 0


if __name__ == "__main__":
    sys.exit(main())
