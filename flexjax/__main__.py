"""Command line: ``python -m flexjax demo`` and ``python -m flexjax show-mask NAME``."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

# Each demo case: (label, mask name, score_mod name). Masks and mods are built by
# _mask_mod / _score_mod at the demo's size.
_DEMO_CASES = (
    ("soft_cap(20) + causal", "causal", "soft_cap"),
    ("alibi + sliding_window", "sliding_window", "alibi"),
    ("relative_bias + document", "document", "relative_bias"),
    ("none + prefix_lm", "prefix_lm", None),
)

MASK_NAMES = ("causal", "sliding_window", "prefix_lm", "document", "causal_document",
              "chunked_causal", "dilated", "full")


def _mask_mod(name: str, seq: int, *, window: int | None = None, docs: int = 4,
              prefix: int | None = None, chunk: int | None = None, stride: int = 4):
    """The mask_mod called ``name`` at sequence length ``seq`` (None for ``full``)."""
    import numpy as np

    from . import and_masks, masks

    if name == "full":
        return None
    if name == "causal":
        return masks.causal
    if name == "sliding_window":
        return masks.sliding_window(window if window is not None else max(1, seq // 8))
    if name == "prefix_lm":
        return masks.prefix_lm(prefix if prefix is not None else seq // 4)
    if name in ("document", "causal_document"):
        # ``docs`` documents of unequal lengths (a rising share each), like packed data.
        weights = np.arange(1, docs + 1, dtype=np.float64)
        bounds = np.concatenate([[0], np.round(np.cumsum(weights) / weights.sum() * seq)]).astype(np.int32)
        ids = np.repeat(np.arange(docs, dtype=np.int32), np.diff(bounds))
        doc = masks.document(ids)
        return and_masks(masks.causal, doc) if name == "causal_document" else doc
    if name == "chunked_causal":
        return masks.chunked_causal(chunk if chunk is not None else max(1, seq // 4))
    if name == "dilated":
        return and_masks(masks.causal, masks.dilated(stride))
    raise ValueError(f"unknown mask {name!r}; choose one of {', '.join(MASK_NAMES)}")


def _score_mod(name: str | None, heads: int, seq: int):
    import jax
    import jax.numpy as jnp

    from . import mods

    if name is None:
        return None
    if name == "soft_cap":
        return mods.soft_cap(20.0)
    if name == "alibi":
        return mods.alibi(heads)
    if name == "relative_bias":
        table = 0.5 * jax.random.normal(jax.random.key(7), (heads, 2 * seq - 1), jnp.float32)
        return mods.relative_bias(table)
    raise ValueError(f"unknown score_mod {name!r}")


def _median_ms(fn, *args, warmup: int = 2, runs: int = 5) -> float:
    for _ in range(warmup):
        _block(fn(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        _block(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _block(x):
    import jax

    return jax.block_until_ready(x)


def dense_attention(q, k, v, mask=None, bias=None):
    """softmax(q·kᵀ/sqrt(d) + bias, masked) v in jnp, materializing (B, H, Sq, Skv) scores.

    Layout (batch, seq, heads, head_dim), as flex_attention. Rows without an allowed key
    give 0, as in flex_attention.
    """
    import jax
    import jax.numpy as jnp

    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
    if bias is not None:
        s = s + bias
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    if mask is not None:
        # A fully masked row is NaN after softmax; flex_attention defines it as 0.
        p = jnp.where(mask.any(-1, keepdims=True), p, 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def _print_masks(seq: int, block: int) -> None:
    from . import create_block_mask

    for name in ("causal", "sliding_window", "causal_document"):
        bm = create_block_mask(_mask_mod(name, seq), None, None, seq, seq, block_size=block)
        print(bm.to_string(grid_size=(16, 32)))
        print()


def _check_cases(seq: int, heads: int, dim: int) -> bool:
    import jax
    import numpy as np

    from . import create_block_mask, flex_attention
    from .backends import platform_backends

    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(x, (1, seq, heads, dim)) for x in ks)
    default = platform_backends()[0]
    print(f"correctness: B=1 H={heads} S={seq} D={dim} float32, backend={default!r} vs 'reference'")
    ok_all = True
    for label, mask_name, mod_name in _DEMO_CASES:
        bm = create_block_mask(_mask_mod(mask_name, seq), None, None, seq, seq, block_size=64)
        score_mod = _score_mod(mod_name, heads, seq)
        out = flex_attention(q, k, v, score_mod, bm)
        ref = flex_attention(q, k, v, score_mod, bm, backend="reference")
        err = float(np.max(np.abs(np.asarray(out) - np.asarray(ref))))
        # float32 online softmax vs dense softmax agree to a few ulps of O(1) outputs.
        ok = bool(np.isfinite(err) and err < 1e-4)
        ok_all &= ok
        print(f"  {label:<28} max|err| = {err:.2e}  {'OK' if ok else 'FAIL'}")
    return ok_all


def _timing_table(seq: int, heads: int, dim: int, runs: int) -> None:
    import jax
    import jax.numpy as jnp

    from . import create_block_mask, create_mask, flex_attention, masks

    ks = jax.random.split(jax.random.key(1), 3)
    q, k, v = (jax.random.normal(x, (1, seq, heads, dim)) for x in ks)
    bm = create_block_mask(masks.causal, None, None, seq, seq)
    dense_mask = create_mask(masks.causal, None, None, seq, seq)
    flex = jax.jit(lambda q, k, v, bm: flex_attention(q, k, v, block_mask=bm))
    dense = jax.jit(dense_attention)
    dpa = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"))
    rows = [
        ("flexjax.flex_attention (causal BlockMask)", lambda: _median_ms(flex, q, k, v, bm, runs=runs)),
        ("dense jnp softmax(QK^T) + dense mask", lambda: _median_ms(dense, q, k, v, dense_mask, runs=runs)),
        ("jax.nn.dot_product_attention(is_causal)", lambda: _median_ms(dpa, q, k, v, runs=runs)),
    ]
    # Causal attention computes S(S+1)/2 of the S^2 (q, kv) pairs; 4 flops per pair per dim.
    flops = 4 * heads * dim * seq * (seq + 1) / 2
    print(f"timing: causal forward, B=1 H={heads} S={seq} D={dim} {jnp.float32.dtype}, jitted, "
          f"median of {runs} after warm-up ({jax.default_backend()}, {jax.device_count()} device(s))")
    print(f"  {'implementation':<44}{'ms':>9}{'eff. GFLOP/s':>14}")
    for label, measure in rows:
        ms = measure()
        print(f"  {label:<44}{ms:>9.2f}{flops / ms / 1e6:>14.1f}")


def demo(args: argparse.Namespace) -> int:
    """Mask pictures, a correctness check against the reference backend, a timing table."""
    seq_check, seq_time = (256, 512) if args.small else (512, 2048)
    t0 = time.perf_counter()
    print(f"== block masks (S={seq_check * 2}, block 64) ==")
    _print_masks(seq_check * 2, 64)
    print("== flex_attention vs the dense reference ==")
    ok = _check_cases(seq_check, heads=4, dim=64)
    print()
    if not args.no_timing:
        print("== timing ==")
        _timing_table(seq_time, heads=8, dim=64, runs=3 if args.small else 5)
        print()
    print(f"demo {'passed' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1


def show_mask(args: argparse.Namespace) -> int:
    """Prints a named mask's BlockMask picture and, with --out, saves its plot."""
    from . import create_block_mask

    mask_mod = _mask_mod(args.name, args.seq, window=args.window, docs=args.docs,
                         prefix=args.prefix, chunk=args.chunk, stride=args.stride)
    bm = create_block_mask(mask_mod, None, None, args.seq, args.seq, block_size=args.block)
    print(bm.to_string())
    if args.out:
        fig = bm.plot()
        fig.savefig(args.out, dpi=120, bbox_inches="tight")
        print(f"saved {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flexjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="mask pictures, a check against the reference, a timing table")
    p.add_argument("--small", action="store_true", help="smaller shapes (for tests)")
    p.add_argument("--no-timing", action="store_true", help="skip the timing table")
    p.set_defaults(func=demo)

    p = sub.add_parser("show-mask", help="print (and plot) the BlockMask of a named mask")
    p.add_argument("name", choices=MASK_NAMES)
    p.add_argument("--seq", type=int, default=2048, help="sequence length (queries and keys)")
    p.add_argument("--block", type=int, default=128, help="BlockMask block size")
    p.add_argument("--window", type=int, default=None, help="sliding_window: keys before each query (default seq/8)")
    p.add_argument("--docs", type=int, default=4, help="document, causal_document: number of documents")
    p.add_argument("--prefix", type=int, default=None, help="prefix_lm: prefix length (default seq/4)")
    p.add_argument("--chunk", type=int, default=None, help="chunked_causal: chunk length (default seq/4)")
    p.add_argument("--stride", type=int, default=4, help="dilated: stride (causal & dilated)")
    p.add_argument("--out", default=None, help="save the plot to this file (needs matplotlib)")
    p.set_defaults(func=show_mask)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
