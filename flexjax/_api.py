"""flex_attention: input checks, backend dispatch and the custom_vjp around the backends."""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _dropout
from ._autodiff import attention_jvp
from ._block_mask import BlockMask, check_broadcast, full_block_mask
from ._trace import StaticMod, trace_mod
from .backends import available_backends, get_backend, kernel_option_names, platform_backends
from .backends._common import acc_dtype


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


def _check_qkv(query, key, value):
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


def _check_block_mask(block_mask, query_shape, Skv):
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


def _and(names) -> str:
    """'a', 'a' and 'b', 'a', 'b' and 'c'."""
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]}"


def _options_tuple(kernel_options, backend) -> tuple:
    """``kernel_options`` as a sorted tuple, after checking every key against the backends.

    A key no backend takes (a typo) and a key the chosen backend(s) do not take are
    ValueErrors naming the keys of every backend.
    """
    if kernel_options is None:
        return ()
    if not isinstance(kernel_options, dict):
        raise TypeError(f"kernel_options must be a dict or None, got {type(kernel_options).__name__}")
    for k in kernel_options:
        if not isinstance(k, str):
            raise TypeError(f"kernel_options keys must be strings, got {k!r}")
    known = {name: kernel_option_names(name) for name in available_backends()}
    listing = "; ".join(f"{name}: {', '.join(keys) if keys else '(none)'}" for name, keys in known.items())
    candidates = platform_backends() if backend is None else (get_backend(backend).NAME,)
    for k in sorted(kernel_options):
        takers = [name for name, keys in known.items() if k in keys]
        if not takers:
            raise ValueError(f"unknown kernel_options key {k!r}; the backends take {listing}")
        if not any(name in takers for name in candidates):
            chosen = f"backend={backend!r}" if backend is not None else (
                f"backend=None (which picks from {list(candidates)} on {jax.default_backend()})")
            raise ValueError(
                f"kernel_options key {k!r} is taken by backend {_and(takers)}, not by {chosen}; "
                f"pass backend={takers[0]!r} or drop the key. The backends take {listing}")
    return tuple(sorted(kernel_options.items()))


# flexjax.sharding, a layer above this module, installs its dispatch here when it is
# imported (flexjax/__init__.py imports it): under `attention_specs(...)`, or for q/k/v
# sharded over Explicit mesh axes, it returns the sharded result; else NotImplemented.
# Importing it lazily from inside a trace would add a jit tracing-context value
# mid-trace, and the first jitted caller would compile twice.
_sharded_dispatch: Callable[..., Any] | None = None


def register_sharded_dispatch(dispatch: Callable[..., Any]) -> None:
    """Installs ``dispatch`` as the first step of every ``flex_attention`` call."""
    global _sharded_dispatch
    _sharded_dispatch = dispatch


class AuxRequest(NamedTuple):
    """Which auxiliary outputs ``flex_attention(..., return_aux=AuxRequest(...))`` returns.

    Attributes:
      lse: the log-sum-exp of each row, float32 (B, Hq, Sq) (with ``sinks``, of keys and sinks).
      max_scores: each row's maximum of the modified, unmasked scores, float32 (B, Hq,
        Sq), ``-inf`` on rows with no allowed key (for monitoring or clipping logits, as
        QK-clip does). Not differentiated (its tangent and cotangent are zero).
    """

    lse: bool = False
    max_scores: bool = False


class AuxOutput(NamedTuple):
    """The auxiliary outputs requested by an ``AuxRequest``; None where not requested."""

    lse: jax.Array | None = None
    max_scores: jax.Array | None = None


def _check_sinks(sinks, Hq):
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


def _check_outputs(return_lse, return_aux):
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if return_aux is not None:
        if not isinstance(return_aux, AuxRequest):
            raise TypeError(f"return_aux must be a flexjax.AuxRequest or None, got {type(return_aux).__name__}")
        if return_lse:
            raise ValueError("pass either return_lse=True or return_aux=AuxRequest(lse=True), not both")


def _with_sinks(out, lse, sinks):
    """Output and lse with ``sinks`` joining every row's softmax normalizer (they add no value).

    The kernels normalize by the keys alone (lse_keys); with the sinks the normalizer is
    lse = logaddexp(lse_keys, logsumexp(sinks)), so the output is the kernels' times
    exp(lse_keys - lse). Exact, O(B * S * H * D), and differentiated by JAX through the
    kernels' (out, lse) gradient. A row with no allowed key keeps output 0 and gets lse =
    logsumexp(sinks).
    """
    dt = lse.dtype
    s = sinks.astype(dt).reshape(sinks.shape[0], -1)
    sink_lse = jax.nn.logsumexp(s, axis=-1)[None, :, None]
    total = jnp.logaddexp(lse, sink_lse)
    factor = jnp.exp(lse - total)  # 0 where lse is -inf
    out = (out.astype(dt) * jnp.swapaxes(factor, 1, 2)[..., None]).astype(out.dtype)
    return out, total


