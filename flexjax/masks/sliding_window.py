"""Sliding-window (local, banded) attention mask."""

from collections.abc import Callable

import jax
import numpy as np

MaskMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def sliding_window(left: int, right: int = 0) -> MaskMod:
    """Band mask: query ``q`` sees key ``k`` iff ``q - left <= k <= q + right``.

    ``sliding_window(w)`` is causal local attention over the current token and the
    ``w`` before it (Mistral-style with window ``w + 1``).

    Args:
        left: how many earlier keys each query sees, >= 0.
        right: how many later keys each query sees, >= 0 (0 = causal).

    Returns:
        mask_mod ``(b, h, q_idx, kv_idx) -> bool`` named ``sliding_window_{left}_{right}``.

    Raises:
        TypeError: ``left`` or ``right`` is not an int.
        ValueError: ``left`` or ``right`` is negative.
    """
    for name, value in (("left", left), ("right", right)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"sliding_window: {name} must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"sliding_window: {name} must be >= 0, got {value}")
    left, right = int(left), int(right)

    def mask_mod(b, h, q_idx, kv_idx):
        del b, h
        return (kv_idx >= q_idx - left) & (kv_idx <= q_idx + right)

    mask_mod.__name__ = mask_mod.__qualname__ = f"sliding_window_{left}_{right}"
    return mask_mod
