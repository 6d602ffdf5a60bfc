"""``flexjax.dot_product_attention``: ``jax.nn.dot_product_attention``'s signature, served by flexjax.

Switching a model is a one-line change: the arguments mean what they mean for jax.nn, and
each becomes a flexjax mod. ``is_causal``, ``local_window_size`` and the sequence lengths
become a mask_mod (so their BlockMask skips the tiles they exclude); a dense ``mask`` is a
mask_mod reading it and a dense ``bias`` a score_mod reading it (``jax.grad`` reaches the
bias, as with jax.nn). ``implementation`` names a flexjax backend.

One difference, on rows that have no key at all (every key masked, or a query past its
``query_seq_lengths``): flexjax gives 0 and lse ``-inf`` (FlexAttention's semantics), where
jax.nn's XLA path averages every value with equal weights (it fills masked logits with a
large negative number) except on padded query rows, which it zeroes. Rows with a key agree.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._api import flex_attention
from ._block_mask import create_block_mask
from .backends import available_backends


def check_implementation(implementation) -> None:
    """``implementation`` is None or a flexjax backend's name (jax.nn's 'cudnn' is not one)."""
    if implementation is not None and implementation not in available_backends():
        raise ValueError(f"implementation must be None or a flexjax backend {sorted(available_backends())}, got "
                         f"{implementation!r} (jax.nn's 'cudnn' is jax.nn.dot_product_attention's own)")


def _ensure_4d(x, name: str):
    """jax.nn's rule: arrays of rank below 4 get leading axes of size 1."""
    x = jnp.asarray(x)
    if x.ndim > 4:
        raise ValueError(f"{name} must have at most 4 dimensions, got shape {x.shape}")
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _check_broadcast(x, name: str, full: tuple[int, int, int, int]):
    """``x`` (4-D) broadcasts to (batch, heads, q_len, kv_len): each axis 1 or the full size."""
    for axis, (n, want) in enumerate(zip(x.shape, full)):
        if n not in (1, want):
            raise ValueError(f"{name} must broadcast to (batch, num_heads, q_len, kv_len) = {full}, got shape "
                             f"{x.shape} (axis {axis} is {n})")


def _reader(x):
    """A function of (b, h, q_idx, kv_idx) reading ``x`` (4-D), index 0 along its size-1 axes."""
    def read(b, h, q_idx, kv_idx):
        idx = tuple(i if n > 1 else 0 for i, n in zip((b, h, q_idx, kv_idx), x.shape))
        return x[idx]

    return read


def _window(local_window_size):
    if local_window_size is None:
        return None
    if isinstance(local_window_size, (int, np.integer)) and not isinstance(local_window_size, bool):
        left = right = int(local_window_size)
    elif (isinstance(local_window_size, tuple) and len(local_window_size) == 2
          and all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in local_window_size)):
        left, right = (int(w) for w in local_window_size)
    else:
        raise TypeError(f"local_window_size must be an int or a (left, right) tuple of ints, got "
                        f"{local_window_size!r}")
    if left < 0 or right < 0:
        raise ValueError(f"local_window_size must be non-negative, got {local_window_size!r}")
    return left, right


def _lengths(x, name: str, batch: int):
    if x is None:
        return None
    x = jnp.asarray(x)
    if x.shape != (batch,) or x.dtype != jnp.int32:
        raise ValueError(f"{name} must be int32 of shape (batch,) = ({batch},), got {x.dtype} {x.shape}")
    return x


