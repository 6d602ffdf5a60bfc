"""Prefix-LM mask: bidirectional over a prefix, causal after it."""

from collections.abc import Callable

import jax
from jax.typing import ArrayLike

from .._factory import entry, int_or_batch_param, named

MaskMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def _prefix_lm(b, h, q_idx, kv_idx, *, prefix_len):
    del h
    return (kv_idx < entry(prefix_len, b)) | (q_idx >= kv_idx)


def prefix_lm(prefix_len: int | ArrayLike) -> MaskMod:
    """Prefix-LM mask: query ``q`` sees key ``k`` iff ``k < prefix_len`` or ``k <= q``.

    Args:
        prefix_len: prefix length shared by all batch elements, an int >= 0 or an
            integer JAX scalar (may be traced inside ``jit``), or a ``(B,)`` integer array
            indexed by the batch index (may be traced). The mask reads ``b`` only for a
            ``(B,)`` array with ``B > 1``.

    Returns:
        mask_mod ``(b, h, q_idx, kv_idx) -> bool`` named ``prefix_lm_{prefix_len}`` for
        a concrete scalar and ``prefix_lm`` for an array or traced value.

    Raises:
        TypeError: ``prefix_len`` is neither an int nor an integer array.
        ValueError: a negative int, or an array that is not 0-d or 1-D.
    """
    n = int_or_batch_param("prefix_lm", "prefix_len", prefix_len, minimum=0)
    return named(_prefix_lm, f"prefix_lm_{n}" if isinstance(n, int) else "prefix_lm", prefix_len=n)
