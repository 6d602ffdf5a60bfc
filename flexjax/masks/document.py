"""Document (packed sequences) masks from segment ids or cumulative lengths."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from .._factory import named, replicated

MaskMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def _as_ids(ids: ArrayLike, name: str) -> jax.Array:
    """Returns ``ids`` as ``(B, S)`` integers, or ``(S,)`` when shared by the batch (B = 1)."""
    ids = replicated(jnp.asarray(ids))
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"document: {name} must be an integer array, got dtype {ids.dtype}")
    if ids.ndim not in (1, 2) or ids.size == 0:
        raise ValueError(f"document: {name} must have shape (B, S) or (S,) and be non-empty, got shape {ids.shape}")
    # One row is shared by the batch: index it without b, so the mask can use B=None.
    return ids[0] if ids.ndim == 2 and ids.shape[0] == 1 else ids


def _segment(ids: jax.Array, b, idx):
    """``ids[b, idx]`` (``ids[idx]`` for shared ids), indices clamped into range."""
    pos = jnp.clip(idx, 0, ids.shape[-1] - 1)
    if ids.ndim == 1:
        return ids[pos]
    return ids[jnp.clip(b, 0, ids.shape[0] - 1), pos]


def _document(b, h, q_idx, kv_idx, *, q_ids, kv_ids):
    del h
    return _segment(q_ids, b, q_idx) == _segment(kv_ids, b, kv_idx)


def document(segment_ids: ArrayLike, kv_segment_ids: ArrayLike | None = None) -> MaskMod:
    """Document mask: tokens attend only within their own segment.

    Query ``q`` of batch ``b`` sees key ``k`` iff
    ``segment_ids[b, q] == kv_segment_ids[b, k]``. Combine with ``causal`` for causal
    packed training: ``and_masks(causal, document(ids))``.

    Args:
        segment_ids: ``(B, Sq)`` or ``(Sq,)`` integer query segment ids; a 1-D array is
            shared by every batch element. May be traced (ids known only inside
            ``jit``). The mask reads ``b`` only when some ids have a batch size > 1.
        kv_segment_ids: ``(B, Skv)`` or ``(Skv,)`` integer key segment ids; defaults to
            ``segment_ids`` (self-attention).

    Returns:
        mask_mod ``(b, h, q_idx, kv_idx) -> bool`` named ``document``.

    Raises:
        TypeError: ids are not integer arrays.
        ValueError: ids have the wrong rank, or batch sizes that do not broadcast.
    """
    q_ids = _as_ids(segment_ids, "segment_ids")
    kv_ids = q_ids if kv_segment_ids is None else _as_ids(kv_segment_ids, "kv_segment_ids")
    q_b, kv_b = (x.shape[0] if x.ndim == 2 else 1 for x in (q_ids, kv_ids))
    if q_b != kv_b and 1 not in (q_b, kv_b):
        raise ValueError(
            f"document: segment_ids has batch size {q_b} but kv_segment_ids has "
            f"{kv_b}; they must match, or one of them must be 1-D (shared by the batch)"
        )
    return named(_document, "document", q_ids=q_ids, kv_ids=kv_ids)


def segment_ids_from_cu_seqlens(cu_seqlens: ArrayLike, seq_len: int, pad_id: int = -1) -> jax.Array:
    """Segment ids from cumulative sequence lengths (the varlen / packing format).

    Position ``p`` gets id ``i`` when ``cu_seqlens[i] <= p < cu_seqlens[i + 1]`` and
    ``pad_id`` when it lies in no segment (before ``cu_seqlens[0]`` or at/after
    ``cu_seqlens[-1]``).

    Args:
        cu_seqlens: ``(n + 1,)`` or ``(B, n + 1)`` non-decreasing integer offsets, e.g.
            ``[0, 5, 12]`` for two documents of 5 and 7 tokens. May be traced.
        seq_len: the padded sequence length S.
        pad_id: id given to positions outside every segment.

    Returns:
        ``(S,)`` or ``(B, S)`` int32 segment ids.

    Raises:
        TypeError: ``cu_seqlens`` is not an integer array or ``seq_len`` not an int.
        ValueError: wrong rank, fewer than 2 offsets, or ``seq_len`` < 1.
    """
    cu = jnp.asarray(cu_seqlens)
    if not jnp.issubdtype(cu.dtype, jnp.integer):
        raise TypeError(f"segment_ids_from_cu_seqlens: cu_seqlens must be an integer array, got dtype {cu.dtype}")
    if cu.ndim not in (1, 2) or cu.shape[-1] < 2:
        raise ValueError(
            "segment_ids_from_cu_seqlens: cu_seqlens must have shape "
            f"(n + 1,) or (B, n + 1) with n >= 1, got shape {cu.shape}"
        )
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)):
        raise TypeError(f"segment_ids_from_cu_seqlens: seq_len must be an int, got {type(seq_len).__name__}")
    if seq_len < 1:
        raise ValueError(f"segment_ids_from_cu_seqlens: seq_len must be >= 1, got {seq_len}")
    cu = cu.astype(jnp.int32)
    positions = jnp.arange(int(seq_len), dtype=jnp.int32)
    num_segments = cu.shape[-1] - 1

    def ids_1d(offsets: jax.Array) -> jax.Array:
        ids = jnp.searchsorted(offsets, positions, side="right").astype(jnp.int32) - 1
        return jnp.where((ids >= 0) & (ids < num_segments), ids, jnp.int32(pad_id))

    return ids_1d(cu) if cu.ndim == 1 else jax.vmap(ids_1d)(cu)


def document_from_cu_seqlens(cu_seqlens: ArrayLike, seq_len: int) -> MaskMod:
    """Document mask for packed sequences given as cumulative lengths.

    Positions outside every document (before ``cu_seqlens[0]`` or at/after
    ``cu_seqlens[-1]``) get id -1 as queries and -2 as keys, so padding never attends
    nor is attended to.

    Args:
        cu_seqlens: ``(n + 1,)`` or ``(B, n + 1)`` non-decreasing integer offsets, e.g.
            ``[0, 5, 12]``. May be traced.
        seq_len: the padded sequence length S (queries and keys).

    Returns:
        mask_mod ``(b, h, q_idx, kv_idx) -> bool`` named ``document``.

    Raises:
        TypeError, ValueError: as ``segment_ids_from_cu_seqlens``.
    """
    q_ids = segment_ids_from_cu_seqlens(cu_seqlens, seq_len, pad_id=-1)
    kv_ids = segment_ids_from_cu_seqlens(cu_seqlens, seq_len, pad_id=-2)
    return document(q_ids, kv_ids)
