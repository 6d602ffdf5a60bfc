"""The Triton and jax-triton versions the triton backend supports, and why an installed pair is refused."""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version

# What the triton backend is tested with (`make test-compile`, the GPU check), and what the `gpu`
# and `compile` extras pin in pyproject.toml; bump all of them together. Triton 3.6 is the GPU
# machine's: its PTX assembles with CUDA 12.9's ptxas (3.9's PTX 9.4 does not). jax-triton 0.4
# needs Triton >= 3.7 and JAX >= 0.11.
TRITON_VERSION = "3.6.0"
JAX_TRITON_VERSION = "0.3.1"

# Per distribution: its label, the tested version, and how many leading release numbers an
# installed version must share with it (any Triton 3.6.x; jax-triton 0.3.1 exactly).
_SUPPORTED = {
    "triton": ("Triton", TRITON_VERSION, 2),
    "jax-triton": ("jax-triton", JAX_TRITON_VERSION, 3),
}

_RELEASE = re.compile(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def _release(text: str) -> tuple[int, int, int] | None:
    """The release numbers at the start of a version string, or None where there are none.

    Pre-releases, dev and local builds count as their release: "3.6.0rc1" and
    "3.6.0+git1a2b3c" are (3, 6, 0).
    """
    m = _RELEASE.match(text)
    return None if m is None else (int(m[1]), int(m[2]), int(m[3] or 0))


def _installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _describe(name: str, found: str) -> str:
    label = _SUPPORTED[name][0]
    return f"{label} {found}" if _release(found) is not None else f"{label} {found!r} (not a version number)"


def _wanted(name: str) -> str:
    label, tested, shared = _SUPPORTED[name]
    return f"{label} {'.'.join(tested.split('.')[:shared])}{'.x' if shared < 3 else ''}"


def version_problem(interpret: bool) -> str | None:
    """Why the installed Triton (and jax-triton) cannot serve the triton backend, or None.

    Reads the installed distributions' versions with ``importlib.metadata`` and imports
    neither. Supported: a Triton whose major and minor numbers are ``TRITON_VERSION``'s (3.6.x)
    with jax-triton ``JAX_TRITON_VERSION`` (0.3.1). A distribution that is not installed is no
    problem here: the backend reports missing modules itself.

    Args:
      interpret: whether the kernels run under Triton's interpreter, which needs no
        jax-triton; then only Triton's version matters.

    Returns:
      None for a supported combination (or nothing installed to judge); otherwise a
      sentence for the backend's ``resolve``, naming the installed versions, the
      supported ones and the ``pip install`` that fixes it.
    """
    names = ("triton",) if interpret else ("triton", "jax-triton")
    found = {name: v for name in names if (v := _installed(name)) is not None}
    bad = []
    for name, text in found.items():
        _, tested, shared = _SUPPORTED[name]
        release = _release(text)
        if release is None or release[:shared] != _release(tested)[:shared]:
            bad.append(name)
    if not bad:
        return None
    have = " and ".join(_describe(name, text) for name, text in found.items())
    want = " with ".join(_wanted(name) for name in names)
    return (f"the triton backend supports {want}{' under the interpreter' if interpret else ''}, but "
            f"{have} {'is' if len(found) == 1 else 'are'} installed; install the tested versions with "
            f"pip install 'flexjax[gpu]' (it pins triton=={TRITON_VERSION} and jax-triton=={JAX_TRITON_VERSION})")
