"""The backend contract: what every backend implements, and the data that crosses it.

A backend is a module (``backends/reference.py`` is the smallest complete one) that the
``Backend`` Protocol describes, registered by name in ``backends/__init__.py``. The API
layer prepares one ``Call`` (spec, captured arrays, tile lists) and asks each candidate
backend for its ``Plan`` (``make_plan``: options checked and resolved once, then the
``Implementation`` of each pass, a C++ kernel, a decode path, loops, walked in order); the
first plan runs, ``forward_with_residuals`` under a ``custom_jvp`` whose transpose is
``backward``, both reading it, and ``flexjax.explain`` reports the same plan.

This module imports nothing from flexjax: every layer may use it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

_LOG = logging.getLogger("flexjax")


class TileLists(NamedTuple):
    """The eight tile lists of a BlockMask (PyTorch FlexAttention's layout), as the kernels read them.

    All int32, leading dims (Bm, Hm) with 1 where the mask broadcasts. ``*_num`` counts a row's
    entries; ``*_idx`` holds them ascending, padded with valid indices past the count.

    Attributes:
      kv_num, kv_idx: per q block, its partial kv blocks (the mask_mod is applied there).
      full_kv_num, full_kv_idx: per q block, its full kv blocks (no mask_mod).
      q_num, q_idx, full_q_num, full_q_idx: the transposed lists: per kv block, its q
        blocks, which the dK/dV pass walks.
    """

    kv_num: Any
    kv_idx: Any
    full_kv_num: Any
    full_kv_idx: Any
    q_num: Any
    q_idx: Any
    full_q_num: Any
    full_q_idx: Any

    @property
    def by_q(self) -> tuple:
        """(kv_num, kv_idx, full_kv_num, full_kv_idx): the lists the forward and dQ pass walk."""
        return tuple(self[:4])

    @property
    def by_kv(self) -> tuple:
        """(q_num, q_idx, full_q_num, full_q_idx): the lists the dK/dV pass walks."""
        return tuple(self[4:])


class Residuals(NamedTuple):
    """What a forward keeps for its backward: each row's softmax statistics, (B, Hq, Sq) float32.

    One format for every backend. ``row_max`` is the maximum of the row's modified,
    allowed scores and ``row_sum`` the sum of ``exp(s - row_max)`` over them (undropped);
    a row with no allowed key has ``row_max = -inf`` and ``row_sum = 0``. Keeping the two
    apart (not only lse = max + log(sum)) keeps the backward exact on rows whose scores
    are huge in magnitude, where float32 lse loses log(sum).
    """

    row_max: Any
    row_sum: Any

    @classmethod
    def from_running(cls, m, l) -> Residuals:
        """From an online softmax's running max ``m`` and sum ``l`` (any value of ``m`` where ``l == 0``)."""
        alive = l > 0
        return cls(jnp.where(alive, m, -jnp.inf), jnp.where(alive, l, 0.0))

    def lse(self):
        """log-sum-exp of each row: ``row_max + log(row_sum)``, -inf on rows with no allowed key."""
        alive = self.row_sum > 0
        return jnp.where(alive, self.row_max + jnp.log(jnp.where(alive, self.row_sum, 1.0)), -jnp.inf)

    def recompute_stats(self):
        """(max, log of the sum) with 0 for both on rows with no allowed key: the backward's and
        tangent pass's ``P = exp((s - max) - log_sum)``, finite everywhere (masked pairs are
        zeroed after)."""
        alive = self.row_sum > 0
        return (jnp.where(alive, self.row_max, 0.0),
                jnp.where(alive, jnp.log(jnp.where(alive, self.row_sum, 1.0)), 0.0))


class Call(NamedTuple):
    """A call prepared for the backends (``flexjax._spec.prepare``): its spec, the arrays the mods capture,
    and the tile lists."""

    spec: Any
    score_consts: tuple
    mask_consts: tuple
    lists: Any


@dataclasses.dataclass(frozen=True)
class Plan:
    """What runs for one call, decided once by the backend's ``plan`` and read by everything after it:
    ``flex_attention`` (passed statically through its ``custom_jvp``, so it keys the compiled program),
    the backend's forward and backward, and ``explain``, which reports it. What ``explain`` says is what runs.

    Attributes:
      backend: the backend's name.
      forward: the ``Implementation`` of ``FORWARD`` that runs the forward.
      backward: the one of ``BACKWARD`` that ``jax.grad`` runs when gradients of the score_mod's captured
        arrays are wanted (planned with every float array differentiated).
      backward_qkv: the one it runs for gradients of q, k and v alone.
      options: the backend's kernel_options resolved for the call (its ``KernelOptions`` with the user's
        values and the heuristics' defaults; hashable), or None where it takes none.
      forward_fallback, backward_fallback: where the chosen implementation is a primitive that lowers to
        another one when it cannot be called (the C++ CPU kernel under ``jax.export`` or for another
        platform), that other one; else None.
      skipped_forward, skipped_backward: (name, reason) for each implementation passed over, in order.
    """

    backend: str
    forward: str
    backward: str
    backward_qkv: str
    options: Any = None
    forward_fallback: str | None = None
    backward_fallback: str | None = None
    skipped_forward: tuple = ()
    skipped_backward: tuple = ()

    def backward_for(self, grad_consts: Sequence[bool]) -> str:
        """The backward implementation for these captured-array gradients."""
        return self.backward if any(grad_consts) else self.backward_qkv


@runtime_checkable
class Backend(Protocol):
    """What a backend module defines (``flexjax.backends.get_backend(name)`` returns it).

    Shapes: q (B, Sq, Hq, D), k (B, Skv, Hkv, D), v (B, Skv, Hkv, Dv); lse and the
    residuals (B, Hq, Sq). ``spec`` is the call's ``flexjax._spec.AttentionSpec``;
    ``score_consts`` / ``mask_consts`` are the arrays the mods close over; ``lists`` is
    the BlockMask's ``TileLists``; ``plan`` is what the backend's ``plan`` returned for the call.

    Optional: ``KernelOptions`` (a frozen dataclass, one field per ``kernel_options`` key)
    and ``SWITCHES`` (further keys that are not fields).
    """

    NAME: str
    FORWARD: tuple   # the forward's ``Implementation``s, in the order tried
    BACKWARD: tuple  # the backward's

    def validate_options(self, spec) -> None:
        """Raises ``ValueError`` naming the key for an invalid ``kernel_options`` value.

        Keys of other backends are not errors here (the API layer checks names); nothing
        else raises.
        """

    def resolve(self, spec, q, k, v) -> Any:
        """The call's resolved options (hashable; the plan's ``options``), or the reason the backend cannot
        serve it, as a ``str`` sentence. Called after ``validate_options``; a ``NotImplementedError`` is a
        refusal too, and any other exception a flexjax bug reported as the reason (``guarded``)."""

    def plan(self, call: Call, q, k, v, dropout_seed=None) -> Plan | str:
        """The ``Plan`` for ``call``, or the reason the backend cannot serve it. Every backend's is
        ``make_plan`` on itself (``plan = planner(__name__)``): ``validate_options``, ``resolve``, then the
        first implementation of ``FORWARD`` and of ``BACKWARD`` that serves, each asked once."""

    def forward_with_residuals(self, spec, q, k, v, score_consts, mask_consts, lists: TileLists,
                               dropout_seed=None, plan: Plan | None = None) -> tuple[jax.Array, jax.Array, Residuals]:
        """(out (B, Sq, Hq, Dv) in q's dtype, lse float32, ``Residuals``), as ``plan`` says (None: planned
        here, ``planned``).

        ``dropout_seed`` is the (2,) uint32 seed when ``spec.dropout_rate > 0``.
        """

    def backward(self, spec, q, k, v, out, lse, dout, dlse, score_consts, mask_consts, lists: TileLists,
                 grad_consts: Sequence[bool], residuals: Residuals, dropout_seed=None,
                 plan: Plan | None = None) -> tuple:
        """(dq, dk, dv, dscore): the inputs' gradients in their dtypes and one entry per
        score_mod captured array, its gradient where ``grad_consts`` flags it, else None.
        Deterministic (no atomics): the same inputs give the same bits. ``plan.backward_for(grad_consts)``
        names the implementation."""


@runtime_checkable
class PagedBackend(Protocol):
    """What a backend with a paged path defines beside ``Backend``'s members (xla, pallas, triton): the
    paged, ragged and ``write_and_attend`` calls choose among the backends that satisfy it.

    ``k`` / ``v`` in the checks stand for the logical cache (B, max_pages * page_size, Hkv, .);
    ``scales`` is a quantized pool's (k_scale, v_scale), float32 (num_pages, Hkv), or None.
    ``PAGED_FORWARD``: its paged forward's ``Implementation``s, in the order tried (``paged.explain``
    names the first that serves). The backward of every paged call is one XLA loop reading the
    pools through the table (``backends/_paged_backward.py``).
    """

    PAGED_FORWARD: tuple

    def supports_paged(self, spec, q, k, v, lists: TileLists) -> str | None:
        """None when the backend's paged forward serves this call, else the reason (never raises)."""

    def supports_quantized(self, spec, q, pages) -> str | None:
        """None when it reads int8 / float8_e4m3fn pools of ``pages``' dtype, else the reason."""

    def paged_forward(self, spec, q, k_pages, v_pages, page_table, score_consts, mask_consts, lists: TileLists,
                      scales=None) -> tuple[jax.Array, jax.Array, Residuals]:
        """``forward_with_residuals`` reading K/V through the page table (B, max_pages)."""

    def ragged_rows(self, dtype, kernel_options: dict) -> int:
        """How many query rows (heads x tokens) a ragged call packs in a tile for this backend."""


class Implementation(NamedTuple):
    """One way a backend can serve a pass: a name and its own "can you serve this" test.

    ``supports(**context) -> str | None`` (None: it serves) receives the keywords the
    plan passes to ``walk`` (``make_plan``: the call, its arrays and the resolved
    ``options``); it must not raise. ``fallback``: it is a primitive that lowers to the next implementation
    that serves where it cannot be called (``Plan.forward_fallback``).
    """

    name: str
    supports: Callable[..., str | None]
    fallback: bool = False


class InvalidOption(ValueError):
    """An invalid ``kernel_options`` value (``validate``): the caller's to fix, so it crosses every guard."""


def validate(backend, spec) -> None:
    """``backend.validate_options(spec)``, its ValueError raised as an ``InvalidOption``."""
    try:
        backend.validate_options(spec)
    except InvalidOption:
        raise
    except ValueError as e:
        raise InvalidOption(str(e)) from e


@contextlib.contextmanager
def guarded(who: str, what: str = "check the call"):
    """The one rule for every "can you serve this" question (a backend's ``resolve``, an implementation's
    ``supports``, a mod compiled to see whether it lowers): a ``NotImplementedError`` is a refusal and an
    ``InvalidOption`` the caller's, and both pass; any other exception is a flexjax bug, raised as a refusal
    that says so and keeps it as its cause, so that ``backend=None`` moves on to the next backend instead
    of crashing."""
    try:
        yield
    except (NotImplementedError, InvalidOption):
        raise
    except Exception as e:
        raise NotImplementedError(f"{who} failed to {what} ({type(e).__name__}: {e}); this is a flexjax bug, "
                                  "please report it") from e


def answer(question: Callable[..., str | None], who: str, *args, **kwargs) -> str | None:
    """``question(*args, **kwargs)`` under ``guarded``: None, or the reason of the refusal."""
    try:
        with guarded(who):
            return question(*args, **kwargs)
    except InvalidOption:
        raise
    except NotImplementedError as e:
        return str(e)


def choose(candidates: Sequence[Implementation], label: str = "", *, or_none: bool = False,
           **context) -> tuple[str | None, Any, list[tuple[str, str]]]:
    """The first candidate that serves: its name, what its ``supports`` answered (a ``str`` is a refusal;
    anything else, None included, is the answer of one that serves, such as a backend's ``Plan``), and
    (name, reason) for each one passed over.

    The last implementation of every backend's list serves everything it is given, so a pass always
    has one; where none serves it raises, or with ``or_none`` returns (None, None, every reason).
    ``label`` names the choice in the log ("xla forward"): each is logged at DEBUG level on the
    "flexjax" logger (``logging.getLogger("flexjax").setLevel(logging.DEBUG)``), with the reasons of
    those passed over: the same sentences ``flexjax.explain`` returns.
    """
    skipped = []
    for impl in candidates:
        got = answer(impl.supports, f"implementation {impl.name!r}", **context)
        if not isinstance(got, str):
            if _LOG.isEnabledFor(logging.DEBUG):
                passed = "".join(f"; not {n!r}: {r}" for n, r in skipped)
                _LOG.debug("flexjax: %s runs %r%s", label or "a pass", impl.name, passed)
            return impl.name, got, skipped
        skipped.append((impl.name, got))
    if or_none:
        return None, None, skipped
    raise NotImplementedError("no implementation serves this call: " + "; ".join(f"{n}: {r}" for n, r in skipped))


def walk(backend, kind: str, context: dict) -> tuple[str, str | None, list]:
    """(chosen, its fallback, skipped) among ``backend``'s ``kind`` implementations ("FORWARD", "BACKWARD",
    "PAGED_FORWARD"), ``context`` their keywords."""
    impls = tuple(getattr(backend, kind))
    name, _, skipped = choose(impls, f"{backend.NAME} {kind.lower()}", **context)
    chosen = next(i for i, impl in enumerate(impls) if impl.name == name)
    fallback = None
    if impls[chosen].fallback:
        fallback, _, _ = choose(impls[chosen + 1:], f"{backend.NAME} {kind.lower()} fallback", **context)
    return name, fallback, skipped


def make_plan(backend, call: Call, q, k, v, dropout_seed=None) -> Plan | str:
    """The body of every backend's ``plan``: ``validate_options`` (an invalid value raises, the caller's to
    fix), ``resolve`` under ``guarded`` (a reason ends it), then the forward's and the backward's
    implementations, each list walked once with the resolved options in the context."""
    spec = call.spec
    validate(backend, spec)
    options = answer(backend.resolve, f"the {backend.NAME} backend", spec, q, k, v)
    if isinstance(options, str):
        return options
    context = dict(spec=spec, q=q, k=k, v=v, score_consts=call.score_consts, mask_consts=call.mask_consts,
                   lists=call.lists, dropout_seed=dropout_seed, options=options)
    forward, forward_fallback, skipped_forward = walk(backend, "FORWARD", context)
    grads = tuple(bool(jnp.issubdtype(jnp.result_type(c), jnp.inexact)) for c in call.score_consts)
    backward, backward_fallback, skipped_backward = walk(backend, "BACKWARD", dict(context, grad_consts=grads))
    backward_qkv = backward
    if any(grads):
        backward_qkv, _, _ = walk(backend, "BACKWARD", dict(context, grad_consts=(False,) * len(grads)))
    return Plan(backend.NAME, forward, backward, backward_qkv, options, forward_fallback, backward_fallback,
                tuple(skipped_forward), tuple(skipped_backward))


def planner(module_name: str) -> Callable[..., Plan | str]:
    """A backend module's ``plan``: ``make_plan`` on the module (``plan = planner(__name__)``)."""

    def plan(call: Call, q, k, v, dropout_seed=None) -> Plan | str:
        return make_plan(sys.modules[module_name], call, q, k, v, dropout_seed)

    plan.__doc__ = Backend.plan.__doc__
    return plan


def planned(backend, plan: Plan | None, spec, q, k, v, score_consts, mask_consts, lists, dropout_seed=None) -> Plan:
    """``plan``, or where it is None (a backend's forward or backward called directly) the backend's plan for
    the call, raising its reason."""
    if plan is not None:
        return plan
    got = backend.plan(Call(spec, tuple(score_consts), tuple(mask_consts), lists), q, k, v, dropout_seed)
    if isinstance(got, str):
        raise NotImplementedError(f"backend {backend.NAME!r} cannot serve this call: {got}")
    return got


def always(**_) -> None:
    """``supports`` of an implementation that serves every call its backend accepts."""
    return None
