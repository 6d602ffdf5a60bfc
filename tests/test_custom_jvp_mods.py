"""Mods that call functions with their own JVP rule (jax.nn.relu, softplus) differentiate by that rule on every backend.

The mod compiler used to inline a ``custom_jvp`` function's body into the kernel part, so
the kernels' gradient was that of the body: ``max(x, 0)`` has derivative 0.5 at 0, where
``jax.nn.relu``'s rule says 0. With queries of exact zeros (scores exactly 0) pallas' dq
was off by 0.5 against xla and the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flexjax


def relu_mod(score, b, h, q_idx, kv_idx):
    return jax.nn.relu(score) + 0.5 * jax.nn.softplus(score)


def _grads(backend, **kw):
    B, S, H, D = 1, 128, 2, 16
    q = jnp.zeros((B, S, H, D)).at[:, ::2].set(jax.random.normal(jax.random.PRNGKey(0), (B, S // 2, H, D)))
    k = jax.random.normal(jax.random.PRNGKey(1), (B, S, H, D))
    v = jax.random.normal(jax.random.PRNGKey(2), (B, S, H, D))
    bm = flexjax.create_block_mask(flexjax.masks.causal, None, None, S, S, block_size=64)

    def loss(q, k, v):
        return jnp.sum(flexjax.flex_attention(q, k, v, relu_mod, bm, backend=backend, **kw) ** 2)

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


# xla evaluates the mod's own jaxpr (its custom_jvp intact); the kernel backends go through the mod compiler.
@pytest.mark.parametrize("backend,kw", [("pallas", {"kernel_options": {"interpret": True}}),
                                        ("pallas", {"kernel_options": {"target": "tpu", "interpret": True}})],
                         ids=["pallas-gpu-template", "pallas-tpu-template"])
def test_custom_jvp_rule_reaches_the_kernels(backend, kw):
    want = _grads("reference")
    got = _grads(backend, **kw)
    for name, g, w in zip("qkv", got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-4, err_msg=f"d{name}")


def test_custom_jvp_stays_one_node_only_when_elementwise():
    from flexjax._modcompiler import compile_mod
    from flexjax._trace import trace_mod

    cm = compile_mod(trace_mod(relu_mod, "score", arg_name="score_mod").static(), "interpret")
    names = [n.prim.name for n in cm.nodes]
    assert names.count("custom_jvp_call") == 2  # relu and softplus's logaddexp


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("target", ["cuda", "tpu"])
def test_custom_jvp_mod_lowers_for_gpu_and_tpu(target):
    from test_pallas_lowering import MOSAIC_CALL, TRITON_CALL, _lower

    assert _lower(relu_mod, target, grad=True).count(TRITON_CALL if target == "cuda" else MOSAIC_CALL) == 3
