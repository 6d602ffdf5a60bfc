"""AOT-compiles the pallas TPU decode kernel (contiguous and paged caches) for TPU v5e from a CPU host.

Run by ``make test-compile`` inside ``build/venv-compile`` (pip ``libtpu``): one decode step
per case, {bfloat16, float32} x Sq {1, 4} x {causal, sliding window} x score_mod {none,
soft-cap (heads packed), ALiBi (reads h: one program per head), a captured bias along
kv_idx} x {contiguous, paged}, B=2, Hq=8, Hkv=2, D=128, a 4096-token cache, 256-token
pages. Every case must compile through Mosaic and take the decode kernel; it prints one
line per case and exits non-zero on any failure.

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
B, HQ, HKV, D, L, PS = 2, 8, 2, 128, 4096, 256


def main() -> int:
    used = []
    real = _decode._tpu_call

    def spy(*args, **kwargs):
        used.append(args[10])
        return real(*args, **kwargs)

    _decode._tpu_call = spy
    topo = topologies.get_topology_desc(TPU_TOPOLOGY, "tpu")
    mesh = Mesh(np.array(topo.devices[:1]), ("x",))
    sh = NamedSharding(mesh, P())
    bias = jnp.zeros((L,), jnp.float32)
    scores = {"none": None, "soft-cap": mods.soft_cap(30.0),
              "alibi": lambda s, b, h, q_idx, kv_idx: s - (h + 1) * 0.1 * (q_idx - kv_idx),
              "kv bias": lambda s, b, h, q_idx, kv_idx: s + bias[kv_idx]}
    mask_mods = {"causal": masks.causal, "window 1024": masks.sliding_window(1024)}
    fails = 0
    for dt, sq, mname, sname, kind in itertools.product((jnp.bfloat16, jnp.float32), (1, 4), mask_mods, scores,
                                                        ("contiguous", "paged")):
        bm = flexjax.create_block_mask(mask_mods[mname], None, None, L, L)
        score = scores[sname]

        def step(q, k, v, pos, table, bm=bm, score=score, kind=kind, sq=sq):
            step_bm = paged.decode_block_mask(bm, pos, q_len=sq)
            opts = {"target": "tpu"}
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
        print(f"{jnp.dtype(dt).name} Sq={sq} {mname}, {sname}, {kind}: {status} (packed heads: {used}) "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    print(f"{fails} failures")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
