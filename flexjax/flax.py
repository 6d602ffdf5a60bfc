"""Flax integration: an ``attention_fn`` for Flax's attention modules, and ``FlexMultiHeadAttention``.

Flax's own modules take it as their ``attention_fn``::

    from flax import nnx
    import flexjax.flax

    layer = nnx.MultiHeadAttention(num_heads=8, in_features=512, decode=False, rngs=nnx.Rngs(0),
                                   attention_fn=flexjax.flax.attention_fn)

``attention_fn`` takes the arguments both modules pass (flax's ``dot_product_attention``
signature) and computes the attention with ``flexjax.flex_attention``: ``mask`` and
``is_causal`` become a BlockMask (a causal mask skips the tiles above the diagonal), a
``bias`` a score_mod reading it. ``make_attention_fn(implementation=..., kernel_options=...)``
binds a backend. ``FlexMultiHeadAttention`` is an NNX layer of its own that takes a score_mod,
a mask_mod or a BlockMask, GQA, attention sinks, and a decode cache, contiguous or paged
(``flexjax.paged``: a page pool, a page table and per-sequence lengths); with
``sparse=SparseAttention(...)`` each query block attends to the key blocks the data chooses
(MoBA's top-k blocks, or NSA's three gated branches: ``flexjax.sparse``). Flax is an optional
dependency (``pip install 'flexjax[flax]'``); importing this module needs it, ``import
flexjax`` does not.

Where it differs from flax's function:

- dropout uses flexjax's own keep mask (a hash of the rng, batch, head, query and key
  index, regenerated in the backward), independent per batch and head whatever
  ``broadcast_dropout`` says; the rate and the 1 / (1 - rate) scaling are flax's;
- the attention weights are never formed, so ``module`` (flax's ``sow_weights``) raises;
- ``precision`` is not used: the backends accumulate in float32;
- a query row with no allowed key gives 0 (FlexAttention's semantics), where flax's
  softmax over masked logits averages the values.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import flax  # noqa: F401  (the optional dependency this module stands on: fail at import without it)
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import masks, paged, sparse
from ._api import flex_attention
from ._block_mask import BlockMask, and_masks, block_mask_over_read_axes
from ._drop_in import as_flex, check_implementation
from ._factory import built_here, fail_on_host
from ._trace import trace_mod


def _flatten_batch(x, batch: tuple[int, ...], name: str):
    """``x`` of shape ``[batch..., a, b, c]`` (or broadcastable batch axes) as ``[prod(batch), a, b, c]``."""
    if x is None:
        return None
    x = jnp.asarray(x)
    lead = x.ndim - 3
    if lead < 0:
        x = x.reshape((1,) * (3 - x.ndim) + x.shape)
        lead = 0
    if lead > len(batch):
        raise ValueError(f"{name} has {lead} batch axes, more than the query's {len(batch)}: shape {x.shape}")
    x = x.reshape((1,) * (len(batch) - lead) + x.shape)
    if all(n == 1 for n in x.shape[: len(batch)]):
        return x.reshape((1,) + x.shape[len(batch):])
    x = jnp.broadcast_to(x, batch + x.shape[len(batch):])
    return x.reshape((math.prod(batch),) + x.shape[len(batch):])


def make_attention_fn(implementation: str | None = None, kernel_options: dict | None = None) -> Callable:
    """An ``attention_fn`` for Flax's attention modules, on ``implementation`` (a flexjax
    backend, or None to let flexjax pick) with ``kernel_options``."""
    check_implementation(implementation)

    def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
                     dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
                     is_causal=False, **unused):
        """flax's ``dot_product_attention`` arguments; ``[batch..., length, heads, head_dim]`` inputs."""
        del broadcast_dropout, precision, unused
        if module is not None:
            raise NotImplementedError("flexjax never forms the attention weights, so it cannot sow them: build the "
                                      "module with sow_weights=False")
        query, key, value = (jnp.asarray(x) for x in (query, key, value))
        dtype = dtype or jnp.result_type(query, key, value)
        query, key, value = (x.astype(dtype) for x in (query, key, value))
        if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
            raise ValueError(f"query, key and value must be [batch..., length, heads, head_dim] of one rank, got "
                             f"shapes {query.shape}, {key.shape}, {value.shape}")
        batch = query.shape[:-3]
        q, k, v = (_flatten_batch(x, batch, n) for x, n in ((query, "query"), (key, "key"), (value, "value")))
        bias4 = _flatten_batch(bias, batch, "bias")
        mask4 = _flatten_batch(mask, batch, "mask")
        if mask4 is not None:
            mask4 = mask4.astype(jnp.bool_)
        q, k, v, score_mod, block_mask, _ = as_flex(q, k, v, bias4, mask4, is_causal=bool(is_causal))
        rate = 0.0 if deterministic else float(dropout_rate)
        if rate > 0.0 and dropout_rng is None:
            raise ValueError("dropout_rng is needed when dropout_rate > 0 and deterministic is False")
        out = flex_attention(q, k, v, score_mod, block_mask, dropout_rate=rate,
                             dropout_rng=dropout_rng if rate > 0.0 else None, backend=implementation,
                             kernel_options=kernel_options)
        return out.reshape(batch + out.shape[1:])

    return attention_fn


