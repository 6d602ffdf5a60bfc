"""What ``flex_attention`` and ``paged.flex_attention`` share: the call's spec, input checks and results.

``_api`` (the contiguous entry point), ``paged`` (page pools) and ``sharding`` build on it; it
imports only the BlockMask type.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._block_mask_type import BlockMask, check_broadcast
from ._trace import StaticMod
from .backends import _softmax
from .backends._contract import Call


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Everything static about one attention call; backends read it.

    Attributes:
      score: the traced score_mod, or None.
      mask: the traced mask_mod, or None (no mask_mod: partial tiles only mask padding).
      scale: the factor on q·k.
      q_len, kv_len: sequence lengths.
      block_size: the BlockMask's (block_q, block_kv).
      kernel_options: the user's options as a sorted tuple of (key, value) pairs.
      kv_band: the BlockMask's kv_band (the widest kv range of any q block, None when
        unknown); backends may pick tiles from it (a band of width 256 wants other tiles
        than causal attention).
      dropout_rate: probability of dropping each attention probability (0.0: no dropout;
        backends then run exactly their no-dropout code). The keep mask comes from
        ``flexjax._dropout`` and the seed operand.
    """

    score: StaticMod | None
    mask: StaticMod | None
    scale: float
    q_len: int
    kv_len: int
    block_size: tuple[int, int]
    kernel_options: tuple = ()
    kv_band: int | None = None
    dropout_rate: float = 0.0

    @property
    def options(self) -> dict:
        return dict(self.kernel_options)


def check_qkv(query, key, value):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(
                f"{name} must be a JAX array of shape (batch, seq, heads, head_dim), got {type(x).__name__}"
            )
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have rank 4 (batch, seq, heads, head_dim), got shape {tuple(x.shape)}; "
                "flexjax uses the layout of jax.nn.dot_product_attention"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be float32, bfloat16, float16 (or float64 with jax_enable_x64), "
                            f"got {x.dtype}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}; cast them to one"
        )
    B, Sq, Hq, D = query.shape
    Bk, Skv, Hkv, Dk = key.shape
    Bv, Sv, Hv, Dv = value.shape
    if not (B == Bk == Bv):
        raise ValueError(f"batch sizes differ: query {B}, key {Bk}, value {Bv}; they must be equal")
    if Dk != D:
        raise ValueError(f"key head_dim {Dk} must equal query head_dim {D} (shapes {query.shape}, {key.shape})")
    if Sv != Skv or Hv != Hkv:
        raise ValueError(
            f"value must have the key's seq and heads (batch, {Skv}, {Hkv}, Dv), got shape {tuple(value.shape)}"
        )
    if Hq % Hkv != 0:
        raise ValueError(
            f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv}) for GQA/MQA; got key shape {key.shape}"
        )
    for name, n in (("query", Sq), ("key", Skv), ("query head_dim", D), ("value head_dim", Dv)):
        if n == 0:
            raise ValueError(f"{name} has a zero-sized dimension; shapes {query.shape}, {key.shape}, {value.shape}")


def check_layout(query, key) -> None:
    """With no block_mask to fix the lengths, refuses shapes that read as GQA / MQA inputs in PyTorch's
    (batch, heads, seq, head_dim) layout: as flexjax's (batch, seq, heads, head_dim) they give query and
    key the same number of "heads", more than either has tokens, with the query's tokens a multiple of the
    key's (PyTorch's query heads and kv heads). Passing a block_mask built for those lengths says they are
    meant (``check_block_mask`` then checks them)."""
    _, Sq, Hq, _ = query.shape
    _, Skv, Hkv, _ = key.shape
    if Hq == Hkv and Sq != Skv and Sq % Skv == 0 and Hq > Sq:
        raise ValueError(
            f"query shape {tuple(query.shape)} and key shape {tuple(key.shape)} read as {Sq} queries against "
            f"{Skv} keys in {Hq} heads each, which is how GQA inputs in PyTorch's (batch, heads, seq, head_dim) "
            f"layout look ({Sq} query heads sharing {Skv} key/value heads over {Hq} tokens). flexjax's layout is "
            "(batch, seq, heads, head_dim), as jax.nn.dot_product_attention: pass jnp.swapaxes(x, 1, 2) for "
            "query, key and value. If these lengths are meant, pass a block_mask built for them "
            f"(create_block_mask(mask_mod, B, H, {Sq}, {Skv}))")


