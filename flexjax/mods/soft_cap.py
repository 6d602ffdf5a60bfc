"""Logit soft-capping score_mod (Gemma 2, Grok)."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .._factory import describe, is_traced, named

ScoreMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def _soft_cap(score, b, h, q_idx, kv_idx, *, cap):
    del b, h, q_idx, kv_idx
    if not isinstance(cap, float):
        cap = cap.astype(score.dtype)
    return cap * jnp.tanh(score / cap)


def soft_cap(cap: float | jax.Array) -> ScoreMod:
    """Soft-caps scores into ``(-cap, cap)``: ``score -> cap * tanh(score / cap)``.

    See Gemma 2 (https://arxiv.org/abs/2408.00118), which uses ``cap = 50``.

    Args:
        cap: the cap, a finite number > 0, or a floating JAX scalar; a traced one (e.g. a
            learnable cap under ``jax.grad``) is captured, so gradients reach it, and its
            value is not checked.

    Returns:
        score_mod ``(score, b, h, q_idx, kv_idx) -> score`` named ``soft_cap_{cap:g}``
        (``soft_cap`` for a traced cap); it keeps the score's dtype.

    Raises:
        TypeError: ``cap`` is not a real number or a floating scalar.
        ValueError: a concrete ``cap`` that is not finite and > 0.
    """
    is_scalar = isinstance(cap, (jax.Array, np.ndarray)) and cap.shape == ()
    if is_traced(cap) and is_scalar and jnp.issubdtype(cap.dtype, jnp.floating):
        return named(_soft_cap, "soft_cap", cap=cap)
    if is_scalar and not is_traced(cap) and jnp.issubdtype(cap.dtype, np.number):
        cap = cap.item()
    if isinstance(cap, bool) or not isinstance(cap, (int, float, np.integer, np.floating)):
        raise TypeError(f"soft_cap: cap must be a float, got {describe(cap)}; pass a number or a floating JAX scalar")
    if not (np.isfinite(cap) and cap > 0):
        raise ValueError(f"soft_cap: cap must be finite and > 0, got {cap}")
    return named(_soft_cap, f"soft_cap_{float(cap):g}", cap=float(cap))
