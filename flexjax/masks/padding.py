"""Key padding mask from per-batch valid lengths."""

from collections.abc import Callable

import jax
from jax.typing import ArrayLike

from .._factory import batch_param, entry, named

MaskMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def _padding(b, h, q_idx, kv_idx, *, kv_lengths):
    del h, q_idx
    return kv_idx < entry(kv_lengths, b)


def padding(kv_lengths: ArrayLike) -> MaskMod:
    """Mask out padded keys: batch ``b`` sees keys ``kv_idx < kv_lengths[b]``.

    Args:
        kv_lengths: ``(B,)`` integer valid key counts per batch element; may be a
            traced array (lengths known only inside ``jit``). The mask reads ``b`` only
            when ``B > 1``.

    Returns:
        mask_mod ``(b, h, q_idx, kv_idx) -> bool`` named ``padding``.

    Raises:
        TypeError: ``kv_lengths`` is not an integer array.
        ValueError: ``kv_lengths`` is not 1-D.
    """
    return named(_padding, "padding", kv_lengths=batch_param("padding", "kv_lengths", kv_lengths))
