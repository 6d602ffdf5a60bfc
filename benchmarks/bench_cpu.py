"""JAX side of the CPU benchmark: flexjax vs jax.nn.dot_product_attention vs dense jnp.

Each spec of ``benchmarks/specs.py`` is timed jitted, after warm-up, as a median of
several runs, and written as one JSON line. Usually driven by ``python -m benchmarks.run``
(which alternates it with the PyTorch side); on its own:

    python -m benchmarks.bench_cpu --suite ci [--out results.jsonl]
    python -m benchmarks.bench_cpu --memory memory_causal_fwdbwd_S32768   # fresh process
"""

from __future__ import annotations

import os
import platform
import resource
import sys
import time

if __package__ in (None, ""):  # run as a script: `python benchmarks/bench_cpu.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

import flexjax
from benchmarks import specs as S
from flexjax import masks, mods
from flexjax.backends import platform_backends

# A worker's protocol lines on stdout start with this; everything else is ignored.
# Dense baselines hold a few (B, H, S, S) float32 arrays; skip them past this many GiB
# (the machine is shared; S=8192, H=8 forward needs ~6 GiB).
MAX_DENSE_GIB = float(os.environ.get("FLEXJAX_BENCH_MAX_DENSE_GIB", "8"))


def mask_mod(spec):
    """The flexjax mask_mod of a spec's mask family (None for full attention)."""
    if spec.mask == "full":
        return None
    if spec.mask == "causal":
        return masks.causal
    if spec.mask == "sliding_window":
        return masks.sliding_window(spec.window)
    if spec.mask == "causal_documents":
        return flexjax.and_masks(masks.causal, masks.document(jnp.asarray(S.document_ids(spec.S, spec.docs))))
    raise ValueError(f"unknown mask family {spec.mask!r}")


def score_mod(spec):
    if spec.score_mod is None:
        return None
    if spec.score_mod == "alibi":
        return mods.alibi(spec.H)
    raise ValueError(f"unknown score_mod {spec.score_mod!r}")


