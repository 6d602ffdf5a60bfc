"""What a bare `pip install flexjax` (JAX and NumPy, no extras) must serve on CPU, checked against the reference.

Runs README.md's Python examples in order (they share names, as a reader running them would), then the
entry points the README and docs/decoding.md name: `paged.flex_attention`, a quantized (int8) pool,
`paged.flex_attention_ragged`, `paged.write_and_attend`, and `flex_attention(..., kernel_options=...)`,
and asks each optional backend whether it can serve (it must refuse with the extra to install, never
raise ImportError). `make test-bare` runs it in a fresh venv with `--bare` (which also checks that no
optional package is installed); tests/test_bare_install.py runs it in make test's venv with the optional
packages hidden (``--hide-optional``).

    python tests/bare_install.py [--bare | --hide-optional] [--skip-readme]
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import re
import sys

OPTIONAL = ("absl", "flax", "optax", "triton", "jax_triton", "torch")  # what the extras bring
README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


class _Hide:
    """A meta path finder that makes the optional packages unimportable, as on a bare install."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in OPTIONAL:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by tests/bare_install.py)", name=name)
        return None


def readme_examples():
    """README.md's ```python blocks, in order."""
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def check(name: str, got, want, tol: float) -> None:
    import numpy as np

    err = float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))))
    if not err <= tol:
        raise AssertionError(f"{name}: max abs error {err:.3g} > {tol:g}")
    print(f"ok   {name} (max abs error {err:.2g})")


def logical_cache(pages, table, scale=None):
    """(B, max_pages * page_size, H, D) float32: the pools gathered through the table (dequantized)."""
    import jax.numpy as jnp

    x = pages.astype(jnp.float32)
    if scale is not None:
        x = x * scale[:, None, :, None]
    t = jnp.maximum(table, 0)
    g = x[t]  # (B, max_pages, page, H, D)
    return g.reshape(g.shape[0], -1, *g.shape[3:])


def reference(q, k, v, lengths, score_mod=None, q_pos=None):
    """flex_attention(backend="reference") on a contiguous cache, keys past each length masked; queries
    at positions ``q_pos`` (B, Sq) (default: the last Sq of each length), causal."""
    import jax.numpy as jnp

    import flexjax

    B, Sq = q.shape[:2]
    if q_pos is None:
        q_pos = lengths[:, None] - Sq + jnp.arange(Sq)[None]

    def mask(b, h, q_idx, kv_idx):
        return (kv_idx < lengths[b]) & (kv_idx <= q_pos[b, q_idx])

    bm = flexjax.create_block_mask(mask, B, None, Sq, k.shape[1], block_size=16)
    return flexjax.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, backend="reference")


