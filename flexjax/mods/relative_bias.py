"""Learnable relative-position bias score_mod (one bias per head and distance)."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from .._factory import named, replicated

ScoreMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def _relative_bias(score, b, h, q_idx, kv_idx, *, table):
    del b
    col = jnp.clip(kv_idx - q_idx + table.shape[-1] // 2, 0, table.shape[-1] - 1)
    bias = table[col] if table.ndim == 1 else table[jnp.clip(h, 0, table.shape[0] - 1), col]
    return score + bias.astype(score.dtype)


def relative_bias(table: ArrayLike) -> ScoreMod:
    """Adds ``table[h, kv_idx - q_idx + S - 1]`` to each score.

    Distances beyond ``S - 1`` in either direction use the table's edge entries.

    Args:
        table: ``(H, 2 * S - 1)`` floating bias, entry ``S - 1`` for distance 0; usually
            a learnable JAX array (gradients reach it through flex_attention). With
            ``H = 1`` the score_mod does not read ``h``.

    Returns:
        score_mod ``(score, b, h, q_idx, kv_idx) -> score`` named ``relative_bias``; it
        keeps the score's dtype.

    Raises:
        TypeError: ``table`` is not floating point.
        ValueError: ``table`` is not ``(H, 2 * S - 1)``.
    """
    table = replicated(jnp.asarray(table))
    if not jnp.issubdtype(table.dtype, jnp.floating):
        raise TypeError(f"relative_bias: table must be a floating array, got dtype {table.dtype}")
    if table.ndim != 2 or table.shape[0] == 0 or table.shape[1] % 2 != 1:
        raise ValueError(
            "relative_bias: table must have shape (H, 2 * S - 1) (an odd number of "
            f"distances, centred on 0), got shape {table.shape}"
        )
    return named(_relative_bias, "relative_bias", table=table[0] if table.shape[0] == 1 else table)
