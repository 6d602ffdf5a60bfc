"""flex_attention: input checks, backend dispatch and the custom_vjp around the backends."""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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
    """

    score: StaticMod | None
    mask: StaticMod | None
    scale: float
    q_len: int
    kv_len: int
    block_size: tuple[int, int]
    kernel_options: tuple = ()
    kv_band: int | None = None

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


def flex_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                   score_mod: Callable | None = None, block_mask: BlockMask | None = None, *,
                   scale: float | None = None, return_lse: bool = False,
                   backend: str | None = None, kernel_options: dict | None = None) -> Any:
    """Attention with a user score_mod and a block-sparse mask, differentiable.

    Semantics are PyTorch FlexAttention's: ``s = q·k * scale``, ``s = score_mod(s, b, h,
    q_idx, kv_idx)``, masked pairs excluded, softmax over keys, times V. A row with no
    allowed key gives output 0 and lse ``-inf``.

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
      backend: "xla", "reference" (dense, for tests), "pallas"; None picks for the platform.
      kernel_options: backend options (tile sizes etc.; see each backend's KernelOptions).

    Returns:
      Output (batch, q_len, q_heads, v_head_dim) in the query's dtype, or ``(out, lse)``.
    """
    _check_qkv(query, key, value)
    if _sharded_dispatch is not None:
        sharded = _sharded_dispatch(query, key, value, score_mod, block_mask, scale=scale,
                                    return_lse=return_lse, backend=backend, kernel_options=kernel_options)
        if sharded is not NotImplemented:
            return sharded
    B, Sq, Hq, D = query.shape
    Skv = key.shape[1]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale must be a Python float or None, got {type(scale).__name__}")
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
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
                         kv_band=block_mask.kv_band)
    impl = _choose_backend(backend, spec, query, key, value)
    lists = block_mask.tree_flatten()[0][:8]
    out, lse = _attention(impl.NAME, spec, query, key, value, tuple(score_consts),
                          tuple(block_mask.mask_consts), tuple(lists))
    return (out, lse) if return_lse else out


def _choose_backend(backend, spec, query, key, value):
    """The named backend, or the first of the platform's list that can serve ``spec``.

    A named backend that cannot serve raises; with ``backend=None`` each skipped backend
    is reported by a warning, so no fallback is silent.
    """
    names = platform_backends() if backend is None else (backend,)
    skipped = []
    for name in names:
        candidate = get_backend(name)
        reason = candidate.unsupported_reason(spec, query, key, value)
        if reason is None:
            for skipped_name, skipped_reason in skipped:
                warnings.warn(f"flexjax: backend {skipped_name!r} cannot serve this call ({skipped_reason}); "
                              f"using {name!r}. Pass backend={name!r} to choose it explicitly.", stacklevel=3)
            return candidate
        if backend is not None:
            raise NotImplementedError(f"backend {name!r} cannot serve this call: {reason}")
        skipped.append((name, reason))
    raise NotImplementedError("no backend can serve this call: " + "; ".join(f"{n}: {r}" for n, r in skipped))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(backend_name, spec, q, k, v, score_consts, mask_consts, lists):
    out, lse = get_backend(backend_name).forward(spec, q, k, v, score_consts, mask_consts, lists)
    return out, lse


def _attention_fwd(backend_name, spec, q, k, v, score_consts, mask_consts, lists):
    # symbolic_zeros=True: each argument arrives as CustomVJPPrimal(value, perturbed).
    # Which captured arrays are differentiated is known now, statically; () / None in the
    # residuals carry it to the backward, which then skips the others' gradients (for a
    # bias table, a scatter per tile).
    wants = tuple(() if p.perturbed else None for p in score_consts)
    q, k, v, score_consts, mask_consts, lists = jax.tree.map(
        lambda p: p.value, (q, k, v, score_consts, mask_consts, lists), is_leaf=_is_primal)
    # Each backend saves what its backward needs beside lse (the kernels keep each row's max
    # apart from its sum: lse alone loses log(sum) on rows with scores near finfo.min).
    out, lse, residuals = get_backend(backend_name).forward_with_residuals(
        spec, q, k, v, score_consts, mask_consts, lists)
    return (out, lse), (q, k, v, out, lse, score_consts, mask_consts, lists, wants, residuals)


def _is_primal(x) -> bool:
    return isinstance(x, jax.custom_derivatives.CustomVJPPrimal)


def _zero_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, dtype=jax.dtypes.float0)


def _instantiate(ct, like):
    if isinstance(ct, jax.custom_derivatives.SymbolicZero):
        return jnp.zeros(like.shape, like.dtype)
    return ct


def _attention_bwd(backend_name, spec, res, cts):
    q, k, v, out, lse, score_consts, mask_consts, lists, wants, residuals = res
    dout, dlse = _instantiate(cts[0], out), _instantiate(cts[1], lse)
    grad_consts = tuple(w is not None and jnp.issubdtype(c.dtype, jnp.inexact)
                        for w, c in zip(wants, score_consts))
    dq, dk, dv, dscore = get_backend(backend_name).backward(
        spec, q, k, v, out, lse, dout, dlse, score_consts, mask_consts, lists, grad_consts, residuals)
    dscore = tuple(d if want else _zero_cotangent(c) for c, d, want in zip(score_consts, dscore, grad_consts))
    return (dq, dk, dv, dscore, tuple(_zero_cotangent(c) for c in mask_consts),
            tuple(_zero_cotangent(x) for x in lists))


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)
