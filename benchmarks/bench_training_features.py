"""Cost of the training features (sinks, dropout, max_scores, forward-mode AD) over the plain kernel.

xla backend on CPU, causal, float32, B=1, H=8, D=64 (default S=4096). Each variant is
timed jitted (forward, and forward + backward of a sum-of-squares loss; the JVP variant
times ``jax.jvp`` with respect to q), rounds interleaved so drift hits every variant alike;
one JSON line per (variant, mode) with the median and the ratio to the plain kernel.

    python -m benchmarks.bench_training_features [--S 4096] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

import flexjax
from benchmarks import specs as S
from flexjax import masks


def variants(q, k, v, bm):
    sinks = jnp.linspace(-1.0, 1.0, q.shape[2])
    rng = jax.random.key(0)
    aux = flexjax.AuxRequest(max_scores=True)
    return {
        "plain": lambda q, k, v: flexjax.flex_attention(q, k, v, block_mask=bm, backend="xla"),
        "sinks": lambda q, k, v: flexjax.flex_attention(q, k, v, block_mask=bm, backend="xla", sinks=sinks),
        "dropout0.1": lambda q, k, v: flexjax.flex_attention(q, k, v, block_mask=bm, backend="xla",
                                                             dropout_rate=0.1, dropout_rng=rng),
        "max_scores": lambda q, k, v: flexjax.flex_attention(q, k, v, block_mask=bm, backend="xla",
                                                             return_aux=aux),
    }


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--S", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    B, H, D, Sn = 1, 8, 64, args.S
    ks = jax.random.split(jax.random.key(1), 3)
    q, k, v = (jax.random.normal(kk, (B, Sn, H, D), jnp.float32) for kk in ks)
    bm = flexjax.create_block_mask(masks.causal, None, None, Sn, Sn)
    fns = {}
    for name, f in variants(q, k, v, bm).items():
        loss = lambda q, k, v, f=f: jnp.sum(jnp.square(_out(f(q, k, v))))  # noqa: E731
        fns[(name, "fwd")] = jax.jit(lambda q, k, v, f=f: _out(f(q, k, v)))
        fns[(name, "fwd+bwd")] = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    plain = variants(q, k, v, bm)["plain"]
    tq = jax.random.normal(jax.random.key(2), q.shape)
    fns[("plain", "jvp")] = jax.jit(lambda q, k, v: jax.jvp(lambda a: plain(a, k, v), (q,), (tq,)))
    times = {key: [] for key in fns}
    for _ in range(args.rounds):
        for key, f in fns.items():
            times[key].append(S.measure(lambda f=f: f(q, k, v), jax.block_until_ready, min_runs=3,
                                        min_time=0.5)["median_ms"])
    for (name, mode), ts in times.items():
        base = statistics.median(times[("plain", "fwd" if mode == "jvp" else mode)])
        med = statistics.median(ts)
        print(json.dumps({"variant": name, "mode": mode, "S": Sn, "median_ms": round(med, 2),
                          "rounds_ms": [round(t, 1) for t in ts], "ratio_to_plain": round(med / base, 3)}))


def _out(r):
    return r[0] if isinstance(r, tuple) else r


if __name__ == "__main__":
    main()