attention_fn = make_attention_fn()
"""The ``attention_fn`` on flexjax's automatic backend choice (``make_attention_fn()``)."""



def _check_room(start, T: int, S: int) -> jax.Array:
    """Raises when T new positions from ``start`` do not fit a contiguous cache of S."""
    def fail(at):
        raise ValueError(f"the decode cache holds {S} positions; writing {T} at position {int(at)} overflows it "
                         f"(init_cache with a larger max_length)")

    if T > S:
        fail(0)
    return fail_on_host(start + T <= S, fail, start)  # an int32 0, to add into the position written at


def _storage_dtype(dtype):
    """The element type a decode cache of ``dtype`` is held in: uint16 for a 16-bit float on CPU (see
    ``FlexMultiHeadAttention.init_cache``), else ``dtype``. Measured on 2 CPU cores, writing 4 tokens into a
    bfloat16 pool of 8 MB: 1.6 ms; into its uint16 bits, or a float32 pool: 6-8 us."""
    dtype = jnp.dtype(dtype)
    if jax.default_backend() == "cpu" and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2:
        return jnp.dtype(jnp.uint16)
    return dtype


def _decode_block_mask(user_mask, B: int, H: int, T: int, kv_len: int, block_size, start, position) -> BlockMask:
    """The BlockMask of a decode call: T queries of each sequence at ``position(b, q_idx)``, causal by
    absolute position and within ``user_mask``.

    Where the mask captures no traced array, the mask of every position, ``(kv_len, kv_len)``, is built
    once while the step is traced (a constant of the compiled step) and the step takes the rows of its
    positions (``paged.decode_block_mask``): a gather, where classifying the tiles in the step cost the
    layer about a third of its decode time (examples/gpt.py, cache of 256, 2 CPU cores). Otherwise the
    step classifies its own row of tiles.
    """

    def absolute(b, h, p, kv_idx):  # causal by absolute position
        ok = kv_idx <= p
        return ok if user_mask is None else ok & user_mask(b, h, p, kv_idx)

    traced = user_mask is not None and any(
        isinstance(c, jax.core.Tracer) for c in trace_mod(user_mask, "mask", arg_name="mask_mod").consts)
    if not traced:
        with jax.ensure_compile_time_eval():
            full = block_mask_over_read_axes(absolute, B, H, kv_len, kv_len, block_size=block_size)
        return paged.decode_block_mask(full, start, q_len=T)

    def mask_mod(b, h, q_idx, kv_idx):
        return absolute(b, h, position(b, q_idx), kv_idx)

    return block_mask_over_read_axes(mask_mod, B, H, T, kv_len, block_size=block_size)


