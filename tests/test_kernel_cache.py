"""The CPU kernel's library cache heals: a cached library that does not load is built again.

Each check runs flex_attention in a new process (``_RUN``) over a copy of one good cache
(``$FLEXJAX_CACHE_DIR``) with some of its files cut short or overwritten, as a full disk,
a crash or a bad copy leaves them: a process that has loaded a library holds it, so only a
new process reads the bad file. The call runs a GQA causal mask with ALiBi forward and
backward, which loads every kind of library: the kernel, the mods, their packed variants
and the score_mod's VJP (and, to build a mod again, the precompiled header).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import flexjax
from flexjax.backends.xla import cpu

pytestmark = pytest.mark.skipif(not cpu.usable(), reason="no AVX-512 CPU or no C++ compiler")

# Prints one JSON line: the largest differences from the reference, whether the kernel ran,
# the libraries loaded and flexjax's warnings. Argument "broken-compiler": every compile fails.
_RUN = r"""
import json, subprocess, sys, warnings
import jax, jax.numpy as jnp
import flexjax
from flexjax import masks, mods
from flexjax.backends.xla import cpu

if sys.argv[1] == "broken-compiler":
    run = subprocess.run
    def _broken(cmd, *args, **kwargs):
        if cmd[0] == cpu._compiler() and "--version" not in cmd:
            return subprocess.CompletedProcess(cmd, 1, "", "the C++ compiler failed (test)")
        return run(cmd, *args, **kwargs)
    subprocess.run = _broken

B, S, Hq, Hkv, D = 1, 128, 4, 2, 16
kq, kk, kv, kw = jax.random.split(jax.random.PRNGKey(0), 4)
q = jax.random.normal(kq, (B, S, Hq, D))
k = jax.random.normal(kk, (B, S, Hkv, D))
v = jax.random.normal(kv, (B, S, Hkv, D))
w = jax.random.normal(kw, (B, S, Hq, D))
bm = flexjax.create_block_mask(masks.causal, None, None, S, S, block_size=64)
score = mods.alibi(Hq)

def attend(backend):
    return lambda q, k, v: flexjax.flex_attention(q, k, v, score, bm, backend=backend)

def grads(backend):
    return jax.grad(lambda q, k, v: jnp.sum(attend(backend)(q, k, v) * w), argnums=(0, 1, 2))

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    errs = {"out": float(jnp.max(jnp.abs(attend("xla")(q, k, v) - attend("reference")(q, k, v))))}
    for name, a, b in zip("qkv", grads("xla")(q, k, v), grads("reference")(q, k, v)):
        errs["d" + name] = float(jnp.max(jnp.abs(a - b)))
    fwd = jax.jit(attend("xla")).lower(q, k, v).as_text()
    bwd = jax.jit(grads("xla")).lower(q, k, v).as_text()
print(json.dumps({"errs": errs, "forward_kernel": "flexjax_cpu_forward" in fwd,
                  "backward_kernel": "flexjax_cpu_backward" in bwd, "loaded": sorted(cpu._LIBS),
                  "warnings": [str(x.message) for x in caught if str(x.message).startswith("flexjax")]}))
