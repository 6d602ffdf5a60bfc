"""flexjax: FlexAttention for JAX (score_mod / mask_mod into block-sparse attention)."""

from . import masks as masks
from . import mods as mods
from . import sharding as sharding
from ._api import flex_attention as flex_attention
from ._block_mask import BlockMask as BlockMask
from ._block_mask import and_masks as and_masks
from ._block_mask import create_block_mask as create_block_mask
from ._block_mask import create_mask as create_mask
from ._block_mask import noop_mask as noop_mask
from ._block_mask import or_masks as or_masks

__version__ = "0.1.0"

__all__ = [
    "BlockMask",
    "and_masks",
    "create_block_mask",
    "create_mask",
    "flex_attention",
    "masks",
    "mods",
    "noop_mask",
    "or_masks",
    "sharding",
]
