"""T5 bucketed relative-position bias score_mod (https://arxiv.org/abs/1910.10683)."""

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from .._factory import named, replicated

ScoreMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def _check_bucketing(caller: str, num_buckets: int, max_distance: int, bidirectional: bool) -> None:
    """Raises a TypeError or ValueError naming the first invalid bucketing argument."""
    for name, value in (("num_buckets", num_buckets), ("max_distance", max_distance)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{caller}: {name} must be an int, got {type(value).__name__}")
    max_exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    if max_exact < 1:
        raise ValueError(
            f"{caller}: num_buckets must be >= {4 if bidirectional else 2} "
            f"(bidirectional={bidirectional}), got {num_buckets}"
        )
    if max_distance <= max_exact:
        raise ValueError(
            f"{caller}: max_distance must be > {max_exact} (the last exact distance for "
            f"num_buckets={num_buckets}, bidirectional={bidirectional}), got {max_distance}"
        )


@functools.cache
def _bucket_thresholds(num_buckets: int, max_distance: int, bidirectional: bool) -> tuple[int, int, tuple[int, ...]]:
    """Returns (buckets per direction, max_exact, thresholds) for validated arguments.

    Threshold ``k`` is the smallest distance ``d`` whose logarithmic bucket is at least
    ``e + k``, i.e. ``log(d / e) / log(m / e) * n >= k`` with ``e = max_exact``,
    ``n`` logarithmic buckets per direction and ``m = max_distance``; it is found in
    exact integer arithmetic as ``d**n * e**k >= m**k * e**n``.
    """
    per_direction = num_buckets // 2 if bidirectional else num_buckets
    max_exact = per_direction // 2
    n, e, m = per_direction - max_exact, max_exact, max_distance

    def reaches(d: int, k: int) -> bool:
        return d**n * e**k >= m**k * e**n

    thresholds = []
    for k in range(1, n):
        d = max(e, math.ceil(e * (m / e) ** (k / n)))
        while d > e and reaches(d - 1, k):
            d -= 1
        while not reaches(d, k):
            d += 1
        thresholds.append(d)
    return per_direction, max_exact, tuple(thresholds)


def t5_relative_position_bucket(
    relative_position: ArrayLike,
    num_buckets: int = 32,
    max_distance: int = 128,
    bidirectional: bool = True,
) -> jax.Array:
    """T5's ``_relative_position_bucket`` for ``relative_position = kv_idx - q_idx``.

    Distances below ``max_exact`` get a bucket each; larger ones share logarithmically
    wider buckets up to ``max_distance``, and beyond it the last bucket. Bidirectional
    bucketing gives the keys after the query (``relative_position > 0``) the upper half
    of the buckets; unidirectional bucketing sends all later keys to bucket 0.

    The logarithmic buckets are compared against integer thresholds computed exactly on
    the host, rather than through a float32 ``log`` in the kernel: backends' ``log``
    approximations disagree by an ulp where the formula lands on an integer (e.g. XLA
    CPU puts distance 10 in a lower bucket than exact math for ``num_buckets=6``,
    ``max_distance=100``), so this gives the same buckets on every backend and matches
    T5's formula evaluated exactly.

    Args:
        relative_position: integer array of any shape, ``kv_idx - q_idx``.
        num_buckets: total number of buckets (both directions when bidirectional).
        max_distance: distance from which everything shares the last bucket.
        bidirectional: whether later keys get their own buckets.

    Returns:
        int32 buckets in ``[0, num_buckets)``, the shape of ``relative_position``.

    Raises:
        TypeError: ``num_buckets`` or ``max_distance`` is not an int.
        ValueError: too few buckets, or ``max_distance`` not above the exact range.
    """
    _check_bucketing("t5_relative_position_bucket", num_buckets, max_distance, bool(bidirectional))
    per_direction, max_exact, thresholds = _bucket_thresholds(int(num_buckets), int(max_distance), bool(bidirectional))
    relative_position = jnp.asarray(relative_position).astype(jnp.int32)
    if bidirectional:
        offset = jnp.where(relative_position > 0, per_direction, 0)
        distance = jnp.abs(relative_position)
    else:
        offset = 0
        distance = jnp.maximum(-relative_position, 0)
    large = jnp.full_like(distance, max_exact)
    for threshold in thresholds:
        large = large + (distance >= threshold).astype(jnp.int32)
    return offset + jnp.where(distance < max_exact, distance, large)


def _t5_bias(score, b, h, q_idx, kv_idx, *, table, num_buckets, max_distance, bidirectional):
    del b
    bucket = t5_relative_position_bucket(kv_idx - q_idx, num_buckets, max_distance, bidirectional)
    bucket = jnp.clip(bucket, 0, num_buckets - 1)
    bias = table[bucket] if table.ndim == 1 else table[jnp.clip(h, 0, table.shape[0] - 1), bucket]
    return score + bias.astype(score.dtype)


def t5_relative_bucket_bias(
    table: ArrayLike, num_buckets: int, max_distance: int, bidirectional: bool = True
) -> ScoreMod:
    """Adds T5's bucketed relative-position bias ``table[h, bucket(kv_idx - q_idx)]``.

    Args:
        table: ``(H, num_buckets)`` floating bias, usually a learnable JAX array
            (gradients reach it through flex_attention). With ``H = 1`` the score_mod
            does not read ``h``.
        num_buckets: number of buckets, ``table.shape[1]`` (T5 uses 32).
        max_distance: distance from which everything shares the last bucket (T5: 128).
        bidirectional: False for decoder self-attention (T5's causal setting).

    Returns:
        score_mod ``(score, b, h, q_idx, kv_idx) -> score`` named
        ``t5_bias_{num_buckets}_{max_distance}`` (``_unidirectional`` appended when not
        bidirectional); it keeps the score's dtype.

    Raises:
        TypeError: ``table`` is not floating point, or non-int bucketing arguments.
        ValueError: ``table`` is not ``(H, num_buckets)``, or invalid bucketing.
    """
    _check_bucketing("t5_relative_bucket_bias", num_buckets, max_distance, bool(bidirectional))
    num_buckets, max_distance = int(num_buckets), int(max_distance)
    table = replicated(jnp.asarray(table))
    if not jnp.issubdtype(table.dtype, jnp.floating):
        raise TypeError(f"t5_relative_bucket_bias: table must be a floating array, got dtype {table.dtype}")
    if table.ndim != 2 or table.shape[0] == 0 or table.shape[1] != num_buckets:
        raise ValueError(
            f"t5_relative_bucket_bias: table must have shape (H, num_buckets={num_buckets}), got shape {table.shape}"
        )
    suffix = "" if bidirectional else "_unidirectional"
    return named(_t5_bias, f"t5_bias_{num_buckets}_{max_distance}{suffix}",
                 table=table[0] if table.shape[0] == 1 else table, num_buckets=num_buckets,
                 max_distance=max_distance, bidirectional=bidirectional)
