"""The compile suites' target for a catalog entry: its forward and every backward kernel, abstractly.

``grads(call)`` is ``jax.grad`` over ``(q, k, v, params)`` of the output's sum plus the finite
lse's sum, so one compile lowers the forward, dQ and dK/dV kernels; ``abstract_args`` the
inputs as ``ShapeDtypeStruct``s on a mesh's sharding. Used by ``compile_suite.py`` (pallas) and
``mosaic_gpu_suite.py``.
"""

from __future__ import annotations


def grads(call, name: str = "catalog_grads"):
    """``call(q, k, v, params) -> (out, lse)`` to the gradients of every input, as a function
    called ``name`` (jit names the XLA module after it, which a suite's dump filter may match)."""
    import jax
    import jax.numpy as jnp

    def loss(q, k, v, params):
        out, lse = call(q, k, v, params)
        return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

    def f(q, k, v, params):
        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, params)

    f.__name__ = f.__qualname__ = name
    return f


def abstract_args(B, S, Hq, Hkv, D, dtype, sharding, params):
    """q (B, S, Hq, D), k and v (B, S, Hkv, D) of ``dtype``, and ``params``' shapes, on ``sharding``."""
    import jax

    return (jax.ShapeDtypeStruct((B, S, Hq, D), dtype, sharding=sharding),
            jax.ShapeDtypeStruct((B, S, Hkv, D), dtype, sharding=sharding),
            jax.ShapeDtypeStruct((B, S, Hkv, D), dtype, sharding=sharding),
            jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), params))
