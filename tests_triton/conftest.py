"""Setup of the triton backend's tests: the shared catalog on the path, and Triton's cache dir kept.

Run with ``JAX_PLATFORMS=cpu build/venv-compile/bin/python -m pytest -q tests_triton``
(that venv has triton, jax-triton and torch).
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tests"))

pytest.importorskip("triton")
pytest.importorskip("torch")

# jax_triton sets TRITON_CACHE_DIR="" when imported (it compiles without Triton's cache),
# which makes a later triton.compile in the same process fail ("Could not create or
# locate cache dir"); the codegen tests compile with triton.compile, so import it first
# and give Triton its default cache back.
_cache_dir = os.environ.get("TRITON_CACHE_DIR")
try:
    import jax_triton  # noqa: F401
except ImportError:
    pass
if _cache_dir is None:
    os.environ.pop("TRITON_CACHE_DIR", None)
else:
    os.environ["TRITON_CACHE_DIR"] = _cache_dir