def check_scale(scale, head_dim: int) -> float:
    """The factor on q·k every entry point takes: ``1/sqrt(head_dim)`` for None, else a Python or NumPy real
    number (not a bool, not an array: it is static, part of the compiled kernel)."""
    if scale is None:
        return 1.0 / float(np.sqrt(head_dim))
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale must be a Python float or None, got {type(scale).__name__}")
    return float(scale)


def trace_score(score_mod, dtype) -> tuple:
    """``(StaticMod, captured arrays)`` of a score_mod traced at the scores' accumulation dtype for inputs of
    ``dtype``, or ``(None, ())``."""
    if score_mod is None:
        return None, ()
    from ._trace import trace_mod
    from .backends._common import acc_dtype

    traced = trace_mod(score_mod, "score", arg_name="score_mod", score_dtype=acc_dtype(dtype))
    return traced.static(), tuple(traced.consts)


def check_block_mask(block_mask, query_shape, Skv):
    B, Sq, Hq, _ = query_shape
    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"block_mask must be a BlockMask from flexjax.create_block_mask, got {type(block_mask).__name__}"
        )
    Bm, Hm, Qm, KVm = block_mask.shape
    if (Qm, KVm) != (Sq, Skv):
        msg = (f"block_mask was built for Q_LEN={Qm}, KV_LEN={KVm} but query has {Sq} tokens and key has {Skv}; "
               f"rebuild it with create_block_mask(mask_mod, B, H, {Sq}, {Skv})")
        if Qm == query_shape[2]:
            # The usual first symptom of PyTorch's (batch, heads, seq, head_dim) layout.
            msg += (f". The query's axis 2 has {Qm} entries, the mask's Q_LEN: flexjax's layout is "
                    "(batch, seq, heads, head_dim), as jax.nn.dot_product_attention; if your arrays are "
                    "(batch, heads, seq, head_dim), pass jnp.swapaxes(x, 1, 2) for query, key and value")
        raise ValueError(msg)
    if Bm not in (1, B):
        raise ValueError(f"block_mask was built for B={Bm} but query has batch {B}; rebuild it with B={B} or B=None")
    if Hm not in (1, Hq):
        raise ValueError(
            f"block_mask was built for H={Hm} but query has {Hq} heads; rebuild it with H={Hq} or H=None"
        )
    check_broadcast(block_mask.mask, Bm, Hm, data_shape=(B, Hq))


def prepare(query, kv_len: int, score_mod, block_mask, *, scale, kernel_options, backend,
            dropout_rate: float = 0.0) -> Call:
    """The start of every call, whatever its entry point: the scale checked (default ``1/sqrt(head_dim)``),
    the score_mod traced at the scores' dtype, ``kernel_options`` checked against the backends
    (``backends.options_tuple``) and the ``AttentionSpec`` built, with the block mask's mod, arrays and
    lists (None: every pair attends). ``flex_attention``, the sharded one, and the paged and ragged calls
    (whose block masks ``_trace.remapped`` rewrites first) all start here."""
    from ._block_mask_type import full_block_mask
    from .backends import options_tuple

    q_len = block_mask.seq_lengths[0] if block_mask is not None else query.shape[-3]
    if block_mask is None:
        block_mask = full_block_mask(1, 1, q_len, kv_len)
    score, score_consts = trace_score(score_mod, query.dtype)
    spec = AttentionSpec(score=score, mask=block_mask.mask, scale=check_scale(scale, query.shape[-1]), q_len=q_len,
                         kv_len=kv_len, block_size=block_mask.block_size,
                         kernel_options=options_tuple(kernel_options, backend), kv_band=block_mask.kv_band,
                         dropout_rate=dropout_rate)
    return Call(spec, score_consts, tuple(block_mask.mask_consts), block_mask.tile_lists())


class AuxRequest(NamedTuple):
    """Which auxiliary outputs ``flex_attention(..., return_aux=AuxRequest(...))`` returns.

    Attributes:
      lse: the log-sum-exp of each row, float32 (B, Hq, Sq) (with ``sinks``, of keys and sinks).
      max_scores: each row's maximum of the modified, unmasked scores, float32 (B, Hq,
        Sq), ``-inf`` on rows with no allowed key (for monitoring or clipping logits, as
        QK-clip does). Not differentiated (its tangent and cotangent are zero).
      min_scores: each row's minimum of the modified, unmasked scores, float32 (B, Hq, Sq),
        ``+inf`` on rows with no allowed key. Not differentiated. It costs one more forward
        pass (``min_scores_pass``: the backend's ``max_scores`` of the negated scores).
    """

    lse: bool = False
    max_scores: bool = False
    min_scores: bool = False


