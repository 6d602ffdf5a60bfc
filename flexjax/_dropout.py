"""Counter-based dropout on attention probabilities: the keep mask as a hash of positions.

The mask is never stored. Every backend regenerates it tile by tile, in the forward and
again in the backward, from ``(seed, b, h, q_idx, kv_idx)`` alone, so it is the same for
every tile size, every backend and both passes. ``dropout_mask`` gives it densely, for
tests and debugging.

The hash, on uint32 with wrap-around arithmetic (computed here on int32 with the same
bits; the Triton code generator spells the same operations in Triton source):

    fmix(x)    = murmur3's 32-bit finalizer (xor-shift 16, *0x85EBCA6B, xor-shift 13,
                 *0xC2B2AE35, xor-shift 16): a bijection of uint32;
    row        = fmix(seed0 ^ fmix(b + fmix(h + fmix(q_idx ^ seed1))))
    col        = fmix((kv_idx * 0x9E3779B9) ^ seed1)
    keep       = fmix(row ^ col) >= threshold,  threshold = round(rate * 2**32)

Rows and columns are hashed once per tile (O(tq + tk)); each pair costs one ``fmix``.
``seed`` is two uint32 words drawn from the user's PRNG key (``seed_words``), so any key
implementation works and different keys give unrelated masks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_M1, _M2, _GOLDEN = 0x85EBCA6B, 0xC2B2AE35, 0x9E3779B9


def _signed(c: int) -> int:
    """The int32 with the bits of uint32 ``c``."""
    return c - (1 << 32) if c >= 1 << 31 else c


# The arithmetic runs on int32 (wrap-around multiplication, xor and logical shifts give the
# same bits as on uint32): Pallas' Triton lowering compiled the uint32 version of a dK/dV
# kernel in ~65 s against ~3 s for int32 (sm_90, f32, D=256).
_M1_S, _M2_S, _GOLDEN_S = _signed(_M1), _signed(_M2), _signed(_GOLDEN)
_INT_MIN = -(1 << 31)


def _i32(x):
    x = jnp.asarray(x)
    if x.dtype == jnp.uint32:
        return jax.lax.bitcast_convert_type(x, jnp.int32)
    return x.astype(jnp.int32)


def _srl(x, n: int):
    return jax.lax.shift_right_logical(x, jnp.full(jnp.shape(x), n, jnp.int32))


def fmix(x):
    """murmur3's 32-bit finalizer on the bits of int32 ``x`` (a bijection)."""
    x = x ^ _srl(x, 16)
    x = x * jnp.int32(_M1_S)
    x = x ^ _srl(x, 13)
    x = x * jnp.int32(_M2_S)
    return x ^ _srl(x, 16)


def row_hash(seed, b, h, q_idx):
    """int32 hash of a (b, h, q_idx) row; ``seed`` (2,) uint32 or int32 words; indices broadcast."""
    s0, s1 = _i32(seed[0]), _i32(seed[1])
    x = fmix(_i32(q_idx) ^ s1)
    x = fmix(_i32(h) + x)
    x = fmix(_i32(b) + x)
    return fmix(s0 ^ x)


def col_hash(seed, kv_idx):
    """int32 hash of a kv position."""
    return fmix((_i32(kv_idx) * jnp.int32(_GOLDEN_S)) ^ _i32(seed[1]))


def threshold(rate: float) -> int:
    """The uint32 threshold: a pair is kept when its hash is >= it (probability 1 - rate)."""
    return int(min(round(float(rate) * 2.0**32), 2**32 - 1))


def keep_from_hashes(row, col, rate: float):
    """Keep mask from row hashes (..., tq, 1) and column hashes (..., 1, tk).

    The uint32 comparison ``hash >= threshold`` as a signed one, both sides with the sign
    bit flipped.
    """
    return (fmix(row ^ col) ^ jnp.int32(_INT_MIN)) >= jnp.int32(threshold(rate) + _INT_MIN)


def keep_mask(seed, b, h, q_idx, kv_idx, rate: float):
    """bool keep mask over broadcasting ``(b, h, q_idx, kv_idx)`` int32 indices."""
    return keep_from_hashes(row_hash(seed, b, h, q_idx), col_hash(seed, kv_idx), rate)


def check_rate(dropout_rate) -> float:
    """``dropout_rate`` as a float in [0, 1); ValueError/TypeError otherwise."""
    if isinstance(dropout_rate, (bool, np.bool_)) or not isinstance(dropout_rate, (int, float, np.floating,
                                                                                   np.integer)):
        raise TypeError(f"dropout_rate must be a Python float in [0, 1), got {type(dropout_rate).__name__}")
    rate = float(dropout_rate)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate!r}")
    return rate


def seed_words(dropout_rng) -> jax.Array:
    """Two uint32 words from a PRNG key (typed ``jax.random.key`` or raw ``PRNGKey``)."""
    if dropout_rng is None:
        raise ValueError("dropout_rate > 0 needs dropout_rng, a JAX PRNG key (jax.random.key(seed))")
    if not hasattr(dropout_rng, "dtype"):
        raise TypeError(f"dropout_rng must be a JAX PRNG key, got {type(dropout_rng).__name__}")
    typed = jnp.issubdtype(dropout_rng.dtype, jax.dtypes.prng_key)
    if not typed and not (dropout_rng.dtype == jnp.uint32 and dropout_rng.ndim == 1):
        raise TypeError(f"dropout_rng must be a JAX PRNG key (jax.random.key or jax.random.PRNGKey), got an "
                        f"array of dtype {dropout_rng.dtype} and shape {tuple(dropout_rng.shape)}")
    if typed and dropout_rng.ndim != 0:
        raise ValueError(f"dropout_rng must be a single key (shape ()), got shape {tuple(dropout_rng.shape)}")
    return jax.random.bits(dropout_rng, (2,), jnp.uint32)


def dropout_mask(dropout_rng, dropout_rate: float, B: int, H: int, Q_LEN: int, KV_LEN: int) -> jax.Array:
    """The keep mask that ``flex_attention(..., dropout_rate, dropout_rng)`` uses, densely.

    Returns:
      bool (B, H, Q_LEN, KV_LEN), True where the probability is kept (then scaled by
      ``1 / (1 - dropout_rate)``). H counts query heads.
    """
    rate = check_rate(dropout_rate)
    for name, n in (("B", B), ("H", H), ("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n <= 0:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    seed = seed_words(dropout_rng)
    b = jnp.arange(B, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(H, dtype=jnp.int32)[None, :, None, None]
    q = jnp.arange(Q_LEN, dtype=jnp.int32)[:, None]
    kv = jnp.arange(KV_LEN, dtype=jnp.int32)[None, :]
    return jnp.broadcast_to(keep_mask(seed, b, h, q, kv, rate), (B, H, Q_LEN, KV_LEN))
