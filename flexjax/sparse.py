"""Data-chosen block sparsity: each query block attends to the key blocks a gate picks.

MoBA (Mixture of Block Attention, https://arxiv.org/abs/2502.13189) and the selection
branch of NSA (Native Sparse Attention, https://arxiv.org/abs/2502.11089) score every
(query block, key block) pair with a cheap pooled gate and let each query block attend
only to its ``k`` best key blocks. Here that is two steps:

1. a gate gives float scores ``(B, H, num_q_blocks, num_kv_blocks)``: ``moba_scores``
   (queries against mean-pooled keys) or ``nsa_scores`` (softmax over compressed keys,
   summed onto the selection blocks), or any array of your own;
2. ``topk_block_mask`` turns the scores into a ``BlockMask`` (through
   ``BlockMask.from_kv_blocks``) that ``flexjax.flex_attention`` runs as any other.

``moba_block_mask`` does both for MoBA with a causal mask. Everything works under
``jax.jit`` with traced queries, keys and scores (one compile for every array of the same
shape), and nothing builds an ``(S, S)`` array. The selection is discrete: the scores are
passed through ``jax.lax.stop_gradient``, so gradients reach q, k and v through the
attention only (as in MoBA and NSA, whose gates are not trained through the top-k).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ._block_mask_type import BlockMask
from ._factory import check_block_size, check_seq_lengths, describe
from .masks.causal import causal as _causal

__all__ = ["moba_block_mask", "moba_scores", "nsa_scores", "topk_block_mask"]

_HI = jax.lax.Precision.HIGHEST


# -- checks -----------------------------------------------------------------------------------

def _as_array(caller: str, name: str, x, expected: str) -> jax.Array:
    if not isinstance(x, (jax.Array, np.ndarray)):
        try:
            x = jnp.asarray(x)
        except (TypeError, ValueError):
            raise TypeError(f"{caller}: {name} must be a float array of shape {expected}, "
                            f"got {describe(x)}") from None
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{caller}: {name} must be a float array of shape {expected}, got {describe(x)}")
    return x


def _check_scores(scores) -> jax.Array:
    expected = "(B, H, num_q_blocks, num_kv_blocks)"
    scores = _as_array("topk_block_mask", "scores", scores, expected)
    if scores.ndim != 4 or 0 in scores.shape:
        raise ValueError(f"topk_block_mask: scores must have shape {expected} with every size >= 1, "
                         f"got shape {tuple(scores.shape)}")
    return scores


def _check_k(k, nkv: int) -> int:
    if isinstance(k, (bool, np.bool_)):
        raise TypeError(f"topk_block_mask: k must be a Python int, got {describe(k)}")
    if isinstance(k, (jax.Array, np.ndarray)) and k.shape == () and jnp.issubdtype(k.dtype, jnp.integer) \
            and not isinstance(k, jax.core.Tracer):
        k = k.item()
    try:
        k = operator.index(k)
    except TypeError:
        raise TypeError(f"topk_block_mask: k must be a Python int (the number of kv blocks per q block, "
                        f"static under jit), got {describe(k)}") from None
    if not 1 <= k <= nkv:
        raise ValueError(f"topk_block_mask: k must be an int in [1, num_kv_blocks = {nkv}] "
                         f"(scores' last axis), got {k}")
    return k


def _check_seq_lengths(seq_lengths, nq: int, nkv: int, bq: int, bkv: int) -> tuple[int, int]:
    if seq_lengths is None:
        return nq * bq, nkv * bkv
    q_len, kv_len = check_seq_lengths(seq_lengths, "topk_block_mask: ")
    if -(-q_len // bq) != nq or -(-kv_len // bkv) != nkv:
        raise ValueError(
            f"topk_block_mask: seq_lengths={(q_len, kv_len)} with block_size={(bq, bkv)} has "
            f"{-(-q_len // bq)} q blocks and {-(-kv_len // bkv)} kv blocks, but scores of shape "
            f"(B, H, {nq}, {nkv}) has {nq} and {nkv}: Q_LEN must be in ({(nq - 1) * bq}, {nq * bq}] "
            f"and KV_LEN in ({(nkv - 1) * bkv}, {nkv * bkv}]")
    return q_len, kv_len


def _check_qk(caller: str, query, key) -> tuple[jax.Array, jax.Array]:
    query = _as_array(caller, "query", query, "(B, Sq, Hq, D)")
    key = _as_array(caller, "key", key, "(B, Skv, Hkv, D)")
    for name, x, expected in (("query", query, "(B, Sq, Hq, D)"), ("key", key, "(B, Skv, Hkv, D)")):
        if x.ndim != 4 or 0 in x.shape:
            raise ValueError(f"{caller}: {name} must have shape {expected} (flexjax's layout: batch, seq, heads, "
                             f"head_dim) with every size >= 1, got shape {tuple(x.shape)}")
    (B, _, Hq, D), (Bk, _, Hkv, Dk) = query.shape, key.shape
    if (B, D) != (Bk, Dk):
        raise ValueError(f"{caller}: query {tuple(query.shape)} and key {tuple(key.shape)} must agree on batch "
                         f"(axis 0) and head_dim (axis 3)")
    if Hq % Hkv:
        raise ValueError(f"{caller}: query's heads ({Hq}) must be a multiple of key's heads ({Hkv}) (GQA)")
    return query, key


def _check_bool(caller: str, name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{caller}: {name} must be a bool, got {describe(value)}")
    return bool(value)


def _check_pos(caller: str, name: str, value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{caller}: {name} must be a positive int, got {value!r}")
    return int(value)


def _gate_args(caller: str, query, key, block_size, causal, include_self):
    """A gate's arguments checked: (query, key, (block_q, block_kv), causal, include_self)."""
    query, key = _check_qk(caller, query, key)
    return (query, key, check_block_size(block_size), _check_bool(caller, "causal", causal),
            _check_bool(caller, "include_self", include_self))


