"""Backend registry: each backend implements the contract of ``_contract.Backend``.

Adding a backend: write a module with what ``_contract.Backend`` lists, register its name
in ``_BACKENDS`` and place it in ``_PLATFORM_ORDER`` (docs/architecture.md walks through it).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib

import jax

# name -> module path of a module that satisfies ``_contract.Backend``.
_BACKENDS = {
    "reference": "flexjax.backends.reference",
    "xla": "flexjax.backends.xla",
    "pallas": "flexjax.backends.pallas",
    "triton": "flexjax.backends.triton",
    "mosaic_gpu": "flexjax.backends.mosaic_gpu",
}

# Ordered choices for backend=None, per platform; each list ends on "xla". On GPU,
# "mosaic_gpu" serves compute capabilities 9.0 and 10.0 and the mods, dtypes and head dims it
# takes (its ``resolve`` refuses the rest), "triton" only where jax-triton imports (the call
# warns that it fell through to "pallas"). Paged and ragged calls take the backends of the
# list that have a paged path (``_contract.PagedBackend``).
_PLATFORM_ORDER = {
    "cpu": ("xla",),
    "gpu": ("mosaic_gpu", "triton", "pallas", "xla"),
    "cuda": ("mosaic_gpu", "triton", "pallas", "xla"),
    "tpu": ("pallas", "xla"),
}


def available_backends() -> tuple[str, ...]:
    """Names accepted by ``flex_attention(..., backend=...)``."""
    return tuple(_BACKENDS)


def get_backend(name: str):
    """The backend module called ``name``."""
    if not isinstance(name, str) or name not in _BACKENDS:
        raise ValueError(f"backend must be one of {sorted(_BACKENDS)} or None, got {name!r}")
    return importlib.import_module(_BACKENDS[name])


PLATFORMS = ("cpu", "gpu", "cuda", "tpu")
_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("flexjax_platform", default=None)


def current_platform() -> str:
    """The platform calls are prepared for: JAX's default backend, or the one ``for_platform`` names
    (``explain(..., platform=...)`` asks what would run on another platform)."""
    return _PLATFORM.get() or jax.default_backend()


def platform_overridden() -> bool:
    """Whether ``for_platform`` names a platform other than JAX's (no device of it to ask: a GPU's compute
    capability is then the ``compute_capability`` option's, else 9.0)."""
    platform = _PLATFORM.get()
    return platform is not None and platform != jax.default_backend()


@contextlib.contextmanager
def for_platform(platform: str | None):
    """Within it, backends choose and resolve their options as on ``platform`` ("cpu", "gpu" / "cuda",
    "tpu"; None: JAX's)."""
    if platform is None:
        yield
        return
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS} or None, got {platform!r}")
    token = _PLATFORM.set(platform)
    try:
        yield
    finally:
        _PLATFORM.reset(token)


def platform_backends(platform: str | None = None) -> tuple[str, ...]:
    """The backends ``backend=None`` tries, in order, on ``platform`` (default: ``current_platform()``)."""
    platform = platform or current_platform()
    return _PLATFORM_ORDER.get(platform, ("xla",))


def kernel_option_names(name: str) -> tuple[str, ...]:
    """The ``kernel_options`` keys backend ``name`` takes (its KernelOptions fields and switches)."""
    backend = get_backend(name)
    options = getattr(backend, "KernelOptions", None)
    fields = tuple(f.name for f in dataclasses.fields(options)) if options is not None else ()
    return fields + tuple(getattr(backend, "SWITCHES", ()))


def _and(names) -> str:
    """'a', 'a' and 'b', 'a', 'b' and 'c'."""
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]}"


def options_tuple(kernel_options, backend) -> tuple:
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
                f"backend=None (which picks from {list(candidates)} on {current_platform()})")
            raise ValueError(
                f"kernel_options key {k!r} is taken by backend {_and(takers)}, not by {chosen}; "
                f"pass backend={takers[0]!r} or drop the key. The backends take {listing}")
    return tuple(sorted(kernel_options.items()))
