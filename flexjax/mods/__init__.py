"""Ready-made score_mods: ``score_mod(score, b, h, q_idx, kv_idx) -> score``."""

from .alibi import alibi as alibi
from .alibi import alibi_from_slopes as alibi_from_slopes
from .alibi import alibi_slopes as alibi_slopes
from .relative_bias import relative_bias as relative_bias
from .soft_cap import soft_cap as soft_cap
from .t5_bias import t5_relative_bucket_bias as t5_relative_bucket_bias
from .t5_bias import t5_relative_position_bucket as t5_relative_position_bucket

__all__ = [
    "alibi",
    "alibi_from_slopes",
    "alibi_slopes",
    "relative_bias",
    "soft_cap",
    "t5_relative_bucket_bias",
    "t5_relative_position_bucket",
]
