"""Quantized KV pages: int8 and float8_e4m3fn pools with float32 scales per head or per (page, head).

A quantized pool stores ``x / scale`` rounded to int8 (round to nearest, clipped to
[-127, 127]) or converted to float8_e4m3fn (clipped to +-448); a loaded element is
``x_q * scale[page, head]``, in float32. Scales are float32 ``(Hkv,)`` (one per kv head,
fixed: new tokens past ``127 * scale`` are clipped) or ``(num_pages, Hkv)`` (one per page
and head, 0 for a page never written: ``write`` raises a page's scale when a new token needs
it, requantizing the page's earlier tokens).

With a ``FloatTail`` (each sequence's newest page kept in float32), ``write`` quantizes every page
it touches from its values: the page's scale is its content's ``amax / qmax`` and each element is
within half a step of it (int8), or ``2**-4`` of its magnitude (float8_e4m3fn, 3 mantissa bits;
plus half its subnormal spacing, ``2**-10 * scale``).

Without one (and for a page the sequence has left), a page's scale grows only by factors that make
requantization exact (``grow``): odd integers for int8, whose grid of the new scale is then a union
of whole cells of the old one, so rounding a code again gives what rounding the original value once
would; powers of two for float8_e4m3fn, which only shift its exponent while the code stays normal.
Every int8 element is therefore its value quantized once with its page's final scale, whatever the
order and size of the writes, within half a step of that scale. A float8 code shifted into the
subnormals rounds again, at most half a subnormal spacing of each scale it passes through; the
scales at least double, so those roundings sum to less than ``2**-9 * scale`` of the final one: a
float8 element stays within ``2**-4`` of its magnitude plus ``2**-9 * scale``. A page's final scale
is up to 3x (int8) or 2x (float8) its ``amax / qmax``, so an int8 element stays within 1.5 steps of
``amax / 127``.
"""

from __future__ import annotations

from typing import NamedTuple

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


class FloatTail(NamedTuple):
    """The float32 content of each sequence's newest page, beside a quantized pool with per-(page, head)
    scales (``flexjax.paged.float_tail`` makes one; ``write``, ``write_and_attend`` and ``release`` take
    and return it). A page is quantized from these exact values at every write, so its scale is always
    its content's ``amax / qmax`` and each element is its value quantized once; when the sequence moves
    to its next page, the page left behind is final.

    k, v: float32 (B, page_size, kv_heads, head_dim / v_head_dim); page: int32 (B,), the physical page
    each row holds (-1: none).
    """

    k: jax.Array
    v: jax.Array
    page: jax.Array


def new_tail(batch: int, k_pages, v_pages) -> FloatTail:
    ps = k_pages.shape[1]
    return FloatTail(jnp.zeros((batch, ps) + k_pages.shape[2:], jnp.float32),
                     jnp.zeros((batch, ps) + v_pages.shape[2:], jnp.float32),
                     jnp.full((batch,), -1, jnp.int32))


def write_quantized(pages, scale, page, slot, new, runs: int | None = None, seq=None, tail=None):
    """``pages`` with ``new`` (N, Hkv, D) written at (page[n], slot[n]) (a page index past the
    pool drops the token), quantized; returns (pages, scale, tail). Per-head scales clip; with
    per-page scales every page written is quantized again:

    - exactly, from its float values, where they are known: a page never written (scale 0), or the
      page ``tail`` (``(values (B, page_size, Hkv, D), page (B,))``) holds for the token's sequence
      ``seq[n]``: the page's scale becomes its content's amax / qmax;
    - else by ``grow``: the scale grows by an exact factor where a new token needs it, the page's
      earlier codes divided by it.

    The new tail holds, for each sequence written, the page of its last token, when that page was
    quantized from its values (else none: -1).

    ``runs``: when the tokens come as at most ``runs`` sequences of consecutive positions
    (each then touches at most ``n // page_size + 2`` pages, in one run each), only those
    pages are read back; None reads one page per token.
    """
    dtype = pages.dtype
    new = new.astype(jnp.float32)
    scale = jnp.asarray(scale, jnp.float32)
    if scale.ndim == 1:
        q = _to_q(new / scale[None, :, None], dtype)
        return pages.at[page, slot].set(q, mode="drop"), scale, tail
    num_pages, ps = pages.shape[:2]
    N = page.shape[0]
    valid = page < num_pages
    # The pages written, one entry per run of tokens in one page (a page index past the pool: none).
    first = jnp.concatenate([jnp.ones((1,), bool), page[1:] != page[:-1]]) & valid
    M = N if runs is None else min(N, N // ps + 2 * runs + 2)
    at = jnp.nonzero(first, size=M, fill_value=N)[0]
    touched = jnp.where(at < N, page[jnp.clip(at, 0, N - 1)], num_pages)
    safe = jnp.clip(touched, 0, num_pages - 1)
    run = jnp.where(valid, jnp.cumsum(first) - 1, M)  # each token's entry in ``touched`` (M: dropped)
    codes = pages[safe].astype(jnp.float32)  # (M, ps, Hkv, D)
    s_old = scale[safe]  # (M, Hkv)
    fresh = s_old <= 0
    from_tail = jnp.zeros((M,), bool)
    base = jnp.where(fresh[:, None, :, None], 0.0, codes * s_old[:, None, :, None])
    if tail is not None:
        t_values, t_page = tail
        t_seq = seq[jnp.clip(at, 0, N - 1)]
        from_tail = (at < N) & (t_page[t_seq] == touched) & jnp.any(~fresh, axis=-1)
        base = jnp.where(from_tail[:, None, None, None], t_values[t_seq], base)
    exact = from_tail[:, None] | fresh  # (M, Hkv): quantized from its values
    # Exactly: the content's values, the scale their amax / qmax.
    content = base.at[run, slot].set(new, mode="drop")
    tight = jnp.max(jnp.abs(content), axis=(1, 3)) / qmax(dtype)
    q_tight = _to_q(content / jnp.where(tight > 0, tight, 1.0)[:, None, :, None], dtype)
    # Else grown by an exact factor, the earlier codes divided by it (not multiplied by a rounded old / new
    # ratio: the nesting argument needs round(code / m) itself).
    need = jnp.zeros_like(s_old).at[run].max(jnp.max(jnp.abs(new), axis=-1) / qmax(dtype), mode="drop")
    grown, factor = grow(s_old, need, dtype)
    q_grown = _to_q(codes / factor[:, None, :, None], dtype)
    g = grown[jnp.clip(run, 0, M - 1)]
    q_grown = q_grown.at[run, slot].set(_to_q(new / jnp.where(g > 0, g, 1.0)[:, :, None], dtype), mode="drop")
    q = jnp.where(exact[:, None, :, None], q_tight, q_grown)
    pages = pages.at[touched].set(q, mode="drop")
    scale = scale.at[touched].set(jnp.where(exact, tight, grown), mode="drop")
    if tail is not None:
        B = t_page.shape[0]
        last = jnp.full((B,), -1, jnp.int32).at[jnp.where(valid, seq, B)].max(jnp.arange(N, dtype=jnp.int32),
                                                                           mode="drop")
        r = run[jnp.clip(last, 0, N - 1)]
        r = jnp.clip(r, 0, M - 1)
        wrote = last >= 0
        keep = jnp.all(exact[r], axis=-1)
        t_page = jnp.where(wrote, jnp.where(keep, touched[r], -1), t_page)
        t_values = jnp.where(wrote[:, None, None, None], content[r], t_values)
        tail = (t_values, t_page)
    return pages, scale, tail
