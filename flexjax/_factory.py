"""What the mask and mod factories share: picklable named callables and parameter checks; and the run-time
checks of traced inputs (``fail_on_host``) that the paged calls and ``BlockMask.from_kv_blocks`` share."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable

import jax
import jax.extend.backend
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def named(fn: Callable, name: str, **params) -> functools.partial:
    """``functools.partial(fn, **params)`` whose ``__name__`` is ``name``.

    Factories return these rather than closures: plain ``pickle`` stores a partial of a
    module-level function with its parameters, but cannot store a local function.
    """
    mod = functools.partial(fn, **params)
    mod.__name__ = mod.__qualname__ = name
    return mod


def replicated(x: jax.Array) -> jax.Array:
    """``x``, gathered whole onto every device when it is sharded over Explicit mesh axes.

    Mods read captured arrays at data-dependent indices (``ids[b, q_idx]``), which JAX
    cannot type on an Explicit-sharded axis (e.g. document ids sharded with the batch);
    such arrays are small next to q/k/v, so every device keeps all of them.
    """
    sharding = jax.typeof(x).sharding
    if all(e is None for e in sharding.spec):
        return x
    return jax.reshard(x, NamedSharding(sharding.mesh, P()))


def eager_outside_abstract_mesh(fn: Callable) -> Callable:
    """``fn``, run outside an abstract-only mesh when called eagerly (not under a trace).

    Lowering for a GPU or TPU from a CPU host happens inside ``use_abstract_mesh(AbstractMesh(...,
    abstract_device=...))``, with no devices behind it. JAX >= 0.11 gives an AbstractMesh Explicit axes
    by default, and then every eager op inside that context fails; the BlockMask builders compute
    eagerly on the host's own devices, so there they step out of it. Under a trace, or where a
    concrete mesh is set (``jax.set_mesh``), ``fn`` runs where it was called.
    """

    @functools.wraps(fn)
    def outside(*args, **kwargs):
        from jax._src import core as jax_core
        from jax._src import mesh as mesh_lib

        empty = getattr(mesh_lib, "empty_abstract_mesh", None)
        concrete = getattr(mesh_lib, "get_concrete_mesh", lambda: None)()
        if (empty is None or jax.sharding.get_abstract_mesh().empty or not jax_core.trace_state_clean()
                or (concrete is not None and not concrete.empty)):
            return fn(*args, **kwargs)
        with jax.sharding.use_abstract_mesh(empty):
            return fn(*args, **kwargs)

    return outside


def is_traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def describe(x) -> str:
    """``x``'s type for error messages: ``float``, or ``float32 array of shape (3,)``."""
    if isinstance(x, (jax.Array, np.ndarray)):
        return f"{'traced ' if is_traced(x) else ''}{x.dtype} array of shape {tuple(x.shape)}"
    return type(x).__name__


