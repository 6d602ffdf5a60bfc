"""Dilated (strided) attention mask."""

from collections.abc import Callable

import jax
import numpy as np

from .._factory import named

MaskMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def _dilated(b, h, q_idx, kv_idx, *, stride):
    del b, h
    return (q_idx - kv_idx) % stride == 0


def dilated(stride: int) -> MaskMod:
    """Strided mask: query ``q`` sees key ``k`` iff ``(q - k) % stride == 0``.

    Not causal by itself; combine it, e.g. ``and_masks(causal, dilated(4))``.

    Args:
        stride: distance between attended keys, >= 1.

    Returns:
        mask_mod ``(b, h, q_idx, kv_idx) -> bool`` named ``dilated_{stride}``.

    Raises:
        TypeError: ``stride`` is not an int.
        ValueError: ``stride`` < 1.
    """
    if isinstance(stride, bool) or not isinstance(stride, (int, np.integer)):
        raise TypeError(f"dilated: stride must be an int, got {type(stride).__name__}")
    if stride < 1:
        raise ValueError(f"dilated: stride must be >= 1, got {stride}")
    return named(_dilated, f"dilated_{int(stride)}", stride=int(stride))