def entry_points() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import flexjax
    from flexjax import masks, mods, paged

    B, HQ, HKV, D, PAGE, MAXP = 3, 4, 2, 32, 16, 6
    lengths = jnp.array([37, 96, 5], jnp.int32)
    table = jnp.asarray(paged.page_table_for(np.asarray(lengths), PAGE, MAXP, num_pages=20, seed=0))
    keys = jax.random.split(jax.random.key(0), 4)
    k_pages, v_pages = (jax.random.normal(kk, (20, PAGE, HKV, D)) for kk in keys[:2])
    cap = mods.soft_cap(20.0)

    # paged.flex_attention: a decode step of 2 queries per sequence, causal, with a score_mod.
    q = jax.random.normal(keys[2], (B, 2, HQ, D))
    bm = flexjax.create_block_mask(masks.causal, None, None, MAXP * PAGE, MAXP * PAGE, block_size=PAGE)
    bm = paged.decode_block_mask(bm, lengths - 2, q_len=2)
    out = jax.jit(lambda q, kp, vp, t, n: paged.flex_attention(q, kp, vp, t, n, score_mod=cap, block_mask=bm))(
        q, k_pages, v_pages, table, lengths)
    want = reference(q, logical_cache(k_pages, table), logical_cache(v_pages, table), lengths, cap)
    check("paged.flex_attention (float32 pool, soft_cap, jit)", out, want, 2e-5)

    # A quantized pool: int8 pages with per-(page, head) scales, as paged.quantize makes them.
    (kq, ks), (vq, vs) = paged.quantize(k_pages, jnp.int8), paged.quantize(v_pages, jnp.int8)
    out = paged.flex_attention(q, kq, vq, table, lengths, score_mod=cap, block_mask=bm, k_scale=ks, v_scale=vs)
    want = reference(q, logical_cache(kq, table, ks), logical_cache(vq, table, vs), lengths, cap)
    check("paged.flex_attention (int8 pool with scales)", out, want, 2e-5)

    # paged.flex_attention_ragged: a prefill chunk of 5, two decode steps, packed, with a score_mod.
    q_lens = jnp.array([5, 1, 1], jnp.int32)
    cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens)])
    T = 8  # static capacity: the last row is padding
    qr = jax.random.normal(keys[3], (T, HQ, D))
    out = jax.jit(lambda *a: paged.flex_attention_ragged(*a, score_mod=cap))(qr, k_pages, v_pages, table, lengths, cu)
    kc, vc = logical_cache(k_pages, table), logical_cache(v_pages, table)
    for b in range(B):
        lo, n = int(cu[b]), int(q_lens[b])
        want = reference(qr[None, lo:lo + n], kc[b:b + 1], vc[b:b + 1], lengths[b:b + 1], cap)
        check(f"paged.flex_attention_ragged, sequence {b} ({n} queries)", out[lo:lo + n], want[0], 2e-5)

    # paged.write_and_attend: writes the new tokens into an int8 pool, then attends (causal).
    kp8, vp8 = paged.allocate(20, PAGE, HKV, D, jnp.int8)
    scale0 = jnp.zeros((20, HKV))
    k_new, v_new = (jax.random.normal(kk, (T, HKV, D)) for kk in jax.random.split(keys[0], 2))
    fresh = jnp.array([5, 1, 1], jnp.int32)  # each sequence's whole cache is these tokens
    cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(fresh)])
    out, kp8, vp8, ks8, vs8 = jax.jit(lambda *a: paged.write_and_attend(*a, k_scale=scale0, v_scale=scale0))(
        qr, k_new, v_new, kp8, vp8, table, fresh, cu)
    kc, vc = logical_cache(kp8, table, ks8), logical_cache(vp8, table, vs8)
    for b in range(B):
        lo, n = int(cu[b]), int(fresh[b])
        want = reference(qr[None, lo:lo + n], kc[b:b + 1], vc[b:b + 1], fresh[b:b + 1])
        check(f"paged.write_and_attend (int8), sequence {b}", out[lo:lo + n], want[0], 2e-5)
    written = logical_cache(kp8, table, ks8)[0, :5]
    check("paged.write_and_attend: the written keys, within a step of the scale", written, k_new[:5],
          float(jnp.max(ks8)) / 2 + 1e-6)

    # kernel_options on the default (CPU) backend, forward and backward.
    S = 64
    qd, kd, vd = (jax.random.normal(kk, (2, S, HQ, D)) for kk in jax.random.split(keys[1], 3))
    bmd = flexjax.create_block_mask(masks.causal, None, None, S, S, block_size=16)
    for opts in ({"block_q": 16, "block_kv": 32}, {"cpu_kernel": False}):
        def loss(q, opts=opts, backend=None):
            return (flexjax.flex_attention(q, kd, vd, score_mod=cap, block_mask=bmd, kernel_options=opts,
                                           backend=backend) ** 2).sum()
        check(f"flex_attention(kernel_options={opts})", jax.grad(loss)(qd),
              jax.grad(lambda q: loss(q, None, "reference"))(qd), 1e-3)


def optional_backends(bare: bool) -> None:
    """Each optional backend refuses (with the extra that brings its package) or serves; none raises."""
    import jax
    import jax.numpy as jnp

    import flexjax

    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    for name in ("mosaic_gpu", "triton", "pallas"):
        try:
            got = flexjax.explain(q, q, q, backend=name).backend
            print(f"ok   backend={name!r} serves this host")
        except NotImplementedError as e:
            got = str(e)
            print(f"ok   backend={name!r} refuses: {got}")
        # Refused for a package the bare install lacks: the reason names what to install. (From JAX 0.12 Mosaic
        # GPU imports without absl-py, and mosaic_gpu serves, in its interpreter on a CPU host.)
        missing = "needs the" in got and "package" in got
        if bare and missing and "flexjax[gpu]" not in got and "pip install torch" not in got:
            raise AssertionError(f"backend={name!r} on a bare install should name the extra to install, got {got!r}")
    print(f"ok   backend=None serves with {flexjax.explain(q, q, q).backend!r} on {jax.default_backend()}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bare", action="store_true", help="also check that no optional package is installed")
    parser.add_argument("--hide-optional", action="store_true",
                        help="make the optional packages unimportable, then check as --bare does")
    parser.add_argument("--skip-readme", action="store_true", help="skip README.md's examples")
    args = parser.parse_args()
    if args.hide_optional:
        if any(m.split(".")[0] in OPTIONAL + ("jax",) for m in sys.modules):
            raise SystemExit("--hide-optional must run before JAX or an optional package is imported")
        sys.meta_path.insert(0, _Hide())
        print(f"ok   {', '.join(OPTIONAL)} hidden")
    elif args.bare:
        present = [m for m in OPTIONAL if importlib.util.find_spec(m) is not None]
        if present:
            raise SystemExit(f"--bare: optional packages are installed: {present}")
        print(f"ok   none of {', '.join(OPTIONAL)} is installed")
    if not args.skip_readme:
        namespace: dict = {"__name__": "__readme__"}
        for i, block in enumerate(readme_examples()):
            exec(compile(block, f"README.md, example {i + 1}", "exec"), namespace)
            print(f"ok   README.md, example {i + 1} ({block.splitlines()[0][:60]})")
    entry_points()
    optional_backends(args.bare or args.hide_optional)
    print("bare install: every check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