def as_flex(query, key, value, bias=None, mask=None, *, is_causal=False, query_seq_lengths=None,
            key_value_seq_lengths=None, local_window_size=None):
    """jax.nn.dot_product_attention's arguments as ``flex_attention``'s.

    Returns ``(q, k, v, score_mod, block_mask, unbatched)``: 4-D q / k / v, the score_mod
    reading ``bias`` (or None), the BlockMask of every mask argument (or None), and whether
    the inputs were 3-D (the caller drops the batch axis again). Shared by
    ``dot_product_attention`` and ``flexjax.flax``.
    """
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    ranks = {jnp.ndim(x) for x in (query, key, value)}
    if len(ranks) != 1 or ranks.pop() not in (3, 4):
        raise ValueError(f"query, key and value must all be 3-D or all 4-D, got shapes {jnp.shape(query)}, "
                         f"{jnp.shape(key)}, {jnp.shape(value)}")
    unbatched = jnp.ndim(query) == 3
    q, k, v = (_ensure_4d(x, n) for x, n in ((query, "query"), (key, "key"), (value, "value")))
    B, T, N, _ = q.shape
    S = k.shape[1]
    full = (B, N, T, S)
    window = _window(local_window_size)
    q_len = _lengths(query_seq_lengths, "query_seq_lengths", B)
    kv_len = _lengths(key_value_seq_lengths, "key_value_seq_lengths", B)

    score_mod = None
    if bias is not None:
        bias4 = _ensure_4d(bias, "bias")
        if not jnp.issubdtype(bias4.dtype, jnp.floating):
            raise TypeError(f"bias must be a float array, got {bias4.dtype}")
        _check_broadcast(bias4, "bias", full)
        read_bias = _reader(bias4)

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + read_bias(b, h, q_idx, kv_idx).astype(score.dtype)

    parts = []
    mask_b = mask_h = False
    if mask is not None:
        mask4 = _ensure_4d(mask, "mask")
        if mask4.dtype != jnp.bool_:
            raise TypeError(f"mask must be a boolean array, got {mask4.dtype}")
        _check_broadcast(mask4, "mask", full)
        mask_b, mask_h = mask4.shape[0] > 1, mask4.shape[1] > 1
        parts.append(_reader(mask4))
    if is_causal:
        parts.append(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    if window is not None:
        left, right = window
        parts.append(lambda b, h, q_idx, kv_idx: (kv_idx >= q_idx - left) & (kv_idx <= q_idx + right))
    if q_len is not None:
        parts.append(lambda b, h, q_idx, kv_idx: q_idx < q_len[b])
    if kv_len is not None:
        parts.append(lambda b, h, q_idx, kv_idx: kv_idx < kv_len[b])

    block_mask = None
    if parts:
        def mask_mod(b, h, q_idx, kv_idx):
            ok = parts[0](b, h, q_idx, kv_idx)
            for part in parts[1:]:
                ok = ok & part(b, h, q_idx, kv_idx)
            return ok

        per_batch = mask_b or q_len is not None or kv_len is not None
        block_mask = create_block_mask(mask_mod, B if per_batch else None, N if mask_h else None, T, S)

    return q, k, v, score_mod, block_mask, unbatched


def dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None = None,
                          mask: jax.Array | None = None, *, scale: float | None = None, is_causal: bool = False,
                          query_seq_lengths: jax.Array | None = None, key_value_seq_lengths: jax.Array | None = None,
                          local_window_size: int | tuple[int, int] | None = None, implementation: str | None = None,
                          return_residual: bool = False) -> Any:
    """``jax.nn.dot_product_attention``, computed by ``flexjax.flex_attention``.

    Args:
      query: (batch, q_len, num_heads, head_dim), or without the batch axis (3-D).
      key, value: (batch, kv_len, num_kv_heads, head_dim); ``num_heads`` a multiple of
        ``num_kv_heads`` (GQA). Same rank and dtype as ``query``.
      bias: added to the scaled logits; broadcasts to (batch, num_heads, q_len, kv_len)
        (rank below 4: leading axes of size 1). Differentiable.
      mask: boolean, True = attend; broadcasts like ``bias``.
      scale: factor on q·k; default ``1/sqrt(head_dim)``.
      is_causal: ``q_idx >= kv_idx`` (top-left aligned, as jax.nn).
      query_seq_lengths, key_value_seq_lengths: int32 (batch,): queries / keys at or past
        the length are padding.
      local_window_size: ``(left, right)`` or ``w`` for ``(w, w)``: ``q_idx - left <= kv_idx
        <= q_idx + right``.
      implementation: a flexjax backend ("xla", "pallas", "triton", "reference"), or None
        to let flexjax pick for the platform.
      return_residual: also return the log-sum-exp, (batch, q_len, num_heads) in the key's
        dtype, without gradient (jax.nn's residual).

    Returns:
      The output, shaped like ``query`` (with ``value``'s head dim), or ``(output, residual)``.

    Raises:
      ValueError / TypeError: an argument of the wrong shape, dtype or value, naming it.
    """
    check_implementation(implementation)
    q, k, v, score_mod, block_mask, unbatched = as_flex(
        query, key, value, bias, mask, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size)
    out = flex_attention(q, k, v, score_mod, block_mask, scale=scale, return_lse=return_residual,
                         backend=implementation)
    if return_residual:
        out, lse = out
        residual = jax.lax.stop_gradient(jnp.transpose(lse, (0, 2, 1)).astype(k.dtype))
        return (out[0], residual[0]) if unbatched else (out, residual)
    return out[0] if unbatched else out
