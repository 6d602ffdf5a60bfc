"""A/B timing of the CPU paths against another source tree: prints one JSON line of medians (ms).

Times the default backend (xla, the C++ kernel where it builds) on causal S=4096, a sliding
window of 256 and 4 causal documents at S=8192 (B=1, H=8, D=64, float32, block 128),
forward and forward + backward, and the XLA loops (``cpu_kernel=False``) with a learned
relative bias's gradient at S=2048. Run it alternately on two trees, for example the
current one and a worktree of an older commit, and compare pair by pair:

    git worktree add /tmp/old <commit>
    for i in 1 2 3; do
      .venv/bin/python benchmarks/bench_cpu_ab.py --tree $PWD
      .venv/bin/python benchmarks/bench_cpu_ab.py --tree /tmp/old
    done

``--tree`` imports flexjax from that source tree (``.venv``'s editable install would otherwise
win over PYTHONPATH, and both runs would time the current tree).
"""

import json
import sys
import time

if "--tree" in sys.argv:  # before flexjax is imported
    _tree = sys.argv[sys.argv.index("--tree") + 1]
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in (getattr(f, "__module__", "") + repr(f)).lower()]
    sys.path.insert(0, _tree)

import jax
import jax.numpy as jnp
import numpy as np

import flexjax
from flexjax import masks, mods

B, H, D = 1, 8, 64
SPECS = [("causal", 4096), ("window256", 8192), ("docs4", 8192)]


def ids(S, n):
    return jnp.asarray(np.repeat(np.arange(n), S // n), jnp.int32)


def mask(name, S):
    if name == "causal":
        return masks.causal
    if name == "window256":
        return masks.sliding_window(256)
    return flexjax.and_masks(masks.causal, masks.document(ids(S, 4)))


def timeit(fn, *a, n=5):
    """Median ms of ``n`` calls after one warm-up (compile) call."""
    jax.block_until_ready(fn(*a))
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*a))
        ts.append(time.perf_counter() - t0)
    return round(1000 * float(np.median(ts)), 1)


def main():
    out = {}
    for name, S in SPECS:
        k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
        q, k, v = (jax.random.normal(kk, (B, S, H, D)) for kk in (k1, k2, k3))
        bm = flexjax.create_block_mask(mask(name, S), None, None, S, S)
        f = jax.jit(lambda q, k, v: flexjax.flex_attention(q, k, v, block_mask=bm))
        g = jax.jit(jax.grad(lambda q, k, v: flexjax.flex_attention(q, k, v, block_mask=bm).sum(), argnums=(0, 1, 2)))
        out[f"fwd {name}"] = timeit(f, q, k, v)
        out[f"fwdbwd {name}"] = timeit(g, q, k, v, n=3)
    # the XLA loops (C++ kernel off), with a learned bias's gradient: the JAX online softmax
    S = 2048
    q, k, v = (jax.random.normal(kk, (B, S, H, D)) for kk in jax.random.split(jax.random.PRNGKey(1), 3))
    bm = flexjax.create_block_mask(masks.causal, None, None, S, S)
    t = 0.1 * jax.random.normal(jax.random.PRNGKey(2), (H, 2 * S - 1))
    opts = {"cpu_kernel": False}
    f = jax.jit(lambda q, k, v, t: flexjax.flex_attention(q, k, v, mods.relative_bias(t), bm, kernel_options=opts))
    g = jax.jit(jax.grad(lambda q, k, v, t: flexjax.flex_attention(q, k, v, mods.relative_bias(t), bm,
                                                                   kernel_options=opts).sum(),
                         argnums=(0, 1, 2, 3)))
    out["loops fwd causal+relbias S=2048"] = timeit(f, q, k, v, t)
    out["loops fwdbwd causal+relbias S=2048"] = timeit(g, q, k, v, t, n=3)
    out["tree"] = flexjax.__file__.rsplit("/flexjax/", 1)[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
