"""Serving benchmark: one ragged call for a mixed prefill / decode batch against the alternatives.

The batch of a continuous-batching server: ``--prefill`` sequences prefilling a chunk of
256-1024 tokens (behind a prefix of 0-3072 cached tokens) and ``--decode`` sequences each
decoding one token behind a cache of 1k-32k tokens, all in one page pool. Timed, each one
jitted call with the block masks built inside it (a server builds them every step):

- ``ragged``: ``flexjax.paged.flex_attention_ragged`` over the packed tokens;
- ``separate``: ``flexjax.paged.flex_attention`` twice, the prefill chunks padded to the
  longest chunk, then the decode steps (one query each);
- ``padded``: one ``flexjax.paged.flex_attention`` over every sequence padded to the
  longest chunk (the padded rows masked out, so flexjax skips their empty tiles: the
  cheapest form padding can take here).

Reported: milliseconds, new tokens per second, and for the decode share the ragged call
on the decode sequences alone (the chunks idle): K/V bytes per second against the read
bandwidth of the machine measured in the same rounds (a large jnp reduction). With
``--quantized``, the decode share again on int8 and float8_e4m3fn copies of the pools.

    .venv/bin/python benchmarks/bench_serving.py                  # the issue's batch
    .venv/bin/python benchmarks/bench_serving.py --quick          # 4 + 12 sequences, short caches
    .venv/bin/python benchmarks/bench_serving.py --json out.json  # also the records, for the notebook
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

import flexjax
from benchmarks import specs as S
from benchmarks.bench_decode import FLUSH_BYTES, bandwidth_probe
from flexjax import paged


def batch(n_prefill: int, n_decode: int, *, chunk=(256, 1024), prefix=(0, 3072), cache=(1024, 32768), seed=0):
    """(q_lens, kv_lens) of the mixed batch: prefill chunks first, then the decode steps."""
    rng = np.random.default_rng(seed)
    chunks = rng.integers(chunk[0], chunk[1] + 1, n_prefill)
    pre = chunks + rng.integers(prefix[0], prefix[1] + 1, n_prefill)
    dec = rng.integers(cache[0], cache[1] + 1, n_decode)
    q_lens = np.concatenate([chunks, np.ones(n_decode, np.int64)]).astype(np.int32)
    kv_lens = np.concatenate([pre, dec]).astype(np.int32)
    return q_lens, kv_lens


def setup(q_lens, kv_lens, *, Hq, Hkv, D, page_size, dtype, seed=0):
    max_pages = -(-int(kv_lens.max()) // page_size)
    num_pages = int((-(-kv_lens // page_size)).sum())
    table = jnp.asarray(paged.page_table_for(kv_lens, page_size, max_pages, num_pages=num_pages, seed=seed))
    ks = jax.random.split(jax.random.key(seed), 3)
    k_pages = jax.random.normal(ks[0], (num_pages, page_size, Hkv, D), dtype)
    v_pages = jax.random.normal(ks[1], (num_pages, page_size, Hkv, D), dtype)
    q = jax.random.normal(ks[2], (int(q_lens.sum()), Hq, D), dtype)
    return q, k_pages, v_pages, table


def _offset_causal(q_lens, kv_lens, pad_rows_out: bool):
    """Causal in logical positions for queries padded to a common length (row r of sequence
    b at position kv_lens[b] - q_lens[b] + r); with ``pad_rows_out`` rows past q_lens[b]
    attend nothing."""
    def mask(b, h, q_idx, kv_idx):
        ok = q_idx + kv_lens[b] - q_lens[b] >= kv_idx
        return ok & (q_idx < q_lens[b]) if pad_rows_out else ok
    return mask


def calls(q, k_pages, v_pages, table, q_lens, kv_lens, n_prefill: int):
    """The jitted calls (name -> thunk) over one batch, and their outputs' agreement check."""
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    lens = jnp.asarray(kv_lens)
    ql = jnp.asarray(q_lens)
    kv_cap = table.shape[1] * k_pages.shape[1]
    B = len(q_lens)
    longest = int(q_lens[:n_prefill].max()) if n_prefill else 1
    bs = (128, min(128, k_pages.shape[1]))

    ragged = jax.jit(lambda q, kp, vp, t, lens, cu: paged.flex_attention_ragged(q, kp, vp, t, lens, cu))

    def pad_rows(q, cu, n, rows):
        idx = cu[:n, None] + jnp.arange(rows)
        return jnp.where((jnp.arange(rows) < (cu[1:n + 1] - cu[:n])[:, None])[..., None, None],
                         q[jnp.clip(idx, 0, q.shape[0] - 1)], 0)

    @jax.jit
    def separate(q, kp, vp, t, lens, ql, cu):
        outs = []
        if n_prefill:
            mask = _offset_causal(ql[:n_prefill], lens[:n_prefill], False)
            bm = flexjax.create_block_mask(mask, n_prefill, None, longest, kv_cap, block_size=bs)
            outs.append(paged.flex_attention(pad_rows(q, cu, n_prefill, longest), kp, vp, t[:n_prefill],
                                             lens[:n_prefill], block_mask=bm))
        qd = jax.lax.dynamic_slice_in_dim(q, cu[n_prefill], B - n_prefill)[:, None]
        outs.append(paged.flex_attention(qd, kp, vp, t[n_prefill:], lens[n_prefill:]))
        return outs

    @jax.jit
    def padded(q, kp, vp, t, lens, ql, cu):
        mask = _offset_causal(ql, lens, True)
        bm = flexjax.create_block_mask(mask, B, None, longest, kv_cap, block_size=bs)
        return paged.flex_attention(pad_rows(q, cu, B, longest), kp, vp, t, lens, block_mask=bm)

    args = (q, k_pages, v_pages, table, lens)
    thunks = {"ragged": lambda: ragged(*args, cu), "separate": lambda: separate(*args, ql, cu),
              "padded": lambda: padded(*args, ql, cu)}

    def check() -> float:
        """Max |ragged - separate| over the real tokens."""
        r = ragged(*args, cu)
        s = separate(*args, ql, cu)
        parts = []
        if n_prefill:
            pre = s[0]
            parts += [pre[i, :q_lens[i]] for i in range(n_prefill)]
        parts.append(s[-1][:, 0])
        ref = jnp.concatenate(parts)
        return float(jnp.abs(r.astype(jnp.float32) - ref.astype(jnp.float32)).max())

    return thunks, check


