"""Logit soft-capping score_mod (Gemma 2, Grok)."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

ScoreMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def soft_cap(cap: float) -> ScoreMod:
    """Soft-caps scores into ``(-cap, cap)``: ``score -> cap * tanh(score / cap)``.

    See Gemma 2 (https://arxiv.org/abs/2408.00118), which uses ``cap = 50``.

    Args:
        cap: the cap, a finite number > 0.

    Returns:
        score_mod ``(score, b, h, q_idx, kv_idx) -> score`` named ``soft_cap_{cap:g}``;
        it keeps the score's dtype.

    Raises:
        TypeError: ``cap`` is not a real number.
        ValueError: ``cap`` is not finite and > 0.
    """
    if isinstance(cap, bool) or not isinstance(cap, (int, float, np.integer, np.floating)):
        raise TypeError(f"soft_cap: cap must be a float, got {type(cap).__name__}")
    if not (np.isfinite(cap) and cap > 0):
        raise ValueError(f"soft_cap: cap must be finite and > 0, got {cap}")
    cap = float(cap)

    def score_mod(score, b, h, q_idx, kv_idx):
        del b, h, q_idx, kv_idx
        return cap * jnp.tanh(score / cap)

    score_mod.__name__ = score_mod.__qualname__ = f"soft_cap_{cap:g}"
    return score_mod
