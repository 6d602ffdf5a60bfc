"""Sharded flex_attention: context parallelism over a JAX mesh, batch/head parallelism from Explicit shardings."""

from ._attention import flex_attention as flex_attention
from ._attention import maybe_sharded_attention as _maybe_sharded_attention  # noqa: F401  (registered with flexjax.flex_attention)
from ._attention import visited_tiles as visited_tiles
from ._layout import permute_tokens as permute_tokens
from ._layout import unpermute_tokens as unpermute_tokens
from ._specs import AttentionSpecs as AttentionSpecs
from ._specs import active_specs as active_specs
from ._specs import attention_specs as attention_specs

__all__ = [
    "AttentionSpecs",
    "active_specs",
    "attention_specs",
    "flex_attention",
    "permute_tokens",
    "unpermute_tokens",
    "visited_tiles",
]
