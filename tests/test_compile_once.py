"""A jitted training or serving step compiles once, in a fresh Python process.

A fresh process, so that import order is a user's: ``import flexjax``, build the inputs, jit a
step, call it several times. A JAX module that registers a jit-key configuration state, imported
for the first time in the middle of the first trace (as ``flexjax.sharding`` once was, and JAX
0.12's Pallas fuser when a paged call imported every backend), makes that first step compile twice.
Each step here counts its traces and XLA's compiles of it; the last test checks the cause directly:
after ``import flexjax``, importing every flexjax module leaves jit's trace context as it was.
"""

import os
import subprocess
import sys
import textwrap

import pytest

PRELUDE = textwrap.dedent("""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import flexjax
    from flexjax import masks, mods, paged

    compiles, traces = [], []


    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kwargs.get("fun_name"))


    jax.monitoring.register_event_duration_secs_listener(listen)
""")

SCENARIOS = {
    # A train step: the gradient of a causal attention through the projections.
    "dense_train_step": """
        B, S, H, D = 2, 64, 4, 16
        block_mask = flexjax.create_block_mask(masks.causal, None, None, S, S, block_size=32)

        @jax.jit
        def step(w, x):
            traces.append(1)

            def loss(w):
                q, k, v = jnp.split((x @ w).reshape(B, S, 3 * H, D), 3, axis=2)
                return (flexjax.flex_attention(q, k, v, block_mask=block_mask) ** 2).mean()

            return w - 0.1 * jax.grad(loss)(w)

        w = jnp.full((D, 3 * H * D), 1.0 / D, jnp.float32)
        for i in range(4):
            w = step(w, jax.random.normal(jax.random.key(i), (B, S, D)))
    """,
    # A paged decode step: one token a sequence, lengths growing.
    "paged_decode_step": """
        B, HQ, HKV, D, PAGE = 2, 4, 2, 16, 16
        k_pages, v_pages = paged.allocate(16, PAGE, HKV, D)
        table = paged.page_table_for(jnp.array([100, 100]), PAGE, 8)

        @jax.jit
        def step(q, k, v, k_pages, v_pages, lens):
            traces.append(1)
            k_pages, v_pages = paged.write(k_pages, v_pages, table, lens - 1, k, v)[:2]
            return paged.flex_attention(q, k_pages, v_pages, table, lens, mods.soft_cap(30.0)), k_pages, v_pages

        for t in range(1, 9):
            q, k, v = (jax.random.normal(jax.random.key(t), (B, 1, h, D)) for h in (HQ, HKV, HKV))
            out, k_pages, v_pages = step(q, k, v, k_pages, v_pages, jnp.array([t, t + 3], jnp.int32))
    """,
    # A ragged step: prefill chunks beside decode steps, the mix changing every step.
    "ragged_step": """
        HQ, HKV, D, PAGE, T = 4, 2, 16, 16, 32
        kp, vp = (jax.random.normal(jax.random.key(i), (24, PAGE, HKV, D)) for i in (1, 2))
        table = paged.page_table_for(jnp.array([80, 80, 80]), PAGE, 6)

        @jax.jit
        def step(q, lens, q_lens):
            traces.append(1)
            cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens)])
            return paged.flex_attention_ragged(q, kp, vp, table, lens, cu, score_mod=mods.soft_cap(30.0))

        for t in range(8):
            q_lens = np.array([min(16, 1 + 5 * t), 1, 8 - t % 3], np.int32)
            lens = np.array([20 + 5 * t, 40 + t, 60], np.int32)
            step(jax.random.normal(jax.random.key(t), (T, HQ, D)), lens, q_lens)
    """,
    # README's continuous batching: write_and_attend over an int8 pool with scales and a float tail.
    "write_and_attend_step": """
        S, T, HQ, HKV, D, PAGE, PAGES = 8, 64, 8, 2, 64, 16, 64
        k_pages, v_pages = paged.allocate(PAGES, PAGE, HKV, D, jnp.int8)
        k_scale = v_scale = jnp.zeros((PAGES, HKV))
        tail = paged.float_tail(S, k_pages, v_pages)
        table, free = jnp.full((S, 16), -1, jnp.int32), jnp.ones(PAGES, bool)

        @jax.jit
        def step(q, k, v, k_pages, v_pages, k_scale, v_scale, tail, table, free, lens, q_lens):
            traces.append(1)
            table, free, ok = paged.reserve(table, free, lens, PAGE)
            cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens)])
            out, *cache = paged.write_and_attend(q, k, v, k_pages, v_pages, table, lens, cu, k_scale=k_scale,
                                                 v_scale=v_scale, tail=tail, score_mod=mods.soft_cap(30.0))
            return out, *cache, table, free, ok

        todo, lens = np.array([40, 23, 1, 1, 9, 1, 1, 1]), np.zeros(S, np.int32)
        for t in range(8):
            q_lens = np.minimum(np.maximum(todo, 1), 16).astype(np.int32)
            todo, lens = todo - np.minimum(todo, q_lens), lens + q_lens
            q, k, v = (jax.random.normal(jax.random.key(t), (T, h, D)) for h in (HQ, HKV, HKV))
            out, k_pages, v_pages, k_scale, v_scale, tail, table, free, ok = step(
                q, k, v, k_pages, v_pages, k_scale, v_scale, tail, table, free, lens, q_lens)
    """,
    # The Flax layer's paged decode step under nnx.jit, token by token.
    "flax_decode_step": """
        from flax import nnx
        import flexjax.flax

        B, T, F, N = 2, 12, 32, 4
        layer = flexjax.flax.FlexMultiHeadAttention(N, F, num_kv_heads=2, mask_mod=masks.causal,
                                                    score_mod=mods.alibi(N), rngs=nnx.Rngs(0))
        layer.init_cache(B, T, page_size=8)
        x = jax.random.normal(jax.random.key(0), (B, T, F))

        @nnx.jit
        def step(m, x):
            traces.append(1)
            return m(x, decode=True)

        for t in range(T):
            step(layer, x[:, t:t + 1])
    """,
}


def _run(body: str) -> str:
    script = PRELUDE + textwrap.dedent(body) + '\nprint(len(traces), compiles.count("jit(step)"))\n'
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stdout.split()[-2:]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_step_traces_and_compiles_once(scenario):
    traced, compiled = _run(SCENARIOS[scenario])
    assert (traced, compiled) == ("1", "1"), f"{scenario}: traced {traced} times, compiled {compiled} times"


CONTEXT = textwrap.dedent("""
    import importlib, pkgutil
    from jax._src import config

    import flexjax

    before = config.trace_context()
    added = []
    for info in pkgutil.walk_packages(flexjax.__path__, "flexjax."):
        try:
            importlib.import_module(info.name)
        except Exception:  # a backend whose package is missing here (triton, a GPU plugin)
            continue
        if len(config.trace_context()) != len(before):
            added.append(info.name)
            before = config.trace_context()
    print("added:", added)
""")


def test_no_module_adds_a_jit_key_state_after_import():
    """Every flexjax module a call may import lazily (the backends' kernels, their JAX modules) adds nothing
    to jit's trace context once ``import flexjax`` has run: a new JAX release that registers a state in one
    of them fails here, and ``flexjax/_trace_states.py`` is where it is then imported up front."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", CONTEXT], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "added: []", run.stdout
