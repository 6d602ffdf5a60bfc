"""flexjax: FlexAttention for JAX (score_mod / mask_mod into block-sparse attention)."""

from . import _trace_states  # noqa: F401  (first: before any of the user's traces)
from . import masks as masks
from . import mods as mods
from . import paged as paged
from . import sharding as sharding
from . import sparse as sparse
from ._api import AuxOutput as AuxOutput
from ._api import AuxRequest as AuxRequest
from ._api import Explanation as Explanation
from ._api import explain as explain
from ._api import flex_attention as flex_attention
from ._block_mask import BlockMask as BlockMask
from ._block_mask import and_masks as and_masks
from ._block_mask import create_block_mask as create_block_mask
from ._block_mask import create_mask as create_mask
from ._block_mask import noop_mask as noop_mask
from ._block_mask import or_masks as or_masks
from ._debug import debug_checks as debug_checks
from ._drop_in import dot_product_attention as dot_product_attention
from ._dropout import dropout_mask as dropout_mask

__version__ = "0.1.0"

__all__ = [
    "AuxOutput",
    "AuxRequest",
    "BlockMask",
    "Explanation",
    "and_masks",
    "create_block_mask",
    "create_mask",
    "debug_checks",
    "dot_product_attention",
    "dropout_mask",
    "explain",
    "flex_attention",
    "masks",
    "mods",
    "noop_mask",
    "or_masks",
    "paged",
    "sharding",
    "sparse",
]