def flex_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                   score_mod: Callable | None = None, block_mask: BlockMask | None = None, *,
                   scale: float | None = None, return_lse: bool = False, return_aux: AuxRequest | None = None,
                   sinks: jax.Array | None = None, dropout_rate: float = 0.0, dropout_rng: jax.Array | None = None,
                   backend: str | None = None, kernel_options: dict | None = None) -> Any:
    """Attention with a user score_mod and a block-sparse mask, differentiable.

    Semantics are PyTorch FlexAttention's: ``s = q·k * scale``, ``s = score_mod(s, b, h,
    q_idx, kv_idx)``, masked pairs excluded, softmax over keys, times V. A row with no
    allowed key gives output 0 and lse ``-inf``.

    ``jax.grad`` runs the backends' hand-written backward; ``jax.jvp`` / ``jax.linearize``
    run a blockwise tangent pass (the same tiles), with respect to q, k, v, the arrays the
    score_mod closes over, and ``sinks``.

    Inside ``flexjax.sharding.attention_specs`` the call is split over the mesh as the
    specs say (context parallelism). Elsewhere, q/k/v sharded over Explicit mesh axes
    along batch or heads are computed shard by shard, with no communication, and the
    output is sharded like the query; a sharded sequence axis needs ``attention_specs``.

    Args:
      query: (batch, q_len, q_heads, head_dim).
      key: (batch, kv_len, kv_heads, head_dim); ``q_heads % kv_heads == 0`` (GQA/MQA).
      value: (batch, kv_len, kv_heads, v_head_dim).
      score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` or None.
      block_mask: from ``create_block_mask`` for these lengths, or None (attend everywhere).
      scale: factor on q·k; default ``1/sqrt(head_dim)``.
      return_lse: also return the log-sum-exp, float32 (float64 for float64 inputs),
        (batch, q_heads, q_len).
      return_aux: an ``AuxRequest``: return ``(out, AuxOutput(lse=..., max_scores=...))``
        instead (not together with ``return_lse``).
      sinks: learnable attention sinks (gpt-oss), float (q_heads,) or (q_heads, n_sinks):
        logits that join every row's softmax denominator and contribute no value:
        ``out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + sum_k exp(sinks[h, k]))``. The
        returned lse is that normalizer's log; ``jax.grad`` reaches ``sinks``.
      dropout_rate: dropout on the attention probabilities, in [0, 1). The keep mask is a
        counter-based hash of (dropout_rng, b, h, q_idx, kv_idx), regenerated tile by tile
        in the backward (``flexjax.dropout_mask`` gives it densely); kept probabilities are
        scaled by ``1 / (1 - dropout_rate)``; lse is of the undropped probabilities.
        0.0 runs exactly the no-dropout kernels.
      dropout_rng: a JAX PRNG key (``jax.random.key``), needed when ``dropout_rate > 0``.
      backend: "xla", "reference" (dense, for tests), "pallas", "triton"; None picks for
        the platform.
      kernel_options: backend options (tile sizes etc.; see each backend's KernelOptions).

    Returns:
      Output (batch, q_len, q_heads, v_head_dim) in the query's dtype, or ``(out, lse)``,
      or ``(out, AuxOutput)``.
    """
    _check_qkv(query, key, value)
    _check_outputs(return_lse, return_aux)
    rate = _dropout.check_rate(dropout_rate)
    seed = _dropout.seed_words(dropout_rng) if rate > 0 else None
    B, Sq, Hq, D = query.shape
    sinks = _check_sinks(sinks, Hq)
    want_max = return_aux is not None and return_aux.max_scores
    want_lse = return_lse or sinks is not None or (return_aux is not None and return_aux.lse)
    if _sharded_dispatch is not None:
        sharded = _sharded_dispatch(query, key, value, score_mod, block_mask, scale=scale,
                                    return_lse=want_lse, backend=backend, kernel_options=kernel_options,
                                    dropout=rate > 0, max_scores=want_max)
        if sharded is not NotImplemented:
            out, lse = sharded if want_lse else (sharded, None)
            return _results(out, lse, None, sinks, return_lse, return_aux)
    Skv = key.shape[1]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale must be a Python float or None, got {type(scale).__name__}")
    if block_mask is None:
        block_mask = full_block_mask(1, 1, Sq, Skv)
    _check_block_mask(block_mask, query.shape, Skv)
    score = None
    score_consts: tuple = ()
    if score_mod is not None:
        traced = trace_mod(score_mod, "score", arg_name="score_mod", score_dtype=acc_dtype(query.dtype))
        score, score_consts = traced.static(), traced.consts
    spec = AttentionSpec(score=score, mask=block_mask.mask, scale=float(scale), q_len=Sq,
                         kv_len=Skv, block_size=block_mask.block_size,
                         kernel_options=_options_tuple(kernel_options, backend),
                         kv_band=block_mask.kv_band, dropout_rate=rate)
    impl = _choose_backend(backend, spec, query, key, value)
    lists = block_mask.tree_flatten()[0][:8]
    out, lse, max_scores = _attention_jit(impl.NAME, spec, query, key, value, tuple(score_consts),
                                          tuple(block_mask.mask_consts), tuple(lists), seed)
    return _results(out, lse, max_scores, sinks, return_lse, return_aux)


