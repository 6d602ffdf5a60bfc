"""The backend contract: what every backend implements, and the data that crosses it.

A backend is a module (``backends/reference.py`` is the smallest complete one) that the
``Backend`` Protocol describes, registered by name in ``backends/__init__.py``. The API
layer builds one ``AttentionSpec`` per call, asks ``validate_options`` and ``supports``,
then runs ``forward_with_residuals`` under a ``custom_jvp`` whose transpose is
``backward``. Inside a backend, the ways it can serve a call (a C++ kernel, a decode
path, loops) are ``Implementation`` entries walked in order by ``first_serving``, so the
choice made for a call can be reported (``flexjax.explain``).

This module imports nothing from flexjax: every layer may use it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
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


@runtime_checkable
class Backend(Protocol):
    """What a backend module defines (``flexjax.backends.get_backend(name)`` returns it).

    Shapes: q (B, Sq, Hq, D), k (B, Skv, Hkv, D), v (B, Skv, Hkv, Dv); lse and the
    residuals (B, Hq, Sq). ``spec`` is the call's ``flexjax._api.AttentionSpec``;
    ``score_consts`` / ``mask_consts`` are the arrays the mods close over; ``lists`` is
    the BlockMask's ``TileLists``.

    Optional: ``KernelOptions`` (a frozen dataclass, one field per ``kernel_options`` key)
    and ``SWITCHES`` (further keys that are not fields).
    """

    NAME: str

    def validate_options(self, spec) -> None:
        """Raises ``ValueError`` naming the key for an invalid ``kernel_options`` value.

        Keys of other backends are not errors here (the API layer checks names); nothing
        else raises.
        """

    def supports(self, spec, q, k, v) -> str | None:
        """None when the backend serves this call, else the reason, as a sentence.

        Never raises: a failure while deciding (a mod the code generator cannot take, a
        missing package) is a reason. Called after ``validate_options``.
        """

    def forward_with_residuals(self, spec, q, k, v, score_consts, mask_consts, lists: TileLists,
                               dropout_seed=None) -> tuple[jax.Array, jax.Array, Residuals]:
        """(out (B, Sq, Hq, Dv) in q's dtype, lse float32, ``Residuals``).

        ``dropout_seed`` is the (2,) uint32 seed when ``spec.dropout_rate > 0``.
        """

    def backward(self, spec, q, k, v, out, lse, dout, dlse, score_consts, mask_consts, lists: TileLists,
                 grad_consts: Sequence[bool], residuals: Residuals, dropout_seed=None) -> tuple:
        """(dq, dk, dv, dscore): the inputs' gradients in their dtypes and one entry per
        score_mod captured array, its gradient where ``grad_consts`` flags it, else None.
        Deterministic (no atomics): the same inputs give the same bits."""


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
    backend's pass passes to ``first_serving``; it must not raise.
    """

    name: str
    supports: Callable[..., str | None]


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
    """The one rule for every "can you serve this" question (a backend's ``supports``, an implementation's,
    a mod compiled to see whether it lowers): a ``NotImplementedError`` is a refusal and an ``InvalidOption``
    the caller's, and both pass; any other exception is a flexjax bug, raised as a refusal that says so
    and keeps it as its cause, so that ``backend=None`` moves on to the next backend instead of crashing."""
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


def first_serving(implementations: Sequence[Implementation], label: str = "", *, or_none: bool = False,
                  **context) -> tuple[str | None, list[tuple[str, str]]]:
    """The name of the first implementation that serves, and (name, reason) for each one passed over.

    The last implementation of every list serves everything it is given (its ``supports``
    returns None), so a pass always has one; where none serves it raises, or with ``or_none``
    returns (None, every reason). ``label`` names the pass in the log ("xla
    forward"). Each choice is logged at DEBUG level on the
    "flexjax" logger (``logging.getLogger("flexjax").setLevel(logging.DEBUG)``), with the
    reasons of those passed over: the same sentences ``flexjax.explain`` returns.
    """
    skipped = []
    for impl in implementations:
        reason = answer(impl.supports, f"implementation {impl.name!r}", **context)
        if reason is None:
            if _LOG.isEnabledFor(logging.DEBUG):
                passed = "".join(f"; not {n!r}: {r}" for n, r in skipped)
                _LOG.debug("flexjax: %s runs %r%s", label or "a pass", impl.name, passed)
            return impl.name, skipped
        skipped.append((impl.name, reason))
    if or_none:
        return None, skipped
    raise NotImplementedError("no implementation serves this call: " + "; ".join(f"{n}: {r}" for n, r in skipped))


def never_raises(supports: Callable[..., str | None]) -> Callable[..., str | None]:
    """A backend's ``supports`` that keeps its promise, by ``answer``'s rule."""
    who = f"the {supports.__module__.rsplit('.', 1)[-1]} backend"

    @functools.wraps(supports)
    def guarded_supports(*args, **kwargs):
        return answer(supports, who, *args, **kwargs)

    return guarded_supports


def always(**_) -> None:
    """``supports`` of an implementation that serves every call its backend accepts."""
    return None