def _positive_int(name: str, value, *, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"SparseAttention: {name} must be a positive int{' or None' if allow_none else ''}, "
                         f"got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class SparseAttention:
    """``FlexMultiHeadAttention(sparse=...)``: attention over the key blocks the data chooses (``flexjax.sparse``).

    Blocks are ``block_size`` positions, for queries and keys alike. Every kind is causal (top-left
    aligned, as ``masks.causal``) and composes with the layer's (or the call's) mask_mod; the
    choice is made inside the layer's call, under ``jit``, from the projected queries and keys,
    and is not differentiated (``jax.lax.stop_gradient``, as in both papers): the gradients reach
    the projections through the attention over the chosen blocks.

    - ``kind="moba"`` (MoBA, https://arxiv.org/abs/2502.13189): each query block attends to its
      ``top_k`` kv blocks by ``sparse.moba_scores`` (its mean query against each block's mean key;
      its own diagonal block always among them, the future never), under the causal mask and the
      mask_mod, with the layer's score_mod. No parameters of its own.
    - ``kind="nsa"`` (NSA, https://arxiv.org/abs/2502.11089): three branches over the same
      queries, keys and values, each a ``flex_attention``, combined per head by NSA's gate,
      ``out = g_cmp * o_cmp + g_slc * o_slc + g_win * o_win`` with ``(g_cmp, g_slc, g_win) =
      sigmoid(gate(x))`` (a parameter ``gate``, ``nnx.Linear(in_features, 3 * num_heads)`` with a
      bias; its columns are ``[cmp heads, slc heads, win heads]``):

      * ``o_cmp``: attention over compressed keys and values, the means of ``compress_size``
        consecutive keys (values) every ``stride`` positions (mean pooling stands in for NSA's
        learned compression MLP); query ``s`` sees compressed block ``t`` once it has ended,
        ``t * stride + compress_size - 1 <= s``, and the mask_mod allows every key in it; a
        query with no such block gets 0. The score_mod is not applied (its keys are not
        positions).
      * ``o_slc``: each query block's ``top_k`` kv blocks by ``sparse.nsa_scores`` (the
        compressed attention's probabilities summed onto the blocks; the heads of a GQA group
        choose together), under the causal mask, the mask_mod and the score_mod.
      * ``o_win``: a causal sliding window of ``window`` keys (the query and the ``window - 1``
        before it), under the mask_mod and the score_mod.

    Kv blocks that the causal mask and the mask_mod leave empty are never chosen; a query block
    with fewer than ``top_k`` eligible kv blocks takes them all (``top_k`` is capped at the
    number of kv blocks). The layer's decode cache is not served: ``decode=True`` and
    ``init_cache`` raise ``NotImplementedError`` (the sparse option is for full-sequence calls).

    Args:
      kind: ``"moba"`` or ``"nsa"``.
      block_size: the query and kv block, in positions (the BlockMask's tile).
      top_k: kv blocks per query block (MoBA's and NSA's selection).
      window: NSA's sliding-window branch, in keys; default ``8 * block_size`` (NSA's ratio, w = 512
        for blocks of 64). ``"nsa"`` only.
      compress_size: NSA's compressed block ``l``; default ``max(1, block_size // 2)``. ``"nsa"`` only.
      stride: NSA's stride ``d`` between compressed blocks; default ``max(1, compress_size // 2)``.
        ``"nsa"`` only.

    Raises:
      ValueError: naming the field, for an unknown kind, a size that is not a positive int, or an
        NSA field given to ``"moba"``.
    """

    kind: str = "moba"
    block_size: int = 64
    top_k: int = 4
    window: int | None = None
    compress_size: int | None = None
    stride: int | None = None

    def __post_init__(self):
        if self.kind not in ("moba", "nsa"):
            raise ValueError(f"SparseAttention: kind must be 'moba' or 'nsa', got {self.kind!r}")
        set_ = functools.partial(object.__setattr__, self)
        set_("block_size", _positive_int("block_size", self.block_size))
        set_("top_k", _positive_int("top_k", self.top_k))
        if self.kind == "moba":
            for name in ("window", "compress_size", "stride"):
                if getattr(self, name) is not None:
                    raise ValueError(f"SparseAttention: {name} is an NSA branch's setting; kind='moba' takes none "
                                     f"(got {name}={getattr(self, name)!r})")
            return
        window = _positive_int("window", self.window, allow_none=True)
        l = _positive_int("compress_size", self.compress_size, allow_none=True)
        l = max(1, self.block_size // 2) if l is None else l
        d = _positive_int("stride", self.stride, allow_none=True)
        set_("window", 8 * self.block_size if window is None else window)
        set_("compress_size", l)
        set_("stride", max(1, l // 2) if d is None else d)


def _topk_blocks(scores, states, top_k: int, block_size: int, mask_mod, T: int) -> BlockMask:
    """The BlockMask in which each query block attends to its ``top_k`` best kv blocks by ``scores``
    (B, H, nQ, nKV) among those that ``states`` (``mask_mod``'s tiles: 0 empty, 1 partial, 2 full;
    broadcasting) leaves non-empty, under ``mask_mod``; the chosen tiles that ``mask_mod`` fills are
    listed full (the same mask, without evaluating it there)."""
    return sparse._topk_block_mask(scores, min(top_k, scores.shape[-1]), block_size, mask_mod, (T, T),
                                   tile_states=states)


_NO_SPARSE_DECODE = (
    "FlexMultiHeadAttention(sparse=...) serves full-sequence calls only: its blocks are chosen per query block "
    "from the whole sequence, and the decode cache (init_cache, decode=True) has no sparse path (not implemented; "
    "run the whole sequence through the layer instead)")


def _compressed_allowed(mask_mod, B: int, H: int, T: int, n: int, l: int, d: int) -> jax.Array:
    """bool (B', H', T, n): whether ``mask_mod`` allows query ``s`` every key of compressed block ``t``,
    ``[t d, t d + l)``; B' (H') is B (H) where the mask_mod reads ``b`` (``h``), else 1. One (T, n) evaluation
    per key of a block (a loop of ``l``): as large as NSA's compressed scores, never (T, T); and a captured
    array for the compressed branch's mask, where a mask_mod that called ``mask_mod`` ``l`` times would be
    traced, analysed and compiled into the kernels."""
    uses = trace_mod(mask_mod, "mask", arg_name="mask_mod").static().uses
    b = jnp.arange(B if "b" in uses else 1, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(H if "h" in uses else 1, dtype=jnp.int32)[None, :, None, None]
    s = jnp.arange(T, dtype=jnp.int32)[:, None]
    t = jnp.arange(n, dtype=jnp.int32)[None, :] * d
    shape = (b.shape[0], h.shape[0], T, n)
    return jax.lax.fori_loop(0, l, lambda j, ok: ok & jnp.broadcast_to(mask_mod(b, h, s, t + j), shape),
                             jnp.ones(shape, jnp.bool_))


class FlexMultiHeadAttention(nnx.Module):
    """Multi-head attention whose core is ``flexjax.flex_attention``, with mods, GQA, sinks and a decode cache.

    Projections: query ``in_features -> num_heads * head_dim``, key and value ``->
    num_kv_heads * head_dim`` (GQA when ``num_kv_heads < num_heads``), output back to
    ``out_features`` (default ``in_features``). Layout (batch, length, features).

    Args:
      num_heads, in_features: query heads and input width.
      num_kv_heads: key / value heads (default ``num_heads``); divides ``num_heads``.
      head_dim: default ``in_features // num_heads``.
      out_features: default ``in_features``.
      score_mod, mask_mod: the layer's own mods (a call's arguments take precedence); in
        decode mode they see absolute positions (``q_idx`` counts from the sequence's start).
      num_sinks: learnable attention sinks per head (gpt-oss; ``flex_attention``'s ``sinks``):
        logits, zero at initialization, that join every row's softmax normalizer without
        adding a value (a parameter ``sinks`` of shape (num_heads, num_sinks)); 0: none.
      dropout_rate: on the attention probabilities, when ``deterministic`` is False (flexjax's
        keep mask; the call's ``rngs`` give the key).
      implementation, kernel_options: the flexjax backend (None: automatic) and its options.
      dtype, param_dtype, use_bias: as ``nnx.Linear``'s.
      sparse: None (dense: every pair the masks allow) or a ``SparseAttention``: each query
        block attends to the kv blocks the data chooses, causally (MoBA's top-k blocks, or NSA's
        compressed, selected and sliding-window branches under a learned gate, the parameter
        ``gate``); full-sequence calls only (``decode=True`` raises).
      rngs: ``nnx.Rngs`` for the parameters.
    """

    def __init__(self, num_heads: int, in_features: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, out_features: int | None = None, score_mod=None, mask_mod=None,
                 num_sinks: int = 0, dropout_rate: float = 0.0, deterministic: bool = True,
                 implementation: str | None = None, kernel_options: dict | None = None, dtype=None,
                 param_dtype=jnp.float32, use_bias: bool = False, sparse: SparseAttention | None = None,
                 rngs: nnx.Rngs):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        head_dim = in_features // num_heads if head_dim is None else head_dim
        if head_dim <= 0:
            raise ValueError(f"head_dim must be positive, got {head_dim} (in_features // num_heads by default)")
        if isinstance(num_sinks, bool) or not isinstance(num_sinks, int) or num_sinks < 0:
            raise ValueError(f"num_sinks must be an int >= 0, got {num_sinks!r}")
        if sparse is not None and not isinstance(sparse, SparseAttention):
            raise TypeError(f"sparse must be None or a flexjax.flax.SparseAttention, got {type(sparse).__name__}")
        check_implementation(implementation)
        self.sparse = sparse
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.score_mod, self.mask_mod = score_mod, mask_mod
        self.dropout_rate, self.deterministic = float(dropout_rate), deterministic
        self.implementation, self.kernel_options = implementation, kernel_options
        self.dtype = dtype
        lin = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.query = nnx.Linear(in_features, num_heads * head_dim, **lin)
        self.key = nnx.Linear(in_features, num_kv_heads * head_dim, **lin)
        self.value = nnx.Linear(in_features, num_kv_heads * head_dim, **lin)
        self.out = nnx.Linear(num_heads * head_dim, out_features or in_features, **lin)
        self.sinks = nnx.Param(jnp.zeros((num_heads, num_sinks), param_dtype)) if num_sinks else nnx.data(None)
        # NSA's gate: (g_cmp, g_slc, g_win) per head from the layer's input.
        self.gate = (nnx.Linear(in_features, 3 * num_heads, **{**lin, "use_bias": True})
                     if sparse is not None and sparse.kind == "nsa" else nnx.data(None))
        # The decode cache's variables (init_cache fills them): data, not static fields.
        self.cached_key, self.cached_value, self.cache_index = nnx.data(None), nnx.data(None), nnx.data(None)
        self.page_table, self.free_pages = nnx.data(None), nnx.data(None)

    def init_cache(self, batch: int, max_length: int, dtype=jnp.float32, *, page_size: int | None = None,
                   num_pages: int | None = None):
        """A decode cache of ``max_length`` positions per sequence (``nnx.Cache`` variables; paged, whole pages).

        Contiguous (``page_size=None``): ``cached_key`` and ``cached_value`` are
        ``(batch, max_length, num_kv_heads, head_dim)`` and ``cache_index`` the position the
        next call writes at, one scalar for every sequence.

        Paged (``page_size`` given; ``flexjax.paged``): ``cached_key`` and ``cached_value`` are
        page pools ``(num_pages, page_size, num_kv_heads, head_dim)``; ``page_table`` int32
        ``(batch, ceil(max_length / page_size))`` maps each sequence's logical pages to pool
        pages (-1 until assigned), ``free_pages`` bool ``(num_pages,)`` marks the free ones, and
        ``cache_index`` int32 ``(batch,)`` holds each sequence's length. A decode call takes
        pages from the pool as the sequences grow (``flexjax.paged.reserve``), so a pool smaller
        than the default ``batch * ceil(max_length / page_size)`` pages serves sequences of
        unequal lengths; ``release_cache`` gives a finished sequence's pages back.

        ``dtype`` is the cache's element type (``cache_dtype``). On CPU a 16-bit float cache
        (bfloat16, float16) is held as its uint16 bit patterns: XLA:CPU converts a 16-bit float
        buffer to float32 and back for every scatter or dynamic_update_slice into it, the whole
        buffer at each decode step, where a uint16 one is updated in place
        (``lax.bitcast_convert_type(layer.cached_key[...], layer.cache_dtype)`` reads it).
        """
        if self.sparse is not None:
            raise NotImplementedError(_NO_SPARSE_DECODE)
        self.cache_dtype = jnp.dtype(dtype)
        shape_tail = (self.num_kv_heads, self.head_dim)
        dtype = _storage_dtype(dtype)
        if page_size is None:
            if num_pages is not None:
                raise ValueError("num_pages is for a paged cache: pass page_size too")
            self.cached_key = nnx.Cache(jnp.zeros((batch, max_length) + shape_tail, dtype))
            self.cached_value = nnx.Cache(jnp.zeros((batch, max_length) + shape_tail, dtype))
            self.cache_index = nnx.Cache(jnp.zeros((), jnp.int32))
            self.page_table, self.free_pages = nnx.data(None), nnx.data(None)
            return
        max_pages = -(-max_length // page_size)
        num_pages = batch * max_pages if num_pages is None else num_pages
        k_pages, v_pages = paged.allocate(num_pages, page_size, *shape_tail, dtype=dtype)
        self.cached_key, self.cached_value = nnx.Cache(k_pages), nnx.Cache(v_pages)
        self.cache_index = nnx.Cache(jnp.zeros((batch,), jnp.int32))
        self.page_table = nnx.Cache(jnp.full((batch, max_pages), -1, jnp.int32))
        self.free_pages = nnx.Cache(jnp.ones((num_pages,), jnp.bool_))

    def release_cache(self, done: jax.Array):
        """Frees the pages of the sequences where ``done`` (bool ``(batch,)``) is True and sets
        their lengths to 0, so that their rows start new sequences at the next decode call
        (paged cache; jit-able)."""
        if self.page_table is None:
            raise ValueError("release_cache needs a paged cache: init_cache(batch, max_length, page_size=...)")
        done = jnp.asarray(done)
        self.page_table[...], self.free_pages[...] = paged.release(self.page_table[...], self.free_pages[...], done)
        self.cache_index[...] = jnp.where(done, 0, self.cache_index[...])

    def __call__(self, x: jax.Array, *, block_mask: BlockMask | None = None, score_mod=None, mask_mod=None,
                 decode: bool = False, deterministic: bool | None = None, rngs: nnx.Rngs | None = None) -> jax.Array:
        """Attention over ``x`` (batch, length, in_features).

        ``block_mask`` (for (length, length)) or a ``mask_mod`` (the call's, else the layer's)
        masks the pairs; ``decode=True`` appends this call's keys and values to the cache at
        each sequence's position and attends over the cache's filled part, causally by
        absolute position. A write past the cache (or, paged, past the pool) raises.
        """
        B, T, _ = x.shape
        q = self.query(x).reshape(B, T, self.num_heads, self.head_dim)
        k = self.key(x).reshape(B, T, self.num_kv_heads, self.head_dim)
        v = self.value(x).reshape(B, T, self.num_kv_heads, self.head_dim)
        score_mod = score_mod if score_mod is not None else self.score_mod
        mask_mod = mask_mod if mask_mod is not None else self.mask_mod
        deterministic = self.deterministic if deterministic is None else deterministic
        rate = 0.0 if deterministic else self.dropout_rate
        if rate > 0.0 and rngs is None:
            raise ValueError("FlexMultiHeadAttention needs rngs (with a 'dropout' stream) when dropout is active")
        dropout_rng = rngs.dropout() if rate > 0.0 else None
        sinks = None if self.sinks is None else self.sinks[...]
        attend = dict(dropout_rate=rate, dropout_rng=dropout_rng, sinks=sinks, backend=self.implementation,
                      kernel_options=self.kernel_options)
        if self.sparse is not None:
            if decode:
                raise NotImplementedError(_NO_SPARSE_DECODE)
            if block_mask is not None:
                raise ValueError("a sparse layer (sparse=SparseAttention(...)) chooses its own blocks: pass a "
                                 "mask_mod, not a block_mask")
            out = self._sparse_attention(x, q, k, v, score_mod, mask_mod, attend)
            return self.out(out.reshape(B, T, self.num_heads * self.head_dim))
        if not decode:
            if block_mask is None and mask_mod is not None:
                block_mask = block_mask_over_read_axes(mask_mod, B, self.num_heads, T, T)
            out = flex_attention(q, k, v, score_mod, block_mask, **attend)
            return self.out(out.reshape(B, T, self.num_heads * self.head_dim))
        if self.cache_index is None:
            raise ValueError("decode=True needs a cache: call init_cache(batch, max_length) first")
        if block_mask is not None:
            raise ValueError("decode=True builds its own mask from the cache index; pass a mask_mod, not a "
                             "block_mask")
        start = self.cache_index[...]
        if self.page_table is None:
            kv_len = self.cached_key.shape[1]
            start = start + _check_room(start, T, kv_len)
            self.cached_key[...] = jax.lax.dynamic_update_slice(
                self.cached_key[...], self._stored(k), (0, start, 0, 0))
            self.cached_value[...] = jax.lax.dynamic_update_slice(
                self.cached_value[...], self._stored(v), (0, start, 0, 0))
            position = lambda b, q_idx: start + q_idx
            block_size = 128
        else:
            kv_len = self._paged_write(start, k, v)
            position = lambda b, q_idx: start[b] + q_idx
            block_size = (128, math.gcd(self.cached_key.shape[1], 128))  # a kv block divides the page
        self.cache_index[...] = start + T
        user_mask, user_score = mask_mod, score_mod
        if user_score is not None:
            def score_mod(score, b, h, q_idx, kv_idx):
                return user_score(score, b, h, position(b, q_idx), kv_idx)

        block_mask = _decode_block_mask(user_mask, B, self.num_heads, T, kv_len, block_size, start, position)
        if self.page_table is None:
            k, v = self._loaded(self.cached_key, q.dtype), self._loaded(self.cached_value, q.dtype)
            out = flex_attention(q, k, v, score_mod, block_mask, **attend)
        else:
            k_pages, v_pages = self._loaded(self.cached_key, q.dtype), self._loaded(self.cached_value, q.dtype)
            with built_here():  # (the table is reserve's, the lengths checked by _paged_write)
                out = paged.flex_attention(q, k_pages, v_pages, self.page_table[...], start + T, score_mod,
                                           block_mask, **attend)
        return self.out(out.reshape(B, T, self.num_heads * self.head_dim))

    def _sparse_attention(self, x, q, k, v, score_mod, mask_mod, attend) -> jax.Array:
        """(B, T, num_heads, head_dim): the attention of ``sparse`` (``SparseAttention``'s docstring)."""
        sp, (B, T, H, _) = self.sparse, q.shape
        bs = sp.block_size
        base = masks.causal if mask_mod is None else and_masks(masks.causal, mask_mod)
        states = block_mask_over_read_axes(base, B, H, T, T, block_size=bs).block_states()
        if sp.kind == "moba":
            scores = sparse.moba_scores(q, k, block_size=bs)
            return flex_attention(q, k, v, score_mod, _topk_blocks(scores, states, sp.top_k, bs, base, T), **attend)
        if self.gate is None:
            raise ValueError("sparse=SparseAttention(kind='nsa') needs the gate parameter, which the layer creates "
                             "when it is built with that option: pass sparse= to FlexMultiHeadAttention(...)")
        l, d = sp.compress_size, sp.stride
        scores = sparse.nsa_scores(q, k, block_size=bs, compress_size=l, stride=d)
        o_slc = flex_attention(q, k, v, score_mod, _topk_blocks(scores, states, sp.top_k, bs, base, T), **attend)
        window = and_masks(base, masks.sliding_window(sp.window - 1))
        o_win = flex_attention(q, k, v, score_mod, block_mask_over_read_axes(window, B, H, T, T, block_size=bs),
                               **attend)
        if T >= l:
            k_cmp, v_cmp = (sparse._compressed(x, l, d).astype(x.dtype) for x in (k, v))
            allowed = None if mask_mod is None else _compressed_allowed(mask_mod, B, H, T, k_cmp.shape[1], l, d)

            def ended(b, h, q_idx, kv_idx):  # compressed block kv_idx has ended, and the mask_mod allows its keys
                ok = kv_idx * d + (l - 1) <= q_idx
                if allowed is None:
                    return ok
                return ok & allowed[b if allowed.shape[0] > 1 else 0, h if allowed.shape[1] > 1 else 0, q_idx, kv_idx]

            cmp_mask = block_mask_over_read_axes(ended, B, H, T, k_cmp.shape[1], block_size=bs)
            o_cmp = flex_attention(q, k_cmp, v_cmp, None, cmp_mask, **attend)
        else:  # no compressed block: every row has none
            o_cmp = jnp.zeros_like(o_slc)
        g = jax.nn.sigmoid(self.gate(x).astype(jnp.float32)).reshape(B, T, 3, H, 1)
        out = g[:, :, 0] * o_cmp + g[:, :, 1] * o_slc + g[:, :, 2] * o_win
        return out.astype(o_slc.dtype)

    def _stored(self, x) -> jax.Array:
        """New keys or values as the cache holds them (``init_cache``: 16-bit floats as uint16 on CPU)."""
        x = x.astype(self.cache_dtype)
        return x if self.cached_key.dtype == x.dtype else jax.lax.bitcast_convert_type(x, self.cached_key.dtype)

    def _loaded(self, cache, dtype) -> jax.Array:
        x = cache[...]
        if x.dtype != self.cache_dtype:
            x = jax.lax.bitcast_convert_type(x, self.cache_dtype)
        return x.astype(dtype)

    def _paged_write(self, start, k, v) -> int:
        """Reserves pages for T more tokens of every sequence (raising where the pages run out)
        and writes them; returns the logical cache length ``max_pages * page_size``."""
        T = k.shape[1]
        num_pages, page_size = self.cached_key.shape[:2]
        max_pages = self.page_table.shape[1]

        def fail(at):
            raise ValueError(f"the paged decode cache holds {max_pages * page_size} positions per sequence in a pool "
                             f"of {num_pages} pages of {page_size}; writing {T} at positions "
                             f"{np.asarray(at).tolist()} overflows it (init_cache with a larger max_length or "
                             f"num_pages, or release_cache the finished sequences)")

        table, free, ok = paged.reserve(self.page_table[...], self.free_pages[...], start + T, page_size)
        start = start + fail_on_host(ok, fail, start)
        self.page_table[...], self.free_pages[...] = table, free
        self.cached_key[...], self.cached_value[...] = paged.write(self.cached_key[...], self.cached_value[...],
                                                                  table, start, self._stored(k), self._stored(v))
        return max_pages * page_size
