"""Tree attention for speculative decoding: draft tokens attend to the prefix and their ancestors."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from .._factory import entry, int_or_batch_param, is_traced, named

MaskMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def _ancestor_words(parents: jax.Array) -> jax.Array:
    """(B, n, ceil(n / 32)) int32: bit j of node i's words is set where j is i or an ancestor of i."""
    B, n = parents.shape
    words = -(-n // 32)
    nodes = jnp.arange(n, dtype=jnp.int32)
    anc = nodes[None, :, None] == nodes[None, None, :]  # (B, n, n): itself
    cur = jnp.broadcast_to(nodes, (B, n))
    for _ in range(n):  # walk each node's chain up to its root (at most n - 1 steps)
        cur = jnp.where(cur >= 0, jnp.take_along_axis(parents, jnp.clip(cur, 0, n - 1), axis=1), -1)
        anc = anc | ((cur[:, :, None] == nodes[None, None, :]) & (cur[:, :, None] >= 0))
    anc = jnp.pad(anc, ((0, 0), (0, 0), (0, words * 32 - n))).reshape(B, n, words, 32)
    bits = jnp.left_shift(jnp.uint32(1), jnp.arange(32, dtype=jnp.uint32))
    return jax.lax.bitcast_convert_type(jnp.sum(jnp.where(anc, bits, jnp.uint32(0)), -1, dtype=jnp.uint32),
                                        jnp.int32)


def _tree(b, h, q_idx, kv_idx, *, words, prefix_len):
    del h
    p = entry(prefix_len, b)
    B, n, w = words.shape
    qn, kn = q_idx - p, kv_idx - p
    bb, qc = (jnp.clip(b, 0, B - 1) if B > 1 else 0), jnp.clip(qn, 0, n - 1)
    # The word of kv's bit: one read of the query's node per word (row reads, which the
    # kernel backends hoist), selected by kv (no gather by both indices).
    word = words[bb, qc, 0]
    for t in range(1, w):
        word = jnp.where(kn // 32 == t, words[bb, qc, t], word)
    is_anc = (jnp.right_shift(word, jnp.clip(kn, 0, n - 1) % 32) & 1) == 1
    in_tree = (qn >= 0) & (qn < n) & (kn >= 0) & (kn < n)
    return ((kv_idx < p) & (q_idx >= kv_idx)) | (in_tree & is_anc)


def tree(parents: ArrayLike, prefix_len: int | ArrayLike = 0) -> MaskMod:
    """Tree attention over a draft tree appended to a prefix (speculative decoding).

    The cache holds ``prefix_len`` committed tokens, then the draft tree's ``n`` nodes at
    positions ``prefix_len + i``. Node ``i`` (query ``q = prefix_len + i``) sees every
    prefix token and the nodes on its path to the root, itself included; queries before the
    tree are causal. In ``flexjax.paged.flex_attention_ragged``, verify a sequence's tree
    by making its nodes the sequence's new tokens: ``prefix_len = kv_lengths - n``.

    Args:
        parents: int (n,) or (B, n): ``parents[i]`` is node i's parent, ``-1`` for a child of
            the last prefix token; a parent comes before its children (``parents[i] < i``).
            May be traced (one compile for every tree of n nodes).
        prefix_len: an int, an integer scalar or a (B,) integer array (may be traced); 0
            (the default): the tree alone, node i at position i.

    Returns:
        mask_mod ``(b, h, q_idx, kv_idx) -> bool`` named ``tree_{n}``.

    Raises:
        TypeError: ``parents`` is not an integer array.
        ValueError: ``parents`` is not (n,) or (B, n), or (concrete) a parent not before its child.
    """
    arr = jnp.asarray(parents)
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise TypeError(f"tree: parents must be an integer array of shape (n,) or (B, n), got dtype {arr.dtype}")
    if arr.ndim not in (1, 2) or arr.shape[-1] == 0:
        raise ValueError(f"tree: parents must have shape (n,) or (B, n) with n >= 1, got {arr.shape}")
    arr = arr.astype(jnp.int32).reshape((-1, arr.shape[-1]))
    if not is_traced(arr):
        a = np.asarray(arr)
        bad = (a >= np.arange(a.shape[1])) | (a < -1)
        if bad.any():
            b, i = map(int, np.argwhere(bad)[0])
            raise ValueError(f"tree: parents[{b}, {i}] = {int(a[b, i])}; a node's parent must be -1 or an earlier "
                             f"node (parents[i] < i)")
    n = int_or_batch_param("tree", "prefix_len", prefix_len, minimum=0)
    return named(_tree, f"tree_{arr.shape[1]}", words=_ancestor_words(arr), prefix_len=n)
