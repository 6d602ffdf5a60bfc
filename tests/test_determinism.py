"""The backward is deterministic (docs/training.md): the same jitted gradient gives the same bits,
run after run in one process (warm) and in fresh processes, for every backend that runs on a CPU
host and for the paged backward.

Each fresh process computes every target's gradients (q, k, v and a captured bias table) three
times and prints a digest of each run's bytes; the test starts two such processes and requires
all six digests of a target to agree. The C++ CPU kernel's dQ once took kv blocks as its threads
came free, so each thread's partial dQ (summed at the end) held a different set of blocks each
run: up to 5e-7 apart in thousands of elements, between two identical calls.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import hashlib, json, sys
    import jax
    import jax.numpy as jnp
    import numpy as np

    import flexjax
    from flexjax import masks, paged

    TPU_INTERPRET = {"target": "tpu", "interpret": True}
    targets = sys.argv[1].split(",")
    B, H, D = 2, 4, 32
    bias = jax.random.normal(jax.random.key(9), (2 * 512,)) * 0.1

    def bias_mod(table):  # a captured array, so its gradient is a reduction too
        return lambda s, b, h, qi, ki: s + table[qi - ki + 511]

    def dense(backend, options, S, table_grad=True):
        bm = flexjax.create_block_mask(masks.causal, B, None, S, S)
        q, k, v, do = (jax.random.normal(kk, (B, S, H, D)) for kk in jax.random.split(jax.random.key(0), 4))

        def loss(q, k, v, table):
            out = flexjax.flex_attention(q, k, v, bias_mod(table), bm, backend=backend, kernel_options=options)
            return jnp.sum(out * do)

        if backend == "xla" and options is None and not table_grad:  # which backward the kernel case runs
            plans["xla"] = flexjax.explain(q, k, v, bias_mod(bias), bm).plan.backward_qkv
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3) if table_grad else (0, 1, 2))), (q, k, v, bias)

    def paged_call(S=256, page=16):
        lens = jnp.array([S, S - 37], jnp.int32)
        kp, vp = paged.allocate(B * S // page, page, H, D)
        table = paged.page_table_for(lens, page, S // page)
        ks = jax.random.split(jax.random.key(1), 4)
        k, v = (jax.random.normal(kk, (B, S, H, D)) for kk in ks[:2])
        kp, vp = paged.write(kp, vp, table, jnp.zeros(B, jnp.int32), k, v)[:2]
        q, do = (jax.random.normal(kk, (B, S, H, D)) for kk in ks[2:])
        bm = flexjax.create_block_mask(masks.causal, B, None, S, S, block_size=(64, page))

        def loss(q, kp, vp, table_):
            return jnp.sum(paged.flex_attention(q, kp, vp, table, lens, bias_mod(table_), bm) * do)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))), (q, kp, vp, bias)

    CALLS = {
        "xla": lambda: dense("xla", None, 512, table_grad=False),     # the C++ CPU kernel, where it builds
        "xla_table": lambda: dense("xla", None, 512),                 # the table's gradient: XLA loops
        "xla_loops": lambda: dense("xla", {"cpu_kernel": False}, 512, table_grad=False),
        "reference": lambda: dense("reference", None, 256),
        "pallas": lambda: dense("pallas", None, 128),
        "pallas_tpu": lambda: dense("pallas", TPU_INTERPRET, 128),
        "paged": paged_call,
    }
    digests, plans = {}, {}
    for name in targets:
        grad, args = CALLS[name]()
        runs = []
        for _ in range(3):
            got = grad(*args)
            runs.append(hashlib.sha256(b"".join(np.asarray(g).tobytes() for g in got)).hexdigest())
        digests[name] = runs
    print(json.dumps({"digests": digests, "plans": plans}))
""")

FAST = ("xla", "xla_table", "xla_loops", "reference", "paged")
INTERPRETED = ("pallas", "pallas_tpu")


def _digests(targets) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(targets)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def _check(targets):
    first, second = _digests(targets), _digests(targets)
    if "xla" in targets:
        from flexjax.backends.xla import cpu

        want = "cpu_kernel" if cpu.usable() else "loops"
        assert first["plans"]["xla"] == want, first["plans"]
    first, second = first["digests"], second["digests"]
    for name in targets:
        runs = first[name] + second[name]
        assert len(set(runs)) == 1, f"{name}: the gradients' bytes differ between identical runs: {runs}"


@pytest.mark.ci_extra  # (make test-extra: about 20 s, two fresh processes)
def test_backward_is_bitwise_deterministic():
    """xla (the C++ kernel and its loops), reference and the paged backward: three runs in each of two
    fresh processes give the same bytes."""
    _check(FAST)


@pytest.mark.ci_extra  # (make test-extra: about 20 s)
def test_interpreted_backward_is_bitwise_deterministic():
    """The pallas kernels (Triton-lowered and Mosaic TPU, in interpret mode), the same way."""
    _check(INTERPRETED)
