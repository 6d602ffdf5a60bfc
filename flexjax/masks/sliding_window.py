"""Sliding-window (local, banded) attention mask."""

from collections.abc import Callable

import jax

from .._factory import int_param, named

MaskMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def _sliding_window(b, h, q_idx, kv_idx, *, left, right):
    del b, h
    return (kv_idx >= q_idx - left) & (kv_idx <= q_idx + right)


def sliding_window(left: int | jax.Array, right: int | jax.Array = 0) -> MaskMod:
    """Band mask: query ``q`` sees key ``k`` iff ``q - left <= k <= q + right``.

    ``sliding_window(w)`` is causal local attention over the current token and the
    ``w`` before it (Mistral-style with window ``w + 1``).

    Args:
        left: how many earlier keys each query sees, >= 0; an int or an integer JAX
            scalar, which may be traced inside ``jit`` (its value is then not checked).
        right: how many later keys each query sees, >= 0 (0 = causal); as ``left``.

    Returns:
        mask_mod ``(b, h, q_idx, kv_idx) -> bool`` named ``sliding_window_{left}_{right}``,
        or ``sliding_window`` when a width is traced.

    Raises:
        TypeError: ``left`` or ``right`` is not an int or an integer scalar.
        ValueError: a concrete ``left`` or ``right`` is negative.
    """
    left = int_param("sliding_window", "left", left, minimum=0)
    right = int_param("sliding_window", "right", right, minimum=0)
    concrete = isinstance(left, int) and isinstance(right, int)
    name = f"sliding_window_{left}_{right}" if concrete else "sliding_window"
    return named(_sliding_window, name, left=left, right=right)
