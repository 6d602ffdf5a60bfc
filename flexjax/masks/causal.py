"""Causal masks: plain and chunked (block-diagonal causal)."""

from collections.abc import Callable

import jax
import numpy as np

MaskMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def causal(b: jax.Array, h: jax.Array, q_idx: jax.Array, kv_idx: jax.Array) -> jax.Array:
    """Causal (top-left aligned) mask: query ``q_idx`` sees keys ``kv_idx <= q_idx``.

    Args:
        b: batch index, int32 (unused).
        h: query head index, int32 (unused).
        q_idx: query positions, int32, e.g. ``(bq, 1)``.
        kv_idx: key positions, int32, e.g. ``(1, bk)``.

    Returns:
        bool array of the broadcast shape of ``q_idx`` and ``kv_idx``.
    """
    del b, h
    return q_idx >= kv_idx


def chunked_causal(chunk: int) -> MaskMod:
    """Causal attention within consecutive chunks of ``chunk`` tokens.

    Query ``q`` sees key ``k`` iff ``q // chunk == k // chunk`` and ``k <= q``
    (as in Llama 4's chunked attention).

    Args:
        chunk: chunk length in tokens, >= 1.

    Returns:
        mask_mod ``(b, h, q_idx, kv_idx) -> bool`` named ``chunked_causal_{chunk}``.

    Raises:
        TypeError: ``chunk`` is not an int.
        ValueError: ``chunk`` < 1.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)):
        raise TypeError(f"chunked_causal: chunk must be an int, got {type(chunk).__name__}")
    if chunk < 1:
        raise ValueError(f"chunked_causal: chunk must be >= 1, got {chunk}")
    chunk = int(chunk)

    def mask_mod(b, h, q_idx, kv_idx):
        del b, h
        return (q_idx // chunk == kv_idx // chunk) & (q_idx >= kv_idx)

    mask_mod.__name__ = mask_mod.__qualname__ = f"chunked_causal_{chunk}"
    return mask_mod
