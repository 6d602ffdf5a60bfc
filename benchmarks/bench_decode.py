"""Decode-step benchmark: flex decoding against dense attention, contiguous and paged caches.

One decode step (one query per sequence at the end of a cache of length L) for B=4,
Hq=32, Hkv=8, D=128, causal or sliding window 4096, through the cache idiom (a block
mask built once for L x L, ``flexjax.paged.decode_block_mask`` per step). Reports
milliseconds, tokens per second, bytes of K/V the step must read per second, and that
rate over the machine's memory bandwidth measured in the same run (a large jnp
reduction): decoding is bandwidth-bound, so the ratio is the figure of merit. Beside it,
the step's compute floor: its flops at the rate a float32 jnp matmul gets in the same
rounds (where that floor nears the bandwidth one, the step is bound by both). And the
time per layer of a model's decode step: one jitted call over several layers' caches, run
one after another, which pays the per-call dispatch once for all of them.

    .venv/bin/python benchmarks/bench_decode.py                      # the whole table
    .venv/bin/python benchmarks/bench_decode.py --lengths 16384 --dtypes float32
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

import flexjax
from benchmarks import specs as S
from flexjax import masks, paged


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """One decode-step shape.

    Attributes:
      L: cache length (the query sits at position L - 1).
      mask: "causal" or "sliding_window" (``window`` keys back).
      dtype: "float32" or "bfloat16".
      B, Hq, Hkv, D: batch, query heads, kv heads, head dim.
      page_size: page size of the paged run.
    """

    L: int
    mask: str
    dtype: str
    window: int = 4096
    B: int = 4
    Hq: int = 32
    Hkv: int = 8
    D: int = 128
    page_size: int = 256

    @property
    def name(self) -> str:
        m = "causal" if self.mask == "causal" else f"window{self.window}"
        return f"decode_{m}_{self.L // 1024}k_{self.dtype}"

    def keys_read(self) -> int:
        """Keys per sequence the step needs (the window or the whole prefix)."""
        return min(self.L, self.window + 1) if self.mask == "sliding_window" else self.L

    def kv_bytes(self) -> int:
        return self.B * self.keys_read() * self.Hkv * 2 * self.D * jnp.dtype(self.dtype).itemsize

    def flops(self) -> int:
        """The step's multiply-adds, times 2: QK^T and PV for every query head and key read."""
        return 2 * self.B * self.Hq * self.keys_read() * 2 * self.D


SPECS = [DecodeSpec(L, m, dt) for dt in ("float32", "bfloat16") for L in (4096, 16384, 65536)
         for m in ("causal", "sliding_window")]


def mask_mod(spec: DecodeSpec):
    return masks.causal if spec.mask == "causal" else masks.sliding_window(spec.window)