"""

_TOL = 1e-4  # float32 blockwise against the dense float32 reference, inputs of unit scale


def _run(cache: Path, mode: str = "") -> dict:
    env = dict(os.environ, FLEXJAX_CACHE_DIR=str(cache), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(Path(flexjax.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    env.pop("FLEXJAX_CPU_KERNEL", None)
    res = subprocess.run([sys.executable, "-c", _RUN, mode], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"the new process failed:\n{res.stderr[-3000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


def _assert_right(result):
    assert all(e < _TOL for e in result["errs"].values()), result["errs"]


@pytest.fixture(scope="module")
def good_cache(tmp_path_factory) -> Path:
    """One cache with every library the call loads, built once for the module.

    It starts from a copy of the kernel this process loaded (``cpu.usable()``), which saves
    its 10 s build: a library's name is a digest of all it is built from.
    """
    kernel = cpu._library_path((Path(cpu.__file__).parent / "kernel.cc").read_text(), "kernel")
    cache = tmp_path_factory.mktemp("good") / "cache"
    (cache / "cpu").mkdir(parents=True)
    shutil.copy(kernel, cache / "cpu" / kernel.name)
    result = _run(cache)
    _assert_right(result)
    assert result["forward_kernel"] and result["backward_kernel"] and not result["warnings"], result
    return cache


def _copy(good_cache: Path, tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    shutil.copytree(good_cache, cache)
    return cache


def _libraries(cache: Path, prefix: str) -> list[Path]:
    found = sorted((cache / "cpu").glob(f"{prefix}-*.so"))
    assert found, f"no {prefix} library in {cache}"
    return found


def _truncate(path: Path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _garbage(path: Path):
    path.write_bytes(b"not a shared library\n" * 50)


def _assert_healed(result, bad: dict[Path, bytes]):
    _assert_right(result)
    assert result["forward_kernel"] and result["backward_kernel"], "the kernel did not serve the call"
    assert not result["warnings"], result["warnings"]
    assert {str(p) for p in bad if p.suffix == ".so"} <= set(result["loaded"])
    for path, before in bad.items():
        assert path.read_bytes() != before, f"{path} was not built again"
        if path.suffix == ".so":
            ctypes.CDLL(str(path))


# Rebuilding the kernel library takes g++ about 10 s: the kernel's case runs under `make test-all`
# (test_failed_rebuild_runs_the_loops[kernel] checks by default that a bad kernel library is caught).
# Both in make test-all (make test's budget); make test keeps test_garbage_libraries_are_rebuilt.
@pytest.mark.parametrize("with_kernel", [pytest.param(True, marks=pytest.mark.slow),
                                         pytest.param(False, marks=pytest.mark.slow)],
                         ids=["kernel_and_mods", "mods"])
def test_truncated_libraries_are_rebuilt(good_cache, tmp_path, with_kernel):
    """The kernel, every mod library and the precompiled header cut short (a full disk, a crash)."""
    cache = _copy(good_cache, tmp_path)
    kernel = _libraries(cache, "kernel") if with_kernel else []
    paths = [*kernel, *_libraries(cache, "mod"), *(cache / "cpu").glob("pch-*/vec.h.gch")]
    assert len(paths) >= 5 + with_kernel  # (the kernel,) 2 mods, their 2 packed variants, the VJP; the header
    for path in paths:
        _truncate(path)
    bad = {p: p.read_bytes() for p in paths}
    _assert_healed(_run(cache), bad)


@pytest.mark.slow  # (make test's budget: test_failed_rebuild_runs_the_loops[kernel] rebuilds by default)
def test_garbage_libraries_are_rebuilt(good_cache, tmp_path):
    """Every mod library overwritten with bytes that are not a library (a bad copy)."""
    cache = _copy(good_cache, tmp_path)
    paths = _libraries(cache, "mod")
    for path in paths:
        _garbage(path)
    bad = {p: p.read_bytes() for p in paths}
    _assert_healed(_run(cache), bad)


# (make test's budget: kernel in make test-extra, mod in make test-all.)
@pytest.mark.parametrize("prefix,warning", [
    pytest.param("kernel", "flexjax: building or loading the CPU kernel failed, the xla backend runs its XLA loops",
                 marks=pytest.mark.ci_extra),
    pytest.param("mod", "flexjax: a mod's C++ library did not build or load, the xla backend runs its XLA loops",
                 marks=pytest.mark.slow),
], ids=["kernel", "mod"])
def test_failed_rebuild_runs_the_loops(good_cache, tmp_path, prefix, warning):
    """A library that does not load and does not build either: the XLA loops, one warning."""
    cache = _copy(good_cache, tmp_path)
    for path in _libraries(cache, prefix):
        _garbage(path)
    result = _run(cache, "broken-compiler")
    _assert_right(result)
    assert not result["forward_kernel"] and not result["backward_kernel"]
    assert len(result["warnings"]) == 1, result["warnings"]
    assert result["warnings"][0].startswith(warning), result["warnings"]
    assert "does not load" in result["warnings"][0] and "the C++ compiler failed (test)" in result["warnings"][0]