def int_param(caller: str, name: str, value, minimum: int | None = None,
              expected: str = "an int or an integer scalar array") -> int | jax.Array:
    """``value`` as a Python int checked against ``minimum``; a traced integer scalar as is.

    A traced value (a parameter known only inside ``jit``) cannot be checked: it is
    returned as an int32 array and the mask captures it.

    Raises:
      TypeError: ``value`` is neither an int nor an integer scalar array.
      ValueError: a concrete ``value`` below ``minimum``.
    """
    is_int_array = (isinstance(value, (jax.Array, np.ndarray)) and value.shape == ()
                    and jnp.issubdtype(value.dtype, jnp.integer))
    if is_traced(value) and is_int_array:
        return value.astype(jnp.int32)
    if is_int_array:
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{caller}: {name} must be {expected}, got {describe(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{caller}: {name} must be >= {minimum}, got {value}")
    return int(value)


def batch_param(caller: str, name: str, value, hint: str = "") -> jax.Array:
    """A ``(B,)`` integer array (may be traced); with ``B == 1`` its one entry, a scalar.

    The scalar means the mask does not read ``b``, so it can be built with ``B=None``.

    Raises:
      TypeError: not an integer array.
      ValueError: not of shape ``(B,)`` with ``B >= 1``.
    """
    arr = replicated(jnp.asarray(value))
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise TypeError(f"{caller}: {name} must be an integer array, got dtype {arr.dtype}")
    if arr.ndim != 1 or arr.shape[0] == 0:
        raise ValueError(f"{caller}: {name} must have shape (B,) with B >= 1, got shape {arr.shape}{hint}")
    return arr[0] if arr.shape[0] == 1 else arr


def int_or_batch_param(caller: str, name: str, value, minimum: int | None = None) -> int | jax.Array:
    """An int (checked against ``minimum``), a traced integer scalar, or a ``(B,)`` array.

    See ``int_param`` and ``batch_param``.
    """
    if jnp.ndim(value) == 0:
        return int_param(caller, name, value, minimum,
                         expected="an int, an integer scalar array or a (B,) integer array")
    return batch_param(caller, name, value, hint="; pass a scalar for one value shared by the batch")


def entry(x, i):
    """``x[i]``, ``i`` clamped into range, for a 1-D ``x``; a scalar ``x`` as is (``i`` unread)."""
    if jnp.ndim(x) == 0:
        return x
    return x[jnp.clip(i, 0, x.shape[0] - 1)]


def check_block_size(block_size, name: str = "block_size") -> tuple[int, int]:
    """``(block_q, block_kv)`` from a positive int or a pair of them; a ValueError naming ``name`` else."""
    if isinstance(block_size, (int, np.integer)):
        bs = (block_size, block_size)
    elif isinstance(block_size, (tuple, list)):
        bs = tuple(block_size)
    else:
        bs = ()
    if len(bs) != 2 or any(isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or x <= 0
                           for x in bs):
        raise ValueError(f"{name} must be a positive int or a pair (block_q, block_kv) of positive ints, "
                         f"got {block_size!r}")
    return int(bs[0]), int(bs[1])


def check_seq_lengths(seq_lengths, caller: str = "") -> tuple[int, int]:
    """``(Q_LEN, KV_LEN)``, a pair of positive ints; a ValueError else."""
    lengths = tuple(seq_lengths) if isinstance(seq_lengths, (tuple, list)) else ()
    if len(lengths) != 2 or any(isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or x <= 0
                                for x in lengths):
        raise ValueError(f"{caller}seq_lengths must be a pair (Q_LEN, KV_LEN) of positive ints, got {seq_lengths!r}")
    return int(lengths[0]), int(lengths[1])


def member_rows(member: jax.Array, width: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Counts (..., R) and ascending column indices (..., R, width) of each row's True entries of a bool
    (..., R, C) array, in jnp (traceable; the widths depend on the shape only). Entries past a row's count
    are valid column indices (of False entries), to be ignored."""
    n = member.shape[-1]
    i = jnp.arange(n, dtype=jnp.int32)
    order = jnp.argsort(jnp.where(member, i, n + i), axis=-1).astype(jnp.int32)
    return member.sum(-1, dtype=jnp.int32), order[..., :min(n, width or n)]


def int_array(name: str, x, shapes: str) -> jax.Array:
    """``x`` as an int32 array; TypeError naming ``name`` and the ``shapes`` it may have otherwise."""
    arr = jnp.asarray(x)
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise TypeError(f"{name} must be an int or an integer array of shape {shapes}, got dtype {arr.dtype}")
    return arr.astype(jnp.int32)


# -- run-time checks of traced inputs --------------------------------------------------------

# Whether traced page tables, lengths, ragged layouts and ``BlockMask.from_kv_blocks``' lists are checked
# when the step runs (a host callback that fires only on a bad input; ``flexjax.paged.set_runtime_checks``
# turns it off). It lives here, below every module that checks (``_paged_core``, ``_from_kv_blocks``).
RUNTIME_CHECKS = os.environ.get("FLEXJAX_RUNTIME_CHECKS", "1") != "0"


def set_runtime_checks(enabled: bool) -> bool:
    """Turns the run-time checks of traced page tables, lengths, ragged layouts and ``BlockMask.from_kv_blocks``'
    lists on or off; returns the previous setting. It applies to steps traced after the call (a jitted step
    keeps what it was traced with). Eager calls are always checked."""
    global RUNTIME_CHECKS
    previous, RUNTIME_CHECKS = RUNTIME_CHECKS, bool(enabled)
    return previous


@contextlib.contextmanager
def built_here():
    """Traced page tables and lengths built by the caller itself (the Flax layer's ``reserve`` and its own checked
    lengths) skip the run-time check inside: they are right by construction, and a decode step saves a
    conditional a layer."""
    global RUNTIME_CHECKS
    previous, RUNTIME_CHECKS = RUNTIME_CHECKS, False
    try:
        yield
    finally:
        RUNTIME_CHECKS = previous


def _cross_lowering() -> bool:
    """Lowering for a platform this process has no runtime for (an AOT compile for a GPU or TPU from a host
    without one, under a mesh of topology devices or an abstract mesh of an abstract device): XLA cannot lower
    a host callback there, and the executable cannot run in this process anyway."""
    from jax._src import mesh as mesh_lib

    concrete = getattr(mesh_lib, "get_concrete_mesh", lambda: None)()
    if concrete is not None and not concrete.empty:
        platform = concrete.devices.flat[0].platform
    else:
        mesh = jax.sharding.get_abstract_mesh()
        device = getattr(mesh, "abstract_device", None)
        if mesh.empty or device is None:
            return False
        platform = getattr(device, "platform", "cpu")
    return not _has_runtime(platform)


@functools.cache
def _has_runtime(platform: str) -> bool:
    try:
        jax.extend.backend.get_backend(platform)
    except RuntimeError:
        return False
    return True


def fail_on_host(ok, fail, *args) -> jax.Array:
    """Raises ``fail(*args)`` when ``ok`` is False: eagerly now, under jit when the computation runs.

    Returns an int32 0 that the caller adds into a value the call goes on to use. Under jit the check is a
    ``lax.cond`` whose false branch is a ``pure_callback`` (it raises on the host): nothing crosses to the
    host while ``ok`` holds. A pure callback, unlike ``debug.callback``, carries no side effect, which on
    XLA:CPU cost each step about 50 us whatever the branch (measured); XLA drops a pure callback whose result
    is unused, hence the 0 to thread through. The callback checks ``ok`` itself, so under ``vmap`` (where
    the cond becomes a select of both branches) it raises only for a bad input.
    """
    if not isinstance(ok, jax.core.Tracer):
        if not bool(ok):
            fail(*(np.asarray(a) for a in args))
        return jnp.int32(0)
    if not RUNTIME_CHECKS or _cross_lowering():
        return jnp.int32(0)

    def host(good, *a):
        if not bool(good):
            fail(*(np.asarray(x) for x in a))
        return np.int32(0)

    def check(good, *a):
        return jax.pure_callback(host, jax.ShapeDtypeStruct((), jnp.int32), good, *a, vmap_method="sequential")

    return jax.lax.cond(ok, lambda good, *a: jnp.int32(0), check, ok, *args)