def _results(out, lse, max_scores, sinks, return_lse, return_aux):
    if sinks is not None:
        out, lse = _with_sinks(out, lse, sinks)
    if return_aux is not None:
        return out, AuxOutput(lse=lse if return_aux.lse else None,
                              max_scores=max_scores if return_aux.max_scores else None)
    return (out, lse) if return_lse else out


def _unsupported_reason(candidate, name, spec, query, key, value):
    """The backend's answer to "can you serve this": None or a reason, never a crash.

    ValueError and TypeError (an invalid kernel_options value) are the caller's to fix and
    propagate; any other exception is a flexjax bug, reported as the reason, so that
    ``backend=None`` moves on to the next backend (with its warning) instead of crashing.
    """
    try:
        return candidate.unsupported_reason(spec, query, key, value)
    except (ValueError, TypeError):
        raise
    except NotImplementedError as e:
        return str(e)
    except Exception as e:
        return (f"the {name} backend failed while checking the call ({type(e).__name__}: {e}); this is a flexjax "
                "bug, please report it")


def _choose_backend(backend, spec, query, key, value):
    """The named backend, or the first of the platform's list that can serve ``spec``.

    A named backend that cannot serve raises; with ``backend=None`` each skipped backend
    is reported by a warning, so no fallback is silent.
    """
    names = platform_backends() if backend is None else (backend,)
    skipped = []
    for name in names:
        candidate = get_backend(name)
        reason = _unsupported_reason(candidate, name, spec, query, key, value)
        if reason is None:
            for skipped_name, skipped_reason in skipped:
                warnings.warn(f"flexjax: backend {skipped_name!r} cannot serve this call ({skipped_reason}); "
                              f"using {name!r}. Pass backend={name!r} to choose it explicitly.", stacklevel=3)
            return candidate
        if backend is not None:
            raise NotImplementedError(f"backend {name!r} cannot serve this call: {reason}")
        skipped.append((name, reason))
    raise NotImplementedError("no backend can serve this call: " + "; ".join(f"{n}: {r}" for n, r in skipped))


# -- autodiff ------------------------------------------------------------------------------
# One custom_jvp serves both modes (``_autodiff.attention_jvp``): jax.grad runs the backend's
# hand-written backward on the residuals the forward saved, jax.jvp the xla backend's tangent pass.

@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _attention(backend_name, spec, q, k, v, score_consts, mask_consts, lists, seed):
    impl = get_backend(backend_name)
    out, lse, residuals = impl.forward_with_residuals(spec, q, k, v, score_consts, mask_consts, lists,
                                                      dropout_seed=seed)
    row_max, _ = impl.row_stats(lse, residuals)
    return out, lse, row_max


def _attention_jvp(backend_name, spec, primals, tangents):
    impl = get_backend(backend_name)

    def forward(q, k, v, score_consts, mask_consts, lists, seed):
        return impl.forward_with_residuals(spec, q, k, v, score_consts, mask_consts, lists, dropout_seed=seed)

    return attention_jvp(impl, spec, primals, tangents, forward, seed_of=lambda seed: seed)


_attention.defjvp(_attention_jvp, symbolic_zeros=True)

# Every call goes through jit, keyed by the backend and the (hashable) spec: an eager call
# (or an eager jax.grad of one) then compiles the blockwise loops once as one program
# instead of dispatching them op by op, ~5-7x faster on a first call; inside an outer jit
# it is one nested call.
_attention_jit = jax.jit(_attention, static_argnums=(0, 1))


def _zero_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, dtype=jax.dtypes.float0)
