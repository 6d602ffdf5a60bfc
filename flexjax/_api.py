"""flex_attention: input checks, backend dispatch (and ``explain``) and the custom_jvp around the backends
(``jax.grad`` transposes its linear part to the backend's hand-written backward)."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax

from . import _debug, _dropout
from ._autodiff import attention_jvp
from ._block_mask_type import BlockMask
from ._spec import (  # noqa: F401 (AttentionSpec, AuxOutput and AuxRequest are public here)
    AttentionSpec,
    AuxOutput,
    AuxRequest,
    check_block_mask,
    check_layout,
    check_outputs,
    check_qkv,
    check_scale,
    check_sinks,
    min_scores_pass,
    prepare,
    results,
    trace_score,
)
from .backends import (
    for_platform,
    get_backend,
    platform_backends,
)
from .backends._contract import Implementation, Plan, choose

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
      return_aux: an ``AuxRequest``: return ``(out, AuxOutput(lse=..., max_scores=...,
        min_scores=...))`` instead (not together with ``return_lse``).
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
      backend: "xla", "pallas", "triton", "mosaic_gpu" or "reference" (dense, for tests);
        None picks for the platform (``flexjax.backends.platform_backends()``; ``explain``
        says which and why).
      kernel_options: backend options (tile sizes etc.; see each backend's KernelOptions).

    Returns:
      Output (batch, q_len, q_heads, v_head_dim) in the query's dtype, or ``(out, lse)``,
      or ``(out, AuxOutput)``.
    """
    check_qkv(query, key, value)
    check_outputs(return_lse, return_aux)
    rate = _dropout.check_rate(dropout_rate)
    seed = _dropout.seed_words(dropout_rng) if rate > 0 else None
    B, Sq, Hq, D = query.shape
    sinks = check_sinks(sinks, Hq)
    want_max = return_aux is not None and (return_aux.max_scores or return_aux.min_scores)
    want_lse = return_lse or sinks is not None or (return_aux is not None and return_aux.lse)
    if _sharded_dispatch is not None:
        sharded = _sharded_dispatch(query, key, value, score_mod, block_mask, scale=scale,
                                    return_lse=want_lse, backend=backend, kernel_options=kernel_options,
                                    dropout=rate > 0, max_scores=want_max)
        if sharded is not NotImplemented:
            out, lse = sharded if want_lse else (sharded, None)
            return results(out, lse, None, sinks, return_lse, return_aux)
    call = _prepare(query, key, score_mod, block_mask, scale, kernel_options, backend, rate)
    if _debug.enabled():  # reads past a captured array's end raise (flexjax.debug_checks)
        query = query + _debug.check_reads(call.spec, call.score_consts, call.mask_consts, B, Hq).astype(query.dtype)
    plan, _ = _choose_backend(backend, call, query, key, value, seed)
    out, lse, max_scores = _attention_jit(plan, call.spec, query, key, value, call.score_consts,
                                          call.mask_consts, call.lists, seed)
    min_scores = min_scores_pass(
        lambda mod, aux, qkv: flex_attention(*qkv, mod, block_mask, scale=scale, return_aux=aux, backend=backend,
                                             kernel_options=kernel_options),
        score_mod, return_aux, (query, key, value))
    return results(out, lse, max_scores, sinks, return_lse, return_aux, min_scores)


def _prepare(query, key, score_mod, block_mask, scale, kernel_options, backend, rate):
    if block_mask is not None:
        check_block_mask(block_mask, query.shape, key.shape[1])
    else:
        check_layout(query, key)
    return prepare(query, key.shape[1], score_mod, block_mask, scale=scale, kernel_options=kernel_options,
                   backend=backend, dropout_rate=rate)


def _choose_backend(backend, call, query, key, value, seed, *, warn: bool = True) -> tuple[Plan, list]:
    """The named backend's plan, or the first plan of the platform's list (``backends.platform_backends``),
    and (name, reason) for each backend passed over.

    Each candidate answers with its ``plan`` (``_contract.make_plan``: an invalid kernel_options value
    raises, the caller's to fix; a failure inside a backend is a flexjax bug, reported as the reason).
    A named backend that cannot serve raises; with ``backend=None`` each skipped backend is reported by
    a warning (``warn``), so no fallback is silent.
    """
    names = platform_backends() if backend is None else (backend,)
    # The same walker as each backend's implementation lists (``_contract.choose``).
    candidates = [Implementation(n, functools.partial(get_backend(n).plan, call, query, key, value, seed))
                  for n in names]
    name, plan, skipped = choose(candidates, "backend choice", or_none=True)
    if name is None and backend is not None:
        raise NotImplementedError(f"backend {backend!r} cannot serve this call: {skipped[0][1]}")
    if name is None:
        raise NotImplementedError("no backend can serve this call: " + "; ".join(f"{n}: {r}" for n, r in skipped))
    for skipped_name, skipped_reason in skipped if warn else ():
        warnings.warn(f"flexjax: backend {skipped_name!r} cannot serve this call ({skipped_reason}); "
                      f"using {name!r}. Pass backend={name!r} to choose it explicitly.", stacklevel=4)
    return plan, skipped


