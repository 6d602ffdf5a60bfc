"""GPU benchmark: flexjax ``pallas`` vs cuDNN (``jax.nn.dot_product_attention``) and ``xla``.

    python benchmarks/gpu_bench.py --out results.json [--deadline-s 300]

bfloat16, B=4, H=16, D=128, S in {4096, 16384}; no mask, causal, sliding window 1024,
causal documents, causal + ALiBi, causal + soft-cap; forward and forward+backward.
cuDNN gets what it can express natively (causal, sliding window via
``local_window_size``) and otherwise a dense mask or bias where one fits in memory, which
is the comparison for "variants cuDNN cannot express". Effective TFLOP/s count only
unmasked pairs (backward = 2.5x forward), as in benchmarks/specs.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flexjax  # noqa: E402
from benchmarks.specs import FWD_BWD_FACTOR, FWD_FLOPS_PER_PAIR_PER_DIM, document_ids, unmasked_pairs  # noqa: E402

B, H, D = 4, 16, 128
LENGTHS = (4096, 16384)
WINDOW = 1024
DOCS = 8
# (name, mask family for flop counting, score_mod)
VARIANTS = (("none", "full", None), ("causal", "causal", None), ("sliding_window", "sliding_window", None),
            ("documents", "causal_documents", None), ("alibi", "causal", "alibi"),
            ("soft_cap", "causal", "soft_cap"))
# Dense masks/biases for cuDNN above this many bytes are skipped (they are the O(S^2) cost
# that flexjax avoids; at S=16384 a bf16 (1, H, S, S) bias is 8 GiB).
DENSE_LIMIT_BYTES = 4 << 30


def _time(f, *args, runs: int) -> float:
    """Median wall time in ms over ``runs`` calls after one warm-up (which compiles)."""
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def _flex(S, variant):
    _, family, score = variant
    if family == "full":
        mask = None
    elif family == "causal":
        mask = flexjax.masks.causal
    elif family == "sliding_window":
        mask = flexjax.masks.sliding_window(WINDOW)
    else:
        mask = flexjax.and_masks(flexjax.masks.causal, flexjax.masks.document(document_ids(S, DOCS)))
    bm = flexjax.create_block_mask(mask, None, None, S, S) if mask is not None else None
    score_mod = {None: None, "alibi": flexjax.mods.alibi(H), "soft_cap": flexjax.mods.soft_cap(30.0)}[score]
    return lambda backend: (lambda q, k, v: flexjax.flex_attention(q, k, v, score_mod, bm, backend=backend))


def _cudnn(S, variant):
    """cuDNN attention for the variant, or (None, reason)."""
    name = variant[0]
    kw = {}
    if name in ("causal", "alibi", "soft_cap"):
        kw["is_causal"] = True
    if name == "sliding_window":
        kw.update(is_causal=True, local_window_size=(WINDOW, 0))
    if name == "soft_cap":
        return None, "cuDNN has no soft-cap; see causal for its causal time"
    if name == "documents":
        if S * S * B > DENSE_LIMIT_BYTES:
            return None, "dense (B, 1, S, S) document mask too large"
        ids = jnp.asarray(document_ids(S, DOCS))
        dense = (ids[:, None] == ids[None, :]) & (jnp.arange(S)[:, None] >= jnp.arange(S)[None, :])
        kw["mask"] = jnp.broadcast_to(dense, (B, 1, S, S))
        kw.pop("is_causal", None)
    if name == "alibi":
        if 2 * H * S * S > DENSE_LIMIT_BYTES:
            return None, "dense (1, H, S, S) ALiBi bias too large"
        slopes = jnp.asarray(flexjax.mods.alibi_slopes(H), jnp.float32)
        rel = (jnp.arange(S)[None, :] - jnp.arange(S)[:, None]).astype(jnp.float32)
        kw["bias"] = (slopes[:, None, None] * rel)[None].astype(jnp.bfloat16)

    def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kw)

    return f, None


def _fwd_bwd(f):
    def loss(q, k, v):
        return jnp.sum(f(q, k, v).astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--deadline-s", type=float, default=300.0,
                        help="stop starting new measurements after this many seconds")
    args = parser.parse_args()
    start = time.perf_counter()
    results = {"device": str(jax.devices()[0]), "jax": jax.__version__, "B": B, "H": H, "D": D,
               "dtype": "bfloat16", "rows": []}
    for S in LENGTHS:
        ks = jax.random.split(jax.random.key(S), 3)
        q, k, v = (jax.random.normal(kk, (B, S, H, D), jnp.bfloat16) for kk in ks)
        runs = 10 if S <= 4096 else 3
        for variant in VARIANTS:
            pairs = unmasked_pairs(variant[1], S, window=WINDOW, docs=DOCS)
            flex = _flex(S, variant)
            impls = {"pallas": flex("pallas"), "xla": flex("xla")}
            cudnn, why = _cudnn(S, variant)
            for mode in ("fwd", "fwd+bwd"):
                row = {"S": S, "variant": variant[0], "mode": mode, "density": pairs / S**2, "ms": {}, "skipped": {}}
                flops = FWD_FLOPS_PER_PAIR_PER_DIM * pairs * D * H * B * (FWD_BWD_FACTOR if mode != "fwd" else 1.0)
                for name, f in list(impls.items()) + [("cudnn", cudnn)]:
                    if f is None:
                        row["skipped"][name] = why
                        continue
                    if time.perf_counter() - start > args.deadline_s:
                        row["skipped"][name] = "deadline"
                        continue
                    g = jax.jit(f if mode == "fwd" else _fwd_bwd(f))
                    try:
                        row["ms"][name] = _time(g, q, k, v, runs=runs)
                    except Exception as e:  # noqa: BLE001  (an OOM or unsupported config is a result too)
                        row["skipped"][name] = f"{type(e).__name__}: {str(e)[:200]}"
                row["tflops"] = {n: flops / (ms * 1e-3) / 1e12 for n, ms in row["ms"].items()}
                if "cudnn" in row["ms"] and "pallas" in row["ms"]:
                    row["pallas_vs_cudnn"] = row["ms"]["cudnn"] / row["ms"]["pallas"]
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
                with open(args.out, "w") as fh:
                    json.dump(results, fh, indent=1)
    results["wall_s"] = time.perf_counter() - start
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
