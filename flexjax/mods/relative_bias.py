"""Learnable relative-position bias score_mod (one bias per head and distance)."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

ScoreMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def relative_bias(table: ArrayLike) -> ScoreMod:
    """Adds ``table[h, kv_idx - q_idx + S - 1]`` to each score.

    Distances beyond ``S - 1`` in either direction use the table's edge entries.

    Args:
        table: ``(H, 2 * S - 1)`` floating bias, entry ``S - 1`` for distance 0; usually
            a learnable JAX array (gradients reach it through flex_attention).

    Returns:
        score_mod ``(score, b, h, q_idx, kv_idx) -> score`` named ``relative_bias``; it
        keeps the score's dtype.

    Raises:
        TypeError: ``table`` is not floating point.
        ValueError: ``table`` is not ``(H, 2 * S - 1)``.
    """
    table = jnp.asarray(table)
    if not jnp.issubdtype(table.dtype, jnp.floating):
        raise TypeError(f"relative_bias: table must be a floating array, got dtype {table.dtype}")
    if table.ndim != 2 or table.shape[0] == 0 or table.shape[1] % 2 != 1:
        raise ValueError(
            "relative_bias: table must have shape (H, 2 * S - 1) (an odd number of "
            f"distances, centred on 0), got shape {table.shape}"
        )
    last_head, last_col = table.shape[0] - 1, table.shape[1] - 1
    offset = last_col // 2

    def score_mod(score, b, h, q_idx, kv_idx):
        del b
        col = jnp.clip(kv_idx - q_idx + offset, 0, last_col)
        return score + table[jnp.clip(h, 0, last_head), col].astype(score.dtype)

    score_mod.__name__ = score_mod.__qualname__ = "relative_bias"
    return score_mod
