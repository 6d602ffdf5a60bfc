"""AOT-compiles the pallas decode kernels (contiguous and paged caches) for TPU v5e and for
an H100 (sm_90) from a CPU host.

Run by ``make test-compile`` inside ``build/venv-compile`` (pip ``libtpu``, the CUDA plugin):
one decode step per case, {bfloat16, float32} x Sq {1, 4} x {causal, sliding window} x
score_mod {none, soft-cap, ALiBi (reads h), a captured bias along kv_idx} x {contiguous,
paged}, B=2, Hq=8, Hkv=2, D=128, a 4096-token cache, 256-token pages; on cuda also a
per-head table read by h and kv_idx - q_idx. TPU's kernel packs the heads of a GQA group
only for mods that do not read h (ALiBi: one program per head), the GPU template for all of
these (each row's head a tile). Then the serving calls: ``paged.flex_attention_ragged`` over a
mixed batch (4 sequences, 64 packed tokens: prefill chunks and decode steps), {bfloat16,
float32} x {causal, sliding window} x score_mod {none, soft-cap}, on float pools and on int8
and float8_e4m3fn pools with per-(page, head) scales (dequantized in the kernels), and the
plain paged step on an int8 pool; on cuda also the triton backend's paged forward kernel for
the ragged calls (bfloat16, float / int8 / float8 pools, causal and soft-cap). Every case must
compile (Mosaic; Triton through XLA's GPU compiler) and the pallas cases take the decode
kernel; it prints one line per case (the packing of each call) and exits non-zero on any
failure.

    python tests_compile/decode_suite.py
"""

from __future__ import annotations

import itertools
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.update({"JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
                   "JAX_ENABLE_COMPILATION_CACHE": "false"})

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import flexjax  # noqa: E402
from flexjax import masks, mods, paged  # noqa: E402
from flexjax.backends.pallas import _decode  # noqa: E402

TPU_TOPOLOGY = "v5e:2x2"
TARGET_CONFIG = os.path.join(HERE, "h100_target_config.txtpb")
B, HQ, HKV, D, L, PS = 2, 8, 2, 128, 4096, 256


