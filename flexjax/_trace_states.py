"""JAX configuration states that enter jit's cache key, registered at ``import flexjax``.

A JAX module that defines a ``config.State`` with ``include_in_jit_key=True`` adds an entry to
every later trace's context. When such a module is first imported in the middle of a user's first
``jax.jit`` trace (a backend's kernels are imported on the call that first reaches them), the entry
that trace filled no longer matches the next call's context, so a jitted step compiles twice in a
fresh process. JAX 0.12's Pallas fuser (``pallas_fuser_disable_nested_fuse``), which
``jax.experimental.pallas.tpu`` and the Mosaic lowerings import, is one. Importing it here, before any
trace, keeps one compile per step on every JAX; ``tests/test_compile_once.py`` checks, in a fresh
process, that importing every flexjax module afterwards adds no such state.
"""

from __future__ import annotations

import importlib

# Each a module that flexjax's backends import lazily and that defines a jit-key state (on some JAX
# release; on others it may define none, or not exist).
MODULES = ("jax._src.pallas.fuser",)


def preload() -> None:
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # not in this JAX release
            pass


preload()