def bandwidth_probe(nbytes: int = 1 << 30):
    """A call reading ``nbytes`` (a large float32 reduction) and its byte count."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x.sum())
    return (lambda: f(x)), nbytes


def compute_probe(n: int = 1024):
    """A call doing 2 n^3 float32 flops (a jnp matmul) and that count: the rate the machine's
    cores give multiply-adds now (on a shared VM it varies with its neighbours, as memory
    bandwidth does). A decode step's products cost ``DecodeSpec.flops()`` at that rate at
    least: its compute floor, beside the bandwidth one."""
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    return (lambda: f(a)), 2 * n ** 3


def _once(call) -> float:
    """Milliseconds of one synchronized call."""
    return S.measure(call, jax.block_until_ready, warmup=0, min_runs=1, max_runs=1, min_time=0.0)["median_ms"]


# The buffer read before each timed call to empty the caches (see ``run``).
FLUSH_BYTES = 1 << 30


def run(spec: DecodeSpec, *, dense: bool, paged_too: bool, runs: int, flush: bool = True, layers: int = 4) -> dict:
    B, L, Hq, Hkv, D = spec.B, spec.L, spec.Hq, spec.Hkv, spec.D
    dt = jnp.dtype(spec.dtype)
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, 1, Hq, D), dt)
    k = jax.random.normal(ks[1], (B, L, Hkv, D), dt)
    v = jax.random.normal(ks[2], (B, L, Hkv, D), dt)
    pos = jnp.full((B,), L - 1, jnp.int32)
    bm = flexjax.create_block_mask(mask_mod(spec), None, None, L, L)

    @jax.jit
    def flex(q, k, v, pos):
        return flexjax.flex_attention(q, k, v, block_mask=paged.decode_block_mask(bm, pos))

    rec = {"spec": spec.name, "L": L, "mask": spec.mask, "dtype": spec.dtype, "kv_bytes": spec.kv_bytes()}
    probe, probe_bytes = bandwidth_probe()
    # A cold read of the bytes the step needs, no more (reads of a few hundred MB from a cold
    # cache run slower on this machine than the 1 GiB probe's): what the memory system gives
    # a read of that size.
    same, same_bytes = bandwidth_probe(spec.kv_bytes())
    matmul, matmul_flops = compute_probe()
    calls = {"bandwidth": probe, "read": same, "matmul": matmul, "flex": lambda: flex(q, k, v, pos)}
    out = flex(q, k, v, pos)
    if layers > 1:
        # A model's decode step: one jitted call running the attention of several layers, each
        # over its own cache (all cold after the flush), each layer's query depending on the
        # previous layer's output (as through the layer's projections), so they run one after
        # another. Its time per layer leaves out the per-call dispatch a model pays once a step.
        n = layers if 2 * spec.kv_bytes() * L // spec.keys_read() <= (1 << 30) else 2
        caches = [(k, v)] + [tuple(jax.random.normal(kk, (B, L, Hkv, D), dt) for kk in jax.random.split(
            jax.random.key(i + 1), 2)) for i in range(n - 1)]

        @jax.jit
        def model(q, caches, pos):
            for k_, v_ in caches:
                o = flexjax.flex_attention(q, k_, v_, block_mask=paged.decode_block_mask(bm, pos))
                q = (q.astype(jnp.float32) + 1e-30 * o.astype(jnp.float32)).astype(q.dtype)
            return q

        rec["layers"] = n
        calls["model"] = lambda: model(q, caches, pos)
    if dense:
        @jax.jit
        def dpa(q, k, v, pos):
            kv = jnp.arange(L)
            ok = kv[None, :] <= pos[:, None]
            if spec.mask == "sliding_window":
                ok &= kv[None, :] >= pos[:, None] - spec.window
            return jax.nn.dot_product_attention(q, k, v, mask=ok[:, None, None, :])

        want = dpa(q, k, v, pos)
        rec["dense_max_err"] = float(jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32)).max())
        calls["dense"] = lambda: dpa(q, k, v, pos)
    if paged_too:
        ps = spec.page_size
        table = jnp.asarray(paged.page_table_for(np.full(B, L), ps, L // ps, seed=0))
        k_pages = jnp.zeros((B * L // ps, ps, Hkv, D), dt).at[table].set(k.reshape(B, L // ps, ps, Hkv, D))
        v_pages = jnp.zeros((B * L // ps, ps, Hkv, D), dt).at[table].set(v.reshape(B, L // ps, ps, Hkv, D))

        @jax.jit
        def flex_paged(q, k_pages, v_pages, table, pos):
            step_bm = paged.decode_block_mask(bm, pos)
            return paged.flex_attention(q, k_pages, v_pages, table, pos + 1, block_mask=step_bm)

        got = flex_paged(q, k_pages, v_pages, table, pos)
        rec["paged_max_err"] = float(jnp.abs(out.astype(jnp.float32) - got.astype(jnp.float32)).max())
        calls["paged"] = lambda: flex_paged(q, k_pages, v_pages, table, pos)
    # Interleaved runs (the machine is shared and its load drifts): each round times the
    # bandwidth probe and every flexjax call once, in an order rotated every round; medians
    # over the rounds. With `flush`,
    # every timed call starts from a cold cache (a reduction over a buffer larger than the
    # last-level cache runs first): a decode step reads its layer's cache from memory, and
    # a 4k cache would otherwise stay in a large L3 between back-to-back calls.
    flusher = bandwidth_probe(FLUSH_BYTES)[0] if flush else None
    # The dense call's rounds come after all the others': the call timed after a dense one
    # ran slower (a float32 window step at 64k: 31.9 against 8.5 ms), and a rotation keeps
    # the same neighbours every round.
    for call in calls.values():
        jax.block_until_ready(call())
    times = {name: [] for name in calls}
    names = [n for n in calls if n != "dense"]
    for r in range(runs):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if flusher is not None:
                jax.block_until_ready(flusher())
            times[name].append(_once(calls[name]))
    for _ in range(runs if "dense" in calls else 0):
        if flusher is not None:
            jax.block_until_ready(flusher())
        times["dense"].append(_once(calls["dense"]))
    for name, ts in times.items():
        rec[f"{name}_ms"] = float(np.median(ts))
    rec["bandwidth"] = probe_bytes / (rec["bandwidth_ms"] / 1e3)
    rec["read_bandwidth"] = same_bytes / (rec["read_ms"] / 1e3)
    rec["flop_rate"] = matmul_flops / (rec["matmul_ms"] / 1e3)
    if "model_ms" in rec:
        rec["layer_ms"] = rec["model_ms"] / rec["layers"]
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="*", default=None)
    p.add_argument("--dtypes", nargs="*", default=None)
    p.add_argument("--masks", nargs="*", default=None)
    p.add_argument("--runs", type=int, default=3, help="timed runs per measurement (median)")
    p.add_argument("--no-dense", action="store_true")
    p.add_argument("--no-paged", action="store_true")
    p.add_argument("--no-flush", action="store_true", help="time calls back to back, caches warm")
    p.add_argument("--layers", type=int, default=4,
                   help="layers of the model-step measurement (2 where a cache exceeds 512 MiB; 1: none)")
    args = p.parse_args(argv)
    specs = [s for s in SPECS if (args.lengths is None or s.L in args.lengths)
             and (args.dtypes is None or s.dtype in args.dtypes) and (args.masks is None or s.mask in args.masks)]
    print(f"jax {jax.__version__}, {jax.default_backend()}, {os.cpu_count()} cpus")
    print("| spec | flex ms | tokens/s | K/V GB/s | bandwidth GB/s | ratio | same-size read GB/s | vs read | "
          "matmul GFLOP/s | compute floor ms | layer ms in a model step | its ratio | dense ms | vs dense | "
          "paged ms | paged/contig |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for spec in specs:
        rec = run(spec, dense=not args.no_dense, paged_too=not args.no_paged, runs=args.runs,
                  flush=not args.no_flush, layers=args.layers)
        bw = rec["bandwidth"]
        rate = spec.kv_bytes() / (rec["flex_ms"] / 1e3)
        dense = f"{rec['dense_ms']:.1f} | {rec['dense_ms'] / rec['flex_ms']:.1f}x" if "dense_ms" in rec else "- | -"
        pg = f"{rec['paged_ms']:.1f} | {rec['paged_ms'] / rec['flex_ms']:.2f}" if "paged_ms" in rec else "- | -"
        layer = "- | -"
        if "layer_ms" in rec:
            layer = (f"{rec['layer_ms']:.2f} ({rec['layers']}) | "
                     f"{spec.kv_bytes() / (rec['layer_ms'] / 1e3) / bw:.0%}")
        print(f"| {spec.name} | {rec['flex_ms']:.2f} | {spec.B / (rec['flex_ms'] / 1e3):.0f} | {rate / 1e9:.2f} | "
              f"{bw / 1e9:.2f} | {rate / bw:.0%} | {rec['read_bandwidth'] / 1e9:.2f} | "
              f"{rate / rec['read_bandwidth']:.0%} | {rec['flop_rate'] / 1e9:.0f} | "
              f"{spec.flops() / rec['flop_rate'] * 1e3:.2f} | {layer} | {dense} | {pg} |", flush=True)
        errs = {k: f"{v:.2g}" for k, v in rec.items() if k.endswith("_err")}
        if errs:
            print(f"|   {spec.name} max abs error vs flex: {errs} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
