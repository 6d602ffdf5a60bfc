"""Quantized KV pages: int8 and float8_e4m3fn pools with float32 scales per head or per (page, head).

A quantized pool stores ``x / scale`` rounded to int8 (round to nearest, clipped to
[-127, 127]) or converted to float8_e4m3fn (clipped to +-448); a loaded element is
``x_q * scale[page, head]``, in float32. Scales are float32 ``(Hkv,)`` (one per kv head,
fixed: new tokens past ``127 * scale`` are clipped) or ``(num_pages, Hkv)`` (one per page
and head, 0 for a page never written: ``write`` raises a page's scale when a new token needs
it, requantizing the page's earlier tokens).

A page's scale grows only by factors that make requantization exact (``grow``): odd integers
for int8, whose grid of the new scale is then a union of whole cells of the old one, so
rounding a code again gives what rounding the original value once would; powers of two for
float8_e4m3fn, which only shift its exponent. Every element is therefore its value quantized
once with its page's final scale, whatever the order and size of the writes: int8 within half
a step (``scale / 2``), float8 within ``2**-4`` of its magnitude (3 mantissa bits; plus half
its subnormal spacing, ``2**-10 * scale``). The price: a page's final scale is at most 3x
(int8) or 2x (float8) its ``amax / qmax``, so an int8 element stays within 1.5 steps of
``amax / 127``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# dtype name -> (dtype, the largest magnitude it stores)
QUANT_DTYPES = {"int8": (jnp.int8, 127.0), "float8_e4m3fn": (jnp.float8_e4m3fn, 448.0)}


def is_quantized(dtype) -> bool:
    return jnp.dtype(dtype) in tuple(jnp.dtype(d) for d, _ in QUANT_DTYPES.values())


def qmax(dtype) -> float:
    return QUANT_DTYPES[jnp.dtype(dtype).name][1]


def _to_q(x, dtype):
    """float32 values already divided by their scale -> the quantized dtype."""
    m = qmax(dtype)
    x = jnp.clip(x, -m, m)
    if jnp.dtype(dtype) == jnp.int8:
        return jnp.round(x).astype(jnp.int8)
    return x.astype(dtype)


def quantize(pages, dtype="int8", *, per_page: bool = True):
    """``(q_pages, scale)``: a float pool (num_pages, page_size, Hkv, D) quantized.

    Args:
      pages: a float page pool.
      dtype: "int8" or "float8_e4m3fn" (or the jnp dtype).
      per_page: scales per (page, head), float32 (num_pages, Hkv), from each page's largest
        magnitude; False: per head, (Hkv,), from the whole pool's.

    An element's error is at most ``scale / 2`` for int8 (``amax / 254``), and
    ``2**-4`` of its magnitude for float8_e4m3fn (3 mantissa bits) above its subnormals.
    """
    name = jnp.dtype(dtype).name
    if name not in QUANT_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(QUANT_DTYPES)}, got {dtype!r}")
    pages = jnp.asarray(pages)
    if pages.ndim != 4 or not jnp.issubdtype(pages.dtype, jnp.floating):
        raise ValueError(f"pages must be a float pool (num_pages, page_size, kv_heads, head_dim), got "
                         f"{pages.dtype} {pages.shape}")
    axes = (1, 3) if per_page else (0, 1, 3)
    amax = jnp.max(jnp.abs(pages.astype(jnp.float32)), axis=axes)
    scale = jnp.where(amax > 0, amax / QUANT_DTYPES[name][1], 1.0).astype(jnp.float32)
    s = scale[:, None, :, None] if per_page else scale[None, None, :, None]
    return _to_q(pages.astype(jnp.float32) / s, QUANT_DTYPES[name][0]), scale


def dequantize(q_pages, scale) -> jax.Array:
    """The float32 pool a quantized one stands for."""
    scale = jnp.asarray(scale, jnp.float32)
    s = scale[:, None, :, None] if scale.ndim == 2 else scale[None, None, :, None]
    return q_pages.astype(jnp.float32) * s


def check_scales(k_pages, v_pages, k_scale, v_scale):
    """(k_scale, v_scale) as float32 (num_pages, Hkv) for quantized pools, None for float ones."""
    quant = [is_quantized(x.dtype) for x in (k_pages, v_pages)]
    if not any(quant):
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale / v_scale are for int8 or float8_e4m3fn pools; these pools are "
                             f"{k_pages.dtype} / {v_pages.dtype}: pass no scales")
        return None
    if not all(quant) or k_pages.dtype != v_pages.dtype:
        raise TypeError(f"k_pages and v_pages must both be quantized in one dtype (int8 or float8_e4m3fn), or "
                        f"both float, got {k_pages.dtype} / {v_pages.dtype}")
    num_pages, Hkv = k_pages.shape[0], k_pages.shape[2]
    out = []
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"{k_pages.dtype} pools need {name}: float32 ({Hkv},) per kv head or "
                             f"({num_pages}, {Hkv}) per (page, kv head) (see flexjax.paged.quantize)")
        s = jnp.asarray(s)
        if not jnp.issubdtype(s.dtype, jnp.floating) or s.shape not in ((Hkv,), (num_pages, Hkv)):
            raise ValueError(f"{name} must be float ({Hkv},) or ({num_pages}, {Hkv}), got {s.dtype} {s.shape}")
        out.append(jnp.broadcast_to(s.astype(jnp.float32), (num_pages, Hkv)))
    return tuple(out)


def grow(scale, need, dtype):
    """(new scale, factor) per (page, head): ``scale`` where it holds ``need`` already (factor 1); ``need``
    on a page never written (scale 0: nothing to requantize; factor 1); else ``scale`` times the smallest
    factor of the exact family that holds ``need``: an odd integer for int8, a power of two for float8."""
    fresh = scale <= 0
    ratio = need / jnp.where(fresh, 1.0, scale)
    if jnp.dtype(dtype) == jnp.int8:
        m = 2.0 * jnp.ceil((ratio - 1.0) / 2.0) + 1.0
        m = jnp.where(scale * m < need, m + 2.0, m)  # float rounding of scale * m
    else:
        m = jnp.exp2(jnp.ceil(jnp.log2(jnp.maximum(ratio, 1.0))))
        m = jnp.where(scale * m < need, m * 2.0, m)
    grows = (need > scale) & ~fresh
    factor = jnp.where(grows, m, 1.0)
    return jnp.where(fresh, jnp.maximum(need, 0.0), scale * factor), factor


def write_quantized(pages, scale, page, slot, new, runs: int | None = None):
    """``pages`` with ``new`` (N, Hkv, D) written at (page[n], slot[n]) (a page index past the
    pool drops the token), quantized; returns (pages, scale). Per-head scales clip; per-page
    scales grow to hold the new tokens, the written pages' earlier tokens requantized.

    ``runs``: when the tokens come as at most ``runs`` sequences of consecutive positions
    (each then touches at most ``n // page_size + 2`` pages, in one run each), only those
    pages are read back for the requantization; None reads one page per token.
    """
    dtype = pages.dtype
    new = new.astype(jnp.float32)
    scale = jnp.asarray(scale, jnp.float32)
    if scale.ndim == 1:
        q = _to_q(new / scale[None, :, None], dtype)
        return pages.at[page, slot].set(q, mode="drop"), scale
    num_pages, ps = pages.shape[:2]
    N = page.shape[0]
    need = jnp.zeros_like(scale).at[page].max(jnp.max(jnp.abs(new), axis=-1) / qmax(dtype), mode="drop")
    grown, factor = grow(scale, need, dtype)
    # The pages written, one entry per run of tokens in one page (a page index past the pool:
    # none), read back and requantized where their scale grew.
    first = jnp.concatenate([jnp.ones((1,), bool), page[1:] != page[:-1]]) & (page < num_pages)
    M = N if runs is None else min(N, N // ps + 2 * runs + 2)
    at = jnp.nonzero(first, size=M, fill_value=N)[0]
    touched = jnp.where(at < N, page[jnp.clip(at, 0, N - 1)], num_pages)
    safe = jnp.clip(touched, 0, num_pages - 1)
    # Divided by the exact factor (not multiplied by a rounded old / new ratio): the nesting argument needs
    # round(code / m) itself.
    pages = pages.at[touched].set(_to_q(pages[safe].astype(jnp.float32) / factor[safe][:, None, :, None], dtype),
                                  mode="drop")
    gt = grown[jnp.clip(page, 0, num_pages - 1)]
    q = _to_q(new / jnp.where(gt > 0, gt, 1.0)[:, :, None], dtype)
    return pages.at[page, slot].set(q, mode="drop"), grown
