"""Loading generated Triton modules and launching their kernels: jax_triton on GPU, Triton's interpreter on CPU.

Triton's JIT reads a kernel's source with ``inspect.getsource``, so each generated module
is written to a file (one per source digest, in ``FLEXJAX_TRITON_CACHE`` or the temp
directory) and imported from there, once per process. For the interpreter the same file
is imported a second time with Triton's interpret knob on, which makes every
``@triton.jit`` in it (the mods' functions too) an ``InterpretedFunction``; those kernels
run on torch CPU tensors through ``jax.pure_callback``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import tempfile
import threading
from pathlib import Path

import jax
import numpy as np

_MODULES: dict[tuple[str, bool], object] = {}
# The interpreter patches triton.language globally while a kernel runs: one at a time.
_INTERPRET_LOCK = threading.Lock()


def cache_dir() -> Path:
    """Where generated modules are written."""
    root = os.environ.get("FLEXJAX_TRITON_CACHE")
    if root:
        return Path(root)
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"flexjax_triton_{uid}"


def load(source: str, interpret: bool):
    """The module of ``source``, imported from its file (compiled or interpreted kernels)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:24]
    key = (digest, interpret)
    if key in _MODULES:
        return _MODULES[key]
    import triton

    path = cache_dir() / f"flexjax_{digest}.py"
    if not path.exists() or path.read_text() != source:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(source)
        os.replace(tmp, path)
    name = f"flexjax_triton_{digest}_{'interpret' if interpret else 'jit'}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = interpret
        spec.loader.exec_module(module)
    _MODULES[key] = module
    return module


_BF16_PROBE = """import triton
import triton.language as tl


@triton.jit
def probe(X, Y, O):
    r = tl.arange(0, 16)
    x = tl.load(X + r[:, None] * 16 + r[None, :])
    y = tl.load(Y + r[:, None] * 16 + r[None, :])
    tl.store(O + r[:, None] * 16 + r[None, :], tl.dot(x, y))
"""


@functools.lru_cache(maxsize=1)
def interpreter_bf16_dot_ok() -> bool:
    """Whether Triton's interpreter computes a bfloat16 ``tl.dot`` right (small integers, exact products).

    Triton 3.6's does not: on this CPU host a 16x16 dot was off by 2.6e10 (bfloat16
    loads, stores and conversions were exact, and float16 / float32 dots too).
    """
    import torch

    x = torch.arange(256, dtype=torch.float32).reshape(16, 16) % 7 - 3
    y = torch.arange(256, dtype=torch.float32).reshape(16, 16).T % 5 - 2
    out = torch.zeros(16, 16)
    with _INTERPRET_LOCK, _scalar_index():
        load(_BF16_PROBE, True).probe[(1,)](x.to(torch.bfloat16), y.to(torch.bfloat16), out)
    return bool(torch.equal(out, x @ y))


def _autotuned(kernel, configs):
    """``kernel`` under ``triton.autotune`` over (num_warps, num_stages) ``configs``.

    A fresh Autotuner per launch: jax_triton chains its config pruning onto the one it is
    given each time it lowers a call.
    """
    import triton

    return triton.autotune(configs=[triton.Config({}, num_warps=w, num_stages=s) for w, s in configs],
                           key=[])(kernel)


def launch(source: str, name: str, args, out_shapes, grid, constexprs: dict, *, interpret: bool,
           num_warps: int, num_stages: int, compute_capability: int, zeroed_outputs=(), autotune=None):
    """Runs kernel ``name`` of ``source`` on ``args`` (arrays only) with ``constexprs``.

    Args:
      out_shapes: ShapeDtypeStructs of the outputs; their pointers follow the inputs.
      grid: the launch grid.
      interpret: run under Triton's interpreter on the host (through ``pure_callback``).
      zeroed_outputs: indices of outputs that must start at zero (the kernel accumulates
        into them).
      autotune: None, or the (num_warps, num_stages) configs to search on the GPU.

    Returns:
      The outputs, a list.
    """
    out_shapes = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_shapes]
    if interpret:
        kernel = getattr(load(source, True), name)
        return list(_interpreted(kernel, args, out_shapes, grid, constexprs))
    import jax_triton

    kernel = getattr(load(source, False), name)
    kw = {}
    if autotune:
        kernel = _autotuned(kernel, autotune)
    else:
        kw = {"num_warps": num_warps, "num_stages": num_stages}
    return list(jax_triton.triton_call(*args, kernel=kernel, out_shape=out_shapes, grid=tuple(grid), name=name,
                                       compute_capability=compute_capability, zeroed_outputs=tuple(zeroed_outputs),
                                       **kw, **constexprs))


def _to_torch(x: np.ndarray):
    import torch

    x = np.array(x)  # a writable copy: JAX hands the callback read-only buffers
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def _torch_dtype(dtype):
    import torch

    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        return torch.bfloat16
    return torch.from_numpy(np.zeros((), dtype)).dtype


def _to_numpy(t, dtype):
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy().view(dtype)
    return t.numpy()


@contextlib.contextmanager
def _scalar_index():
    """Lets the interpreter take a loaded scalar as a loop bound.

    Triton 3.6's interpreter holds scalars as 1-element 1-D arrays and gives them
    ``__index__ = int(array)``, which NumPy >= 2.4 refuses ("only 0-dimensional arrays can
    be converted to Python scalars"), so ``range(0, n)`` fails; while a kernel runs, the
    tensor patch it installs also gets an ``__index__`` that takes the element.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch
    try:
        yield
    finally:
        interpreter._patch_lang_tensor = original


def _interpreted(kernel, args, out_shapes, grid, constexprs):
    import torch

    def host(*arrays):
        ins = [_to_torch(a) for a in arrays]
        outs = [torch.zeros(s.shape, dtype=_torch_dtype(s.dtype)) for s in out_shapes]
        with _INTERPRET_LOCK, _scalar_index():
            kernel[tuple(grid)](*ins, *outs, **constexprs)
        return tuple(_to_numpy(o, s.dtype) for o, s in zip(outs, out_shapes))

    return jax.pure_callback(host, tuple(out_shapes), *args, vmap_method="sequential")