class AuxOutput(NamedTuple):
    """The auxiliary outputs requested by an ``AuxRequest``; None where not requested."""

    lse: jax.Array | None = None
    max_scores: jax.Array | None = None
    min_scores: jax.Array | None = None


def check_sinks(sinks, Hq):
    if sinks is None:
        return None
    if not hasattr(sinks, "shape") or not hasattr(sinks, "dtype"):
        raise TypeError(f"sinks must be a float array of shape ({Hq},) or ({Hq}, n_sinks), got {type(sinks).__name__}")
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(f"sinks must be a float array, got dtype {sinks.dtype}")
    if sinks.ndim not in (1, 2) or sinks.shape[0] != Hq or (sinks.ndim == 2 and sinks.shape[1] == 0):
        raise ValueError(f"sinks must have shape ({Hq},) or ({Hq}, n_sinks) (one logit per query head), "
                         f"got {tuple(sinks.shape)}")
    return sinks


def check_outputs(return_lse, return_aux):
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if return_aux is not None:
        if not isinstance(return_aux, AuxRequest):
            raise TypeError(f"return_aux must be a flexjax.AuxRequest or None, got {type(return_aux).__name__}")
        if return_lse:
            raise ValueError("pass either return_lse=True or return_aux=AuxRequest(lse=True), not both")


def with_sinks(out, lse, sinks):
    """Output and lse with ``sinks`` joining every row's softmax normalizer (they add no value).

    The kernels normalize by the keys alone (lse_keys); the sinks are one more part of each
    row's softmax, with lse logsumexp(sinks) and output 0, merged in by
    ``backends._softmax.merge_normalized``: the normalizer becomes lse = logaddexp(lse_keys,
    logsumexp(sinks)) and the output the kernels' times exp(lse_keys - lse). Exact,
    O(B * S * H * D), and differentiated by JAX through the kernels' (out, lse) gradient. A
    row with no allowed key keeps output 0 and gets lse = logsumexp(sinks).
    """
    dt = lse.dtype
    s = sinks.astype(dt).reshape(sinks.shape[0], -1)
    sink_lse = jnp.broadcast_to(jax.nn.logsumexp(s, axis=-1)[None, :, None], lse.shape)
    out_all, total = _softmax.merge_normalized(out, lse, jnp.zeros((), dt), sink_lse,
                                               lambda w: jnp.swapaxes(w, 1, 2)[..., None])
    return out_all.astype(out.dtype), total


def results(out, lse, max_scores, sinks, return_lse, return_aux, min_scores=None):
    if sinks is not None:
        out, lse = with_sinks(out, lse, sinks)
    if return_aux is not None:
        return out, AuxOutput(lse=lse if return_aux.lse else None,
                              max_scores=max_scores if return_aux.max_scores else None,
                              min_scores=min_scores if return_aux.min_scores else None)
    return (out, lse) if return_lse else out


def negated(score_mod):
    """The score_mod whose scores are ``score_mod``'s negated (``-score`` for None)."""

    def neg(score, b, h, q_idx, kv_idx):
        return -(score if score_mod is None else score_mod(score, b, h, q_idx, kv_idx))

    neg.__name__ = f"-{getattr(score_mod, '__name__', 'score') if score_mod is not None else 'score'}"
    return neg


def min_scores_pass(call, score_mod, return_aux, arrays):
    """Answers ``AuxRequest(min_scores=True)`` for an entry point: ``call(score_mod, return_aux, arrays)``
    is the entry point with everything else bound. The minimum of the modified scores is minus the
    maximum of their negation, which every backend's forward already returns (``max_scores``), so
    each backend serves it exactly, in one more forward pass over the same tiles, from
    ``stop_gradient`` inputs (min_scores is not differentiated). None when not requested."""
    if return_aux is None or not return_aux.min_scores:
        return None
    still = [jax.lax.stop_gradient(a) for a in arrays]
    _, aux = call(negated(score_mod), AuxRequest(max_scores=True), still)
    return -aux.max_scores


def zero_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, dtype=jax.dtypes.float0)
