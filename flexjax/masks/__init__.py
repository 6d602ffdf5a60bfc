"""Ready-made mask_mods: ``mask_mod(b, h, q_idx, kv_idx) -> bool``."""

from .causal import causal as causal
from .causal import causal_bottom_right as causal_bottom_right
from .causal import causal_with_offset as causal_with_offset
from .causal import chunked_causal as chunked_causal
from .dilated import dilated as dilated
from .document import document as document
from .document import document_from_cu_seqlens as document_from_cu_seqlens
from .document import segment_ids_from_cu_seqlens as segment_ids_from_cu_seqlens
from .padding import padding as padding
from .prefix_lm import prefix_lm as prefix_lm
from .sliding_window import sliding_window as sliding_window
from .tree import tree as tree

__all__ = [
    "causal",
    "causal_bottom_right",
    "causal_with_offset",
    "chunked_causal",
    "dilated",
    "document",
    "document_from_cu_seqlens",
    "padding",
    "prefix_lm",
    "segment_ids_from_cu_seqlens",
    "sliding_window",
    "tree",
]
