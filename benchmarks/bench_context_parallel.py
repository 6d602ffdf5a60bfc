"""Context parallelism on a simulated CPU mesh: time per step and memory per device.

Runs causal flex_attention forward + backward once on a single device and then
sequence-sharded over ``--shards`` simulated devices with each strategy (k/v
all-gathered, or passed around a ring), in contiguous and permuted token order.

The simulated devices share this machine's cores, so times measure overhead, not
speed-up. What carries over to real devices is per-device memory (XLA's buffer
assignment of the compiled per-device program: arguments + outputs + temporaries),
the tiles the busiest shard computes, and the bytes each device sends per step.

    python benchmarks/bench_context_parallel.py [--seq 8192 --heads 4 --kv-heads 4 --dim 64 --shards 4]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import time


def _parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--shards", type=int, default=4, help="context shards (simulated devices)")
    p.add_argument("--block", type=int, default=128, help="BlockMask block size")
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args()


ARGS = _parse()
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={ARGS.shards}").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import flexjax  # noqa: E402
from flexjax import masks  # noqa: E402
from flexjax.sharding import attention_specs, flex_attention, visited_tiles  # noqa: E402

MIB = 1 << 20
COLLECTIVES = ("all-gather", "collective-permute", "reduce-scatter", "all-reduce", "all-to-all")


def _step(q, k, v, w):
    """Loss and gradients of one attention layer (fwd + bwd)."""
    bm = flexjax.create_block_mask(masks.causal, None, None, q.shape[1], k.shape[1], block_size=ARGS.block)

    def loss(q, k, v):
        return (flex_attention(q, k, v, block_mask=bm) * w).sum()

    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


def _measure(fn, args):
    compiled = jax.jit(fn).lower(*args).compile()
    mem = compiled.memory_analysis()
    hlo = compiled.as_text()
    ops = {c: len(re.findall(rf"\s{c}(?:-start)?\(", hlo)) for c in COLLECTIVES}
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(ARGS.repeats):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t)
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    return statistics.median(times) * 1e3, peak / MIB, mem.temp_size_in_bytes / MIB, ops


def _sent_mib(strategy: str, n: int) -> float:
    """Bytes one device sends per step (fwd + bwd), from the algorithm (f32 everywhere)."""
    kv_chunk = 2 * ARGS.batch * (ARGS.seq // n) * ARGS.kv_heads * ARGS.dim * 4  # K and V of one shard
    if strategy == "all_gather":
        # Forward: all-gather K/V (each device contributes its chunk to n-1 peers, ring
        # algorithm: n-1 chunk sends). Backward: reduce-scatter dK/dV, the same volume.
        return 2 * (n - 1) * kv_chunk / MIB
    # Forward: n-1 hops of K/V. Backward: n-1 hops of K/V and n hops of dK/dV (float32).
    return ((n - 1) + (n - 1) + n) * kv_chunk / MIB


def main():
    n = ARGS.shards
    B, S, H, Hkv, D = ARGS.batch, ARGS.seq, ARGS.heads, ARGS.kv_heads, ARGS.dim
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (B, S, H, D), jnp.float32)
    k = jax.random.normal(ks[1], (B, S, Hkv, D), jnp.float32)
    v = jax.random.normal(ks[2], (B, S, Hkv, D), jnp.float32)
    w = jax.random.normal(ks[3], (B, S, H, D), jnp.float32)
    bm = flexjax.create_block_mask(masks.causal, None, None, S, S, block_size=ARGS.block)
    total_tiles = int(np.asarray(bm.to_dense()).sum())

    rows = []
    ms, peak, temp, ops = _measure(_step, (q, k, v, w))
    rows.append(("1 device", "-", ms, peak, temp, total_tiles, 0.0, ops))
    mesh = jax.make_mesh((n,), ("context",))
    for strategy, kv_seq in (("all_gather", None), ("ring", "context")):
        for permuted in (False, True):
            with jax.set_mesh(mesh), attention_specs((None, "context", None, None), (None, kv_seq, None, None),
                                                     permuted=permuted):
                # Inputs arrive sharded over the sequence, as activations of a sharded model do.
                args = [jax.reshard(x, P(None, "context")) for x in (q, k, v, w)]
                tiles = int(visited_tiles(bm).sum(1).max())
                ms, peak, temp, ops = _measure(_step, args)
            rows.append((strategy, "yes" if permuted else "no", ms, peak, temp, tiles, _sent_mib(strategy, n), ops))

    cpu = platform.processor() or platform.machine()
    print(f"\ncausal flex_attention fwd+bwd, B={B} S={S} H={H} Hkv={Hkv} D={D} float32, block {ARGS.block}, "
          f"{n} context shards on {n} simulated CPU devices ({os.cpu_count()} cores, {cpu}), "
          f"jax {jax.__version__}\n")
    print("| layout | permuted | ms / step | peak MiB / device | of which temporaries | tiles on busiest shard "
          "| MiB sent / device / step | collectives in HLO |")
    print("|---|---|---|---|---|---|---|---|")
    for name, perm, ms, peak, temp, tiles, sent, ops in rows:
        ops_s = ", ".join(f"{c} x{m}" for c, m in ops.items() if m) or "-"
        print(f"| {name} | {perm} | {ms:.0f} | {peak:.1f} | {temp:.1f} | {tiles} / {total_tiles} | {sent:.1f} "
              f"| {ops_s} |")


if __name__ == "__main__":
    main()
