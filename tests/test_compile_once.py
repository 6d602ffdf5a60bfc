"""A jitted train step that calls flex_attention compiles once, in a fresh Python process.

A fresh process, so that import order is a user's: ``import flexjax``, build a mask, jit
a step. Importing a module that adds a jit tracing-context value in the middle of the
first trace (as ``flexjax.sharding`` once was) makes that first call compile twice.
"""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import jax
    import jax.numpy as jnp

    import flexjax
    from flexjax import masks

    compiles = []


    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kwargs.get("fun_name"))


    jax.monitoring.register_event_duration_secs_listener(listen)
    B, S, H, D = 2, 64, 4, 16
    block_mask = flexjax.create_block_mask(masks.causal, None, None, S, S, block_size=32)


    def train_step(w, x):
        def loss(w):
            q, k, v = jnp.split((x @ w).reshape(B, S, 3 * H, D), 3, axis=2)
            return (flexjax.flex_attention(q, k, v, block_mask=block_mask) ** 2).mean()

        return w - 0.1 * jax.grad(loss)(w)


    step = jax.jit(train_step)
    w = jnp.full((D, 3 * H * D), 1.0 / D, jnp.float32)
    for i in range(3):
        w = step(w, jax.random.normal(jax.random.key(i), (B, S, D)))
    print(compiles.count("jit(train_step)"))
""")


def test_train_step_compiles_once():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-1] == "1", f"train_step compiled {run.stdout.split()[-1]} times\n{run.stderr}"
