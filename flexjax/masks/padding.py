"""Key padding mask from per-batch valid lengths."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

MaskMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def padding(kv_lengths: ArrayLike) -> MaskMod:
    """Mask out padded keys: batch ``b`` sees keys ``kv_idx < kv_lengths[b]``.

    Args:
        kv_lengths: ``(B,)`` integer valid key counts per batch element; may be a
            traced array (lengths known only inside ``jit``).

    Returns:
        mask_mod ``(b, h, q_idx, kv_idx) -> bool`` named ``padding``.

    Raises:
        TypeError: ``kv_lengths`` is not an integer array.
        ValueError: ``kv_lengths`` is not 1-D.
    """
    kv_lengths = jnp.asarray(kv_lengths)
    if not jnp.issubdtype(kv_lengths.dtype, jnp.integer):
        raise TypeError(f"padding: kv_lengths must be an integer array, got {kv_lengths.dtype}")
    if kv_lengths.ndim != 1 or kv_lengths.shape[0] == 0:
        raise ValueError(f"padding: kv_lengths must have shape (B,) with B >= 1, got shape {kv_lengths.shape}")
    last = kv_lengths.shape[0] - 1

    def mask_mod(b, h, q_idx, kv_idx):
        del h, q_idx
        return kv_idx < kv_lengths[jnp.clip(b, 0, last)]

    mask_mod.__name__ = mask_mod.__qualname__ = "padding"
    return mask_mod