def main() -> int:
    used = []
    real_tpu, real_packs = _decode._tpu_call, _decode._packs

    def spy(*args, **kwargs):
        used.append(args[10])
        return real_tpu(*args, **kwargs)

    def packs(*args):  # (cuda: the GPU template's packing, G heads a tile or 1)
        p = real_packs(*args)
        if not args[-1]:
            used.append(HQ // HKV if p else 1)
        return p

    _decode._tpu_call, _decode._packs = spy, packs
    fails = 0
    for target in ("tpu", "cuda"):
        fails += _suite(target, used)
    print(f"{fails} failures")
    return 1 if fails else 0


def _mesh(target: str):
    if target == "tpu":
        topo = topologies.get_topology_desc(TPU_TOPOLOGY, "tpu")
        return Mesh(np.array(topo.devices[:1]), ("x",))
    with open(TARGET_CONFIG) as f:
        topo = topologies.get_topology_desc("", "cuda", target_config=f.read(), topology="1x1x1")
    return Mesh(np.array(topo.devices), ("x",))


def _suite(target: str, used: list) -> int:
    mesh = _mesh(target)
    sh = NamedSharding(mesh, P())
    bias = jnp.zeros((L,), jnp.float32)
    rel = jnp.zeros((HQ, 2 * L), jnp.float32)
    scores = {"none": None, "soft-cap": mods.soft_cap(30.0),
              "alibi": lambda s, b, h, q_idx, kv_idx: s - (h + 1) * 0.1 * (q_idx - kv_idx),
              "kv bias": lambda s, b, h, q_idx, kv_idx: s + bias[kv_idx]}
    if target == "cuda":
        scores["table[h, kv - q]"] = lambda s, b, h, q_idx, kv_idx: s + rel[h, kv_idx - q_idx + L]
    mask_mods = {"causal": masks.causal, "window 1024": masks.sliding_window(1024)}
    fails = 0
    for dt, sq, mname, sname, kind in itertools.product((jnp.bfloat16, jnp.float32), (1, 4), mask_mods, scores,
                                                        ("contiguous", "paged")):
        bm = flexjax.create_block_mask(mask_mods[mname], None, None, L, L)
        score = scores[sname]

        def step(q, k, v, pos, table, bm=bm, score=score, kind=kind, sq=sq):
            step_bm = paged.decode_block_mask(bm, pos, q_len=sq)
            opts = {"target": target}
            if kind == "contiguous":
                return flexjax.flex_attention(q, k, v, score, step_bm, backend="pallas", kernel_options=opts)
            return paged.flex_attention(q, k, v, table, pos + sq, score, step_bm, backend="pallas",
                                        kernel_options=opts)

        kv = (B, L, HKV, D) if kind == "contiguous" else (B * L // PS, PS, HKV, D)
        args = (jax.ShapeDtypeStruct((B, sq, HQ, D), dt, sharding=sh), jax.ShapeDtypeStruct(kv, dt, sharding=sh),
                jax.ShapeDtypeStruct(kv, dt, sharding=sh), jax.ShapeDtypeStruct((B,), jnp.int32, sharding=sh),
                jax.ShapeDtypeStruct((B, L // PS), jnp.int32, sharding=sh))
        used.clear()
        t0 = time.perf_counter()
        try:
            with jax.set_mesh(mesh):
                jax.jit(step).trace(*args).lower().compile()
            status = "ok" if used else "FAIL: the decode kernel did not serve the call"
        except Exception as e:  # noqa: BLE001  (every compile error is a reported failure)
            status = "FAIL: " + next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)[:300]
        fails += status != "ok"
        print(f"{target} {jnp.dtype(dt).name} Sq={sq} {mname}, {sname}, {kind}: {status} (packed heads: {used}) "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    return fails + _serving(target, mesh, used)


# The serving calls' batch: 4 sequences of a 4096-token capacity, 64 packed new tokens.
S, T = 4, 64


def _compile(mesh, f, args, used):
    """Compiles f; ``used`` (the pallas decode kernel's spy list) must fill, unless None."""
    if used is not None:
        used.clear()
    t0 = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            jax.jit(f).trace(*args).lower().compile()
        status = "ok" if used is None or used else "FAIL: the decode kernel did not serve the call"
    except Exception as e:  # noqa: BLE001  (every compile error is a reported failure)
        status = "FAIL: " + next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)[:300]
    return status, time.perf_counter() - t0


def _serving(target: str, mesh, used: list) -> int:
    # (The layout's and page table's run-time checks are a host callback, which flexjax leaves out where this
    # process has no runtime for the target: the first loop's paged steps and these calls check that.)
    sh = NamedSharding(mesh, P())
    opts = {"target": target}
    num_pages = S * L // PS
    mask_mods = {"causal": None, "window 1024": masks.sliding_window(1024)}
    scores = {"none": None, "soft-cap": mods.soft_cap(30.0)}
    fails = 0
    cases = [("pallas", dt, m, sc, pool) for dt in (jnp.bfloat16, jnp.float32) for m in mask_mods for sc in scores
             for pool in ("float", "int8", "float8_e4m3fn")]
    if target == "cuda":
        cases += [("triton", jnp.bfloat16, "causal", sc, pool) for sc in scores
                  for pool in ("float", "int8", "float8_e4m3fn")]
    for backend, dt, mname, sname, pool in cases:
        quant = pool != "float"

        def call(q, kp, vp, table, lens, cu, ks, vs, mname=mname, sname=sname, quant=quant, backend=backend):
            kw = dict(k_scale=ks, v_scale=vs) if quant else {}
            return paged.flex_attention_ragged(q, kp, vp, table, lens, cu, score_mod=scores[sname],
                                               mask_mod=mask_mods[mname], backend=backend, kernel_options=opts,
                                               **kw)

        pool_dt = dt if not quant else jnp.dtype(pool)
        kv = jax.ShapeDtypeStruct((num_pages, PS, HKV, D), pool_dt, sharding=sh)
        args = (jax.ShapeDtypeStruct((T, HQ, D), dt, sharding=sh), kv, kv,
                jax.ShapeDtypeStruct((S, L // PS), jnp.int32, sharding=sh),
                jax.ShapeDtypeStruct((S,), jnp.int32, sharding=sh),
                jax.ShapeDtypeStruct((S + 1,), jnp.int32, sharding=sh),
                jax.ShapeDtypeStruct((num_pages, HKV), jnp.float32, sharding=sh),
                jax.ShapeDtypeStruct((num_pages, HKV), jnp.float32, sharding=sh))
        status, secs = _compile(mesh, call, args, used if backend == "pallas" else None)
        fails += status != "ok"
        what = f"(packed heads: {used})" if backend == "pallas" else "(triton)"
        print(f"{target} {jnp.dtype(dt).name} ragged {mname}, {sname}, {pool} pool, {backend}: {status} {what} "
              f"{secs:.1f} s", flush=True)
    # The plain paged decode step on an int8 pool.
    for dt in (jnp.bfloat16, jnp.float32):
        def step(q, kp, vp, table, lens, ks, vs):
            return paged.flex_attention(q, kp, vp, table, lens, mods.soft_cap(30.0), backend="pallas",
                                        kernel_options=opts, k_scale=ks, v_scale=vs)

        kv = jax.ShapeDtypeStruct((B * L // PS, PS, HKV, D), jnp.int8, sharding=sh)
        args = (jax.ShapeDtypeStruct((B, 1, HQ, D), dt, sharding=sh), kv, kv,
                jax.ShapeDtypeStruct((B, L // PS), jnp.int32, sharding=sh),
                jax.ShapeDtypeStruct((B,), jnp.int32, sharding=sh),
                jax.ShapeDtypeStruct((B * L // PS, HKV), jnp.float32, sharding=sh),
                jax.ShapeDtypeStruct((B * L // PS, HKV), jnp.float32, sharding=sh))
        status, secs = _compile(mesh, step, args, used)
        fails += status != "ok"
        print(f"{target} {jnp.dtype(dt).name} Sq=1 paged step, soft-cap, int8 pool: {status} (packed heads: {used}) "
              f"{secs:.1f} s", flush=True)
    return fails + (_tpu_limits(mesh, used) if target == "tpu" else 0)


def _tpu_limits(mesh, used: list) -> int:
    """The TPU kernel's limits: int8 scales of 8192 pages x 8 kv heads (512 KiB, the most
    ``pallas.TPU_SCALE_BYTES`` lets into SMEM) compile; pages of 64 tokens (kv tiles
    narrower than 128 lanes, which Mosaic rejects) are refused with a reason."""
    from flexjax.backends import pallas

    sh = NamedSharding(mesh, P())
    fails = 0
    for num_pages, ps, hkv in ((pallas.TPU_SCALE_BYTES // (2 * 4 * 8), 256, 8), (256, 64, 8)):
        def call(q, kp, vp, table, lens, cu, ks, vs):
            return paged.flex_attention_ragged(q, kp, vp, table, lens, cu, backend="pallas",
                                               kernel_options={"target": "tpu"}, k_scale=ks, v_scale=vs)

        kv = jax.ShapeDtypeStruct((num_pages, ps, hkv, D), jnp.int8, sharding=sh)
        sc = jax.ShapeDtypeStruct((num_pages, hkv), jnp.float32, sharding=sh)
        args = (jax.ShapeDtypeStruct((T, 8, D), jnp.bfloat16, sharding=sh), kv, kv,
                jax.ShapeDtypeStruct((S, L // ps), jnp.int32, sharding=sh),
                jax.ShapeDtypeStruct((S,), jnp.int32, sharding=sh),
                jax.ShapeDtypeStruct((S + 1,), jnp.int32, sharding=sh), sc, sc)
        status, secs = _compile(mesh, call, args, used)
        if ps % 128:  # must be refused, with the reason
            status = "ok (refused)" if "multiple of 128 on TPU" in status else f"FAIL: not refused: {status}"
        fails += not status.startswith("ok")
        print(f"tpu bfloat16 ragged, int8 pool of {num_pages} pages of {ps} x {hkv} kv heads: {status} {secs:.1f} s",
              flush=True)
    return fails


if __name__ == "__main__":
    sys.exit(main())
