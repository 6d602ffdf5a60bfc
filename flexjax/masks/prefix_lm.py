"""Prefix-LM mask: bidirectional over a prefix, causal after it."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

MaskMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def prefix_lm(prefix_len: int | ArrayLike) -> MaskMod:
    """Prefix-LM mask: query ``q`` sees key ``k`` iff ``k < prefix_len`` or ``k <= q``.

    Args:
        prefix_len: prefix length, an int >= 0 shared by all batch elements, or a
            ``(B,)`` integer array indexed by the batch index (may be traced).

    Returns:
        mask_mod ``(b, h, q_idx, kv_idx) -> bool`` named ``prefix_lm_{prefix_len}`` for
        an int and ``prefix_lm`` for an array.

    Raises:
        TypeError: ``prefix_len`` is neither an int nor an integer array.
        ValueError: a negative int, or an array that is not 1-D.
    """
    if isinstance(prefix_len, bool):
        raise TypeError("prefix_lm: prefix_len must be an int or a (B,) integer array, got bool")
    if isinstance(prefix_len, (int, np.integer)):
        if prefix_len < 0:
            raise ValueError(f"prefix_lm: prefix_len must be >= 0, got {prefix_len}")
        n = int(prefix_len)

        def mask_mod(b, h, q_idx, kv_idx):
            del b, h
            return (kv_idx < n) | (q_idx >= kv_idx)

        mask_mod.__name__ = mask_mod.__qualname__ = f"prefix_lm_{n}"
        return mask_mod

    lengths = jnp.asarray(prefix_len)
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"prefix_lm: prefix_len must be an int or a (B,) integer array, got dtype {lengths.dtype}")
    if lengths.ndim != 1 or lengths.shape[0] == 0:
        raise ValueError(
            "prefix_lm: an array prefix_len must have shape (B,) with B >= 1, got shape "
            f"{lengths.shape}; pass an int for one prefix shared by the batch"
        )
    last = lengths.shape[0] - 1

    def batched_mask_mod(b, h, q_idx, kv_idx):
        del h
        return (kv_idx < lengths[jnp.clip(b, 0, last)]) | (q_idx >= kv_idx)

    batched_mask_mod.__name__ = batched_mask_mod.__qualname__ = "prefix_lm"
    return batched_mask_mod
