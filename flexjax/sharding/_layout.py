"""The load-balancing token order: permute_tokens, its inverse, and layout-to-position maps.

For n context shards the sequence is cut into 2n equal chunks and shard i holds chunks
i and 2n-1-i: one early and one late chunk, so every shard gets the same share of a
causal-like mask. The permuted ("layout") order is therefore chunks
0, 2n-1, 1, 2n-2, ..., n-1, n.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ._specs import active_specs


def chunk_order(n: int) -> np.ndarray:
    """Original chunk index of each of the 2n layout slots."""
    order = np.empty(2 * n, np.int64)
    order[0::2] = np.arange(n)
    order[1::2] = 2 * n - 1 - np.arange(n)
    return order


def positions(idx, start, seq_len: int, n: int, permuted: bool):
    """Original positions of layout indices ``start + idx`` (int arithmetic, no gather).

    Args:
      idx: int32 array of local indices.
      start: the layout index of this block's first token (int or int32 scalar).
      seq_len: the full sequence length.
      n: number of context shards.
      permuted: whether the layout is ``permute_tokens`` order (else it is the identity).
    """
    g = idx if isinstance(start, int) and start == 0 else idx + start
    if not permuted:
        return g
    c = seq_len // (2 * n)
    slot = g // c
    shard = slot // 2
    chunk = jnp.where(slot % 2 == 0, shard, 2 * n - 1 - shard)
    return chunk * c + g % c


def block_order(seq_len: int, block: int, n: int, permuted: bool) -> np.ndarray:
    """Original block index of each block in layout order (blocks must tile the chunks)."""
    starts = np.arange(-(-seq_len // block)) * block
    if not permuted:
        return starts // block
    c = seq_len // (2 * n)
    slot = starts // c
    chunk = chunk_order(n)[slot]
    return (chunk * c + starts % c) // block


def _shards_for(x, axis: int, num_shards: int | None, verb: str) -> int | None:
    if num_shards is not None:
        if isinstance(num_shards, bool) or not isinstance(num_shards, (int, np.integer)) or num_shards < 1:
            raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
        return int(num_shards)
    specs = active_specs()
    if specs is None:
        raise ValueError(
            f"{verb}_tokens takes the context shard count from the active attention_specs; call it "
            f"inside `with attention_specs(...):` or pass num_shards=")
    if not specs.permuted:
        return None
    return specs.context_shards()


def _reorder(x, axis: int, order: np.ndarray, verb: str):
    x = jnp.asarray(x)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{verb}_tokens: axis {axis} is out of range for an array of rank {x.ndim}")
    axis %= x.ndim
    s, k = x.shape[axis], len(order)
    if s % k:
        raise ValueError(
            f"{verb}_tokens: the sequence axis has {s} tokens, which does not split into {k} equal "
            f"chunks (2 per context shard); pad it to a multiple of {k}")
    spec = getattr(jax.typeof(x).sharding, "spec", None)
    sharded = spec is not None and len(spec) > axis and spec[axis] is not None
    if sharded:
        # An explicitly sharded sequence is gathered, reordered and sharded again.
        x = jax.reshard(x, P(*spec[:axis], None, *spec[axis + 1:]))
    chunks = x.reshape(x.shape[:axis] + (k, s // k) + x.shape[axis + 1:])
    out = jnp.take(chunks, jnp.asarray(order, jnp.int32), axis=axis).reshape(x.shape)
    return jax.reshard(out, spec) if sharded else out


def permute_tokens(x: jax.Array, axis: int = 1, *, num_shards: int | None = None) -> jax.Array:
    """Puts the sequence axis into the load-balanced order of ``attention_specs(permuted=True)``.

    Call it once on the model input (tokens, embeddings, position ids); everything
    per-token downstream then runs in that order and flex_attention maps indices back.

    Args:
      x: any array; ``x.shape[axis]`` must be a multiple of 2n.
      axis: the sequence axis (1 for ``(batch, seq, ...)``).
      num_shards: n; default: the context shards of the active ``attention_specs``. With
        the default, specs with ``permuted=False`` make this the identity.

    Returns:
      ``x`` with its sequence cut into 2n chunks, reordered 0, 2n-1, 1, 2n-2, ...
    """
    n = _shards_for(x, axis, num_shards, "permute")
    return x if n is None else _reorder(x, axis, chunk_order(n), "permute")


def unpermute_tokens(x: jax.Array, axis: int = 1, *, num_shards: int | None = None) -> jax.Array:
    """The inverse of ``permute_tokens`` (same arguments): back to the original order."""
    n = _shards_for(x, axis, num_shards, "unpermute")
    return x if n is None else _reorder(x, axis, np.argsort(chunk_order(n)), "unpermute")