def dense_attention(q, k, v, mask, score_mod=None):
    """softmax(score_mod(q·kᵀ/sqrt(d)) masked) v over the whole (B, H, S, S) score matrix."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.float32(np.sqrt(q.shape[-1]))
    if score_mod is not None:
        s = score_mod_dense(score_mod, s)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v)


def _inputs(spec, key=0):
    ks = jax.random.split(jax.random.key(key), 4)
    shape = (spec.B, spec.S, spec.H, spec.D)
    q, k, v, do = (jax.random.normal(x, shape, jnp.dtype(spec.dtype)) for x in ks)
    return q, k, v, do


def _with_grad(attn, mode):
    """``attn(q, k, v, *rest)`` for "fwd"; its forward + backward (a vjp with dO) for "fwd+bwd"."""
    if mode == "fwd":
        return lambda q, k, v, do, *rest: attn(q, k, v, *rest)

    def fwd_bwd(q, k, v, do, *rest):
        out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, *rest), q, k, v)
        return out, vjp(do)

    return fwd_bwd


def _time_impl(spec, impl: str, fn, args) -> tuple[dict, object]:
    """Compiles ``fn`` ahead of time (recording the compile time), then times it.

    Returns the record fields and one result (to check flexjax against the dense one).
    """
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    result = jax.block_until_ready(compiled(*args))
    m = S.measure(lambda: compiled(*args), jax.block_until_ready, warmup=0)
    return {"impl": impl, "status": "ok", "compile_s": round(compile_s, 3), **m,
            "eff_gflops": spec.flops / (m["median_ms"] * 1e-3) / 1e9}, result


# flexjax must agree with the dense baseline before its time means anything: float32
# online vs dense softmax differ by ~1e-6 on O(1) outputs; gradients sum over S keys.
_CHECK_TOL = 1e-3


def _max_rel_err(result, want) -> float:
    """Largest |a - b| / max|b| over the leaves (output, and dq, dk, dv for fwd+bwd)."""
    errs = [float(jnp.abs(a - b).max() / jnp.maximum(jnp.abs(b).max(), 1e-30))
            for a, b in zip(jax.tree.leaves(result), jax.tree.leaves(want), strict=True)]
    return max(errs)


def _record(spec, **fields) -> dict:
    return {"kind": "attention", "side": "jax", "spec": spec.name, "label": spec.label, "mode": spec.mode,
            "S": spec.S, "B": spec.B, "H": spec.H, "D": spec.D, "dtype": spec.dtype, "mask": spec.mask,
            "score_mod": spec.score_mod, "pairs": spec.pairs, "density": spec.pairs / spec.S**2,
            "flops": spec.flops} | fields


def run_attention(spec) -> list[dict]:
    """Records for flexjax, jax.nn.dot_product_attention and dense jnp on ``spec``."""
    q, k, v, do = _inputs(spec)
    mm, sm = mask_mod(spec), score_mod(spec)
    out = []

    bm = flexjax.create_block_mask(mm, None, None, spec.S, spec.S)
    backend = platform_backends()[0]
    flex = _with_grad(lambda q, k, v, bm: flexjax.flex_attention(q, k, v, sm, bm), spec.mode)
    fields, flex_result = _time_impl(spec, "flexjax", flex, (q, k, v, do, bm))
    out.append(_record(spec, **fields, impl_detail=f"backend={backend}, block_size={bm.block_size}, jit"))

    dense_arrays = 3 if spec.mode == "fwd" else 6
    need = S.dense_bytes(spec, dense_arrays) / 2**30
    if need > MAX_DENSE_GIB:
        note = f"skipped: needs ~{need:.1f} GiB of dense scores (> FLEXJAX_BENCH_MAX_DENSE_GIB={MAX_DENSE_GIB:g})"
        for impl in ("jax.nn.dot_product_attention", "dense_jnp"):
            out.append(_record(spec, impl=impl, status="skipped", note=note))
        return out

    dense_mask = None if mm is None else flexjax.create_mask(mm, 1, 1, spec.S, spec.S)
    if spec.mask == "causal" and sm is None:
        dpa = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")  # noqa: E731
        dpa_args, detail = (q, k, v, do), "is_causal=True, implementation='xla'"
    else:
        bias = None
        if sm is not None:
            # dot_product_attention takes an additive bias: the score_mod applied to zeros.
            zeros = jnp.zeros((spec.B, spec.H, spec.S, spec.S), jnp.float32)
            bias = score_mod_dense(sm, zeros)

        def dpa(q, k, v, mask, bias):
            return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, implementation="xla")

        dpa_args, detail = (q, k, v, do, dense_mask, bias), "dense mask/bias, implementation='xla'"
    fields, _ = _time_impl(spec, "jax.nn.dot_product_attention", _with_grad(dpa, spec.mode), dpa_args)
    out.append(_record(spec, **fields, impl_detail=detail))
    dense = _with_grad(lambda q, k, v, mask: dense_attention(q, k, v, mask, sm), spec.mode)
    fields, dense_result = _time_impl(spec, "dense_jnp", dense, (q, k, v, do, dense_mask))
    out.append(_record(spec, **fields, impl_detail="einsum + where(mask) + softmax, jit"))
    err = _max_rel_err(flex_result, dense_result)
    out[0]["max_rel_err_vs_dense"] = err
    if not err < _CHECK_TOL:
        out[0]["status"] = "wrong"
        out[0]["note"] = f"WRONG: max relative error vs dense_jnp {err:.2e} > {_CHECK_TOL:g}"
    return out


def score_mod_dense(sm, s):
    """``sm`` applied to a dense (B, H, Sq, Skv) score array."""
    B, H, Sq, Skv = s.shape
    b = jnp.arange(B, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(H, dtype=jnp.int32)[None, :, None, None]
    return sm(s, b, h, jnp.arange(Sq, dtype=jnp.int32)[:, None], jnp.arange(Skv, dtype=jnp.int32)[None, :])


def run_build(spec) -> list[dict]:
    """Time of create_block_mask: the first call (tracing + compiling) and cached calls."""
    mm = mask_mod(spec)

    def build():
        return flexjax.create_block_mask(mm, None, None, spec.S, spec.S, block_size=spec.block)

    jax.clear_caches()  # the first call must trace and compile, even if an earlier spec built this mask
    t0 = time.perf_counter()
    bm = jax.block_until_ready(build())
    first_ms = (time.perf_counter() - t0) * 1e3
    m = S.measure(build, jax.block_until_ready)
    return [{"kind": "build", "side": "jax", "impl": "flexjax.create_block_mask", "spec": spec.name,
             "S": spec.S, "mask": spec.mask, "window": spec.window, "docs": spec.docs, "block": spec.block,
             "status": "ok", "first_ms": first_ms, **m, "sparsity": bm.sparsity()}]


def run_memory(spec) -> list[dict]:
    """One flexjax call in this (fresh) process; reports peak RSS (ru_maxrss)."""
    q, k, v, do = _inputs(spec)
    rss_inputs = _peak_rss_mib()
    bm = flexjax.create_block_mask(mask_mod(spec), None, None, spec.S, spec.S)
    sm = score_mod(spec)
    fn = jax.jit(_with_grad(lambda q, k, v, bm: flexjax.flex_attention(q, k, v, sm, bm), spec.mode))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(q, k, v, do, bm))
    wall = time.perf_counter() - t0
    peak = _peak_rss_mib()
    return [{"kind": "memory", "side": "jax", "impl": "flexjax", "spec": spec.name, "label": spec.label,
             "mode": spec.mode, "S": spec.S, "B": spec.B, "H": spec.H, "D": spec.D, "mask": spec.mask,
             "status": "ok" if peak < spec.goal_mib else "over_goal", "peak_rss_mib": peak,
             "rss_before_call_mib": rss_inputs, "goal_mib": spec.goal_mib,
             "first_call_s": wall, "eff_gflops_first_call": spec.flops / wall / 1e9}]


def _peak_rss_mib() -> float:
    # ru_maxrss is KiB on Linux, bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def run_spec(name: str) -> list[dict]:
    """Records for the spec called ``name`` (attention or build)."""
    spec = S.find(name)
    try:
        if isinstance(spec, S.BuildSpec):
            return run_build(spec)
        if isinstance(spec, S.MemorySpec):
            return run_memory(spec)
        return run_attention(spec)
    except Exception as e:
        return [S.error_record("jax", name, e)]


def machine_info() -> dict:
    return {"kind": "machine", "side": "jax", "jax": jax.__version__, "jaxlib": jax.lib.__version__,
            "jax_backend": jax.default_backend(), "jax_devices": jax.device_count(),
            "flexjax": flexjax.__version__, "python": platform.python_version()}


def main(argv=None) -> int:
    p = S.arg_parser(__doc__, memory=True)
    args = p.parse_args(argv)
    S.use_suite_timing(args.suite)
    if args.worker:
        S.serve(run_spec, machine_info)
        return 0
    if args.memory:
        S.emit(run_spec(args.memory)[0])
        return 0
    return S.run_standalone(args, run_spec, machine_info)


if __name__ == "__main__":
    sys.exit(main())