@dataclasses.dataclass(frozen=True)
class Explanation:
    """Which backend and which of its implementations serve a call, and why the others do not.

    Attributes:
      backend: the backend's name.
      forward: the implementation that runs the forward (e.g. "cpu_kernel", "decode",
        "band", "loops" for xla; "decode", "tiled" for pallas).
      backward: the implementation ``jax.grad`` runs, for gradients of q, k, v and every
        float array the score_mod closes over.
      skipped_backends, skipped_forward, skipped_backward: (name, reason) for each one
        passed over, in the order tried.
      plan: the chosen backend's ``Plan``, the one the call runs (its resolved ``options``, the
        backward for gradients of q, k and v alone, the fallbacks of a kernel primitive).
    """

    backend: str
    forward: str
    backward: str
    skipped_backends: tuple[tuple[str, str], ...] = ()
    skipped_forward: tuple[tuple[str, str], ...] = ()
    skipped_backward: tuple[tuple[str, str], ...] = ()
    plan: Plan | None = None

    def __str__(self) -> str:
        lines = [f"backend {self.backend!r}: forward {self.forward!r}, backward {self.backward!r}"]
        plan = self.plan
        if plan is not None:
            if plan.backward_qkv != plan.backward:
                lines.append(f"  backward for gradients of q, k and v alone: {plan.backward_qkv!r}")
            for kind, fallback in (("forward", plan.forward_fallback), ("backward", plan.backward_fallback)):
                if fallback is not None:
                    lines.append(f"  {kind} lowered as {fallback!r} where the kernel cannot be called (jax.export)")
            if plan.options is not None:
                lines.append(f"  options: {plan.options}")
        for kind, skipped in (("backend", self.skipped_backends), ("forward", self.skipped_forward),
                              ("backward", self.skipped_backward)):
            lines += [f"  skipped {kind} {name!r}: {reason}" for name, reason in skipped]
        return "\n".join(lines)


def explain(query: jax.Array, key: jax.Array, value: jax.Array, score_mod: Callable | None = None,
            block_mask: BlockMask | None = None, *, scale: float | None = None, dropout_rate: float = 0.0,
            dropout_rng: jax.Array | None = None, backend: str | None = None,
            kernel_options: dict | None = None, platform: str | None = None) -> Explanation:
    """What ``flex_attention`` with these arguments would run, without running it.

    Takes ``flex_attention``'s arguments (arrays or ``jax.ShapeDtypeStruct``s) and returns an
    ``Explanation``: the backend chosen, the implementation of its forward and backward, and
    the reason each backend or implementation tried before it was passed over (the same
    reasons ``backend=None`` warns with). ``print(flexjax.explain(...))`` reads as a report.
    Raises what ``flex_attention`` raises for invalid arguments or an unservable call.

    ``platform`` ("cpu", "gpu" / "cuda", "tpu"; None: JAX's default backend) asks what would
    run there, from any host: the backends choose and resolve their options as on that
    platform (a GPU without one to ask is compute capability 9.0 unless
    ``kernel_options["compute_capability"]`` says otherwise).
    """
    with for_platform(platform):
        return _explain(query, key, value, score_mod, block_mask, scale, dropout_rate, dropout_rng, backend,
                        kernel_options)


def _explain(query, key, value, score_mod, block_mask, scale, dropout_rate, dropout_rng, backend,
             kernel_options) -> Explanation:
    check_qkv(query, key, value)
    rate = _dropout.check_rate(dropout_rate)
    seed = _dropout.seed_words(dropout_rng) if rate > 0 else None
    call = _prepare(query, key, score_mod, block_mask, scale, kernel_options, backend, rate)
    if _debug.enabled():
        _debug.check_reads(call.spec, call.score_consts, call.mask_consts, query.shape[0], query.shape[2])
    plan, skipped = _choose_backend(backend, call, query, key, value, seed, warn=False)
    return Explanation(plan.backend, plan.forward, plan.backward, tuple(skipped), plan.skipped_forward,
                       plan.skipped_backward, plan)


# -- autodiff ------------------------------------------------------------------------------
# One custom_jvp serves both modes (``_autodiff.attention_jvp``): jax.grad runs the backend's
# hand-written backward on the residuals the forward saved, jax.jvp the xla backend's tangent pass.

@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _attention(plan, spec, q, k, v, score_consts, mask_consts, lists, seed):
    out, lse, residuals = get_backend(plan.backend).forward_with_residuals(spec, q, k, v, score_consts, mask_consts,
                                                                           lists, dropout_seed=seed, plan=plan)
    return out, lse, residuals.row_max


def _attention_jvp(plan, spec, primals, tangents):
    impl = get_backend(plan.backend)

    def forward(q, k, v, score_consts, mask_consts, lists, seed):
        return impl.forward_with_residuals(spec, q, k, v, score_consts, mask_consts, lists, dropout_seed=seed,
                                           plan=plan)

    return attention_jvp(plan, spec, primals, tangents, forward, seed_of=lambda seed: seed)


_attention.defjvp(_attention_jvp, symbolic_zeros=True)

# Every call goes through jit, keyed by the (hashable) plan and spec: an eager call
# (or an eager jax.grad of one) then compiles the blockwise loops once as one program
# instead of dispatching them op by op, ~5-7x faster on a first call; inside an outer jit
# it is one nested call.
_attention_jit = jax.jit(_attention, static_argnums=(0, 1))