def decode_share(q, k_pages, v_pages, table, q_lens, kv_lens, n_prefill: int):
    """The ragged call with the chunks idle (q_len 0): the decode steps alone, and the K/V
    bytes they must read."""
    ql = q_lens.copy()
    ql[:n_prefill] = 0
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(ql)]), jnp.int32)
    lens = kv_lens.copy()
    lens[:n_prefill] = 0
    f = jax.jit(lambda q, kp, vp, t, lens, cu: paged.flex_attention_ragged(q, kp, vp, t, lens, cu))
    qd = q[:int(ql.sum())]
    per_token = k_pages.shape[2] * (k_pages.shape[3] + v_pages.shape[3]) * k_pages.dtype.itemsize
    nbytes = int(lens.sum()) * per_token
    return (lambda: f(qd, k_pages, v_pages, table, jnp.asarray(lens), cu)), nbytes


def timed(thunks: dict, runs: int, flush: bool) -> dict:
    """Median ms per thunk: interleaved rounds (each round every thunk once, rotated), a
    cache flush before each timed call."""
    flusher = bandwidth_probe(FLUSH_BYTES)[0] if flush else None
    for t in thunks.values():
        jax.block_until_ready(t())
    times = {k: [] for k in thunks}
    names = list(thunks)
    for r in range(runs):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if flusher is not None:
                jax.block_until_ready(flusher())
            times[name].append(S.measure(thunks[name], jax.block_until_ready, warmup=0, min_runs=1, max_runs=1,
                                         min_time=0.0)["median_ms"])
    return {k: float(np.median(v)) for k, v in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", type=int, default=8)
    p.add_argument("--decode", type=int, default=56)
    p.add_argument("--quick", action="store_true", help="4 chunks of 64-256, 12 decodes at 512-4096")
    p.add_argument("--heads", type=int, nargs=2, default=(16, 4), metavar=("HQ", "HKV"))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--no-padded", action="store_true", help="skip the padded call (the slowest)")
    p.add_argument("--quantized", action="store_true", help="also the decode share on int8 / float8 pools")
    p.add_argument("--no-flush", action="store_true")
    p.add_argument("--json", default=None, help="write the records here")
    args = p.parse_args(argv)
    kw = dict(chunk=(64, 256), prefix=(0, 512), cache=(512, 4096)) if args.quick else {}
    n_pre, n_dec = (4, 12) if args.quick else (args.prefill, args.decode)
    q_lens, kv_lens = batch(n_pre, n_dec, **kw)
    Hq, Hkv = args.heads
    q, k_pages, v_pages, table = setup(q_lens, kv_lens, Hq=Hq, Hkv=Hkv, D=args.head_dim,
                                       page_size=args.page_size, dtype=jnp.dtype(args.dtype))
    print(f"jax {jax.__version__}, {jax.default_backend()}, {os.cpu_count()} cpus; {n_pre} chunks "
          f"({int(q_lens[:n_pre].sum())} tokens, {q_lens[:n_pre].min()}-{q_lens[:n_pre].max()}, kv "
          f"{kv_lens[:n_pre].min()}-{kv_lens[:n_pre].max()}) + {n_dec} decodes (kv {kv_lens[n_pre:].min()}-"
          f"{kv_lens[n_pre:].max()}); Hq={Hq} Hkv={Hkv} D={args.head_dim} page {args.page_size} {args.dtype}")
    thunks, check = calls(q, k_pages, v_pages, table, q_lens, kv_lens, n_pre)
    if args.no_padded:
        thunks.pop("padded")
    print(f"max |ragged - separate| = {check():.2e}")
    dec, dec_bytes = decode_share(q, k_pages, v_pages, table, q_lens, kv_lens, n_pre)
    probe, probe_bytes = bandwidth_probe()
    thunks = {**thunks, "decode_share": dec, "bandwidth": probe}
    if args.quantized:
        for qd in ("int8", "float8_e4m3fn"):
            kq, ks = paged.quantize(k_pages, qd)
            vq, vs = paged.quantize(v_pages, qd)
            thunks[f"decode_{qd}"] = _quantized_share(q, kq, vq, ks, vs, table, q_lens, kv_lens, n_pre)
    ms = timed(thunks, args.runs, not args.no_flush)
    tokens = int(q_lens.sum())
    bw = probe_bytes / (ms["bandwidth"] / 1e3)
    rec = {"ms": ms, "tokens": tokens, "decode_bytes": dec_bytes, "bandwidth": bw,
           "q_lens": q_lens.tolist(), "kv_lens": kv_lens.tolist()}
    print("| call | ms | new tokens/s | vs ragged |")
    print("|---|---|---|---|")
    for name in ("ragged", "separate", "padded"):
        if name in ms:
            print(f"| {name} | {ms[name]:.1f} | {tokens / (ms[name] / 1e3):.0f} | {ms[name] / ms['ragged']:.2f}x |")
    rate = dec_bytes / (ms["decode_share"] / 1e3)
    print(f"decode share ({n_dec} steps, {dec_bytes / 1e6:.0f} MB of K/V): {ms['decode_share']:.1f} ms, "
          f"{n_dec / (ms['decode_share'] / 1e3):.0f} tokens/s, {rate / 1e9:.2f} GB/s = {rate / bw:.0%} of the "
          f"measured read bandwidth {bw / 1e9:.2f} GB/s")
    for qd in ("int8", "float8_e4m3fn"):
        key = f"decode_{qd}"
        if key in ms:
            print(f"decode share on {qd} pages: {ms[key]:.1f} ms, {n_dec / (ms[key] / 1e3):.0f} tokens/s, "
                  f"{ms['decode_share'] / ms[key]:.2f}x the {args.dtype} pages' tokens/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rec, f)
    return 0


def _quantized_share(q, kq, vq, ks, vs, table, q_lens, kv_lens, n_prefill):
    ql = q_lens.copy()
    ql[:n_prefill] = 0
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(ql)]), jnp.int32)
    lens = kv_lens.copy()
    lens[:n_prefill] = 0
    f = jax.jit(lambda q, kp, vp, ks, vs, t, lens, cu: paged.flex_attention_ragged(
        q, kp, vp, t, lens, cu, k_scale=ks, v_scale=vs))
    qd = q[:int(ql.sum())]
    return lambda: f(qd, kq, vq, ks, vs, table, jnp.asarray(lens), cu)


if __name__ == "__main__":
    sys.exit(main())
