"""ALiBi linear position bias score_mods (https://arxiv.org/abs/2108.12409)."""

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from .._factory import entry, named, replicated

ScoreMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The standard ALiBi head slopes, as in the paper's reference code.

    For a power of two ``n`` the slopes are ``2**(-8 * i / n)`` for ``i = 1..n``. Otherwise
    take the ``2**floor(log2(n))`` power-of-two slopes, then every other slope of the
    next power of two until there are ``n``.

    Args:
        num_heads: number of (query) heads, >= 1.

    Returns:
        ``(num_heads,)`` float64 slopes.

    Raises:
        TypeError: ``num_heads`` is not an int.
        ValueError: ``num_heads`` < 1.
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)):
        raise TypeError(f"alibi_slopes: num_heads must be an int, got {type(num_heads).__name__}")
    if num_heads < 1:
        raise ValueError(f"alibi_slopes: num_heads must be >= 1, got {num_heads}")
    num_heads = int(num_heads)
    power = 2 ** math.floor(math.log2(num_heads))
    slopes = 2.0 ** (-8.0 * np.arange(1, power + 1) / power)
    if power == num_heads:
        return slopes
    extra = 2.0 ** (-8.0 * np.arange(1, 2 * power + 1) / (2 * power))
    return np.concatenate([slopes, extra[0::2][: num_heads - power]])


def _alibi(score, b, h, q_idx, kv_idx, *, slopes):
    del b
    slope = entry(slopes, h)
    return score + (slope * (kv_idx - q_idx).astype(slope.dtype)).astype(score.dtype)


def alibi_from_slopes(slopes: ArrayLike) -> ScoreMod:
    """ALiBi with given per-head slopes: ``score + slopes[h] * (kv_idx - q_idx)``.

    Args:
        slopes: ``(H,)`` slopes, one per query head; may be a learnable JAX array,
            traced inside ``jit`` or ``grad`` (gradients reach it through
            flex_attention). With ``H = 1`` the score_mod does not read ``h``.

    Returns:
        score_mod ``(score, b, h, q_idx, kv_idx) -> score`` named ``alibi_{H}h``; it keeps
        the score's dtype.

    Raises:
        ValueError: ``slopes`` is not a non-empty 1-D array.
    """
    slopes = replicated(jnp.asarray(slopes))
    if slopes.ndim != 1 or slopes.shape[0] == 0:
        raise ValueError(f"alibi_from_slopes: slopes must have shape (H,) with H >= 1, got shape {slopes.shape}")
    if not jnp.issubdtype(slopes.dtype, jnp.floating):
        slopes = slopes.astype(jnp.float32)
    num_heads = slopes.shape[0]
    return named(_alibi, f"alibi_{num_heads}h", slopes=slopes[0] if num_heads == 1 else slopes)


def alibi(num_heads: int) -> ScoreMod:
    """ALiBi with the standard slopes for ``num_heads`` query heads.

    Args:
        num_heads: number of query heads, >= 1.

    Returns:
        score_mod ``(score, b, h, q_idx, kv_idx) -> score`` named ``alibi_{num_heads}h``.

    Raises:
        TypeError: ``num_heads`` is not an int.
        ValueError: ``num_heads`` < 1.
    """
    return alibi_from_slopes(alibi_slopes(num_heads).astype(np.float32))
