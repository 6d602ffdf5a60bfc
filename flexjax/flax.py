"""Flax integration: an ``attention_fn`` for ``nnx.MultiHeadAttention`` and linen's ``MultiHeadDotProductAttention``.

    from flax import nnx
    import flexjax.flax

    layer = nnx.MultiHeadAttention(num_heads=8, in_features=512, decode=False, rngs=nnx.Rngs(0),
                                   attention_fn=flexjax.flax.attention_fn)

``attention_fn`` takes the arguments both modules pass (flax's ``dot_product_attention``
signature) and computes the attention with ``flexjax.flex_attention``: ``mask`` and
``is_causal`` become a BlockMask (a causal mask skips the tiles above the diagonal), a
``bias`` a score_mod reading it. ``make_attention_fn(implementation=..., kernel_options=...)``
binds a backend. Flax is an optional dependency (``pip install 'flexjax[flax]'``); importing
this module needs it, ``import flexjax`` does not.

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

import math
from collections.abc import Callable

import flax  # noqa: F401  (the optional dependency this module stands on: fail at import without it)
import jax.numpy as jnp

from ._api import flex_attention
from ._drop_in import as_flex
from .backends import available_backends


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
    if implementation is not None and implementation not in available_backends():
        raise ValueError(f"implementation must be None or a flexjax backend {sorted(available_backends())}, got "
                         f"{implementation!r}")

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