# -- top-k ------------------------------------------------------------------------------------

def _topk_lists(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Each row's k best columns: int32 counts (B, H, nQ) and indices (B, H, nQ, k).

    The k highest scores, ties to the lower index (``jax.lax.top_k``'s documented order,
    with -0.0 made 0.0 so that the two tie); -inf and NaN are never chosen, so a row gets
    fewer than k where fewer are finite or +inf. Each row's chosen indices come first,
    ascending; the entries past its count are other columns (valid block indices, to be
    ignored).
    """
    nkv = scores.shape[-1]
    s = jax.lax.stop_gradient(scores)
    s = jnp.where(jnp.isnan(s), -jnp.inf, s)
    s = jnp.where(s == 0, jnp.zeros_like(s), s)
    vals, idx = jax.lax.top_k(s, k)
    chosen = vals > -jnp.inf  # top_k sorts descending: the chosen entries are a prefix
    count = chosen.sum(-1, dtype=jnp.int32)
    key = jnp.sort(jnp.where(chosen, idx, idx + nkv), axis=-1)
    return count, jnp.where(key >= nkv, key - nkv, key).astype(jnp.int32)


def topk_block_mask(scores, k: int, *, block_size: int | tuple[int, int],
                    mask_mod: Callable | None = None, seq_lengths: tuple[int, int] | None = None) -> BlockMask:
    """The BlockMask in which each query block attends to its ``k`` highest-scoring kv blocks.

    Query block ``i`` of batch ``b`` and head ``h`` keeps the kv blocks ``j`` with the ``k``
    largest ``scores[b, h, i, j]``; ties go to the lower ``j``. A score of -inf (or NaN)
    is never chosen, so a row with fewer than ``k`` other scores keeps fewer blocks (e.g. a
    causal gate's first rows); +inf forces a block in. With ``mask_mod`` the chosen blocks
    are partial (``mask_mod`` decides each pair in them); without it they are full (every
    pair attends), except those holding positions past ``seq_lengths`` (the last q or kv
    block of lengths that are not multiples of the block), which are partial so that the
    padding stays masked. Every other block is skipped.

    The scores go through ``jax.lax.stop_gradient``: the choice is discrete and not
    differentiated. Works under ``jax.jit`` with traced scores (one compile serves every
    score array of the same shape, dtype and ``k``); the work is a ``jax.lax.top_k``, a
    sort of ``k`` entries per row and ``BlockMask.from_kv_blocks`` (PyTorch's semantics).

    Args:
      scores: float (B, H, num_q_blocks, num_kv_blocks), e.g. from ``moba_scores`` or
        ``nsa_scores``; B or H may be 1 to broadcast (then ``mask_mod`` must not read ``b``
        or ``h``).
      k: the number of kv blocks per query block, a Python int in ``[1, num_kv_blocks]``.
      block_size: the block size the scores were computed for, an int or ``(block_q,
        block_kv)``.
      mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` applied inside the chosen blocks,
        or None.
      seq_lengths: ``(Q_LEN, KV_LEN)`` of the attention call; default ``(num_q_blocks *
        block_q, num_kv_blocks * block_kv)``. Each must fall in the last block:
        ``ceil(Q_LEN / block_q) == num_q_blocks`` and the same for kv.

    Returns:
      A BlockMask of shape (B, H, Q_LEN, KV_LEN) for ``flex_attention(..., block_mask=...)``.

    Raises:
      TypeError: ``scores`` is not a float array, ``k`` not an int, ``mask_mod`` not callable.
      ValueError: ``scores`` is not 4-d, ``k`` out of range, a bad ``block_size`` or
        ``seq_lengths`` that disagree with the scores' block counts.
    """
    return _topk_block_mask(scores, k, block_size, mask_mod, seq_lengths)


def _topk_block_mask(scores, k, block_size, mask_mod, seq_lengths, *, tile_states=None) -> BlockMask:
    """``topk_block_mask``; ``tile_states``: int (broadcasting to the scores) states of ``mask_mod``'s tiles
    (0 empty, 1 partial, 2 full), known to the caller: an empty tile is never chosen, and a chosen full
    tile is listed full (the same mask, without evaluating the mask_mod where it is known to be True)."""
    scores = _check_scores(scores)
    B, H, nq, nkv = scores.shape
    k = _check_k(k, nkv)
    bq, bkv = check_block_size(block_size)
    q_len, kv_len = _check_seq_lengths(seq_lengths, nq, nkv, bq, bkv)
    if mask_mod is not None and not callable(mask_mod):
        raise TypeError(f"topk_block_mask: mask_mod must be a callable mask_mod(b, h, q_idx, kv_idx) or None, "
                        f"got {describe(mask_mod)}")
    if tile_states is not None:
        scores = jnp.where(tile_states == 0, -jnp.inf, scores)
    count, idx = _topk_lists(scores, k)
    common = {"block_size": (bq, bkv), "seq_lengths": (q_len, kv_len)}
    if mask_mod is None:
        # Full blocks; from_kv_blocks makes those holding padding partial (the padding stays masked).
        return BlockMask.from_kv_blocks(jnp.zeros((B, H, nq), jnp.int32), jnp.zeros((B, H, nq, 1), jnp.int32),
                                        count, idx, **common)
    if tile_states is None:
        return BlockMask.from_kv_blocks(count, idx, mask_mod=mask_mod, **common)
    whole = jnp.take_along_axis(jnp.broadcast_to(tile_states, scores.shape), idx, axis=-1) == 2
    listed = jnp.arange(k) < count[..., None]
    p_count, p_idx = _compact(idx, listed & ~whole)
    f_count, f_idx = _compact(idx, listed & whole)
    return BlockMask.from_kv_blocks(p_count, p_idx, f_count, f_idx, mask_mod=mask_mod, **common)


def _compact(idx: jax.Array, keep: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The entries of each row of ``idx`` that ``keep`` marks, moved to the front in their order, and their count."""
    pos = jnp.arange(idx.shape[-1], dtype=jnp.int32)
    order = jnp.argsort(jnp.where(keep, pos, pos + idx.shape[-1]), axis=-1)
    return keep.sum(-1, dtype=jnp.int32), jnp.take_along_axis(idx, order, axis=-1)


# -- gates ------------------------------------------------------------------------------------

def _block_mean(x: jax.Array, block: int) -> jax.Array:
    """(B, S, H, D) -> float32 (B, ceil(S / block), H, D): the mean of each block's rows (the
    last block's over its rows that exist)."""
    B, S, H, D = x.shape
    n = -(-S // block)
    x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, n * block - S), (0, 0), (0, 0)))
    sums = x.reshape(B, n, block, H, D).sum(2)
    sizes = np.minimum(block, S - block * np.arange(n)).astype(np.float32)
    return sums / sizes[None, :, None, None]


def _compressed(x: jax.Array, l: int, d: int) -> jax.Array:
    """(B, S, H, D) -> float32 (B, n, H, D): NSA's compressed tokens by mean pooling, the means of
    ``x[:, t d : t d + l]`` for ``t < n = (S - l) // d + 1`` (``S >= l``), from one gather."""
    n = (x.shape[1] - l) // d + 1
    window = np.arange(n)[:, None] * d + np.arange(l)[None, :]
    return x.astype(jnp.float32)[:, window].mean(2)


def _block_rules(s: jax.Array, Sq: int, Skv: int, bq: int, bkv: int, causal: bool, include_self: bool):
    """-inf on the kv blocks after a q block's last query (causal), +inf on the kv blocks
    holding the q block's own positions (include_self). ``s``: (..., nQ, nKV)."""
    nq, nkv = s.shape[-2:]
    first = jnp.arange(nq)[:, None] * bq
    last = jnp.minimum(first + bq, Sq) - 1
    start = jnp.arange(nkv)[None, :] * bkv
    end = jnp.minimum(start + bkv, Skv) - 1
    if causal:
        s = jnp.where(start > last, -jnp.inf, s)
    if include_self:
        s = jnp.where((start <= last) & (end >= first), jnp.inf, s)
    return s


def moba_scores(query, key, *, block_size: int | tuple[int, int], causal: bool = True,
                include_self: bool = True) -> jax.Array:
    """MoBA's gate (https://arxiv.org/abs/2502.13189) per (query block, kv block).

    MoBA scores query ``q_t`` against kv block ``j`` by ``q_t . mean(K_j)``, the mean of the
    block's keys. For one choice per query block, this averages that gate over the block's
    queries, which is the mean query against the mean key::

        scores[b, h, i, j] = mean_{t in Q_i} q[b, t, h] . mean_{s in K_j} k[b, s, h // G]
                           = qbar[b, i, h] . kbar[b, j, h // G]

    with ``Q_i = [i * block_q, min((i + 1) * block_q, Sq))`` (the last block's mean is over the
    queries that exist), ``K_j`` likewise with ``block_kv`` and ``Skv``, and ``G = Hq // Hkv``
    (query head h reads kv head h // G, as flex_attention). No 1 / sqrt(D) scale (it would
    not change the ranking). Then:

    - ``causal``: ``-inf`` where kv block j starts after q block i's last query,
      ``j * block_kv > min((i + 1) * block_q, Sq) - 1``, so it is never chosen; the block
      holding the diagonal stays eligible (attend to it with a causal mask_mod).
    - ``include_self``: ``+inf`` on the kv blocks holding any of q block i's positions
      (with ``block_q == block_kv``, the diagonal block), so they are always chosen when
      ``k`` is at least their number (one when ``block_kv >= block_q`` divides evenly).

    Computed in float32; costs two block means and a (nQ x nKV x D) product per head, and
    holds nothing larger than the (B, Hq, nQ, nKV) result.

    Args:
      query: (B, Sq, Hq, D) float.
      key: (B, Skv, Hkv, D) float, ``Hq`` a multiple of ``Hkv``.
      block_size: an int or ``(block_q, block_kv)``: the BlockMask's blocks.
      causal: exclude kv blocks after each q block (top-left aligned, as ``masks.causal``).
      include_self: force the q block's own kv blocks in.

    Returns:
      float32 (B, Hq, ceil(Sq / block_q), ceil(Skv / block_kv)) scores for ``topk_block_mask``.
    """
    query, key, (bq, bkv), causal, include_self = _gate_args("moba_scores", query, key, block_size, causal,
                                                            include_self)
    B, Sq, Hq, D = query.shape
    Skv, Hkv = key.shape[1:3]
    G = Hq // Hkv
    qbar = _block_mean(query, bq)  # (B, nQ, Hq, D)
    kbar = _block_mean(key, bkv)  # (B, nKV, Hkv, D)
    nq, nkv = qbar.shape[1], kbar.shape[1]
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qbar.reshape(B, nq, Hkv, G, D), kbar, precision=_HI)
    return _block_rules(s.reshape(B, Hq, nq, nkv), Sq, Skv, bq, bkv, causal, include_self)


def nsa_scores(query, key, *, block_size: int | tuple[int, int], compress_size: int | None = None,
               stride: int | None = None, causal: bool = True, include_self: bool = True) -> jax.Array:
    """NSA's selection scores (https://arxiv.org/abs/2502.11089, section 3.3.2) per (query block, kv block).

    With ``l = compress_size`` and ``d = stride``, the keys are compressed into
    ``n = floor((Skv - l) / d) + 1`` blocks (0 where ``Skv < l``; a tail shorter than ``l``
    is not compressed, as in NSA):

        kcmp[b, t, g] = mean(k[b, t * d : t * d + l, g])        (t < n, g a kv head)

    (mean pooling standing in for NSA's learned MLP with position encoding). Each query
    takes attention probabilities over them,

        p[b, h, s, t] = softmax_t(q[b, s, h] . kcmp[b, t, h // G] / sqrt(D)),

    where with ``causal`` the compressed blocks ending after the query (``t * d + l - 1 > s``)
    are left out (a query with none left has p = 0). A selection block ``j`` (the kv block
    ``[j * block_kv, (j + 1) * block_kv)``) gets the probabilities of the compressed blocks
    that overlap it (NSA's equation 9), summed over the queries of q block i and, as NSA
    shares one selection across a GQA group, over the group's G query heads:

        scores[b, h, i, j] = sum_{h' : h' // G == h // G} sum_{s in Q_i} sum_{t overlaps j} p[b, h', s, t]

    so every head of a group has the same scores and chooses the same blocks. Then the same
    ``causal`` (-inf on kv blocks after q block i's last query) and ``include_self`` (+inf
    on the kv blocks holding q block i's positions) rules as ``moba_scores``.

    Computed in float32. The largest array is the probabilities, (B, Hq, Sq, n) with
    ``n ~ Skv / stride``: O(S^2 / stride) memory, never (B, H, Sq, Skv); the work is
    ``1 / stride`` of the attention's ``q . k`` products.

    Args:
      query: (B, Sq, Hq, D) float.
      key: (B, Skv, Hkv, D) float, ``Hq`` a multiple of ``Hkv``.
      block_size: an int or ``(block_q, block_kv)``: the BlockMask's blocks (NSA's selection
        block size is ``block_kv``).
      compress_size: ``l``, the keys per compressed block; default ``max(1, block_kv // 2)``
        (NSA's ratio, l = 32 for l' = 64).
      stride: ``d``, the step between compressed blocks; default ``max(1, compress_size //
        2)`` (NSA's d = 16 for l = 32).
      causal: exclude future compressed blocks per query and future kv blocks per q block.
      include_self: force the q block's own kv blocks in.

    Returns:
      float32 (B, Hq, ceil(Sq / block_q), ceil(Skv / block_kv)) scores for ``topk_block_mask``.
    """
    query, key, (bq, bkv), causal, include_self = _gate_args("nsa_scores", query, key, block_size, causal,
                                                            include_self)
    l = max(1, bkv // 2) if compress_size is None else _check_pos("nsa_scores", "compress_size", compress_size)
    d = max(1, l // 2) if stride is None else _check_pos("nsa_scores", "stride", stride)
    B, Sq, Hq, D = query.shape
    Skv, Hkv = key.shape[1:3]
    G = Hq // Hkv
    nq, nkv = -(-Sq // bq), -(-Skv // bkv)
    n = (Skv - l) // d + 1 if Skv >= l else 0
    if n == 0:
        s = jnp.zeros((B, Hq, nq, nkv), jnp.float32)
        return _block_rules(s, Sq, Skv, bq, bkv, causal, include_self)
    kcmp = _compressed(key, l, d)  # (B, n, Hkv, D)
    # Queries padded to whole q blocks (the padding rows get no compressed block, so p = 0 there).
    qg = jnp.pad(query.astype(jnp.float32), ((0, 0), (0, nq * bq - Sq), (0, 0), (0, 0)))
    logits = jnp.einsum("bshgd,bthd->bhgst", qg.reshape(B, nq * bq, Hkv, G, D), kcmp, precision=_HI)
    t = jnp.arange(n)
    s_idx = jnp.arange(nq * bq)[:, None]
    allowed = s_idx < Sq
    if causal:
        allowed = allowed & ((t * d + l - 1)[None, :] <= s_idx)  # (nQ * bq, n)
    logits = jnp.where(allowed, logits / math.sqrt(D), -jnp.inf)
    m = logits.max(-1, keepdims=True)
    e = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))  # 0 where not allowed
    den = e.sum(-1)
    inv = 1.0 / jnp.where(den > 0, den, 1.0)  # a query with no compressed block: p = 0
    # p = e * inv, summed over each q block's queries and the group's heads in one product, then
    # onto the selection blocks (all linear: summing first keeps the overlap product at nQ x n x nKV).
    pq = jnp.einsum("bhgqrt,bhgqr->bhqt", e.reshape(B, Hkv, G, nq, bq, n), inv.reshape(B, Hkv, G, nq, bq),
                    precision=_HI)  # (B, Hkv, nQ, n)
    j = jnp.arange(nkv)
    overlap = ((t[:, None] * d <= (j[None, :] + 1) * bkv - 1)
               & (t[:, None] * d + l - 1 >= j[None, :] * bkv)).astype(jnp.float32)  # (n, nKV)
    s = jnp.einsum("bhqt,tk->bhqk", pq, overlap, precision=_HI)
    s = jnp.repeat(s, G, axis=1)  # (B, Hq, nQ, nKV): the group's heads equal
    return _block_rules(s, Sq, Skv, bq, bkv, causal, include_self)


def moba_block_mask(query, key, k: int, *, block_size: int | tuple[int, int] = 128,
                    causal: bool = True) -> BlockMask:
    """MoBA's BlockMask: each query block attends to its ``k`` best kv blocks by ``moba_scores``.

    ``topk_block_mask(moba_scores(query, key, block_size=block_size, causal=causal), k,
    block_size=block_size, mask_mod=flexjax.masks.causal if causal else None,
    seq_lengths=(Sq, Skv))``: the q block's own (diagonal) kv blocks are always among the
    ``k`` (``include_self``); with ``causal`` future kv blocks never are and the chosen
    blocks are attended under the causal mask_mod (top-left aligned); without it they are
    attended whole. With ``causal`` the chosen blocks wholly below the diagonal are listed
    full (the causal mask_mod holds in all of them) and only those crossing it partial: the
    same mask as that call, without evaluating the mask_mod in most blocks. Works under
    ``jax.jit`` (one compile per shape). See https://arxiv.org/abs/2502.13189.

    Args:
      query: (B, Sq, Hq, D) float.
      key: (B, Skv, Hkv, D) float, ``Hq`` a multiple of ``Hkv``.
      k: kv blocks per query block, a Python int in ``[1, ceil(Skv / block_kv)]``.
      block_size: an int or ``(block_q, block_kv)``.
      causal: causal MoBA (the gate's future blocks excluded and the causal mask_mod).

    Returns:
      A BlockMask of shape (B, Hq, Sq, Skv).
    """
    causal = _check_bool("moba_block_mask", "causal", causal)
    scores = moba_scores(query, key, block_size=block_size, causal=causal)
    lengths = (query.shape[1], key.shape[1])
    if not causal:
        return _topk_block_mask(scores, k, block_size, None, lengths)
    bq, bkv = check_block_size(block_size)
    nq, nkv = scores.shape[-2:]
    # The causal mask's tiles: whole where the block's last key precedes its first query, min((j + 1) bkv,
    # KV_LEN) - 1 <= i bq (the gate already rules out the tiles after the diagonal).
    below = np.minimum((np.arange(nkv) + 1) * bkv, lengths[1])[None, :] - 1 <= (np.arange(nq) * bq)[:, None]
    return _topk_block_mask(scores, k, block_size, _causal, lengths, tile_states=np.where(below, 2, 1))
