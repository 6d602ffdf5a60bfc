"""The error of quantized paged caches against the float cache, for the library's mods.

For each mod and each quantized dtype (int8, float8_e4m3fn; scales per (page, head) and per
head), a decode step (4 queries per sequence at the end of caches of ``--length`` tokens)
over the quantized pools against the same step over the float32 pools: the largest
absolute difference of the outputs, and the bound ``eps_v + max|v| (exp(2 delta) - 1)``,
``delta = scale * max_row ||q||_1 * eps_k`` (eps: the largest element error of each
dequantized pool), which holds for score_mods with slope at most 1 in the score (all the
library's: they add a bias or cap the score). q, k and v are standard normal.

    .venv/bin/python benchmarks/quant_error.py
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

import flexjax
from flexjax import masks, mods, paged


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=2048)
    args = p.parse_args(argv)
    B, Sq, HQ, HKV, D, PS = 4, 4, 8, 2, 128, 64
    L = args.length
    lengths = np.array([L, L // 2, L - 100, L // 3], np.int32)
    max_pages = -(-L // PS)
    table = jnp.asarray(paged.page_table_for(lengths, PS, max_pages, seed=0))
    n = table.max() + 1
    ks = jax.random.split(jax.random.key(0), 3)
    k, v = (jax.random.normal(x, (int(n), PS, HKV, D)) for x in ks[:2])
    q = jax.random.normal(ks[2], (B, Sq, HQ, D))
    cases = {
        "causal": (None, masks.causal_bottom_right(Sq, lengths)),
        "sliding_window_256": (None, flexjax.and_masks(masks.causal_bottom_right(Sq, lengths),
                                                       masks.sliding_window(256))),
        "alibi": (mods.alibi(HQ), masks.causal_bottom_right(Sq, lengths)),
        "soft_cap_30": (mods.soft_cap(30.0), masks.causal_bottom_right(Sq, lengths)),
    }
    scale = 1 / np.sqrt(D)
    print(f"B={B} Sq={Sq} Hq={HQ} Hkv={HKV} D={D} page {PS}, lengths {lengths.tolist()}, standard normal q, k, v")
    print("| mod | cache | max abs error of out | bound | max abs out |")
    print("|---|---|---|---|---|")
    for name, (score, mask) in cases.items():
        bm = flexjax.create_block_mask(mask, B, None, Sq, max_pages * PS, block_size=(16, PS))
        exact = paged.flex_attention(q, k, v, table, lengths, score, bm)
        for qd in ("int8", "float8_e4m3fn"):
            for per_page in (True, False):
                kq, ksc = paged.quantize(k, qd, per_page=per_page)
                vq, vsc = paged.quantize(v, qd, per_page=per_page)
                got = paged.flex_attention(q, kq, vq, table, lengths, score, bm, k_scale=ksc, v_scale=vsc)
                eps_k = float(jnp.abs(paged.dequantize(kq, ksc) - k).max())
                eps_v = float(jnp.abs(paged.dequantize(vq, vsc) - v).max())
                delta = scale * float(jnp.abs(q).sum(-1).max()) * eps_k
                bound = eps_v + float(jnp.abs(v).max()) * (np.exp(2 * delta) - 1)
                err = float(jnp.abs(got - exact).max())
                where = "per (page, head)" if per_page else "per head"
                print(f"| {name} | {qd}, {where} | {err:.4f} | {bound:.3f} | {float(jnp.abs(exact).max()):.2f} |")
    written(args.length)
    return 0


def written(L: int) -> None:
    """Element errors of per-(page, head) pools filled by ``paged.write`` as a server fills them (scales
    growing, pages requantized), in steps of amax / qmax of what each page holds: the largest error, and the
    largest final scale over that step; without and with a ``paged.float_tail``."""
    B, HKV, D, PS = 4, 2, 128, 64
    max_pages = -(-L // PS)
    table = jnp.asarray(paged.page_table_for([L] * B, PS, max_pages))
    x = jax.random.normal(jax.random.key(1), (B, L, HKV, D))
    write = jax.jit(paged.write)
    print(f"\nPools written by paged.write, B={B} L={L} Hkv={HKV} D={D} page {PS}, standard normal k: the largest "
          "element error and the largest final scale, in steps of amax / qmax of each page and head")
    print("| writes | dtype | float tail | max error / step | max final scale / step |")
    print("|---|---|---|---|---|")
    patterns = {"one token a step": [1] * L, "prefill 200, then one token a step": [200] + [1] * (L - 200),
                "chunks of 16": [16] * (L // 16)}
    for label, sizes in patterns.items():
        for (qd, qmax), with_tail in itertools.product((("int8", 127.0), ("float8_e4m3fn", 448.0)), (False, True)):
            pages, _ = paged.allocate(int(table.max()) + 1, PS, HKV, D, getattr(jnp, qd))
            scale = jnp.zeros((pages.shape[0], HKV), jnp.float32)
            tail = {"tail": paged.float_tail(B, pages, pages)} if with_tail else {}
            pos = 0
            for n in sizes:
                out = write(pages, pages, table, pos, x[:, pos:pos + n], x[:, pos:pos + n], k_scale=scale,
                            v_scale=scale, **tail)
                pages, scale = out[0], out[2]
                if with_tail:
                    tail = {"tail": out[4]}
                pos += n
            got = paged.gather(pages, table, scale)[:, :L]
            amax = jnp.abs(x).reshape(B, max_pages, PS, HKV, D).max((2, 4))  # (B, pages, Hkv)
            step = jnp.repeat(amax / qmax, PS, axis=1)[:, :L, :, None]
            err = float((jnp.abs(got - x) / step).max())
            ratio = float((scale[table] / (amax / qmax)).max())
            print(f"| {label} | {qd} | {'yes' if with_tail else 'no'} | {err:.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
