"""Causal masks: top-left aligned, bottom-right aligned, with an offset, and chunked."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from .._factory import entry, int_or_batch_param, named

MaskMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def causal(b: jax.Array, h: jax.Array, q_idx: jax.Array, kv_idx: jax.Array) -> jax.Array:
    """Causal (top-left aligned) mask: query ``q_idx`` sees keys ``kv_idx <= q_idx``.

    With ``Q_LEN != KV_LEN`` the queries are the *first* ``Q_LEN`` positions (as in
    PyTorch), so a decode step (``Q_LEN = 1``) sees only key 0. For queries that come
    after a KV cache use ``causal_bottom_right``.

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


def _causal_with_offset(b, h, q_idx, kv_idx, *, offset):
    del h
    return kv_idx <= q_idx + entry(offset, b)


def causal_with_offset(offset: int | ArrayLike) -> MaskMod:
    """Causal mask shifted by ``offset``: query ``q`` sees keys ``k <= q + offset``.

    ``offset = 0`` is ``causal``; ``offset = KV_LEN - Q_LEN`` is ``causal_bottom_right``.
    A negative offset hides the first ``-offset`` queries' keys entirely (such rows
    give output 0).

    Args:
        offset: an int; an integer JAX scalar (may be traced inside ``jit``); or a ``(B,)``
            integer array indexed by the batch index (may be traced), e.g. per-sequence
            cache lengths. The mask reads ``b`` only for a ``(B,)`` array with ``B > 1``.

    Returns:
        mask_mod ``(b, h, q_idx, kv_idx) -> bool`` named ``causal_with_offset_{offset}``
        for a concrete scalar and ``causal_with_offset`` for an array or traced value.

    Raises:
        TypeError: ``offset`` is not an int or an integer array.
        ValueError: an array ``offset`` that is not 0-d or ``(B,)``.
    """
    offset = int_or_batch_param("causal_with_offset", "offset", offset)
    name = f"causal_with_offset_{offset}" if isinstance(offset, int) else "causal_with_offset"
    return named(_causal_with_offset, name, offset=offset)


def causal_bottom_right(q_len: int | ArrayLike, kv_len: int | ArrayLike) -> MaskMod:
    """Bottom-right aligned causal mask: the queries are the last ``q_len`` positions.

    Query ``i`` sits at position ``i + kv_len - q_len`` and sees keys up to it
    (FlashAttention's ``causal=True`` for ``Sq != Skv``): a decode step (``q_len = 1``)
    sees the whole cache, a chunk of ``q_len`` new tokens sees the cache and is causal
    within itself. ``causal`` is the top-left aligned variant (PyTorch's); the two agree
    when ``q_len == kv_len``. ``create_block_mask`` still takes the (padded) array lengths
    as ``Q_LEN`` and ``KV_LEN``.

    Args:
        q_len: number of queries, an int >= 1, an integer JAX scalar or a ``(B,)`` array.
        kv_len: number of valid keys, an int >= 0, an integer JAX scalar, or a ``(B,)``
            integer array of per-sequence lengths for a padded cache (keys at or past
            ``kv_len[b]`` are then masked too). Arrays may be traced; the mask reads
            ``b`` only for a ``(B,)`` array with ``B > 1``.

    Returns:
        mask_mod ``(b, h, q_idx, kv_idx) -> bool`` named
        ``causal_bottom_right_{q_len}_{kv_len}`` for ints and ``causal_bottom_right``
        otherwise.

    Raises:
        TypeError: a length that is not an int or an integer array.
        ValueError: an int below its minimum, an array that is not 0-d or ``(B,)``, or
            ``(B,)`` arrays of different batch sizes.
    """
    q = int_or_batch_param("causal_bottom_right", "q_len", q_len, minimum=1)
    kv = int_or_batch_param("causal_bottom_right", "kv_len", kv_len, minimum=0)
    if isinstance(q, int) and isinstance(kv, int):
        return named(_causal_with_offset, f"causal_bottom_right_{q}_{kv}", offset=kv - q)
    if jnp.ndim(q) == jnp.ndim(kv) == 1 and q.shape != kv.shape:
        raise ValueError(
            f"causal_bottom_right: q_len has batch size {q.shape[0]} but kv_len has {kv.shape[0]}; "
            "they must match, or one of them must be a scalar"
        )
    offset = jnp.asarray(kv, jnp.int32) - jnp.asarray(q, jnp.int32)
    return named(_causal_with_offset, "causal_bottom_right", offset=offset)


def _chunked_causal(b, h, q_idx, kv_idx, *, chunk):
    del b, h
    return (q_idx // chunk == kv_idx // chunk) & (q_idx >= kv_idx)


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
    return named(_chunked_causal, f"chunked_causal_{int(chunk)}", chunk=int(chunk))
