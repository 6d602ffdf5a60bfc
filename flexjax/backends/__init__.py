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
# takes (its ``supports`` refuses the rest), "triton" only where jax-triton imports (the call
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


def implementations(backend, kind: str) -> tuple:
    """The ordered ``_contract.Implementation`` list of ``backend``'s "FORWARD" or "BACKWARD" pass
    (one named after the backend where it declares none)."""
    from ._contract import Implementation, always

    return tuple(getattr(backend, kind, None) or (Implementation(backend.NAME, always),))
