"""Backend registry: each backend serves the same forward/backward contract."""

from __future__ import annotations

import dataclasses
import importlib

import jax

# name -> module path; each module defines NAME, unsupported_reason, forward_with_residuals
# (out, lse and what its backward needs), row_stats (each row's max and log-sum from those),
# backward, and a KernelOptions dataclass when it takes kernel_options (docs/architecture.md).
_BACKENDS = {
    "reference": "flexjax.backends.reference",
    "xla": "flexjax.backends.xla",
    "pallas": "flexjax.backends.pallas",
    "triton": "flexjax.backends.triton",
}

# Ordered choices for backend=None, per platform; each list ends on "xla". On GPU, "triton"
# serves only where jax-triton imports (its unsupported_reason says so otherwise, and the
# call warns that it fell through to "pallas").
_PLATFORM_ORDER = {
    "cpu": ("xla",),
    "gpu": ("triton", "pallas", "xla"),
    "cuda": ("triton", "pallas", "xla"),
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


def platform_backends(platform: str | None = None) -> tuple[str, ...]:
    """The backends ``backend=None`` tries, in order, on ``platform`` (default: JAX's)."""
    platform = platform or jax.default_backend()
    return _PLATFORM_ORDER.get(platform, ("xla",))


def kernel_option_names(name: str) -> tuple[str, ...]:
    """The ``kernel_options`` keys backend ``name`` takes (its KernelOptions fields and switches)."""
    backend = get_backend(name)
    options = getattr(backend, "KernelOptions", None)
    fields = tuple(f.name for f in dataclasses.fields(options)) if options is not None else ()
    return fields + tuple(getattr(backend, "SWITCHES", ()))
