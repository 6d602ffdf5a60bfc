"""The xla backend's CPU kernels: its forward and backward as XLA FFI calls into C++ (``kernel.cc``).

XLA:CPU runs the xla backend's blockwise loops as many small ops, each costing tens of
microseconds, so narrow bands of tiles are overhead-bound (BENCHMARKS.md, issue 15).
This kernel runs the same algorithm (the BlockMask's partial tiles with mask_mod, then
its full tiles, online softmax in float32) as fused C++ loops with AVX-512 vector code,
both cores splitting the (batch, head, q block) rows through XLA's own thread pool.

- ``kernel.cc`` is compiled once per machine with the system's C++ compiler (``$CXX``
  or ``g++``) and cached under ``$FLEXJAX_CACHE_DIR`` (default ``~/.cache/flexjax``; a
  cached library that does not load, cut short or not a library, is built again);
- each mod (and a score_mod's VJP in the score) becomes a tile function in C++
  (``_codegen.py``), compiled into a small library of its own and cached the same way;
  the kernels call it through a pointer.

The xla backend uses the forward kernel when ``usable()`` holds and the call fits
(``reason()`` is None), and the backward kernel when ``backward_reason()`` is None (it
returns dq, dk and dv, so gradients of captured arrays go to the loops); otherwise it
runs its own loops (or, for few queries, its XLA decode path), which give the same
result. The forward also serves decode steps (GQA heads packed into a tile's rows, each
mod's packed variant reading ``h`` and ``q_idx`` per lane, the kv tiles split into shares
when there are few items, the cache read row after row for all kv heads with software
prefetch; bfloat16 and float16 caches are read as they are, each row widened exactly to
float32 as it is loaded, or, where ``pair_products()`` holds, bfloat16 rows dotted as they
lie) and ``flexjax.paged`` (``paged_forward``: tiles read from their
pages in place). Where XLA's partitioner would have to split the call (Auto mesh axes,
sharded arrays under a multi-device jit) the XLA versions run: it cannot split an FFI
call. The forward-mode tangent stays the xla backend's.
``FLEXJAX_CPU_KERNEL=0`` (or ``kernel_options={"cpu_kernel": False}``) turns it off;
``FLEXJAX_CPU_PAIR_PRODUCTS=1`` or ``0`` sets ``pair_products()``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import struct
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import batching, mlir

from ... import current_platform
from ..._contract import Residuals, TileLists
from ..._softmax import lse_of
from . import _codegen

_HERE = Path(__file__).resolve().parent
_TARGET = "flexjax_cpu_forward"
_BWD_TARGET = "flexjax_cpu_backward"
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-fPIC", "-shared", "-fno-math-errno", "-fwrapv")
_LOCK = threading.Lock()
_LIBS: dict = {}  # keeps every loaded library (and so its function addresses) alive
_FAILED: dict = {}  # why a library did not build or load: not tried again in this process


def _cache_dir() -> Path:
    root = os.environ.get("FLEXJAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "flexjax")
    return Path(root) / "cpu"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


_CPU_KEYS = ("vendor_id", "cpu family", "model", "model name", "flags")


@functools.cache
def _cpu_info() -> dict[str, str]:
    """The first CPU's vendor, family, model, name and flags from /proc/cpuinfo ('' where absent)."""
    seen: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in _CPU_KEYS:
                    seen.setdefault(key.strip(), value.strip())
                if len(seen) == len(_CPU_KEYS):
                    break
    except OSError:
        pass
    return {k: seen.get(k, "") for k in _CPU_KEYS}


def _cpu_flag(name: str) -> bool:
    return f" {name} " in f" {_cpu_info()['flags']} "


@functools.cache
def _cpu_has_avx512() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and _cpu_flag("avx512f")


@functools.cache
def _cpu_id() -> str:
    """The CPU's vendor, family, model and flags: builds use ``-march=native``, so a cache
    directory shared by different machines must not hand one a library built for another."""
    return "\n".join(f"{k}: {v}" for k, v in _cpu_info().items())


@functools.cache
def _compiler_id(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


_WARNED: set = set()


def _warn_once(msg: str):
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def enabled() -> bool:
    """False when ``FLEXJAX_CPU_KERNEL=0``."""
    return os.environ.get("FLEXJAX_CPU_KERNEL", "1") not in ("0", "false", "False", "")


def usable() -> bool:
    """Whether this machine can run the kernel: enabled, an x86-64 CPU with AVX-512 and a C++ compiler.

    Without a compiler (or AVX-512), or where the kernel's library does not build or load,
    the xla backend's loops run instead, and a RuntimeWarning says so once.
    """
    if not enabled():
        return False
    if not _cpu_has_avx512():
        return False
    if _compiler() is None:
        _warn_once("flexjax: no C++ compiler found (set $CXX or install g++); the xla backend runs its "
                   "slower XLA loops on CPU instead of its C++ kernel")
        return False
    try:
        _kernel()
    except RuntimeError as e:
        _warn_once(f"flexjax: building or loading the CPU kernel failed, the xla backend runs its XLA loops "
                   f"instead: {e}")
        return False
    return True


def _precompiled_header(cxx: str, header: str, out_dir: Path, *, replace: bool = False) -> Path | None:
    """A directory holding vec.h and its precompiled ``vec.h.gch`` (built once per header,
    compiler and flags), or None where the compiler cannot make one (the mods then parse
    vec.h themselves, with the same result). ``replace`` builds the cached one again."""
    flags = [f for f in _FLAGS if f != "-shared"]
    key = "\n".join([header, cxx, _compiler_id(cxx), " ".join(flags), _cpu_id()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    final = out_dir / f"pch-{digest}"
    if (final / "vec.h.gch").exists() and not replace:
        return final
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir))
    try:
        (tmp / "vec.h").write_text(header)
        res = subprocess.run([cxx, *flags, "-x", "c++-header", str(tmp / "vec.h"), "-o", str(tmp / "vec.h.gch")],
                             capture_output=True, text=True)
        if res.returncode != 0:
            return None
        if replace:
            os.replace(tmp / "vec.h.gch", final / "vec.h.gch")  # atomic, as the libraries are
            return final
        try:
            os.rename(tmp, final)  # atomic; another process may have renamed its own first
        except OSError:
            pass
        return final if (final / "vec.h.gch").exists() else None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _library_path(source: str, name: str) -> Path:
    """Where ``source``'s library is cached: named by a digest of source, compiler, flags, JAX and CPU."""
    cxx = _compiler()
    header = (_HERE / "vec.h").read_text()  # included by the kernel and every generated mod
    digest = hashlib.sha256("\n".join([source, header, cxx, _compiler_id(cxx), " ".join(_FLAGS),
                                       jax.ffi.include_dir(), jax.__version__, _cpu_id()]).encode()).hexdigest()[:24]
    return _cache_dir() / f"{name}-{digest}.so"


def _build(source: str, name: str, out: Path):
    """Compiles ``source`` into the shared library ``out``, replacing any file there atomically."""
    cxx = _compiler()
    header = (_HERE / "vec.h").read_text()
    out.parent.mkdir(parents=True, exist_ok=True)
    # A generated mod is small: most of its compile is parsing vec.h's intrinsics header,
    # which a precompiled header saves (0.08 s a mod instead of 0.3 s, here).
    pch = _precompiled_header(cxx, header, out.parent) if name == "mod" else None
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / f"{name}.cc"
        src.write_text(source)
        lib = Path(tmp) / f"{name}.so"

        def compile_with(pch):
            first = [f"-I{pch}"] if pch is not None else []
            cmd = [cxx, *_FLAGS, *first, f"-I{_HERE}", f"-I{jax.ffi.include_dir()}", str(src), "-o", str(lib)]
            return cmd, subprocess.run(cmd, capture_output=True, text=True)

        cmd, res = compile_with(pch)
        if res.returncode != 0 and pch is not None:
            # A cached precompiled header cut short stops the compile ("cannot read vec.h.gch"):
            # build it again and compile once more.
            cmd, res = compile_with(_precompiled_header(cxx, header, out.parent, replace=True))
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-4000:]}")
        os.replace(lib, out)  # atomic: concurrent builders each write their own temporary


def _load(path: Path) -> ctypes.CDLL:
    """Loads the library ``path``; OSError where it is not a whole 64-bit ELF file or dlopen refuses it.

    A library cut short past its headers passes dlopen's checks, and the process dies of
    SIGBUS when it reads a page past the file's end: so the file's size is checked against
    the ends of its segments and section headers first.
    """
    with open(path, "rb") as f:
        head = f.read(64)
        size = os.fstat(f.fileno()).st_size
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4:6] != b"\x02\x01":
            raise OSError(f"{path} is not a 64-bit little-endian ELF file")
        phoff, shoff = struct.unpack_from("<QQ", head, 32)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 54)
        ends = [phoff + phnum * phentsize, shoff + shnum * shentsize]
        f.seek(phoff)
        table = f.read(phnum * phentsize)
    for i in range(len(table) // phentsize if phentsize else 0):
        offset, filesz = struct.unpack_from("<Q16xQ", table, i * phentsize + 8)  # p_offset, p_filesz
        ends.append(offset + filesz)
    if size < max(ends):
        raise OSError(f"{path} is cut short: {size} bytes of the {max(ends)} its headers describe")
    return ctypes.CDLL(str(path))


def _library(source: str, name: str) -> ctypes.CDLL:
    """``source``'s library, loaded: taken from the cache, or built into it.

    A cached library that does not load (cut short by a full disk or a crash, or not a
    library at all) is built again in its place. Raises RuntimeError where the library
    does not build or load; that is remembered, so a later call raises it again at once
    instead of compiling again.
    """
    out = _library_path(source, name)
    key = str(out)
    if key in _LIBS:
        return _LIBS[key]
    if key in _FAILED:
        raise RuntimeError(_FAILED[key])
    try:
        if not out.exists():
            _build(source, name, out)
        try:
            lib = _load(out)
        except OSError as e:
            try:
                _build(source, name, out)
                lib = _load(out)
            except (OSError, RuntimeError) as again:
                raise RuntimeError(f"{key} does not load ({e}), nor after building it again: {again}") from again
    except (OSError, RuntimeError) as e:
        _FAILED[key] = str(e)
        raise RuntimeError(_FAILED[key]) from e
    _LIBS[key] = lib
    return lib


def _kernel():
    """The forward kernel's library, built and registered with XLA on first use."""
    with _LOCK:
        if "kernel" in _LIBS:
            return _LIBS["kernel"]
        lib = _library((_HERE / "kernel.cc").read_text(), "kernel")
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.FlexjaxCpuForward), platform="cpu")
        jax.ffi.register_ffi_target(_BWD_TARGET, jax.ffi.pycapsule(lib.FlexjaxCpuBackward), platform="cpu")
        _LIBS["kernel"] = lib
        return lib


def _mod_address(mod, consts) -> int:
    """Address of ``mod``'s generated tile function (0 for no mod)."""
    if mod is None:
        return 0
    avals = tuple(jax.ShapeDtypeStruct(np.shape(c), jnp.result_type(c)) for c in consts)
    gen = _codegen.generate(mod, avals)
    with _LOCK:
        lib = _library(gen.source, "mod")
    return ctypes.cast(getattr(lib, gen.symbol), ctypes.c_void_p).value


def _packed_address(mod, consts) -> int:
    """Address of ``mod``'s variant for tiles of packed query heads (0 for no mod, or none)."""
    if mod is None:
        return 0
    avals = tuple(jax.ShapeDtypeStruct(np.shape(c), jnp.result_type(c)) for c in consts)
    try:
        gen = _codegen.generate(mod, avals, packed=True)
    except NotImplementedError:
        return 0  # the kernel then runs one query head per tile
    try:
        with _LOCK:
            lib = _library(gen.source, "mod")
    except RuntimeError as e:  # called while lowering, past the point of running the loops instead
        _warn_once(f"flexjax: a mod's packed C++ library did not build or load, the CPU kernel runs one query "
                   f"head per tile: {e}")
        return 0
    return ctypes.cast(getattr(lib, gen.symbol), ctypes.c_void_p).value


_COMPUTE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

# How the backward kernel prepares q, dO and delta: "auto" (a prepass, or per visit where the
# lists visit each q tile at most 4 times on average), "prepass" or "per_tile" (for tests).
_BWD_PREP = "auto"


def reason(spec, q, k, v, score_consts, mask_consts, dropout_seed) -> str | None:
    """Why this forward cannot run in the kernel, or None when it can (builds the mods' C++)."""
    if spec.options.get("cpu_kernel", True) is False:
        return "kernel_options cpu_kernel=False"
    if any(spec.options.get(f) for f in ("block_q", "block_kv")):
        return "explicit forward tiles in kernel_options"
    why = _mesh_reason()
    if why is not None:
        return why
    if _quantized(k):
        if k.dtype != v.dtype or q.shape[-1] % 16 or v.shape[-1] % 16:
            return "an int8 / float8 pool needs k and v in one dtype and head dims that are multiples of 16"
        k = v = jax.ShapeDtypeStruct(k.shape, jnp.float32)  # (read with its scales, as float32)
    elif _decode_step(q) and not _native_kv(q, k, v) and (k.dtype != jnp.float32 or v.dtype != jnp.float32):
        # A 16-bit cache the kernel cannot read as it is would be converted whole at every
        # step, O(capacity), where the XLA decode path upcasts only the tiles it reads.
        return "a decode step over 16-bit caches of different dtypes or a head dim not a multiple of 16"
    return _common_reason(spec, q, k, v, score_consts, mask_consts, dropout_seed)


def _decode_step(q) -> bool:
    from .._decode import DECODE_MAX_Q

    return q.shape[1] <= DECODE_MAX_Q


def _quantized(k) -> bool:
    """Whether k (and v) is an int8 or float8_e4m3fn pool, read with its scales."""
    return k.dtype in (jnp.int8, jnp.float8_e4m3fn)


def _native_kv(q, k, v) -> bool:
    """Whether the forward reads k and v in their own 16-bit dtype. For decode steps, whose
    cost is reading the cache: a longer query reads each tile many times, and XLA widens the
    whole of k and v once. Each tile's rows are widened to float32 as they are read (exact),
    except where ``pair_products()`` holds and the cache is bfloat16: the decode product (at
    most 16 rows a tile) then dots the bfloat16 elements as they are (each product exact,
    sums in float32) and takes P rounded to bfloat16 for P V, as the pallas and triton
    kernels (and PyTorch's) take P in the value dtype."""
    return (_decode_step(q) and k.dtype == v.dtype and k.dtype in (jnp.bfloat16, jnp.float16)
            and q.shape[-1] % 16 == 0 and v.shape[-1] % 16 == 0)


def pair_products() -> bool:
    """Whether decode steps over bfloat16 caches take their products two elements a lane
    (VDPBF16PS, P rounded to bfloat16 for P V; see ``_native_kv``) instead of widening each
    row to float32. ``FLEXJAX_CPU_PAIR_PRODUCTS=1`` or ``0`` decides; by default they are
    taken on AMD CPUs with AVX512-BF16, where VDPBF16PS issues as fast as a float32 FMA and
    does twice its work (Zen 5: 2.43 against 2.46 G/s a core). On Intel's it issues at a
    quarter of the FMA's rate (1.84 against 7.39 G/s a core, a Xeon with AMX), and the widened
    products ran a bfloat16 decode step 4-7% faster (BENCHMARKS.md, "Decode")."""
    forced = os.environ.get("FLEXJAX_CPU_PAIR_PRODUCTS", "").strip()
    if forced:
        if forced not in ("0", "1"):
            raise ValueError(f"FLEXJAX_CPU_PAIR_PRODUCTS must be 0 or 1, got {forced!r}")
        return forced == "1"
    return _cpu_info()["vendor_id"] == "AuthenticAMD" and _cpu_flag("avx512_bf16")


def backward_reason(spec, q, k, v, score_consts, mask_consts, grad_consts, dropout_seed) -> str | None:
    """Why this backward cannot run in the kernel, or None when it can.

    The kernel returns dq, dk and dv; gradients of a score_mod's captured arrays (a learned
    bias table) are left to the XLA loops, which accumulate them.
    """
    if spec.options.get("cpu_kernel", True) is False:
        return "kernel_options cpu_kernel=False"
    if any(spec.options.get(f) for f in ("bwd_block_q", "bwd_block_kv")):
        return "explicit backward tiles in kernel_options"
    if any(grad_consts):
        return "gradients of the score_mod's captured arrays"
    why = _mesh_reason()
    if why is not None:
        return why
    if q.shape[-1] % 16:
        return "the head dim is not a multiple of 16"
    why = _common_reason(spec, q, k, v, score_consts, mask_consts, dropout_seed)
    if why is None and spec.score is not None:
        try:
            _vjp_address(spec.score, score_consts)
        except NotImplementedError as e:
            return str(e)
        except RuntimeError as e:
            _warn_once(f"flexjax: a score_mod VJP's C++ library did not build or load, the xla backend runs its "
                       f"XLA loops: {e}")
            return str(e)
    return why


_JAX_012 = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12)


def _mesh_reason() -> str | None:
    """Why the mesh in scope keeps the kernel out: Auto axes, over which q, k and v may be
    sharded without their types saying so, and XLA's partitioner cannot split an FFI call
    (it would gather them onto every device). Inside a ``shard_map`` each device runs its
    own call, and on Explicit axes flexjax runs sharded arrays in its own ``shard_map``."""
    if jax.process_count() > 1 and _JAX_012:
        # Measured with examples/two_process.py (2 processes x 2 CPU devices, gloo) on JAX 0.12.1: with the
        # kernel, the first context-parallel check leaves all four devices' execute threads blocked in
        # gloo::allgather (xla::cpu::AllGatherThunk), in 3 of 3 runs; with FLEXJAX_CPU_KERNEL=0 every check
        # passes, and on JAX 0.10.2 both do. The cause is not found yet: until it is, the loops serve
        # multi-process calls on JAX 0.12 and later.
        return "several processes on JAX >= 0.12 (the kernel beside gloo collectives deadlocked there)"
    mesh = jax.sharding.get_abstract_mesh()
    if getattr(mesh, "empty", True):
        return None
    kinds = tuple(getattr(mesh, "axis_types", ()) or ())
    manual, auto = (getattr(jax.sharding.AxisType, n, None) for n in ("Manual", "Auto"))
    if manual in kinds:
        return None
    if any(size > 1 and kind == auto for size, kind in zip(mesh.axis_sizes, kinds)):
        return "a mesh with Auto axes (XLA's partitioner cannot split the kernel's FFI call)"
    return None


def _common_reason(spec, q, k, v, score_consts, mask_consts, dropout_seed) -> str | None:
    if current_platform() != "cpu":
        return "not on CPU"
    if dropout_seed is not None and spec.dropout_rate:
        return "dropout"
    if any(x.dtype not in _COMPUTE_DTYPES for x in (q, k, v)):
        return "dtype"
    if v.shape[-1] % 16:
        return "the value head dim is not a multiple of 16"
    if not usable():
        return "no kernel on this machine"
    try:
        _mod_address(spec.score, score_consts)
        _mod_address(spec.mask, mask_consts)
    except NotImplementedError as e:
        return str(e)
    except RuntimeError as e:  # the generated C++ did not compile (a flexjax bug) or its library not load: said once
        _warn_once(f"flexjax: a mod's C++ library did not build or load, the xla backend runs its XLA loops for "
                   f"it: {e}")
        return str(e)
    return None


def _vjp_address(mod, consts) -> int:
    avals = tuple(jax.ShapeDtypeStruct(np.shape(c), jnp.result_type(c)) for c in consts)
    gen = _codegen.generate_vjp(mod, avals)
    with _LOCK:
        lib = _library(gen.source, "mod")
    return ctypes.cast(getattr(lib, gen.symbol), ctypes.c_void_p).value


# The primitive's leading operands per direction; the 8 tile lists and the captured arrays follow.
_LEAD = {"fwd": 3, "paged": 6, "bwd": 9}


def _bind(direction, spec, lead, score_consts, mask_consts, lists, loops):
    lists = tuple(jnp.asarray(x, jnp.int32) for x in lists)
    if len(lists) != 8:
        raise ValueError(f"expected the BlockMask's 8 tile lists, got {len(lists)}")
    n_score = len(score_consts) if spec.score is not None else 0
    n_mask = len(mask_consts) if spec.mask is not None else 0
    args = (*lead, *lists, *score_consts[:n_score], *mask_consts[:n_mask])
    return _attention_p.bind(*args, direction=direction, spec=spec, n_score=n_score, n_mask=n_mask, loops=loops)


def forward(spec, q, k, v, score_consts, mask_consts, lists, loops):
    """out (B, Sq, Hq, Dv) in q's dtype, lse and the rows' ``Residuals``, (B, Hq, Sq) float32.

    One primitive (``flexjax_cpu_attention``): lowered for CPU it is the kernel's FFI call;
    lowered for export (``jax.export``, whose artifacts must not hold this process's
    function addresses) or for another platform it is ``loops(spec, q, k, v, score_consts,
    mask_consts, lists)``, the xla backend's own forward, which gives the same result.
    """
    out, lse, row_max, row_sum = _bind("fwd", spec, (q, k, v), score_consts, mask_consts, lists, loops)
    return out, lse, Residuals(row_max, row_sum)


def paged_forward(spec, q, k_pages, v_pages, page_table, score_consts, mask_consts, lists, loops, scales=None):
    """``forward`` over paged pools (num_pages, page_size, Hkv, D) and a page table (B,
    max_pages): the kernel reads each tile from its page in place. ``loops(spec, q, k_pages,
    v_pages, page_table, score_consts, mask_consts, lists, scales)`` is the XLA version (for
    export). ``scales``: int8 / float8_e4m3fn pools' (k_scale, v_scale), float32 (num_pages,
    Hkv); each tile's scores are scaled by its k scale and its probabilities by its v scale.
    """
    if scales is None:
        scales = (jnp.ones((1, 1), jnp.float32),) * 2
    lead = (q, k_pages, v_pages, jnp.asarray(page_table, jnp.int32), *scales)
    out, lse, row_max, row_sum = _bind("paged", spec, lead, score_consts, mask_consts, lists, loops)
    return out, lse, Residuals(row_max, row_sum)


def backward(spec, q, k, v, out, lse, dout, dlse, score_consts, mask_consts, lists, residuals, loops):
    """dq, dk, dv (the inputs' dtypes) through the same primitive; ``loops`` is the xla backend's backward."""
    lead = (q, k, v, out, lse, dout, dlse, *residuals)
    return tuple(_bind("bwd", spec, lead, score_consts, mask_consts, lists, loops))


def _split(args, direction, n_score):
    n = _LEAD[direction]
    lead, rest = args[:n], args[n:]
    return tuple(lead), TileLists(*rest[:8]), tuple(rest[8:8 + n_score]), tuple(rest[8 + n_score:])


def _f32(x):
    return x.astype(jnp.float32)


def _kernel_impl(*args, direction, spec, n_score, n_mask, loops):
    lead, lists, score_consts, mask_consts = _split(args, direction, n_score)
    q, k, v = lead[:3]
    B, Sq, Hq, D = q.shape
    attrs = dict(scale=np.float32(spec.scale), block_q=np.int64(spec.block_size[0]),
                 block_kv=np.int64(spec.block_size[1]), kv_len=np.int64(spec.kv_len),
                 score_fn=np.int64(_mod_address(spec.score, score_consts)),
                 mask_fn=np.int64(_mod_address(spec.mask, mask_consts)), n_score_consts=np.int64(n_score))
    if direction in ("fwd", "paged"):
        outs = (jax.ShapeDtypeStruct((B, Sq, Hq, v.shape[-1]), jnp.float32),
                jax.ShapeDtypeStruct((B, Hq, Sq), jnp.float32),
                jax.ShapeDtypeStruct((B, Hq, Sq), jnp.float32))
        call = jax.ffi.ffi_call(_TARGET, outs)
        # The mods' packed variants (several query heads in one tile's rows), built only where
        # the kernel can pack: GQA, lists shared by every head, at most 64 rows per head.
        G, Hm = Hq // k.shape[2], lists.kv_num.shape[1]
        can_pack = G > 1 and Hm == 1 and min(spec.block_size[0], Sq) <= 64
        packed = dict(score_packed=np.int64(_packed_address(spec.score, score_consts) if can_pack else 0),
                      mask_packed=np.int64(_packed_address(spec.mask, mask_consts) if can_pack else 0))
        if direction == "paged":
            page_table, page_size, scales = lead[3], np.int64(k.shape[1]), lead[4:6]
        else:
            page_table, page_size = jnp.zeros((1, 1), jnp.int32), np.int64(0)
            scales = (jnp.ones((1, 1), jnp.float32),) * 2
        quantized = _quantized(k)
        kv = (k, v) if quantized or _native_kv(q, k, v) else (_f32(k), _f32(v))
        out, m, l = call(_f32(q), *kv, page_table, *scales, *lists.by_q, *score_consts, *mask_consts, **attrs,
                         quantized=np.int64(quantized),
                         **packed, page_size=page_size, pair_products=np.int64(pair_products()))
        return out.astype(q.dtype), lse_of(m, l), *Residuals.from_running(m, l)
    out, _, dout, dlse, row_max, row_sum = lead[3:]
    row_max, log_sum = Residuals(row_max, row_sum).recompute_stats()
    outs = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(k.shape, jnp.float32),
            jax.ShapeDtypeStruct(v.shape, jnp.float32))
    vjp = _vjp_address(spec.score, score_consts) if spec.score is not None else 0
    call = jax.ffi.ffi_call(_BWD_TARGET, outs)
    # The kernel's prepass forms delta = rowsum(dO * O) - dlse and the transposed q and dO
    # it reads (XLA's transposes and its rowsum dot cost more than the rest of a sparse
    # backward).
    dlse = jnp.broadcast_to(_f32(dlse), (B, Hq, Sq))
    prep = np.int64({"auto": 0, "prepass": 1, "per_tile": 2}[_BWD_PREP])
    dq, dk, dv = call(_f32(q), _f32(k), _f32(v), _f32(out), _f32(dout), dlse, _f32(row_max), _f32(log_sum),
                      *lists.by_kv, *score_consts, *mask_consts, vjp_fn=np.int64(vjp), prep=prep, **attrs)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _loops_impl(*args, direction, spec, n_score, n_mask, loops):
    lead, lists, score_consts, mask_consts = _split(args, direction, n_score)
    if direction == "fwd":
        out, lse, residuals = loops(spec, *lead, score_consts, mask_consts, lists)
        return out, lse, *residuals
    if direction == "paged":
        q, k, v, page_table, k_scale, v_scale = lead
        scales = (k_scale, v_scale) if _quantized(k) else None
        out, lse, residuals = loops(spec, q, k, v, page_table, score_consts, mask_consts, lists, scales)
        return out, lse, *residuals
    q, k, v, out, lse, dout, dlse, row_max, row_sum = lead
    dq, dk, dv, _ = loops(spec, q, k, v, out, lse, dout, dlse, score_consts, mask_consts, lists,
                          (False,) * len(score_consts), Residuals(row_max, row_sum))
    return dq, dk, dv


def _abstract_eval(*avals, direction, spec, n_score, n_mask, loops):
    q, k, v = avals[:3]
    if direction == "bwd":
        return [jax.core.ShapedArray(x.shape, x.dtype) for x in (q, k, v)]
    B, Sq, Hq, _ = q.shape
    stat = jax.core.ShapedArray((B, Hq, Sq), jnp.float32)
    return [jax.core.ShapedArray((B, Sq, Hq, v.shape[-1]), q.dtype), stat, stat, stat]
def _partitioned_by_xla(ctx) -> bool:
    """Whether XLA's partitioner may have to split this call over devices, which it cannot
    do for an FFI call (it would gather q, k and v onto every device): a computation over
    several devices whose operands are not all known to be replicated. Inside a
    ``shard_map`` each device runs its own call; on Explicit axes the operands' types give
    their shardings. (For sharded arrays under a jit with no mesh set, which ``reason``
    cannot see.)"""
    ac = ctx.module_context.axis_context
    if hasattr(ac, "manual_axes") or getattr(ac, "num_devices", 1) <= 1:  # shard_map, or one device
        return False
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    for aval in ctx.avals_in:
        sharding = getattr(aval, "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is None or getattr(mesh, "empty", True) or any(t != explicit for t in mesh.axis_types):
            return True
        if any(s is not None for s in sharding.spec):
            return True
    return False


def _lowering(ctx, *args, **params):
    lp = ctx.module_context.lowering_parameters
    on_cpu = tuple(ctx.module_context.platforms) == ("cpu",)
    kernel = on_cpu and not getattr(lp, "for_export", False) and not _partitioned_by_xla(ctx)
    impl = _kernel_impl if kernel else _loops_impl
    return mlir.lower_fun(functools.partial(impl, **params), multiple_results=True)(ctx, *args)


def _batch(args, dims, **params):
    """vmap: the kernel once per element of the mapped axis (as ``vmap_method="sequential"``)."""
    mapped = [i for i, d in enumerate(dims) if d is not None]
    xs = [jnp.moveaxis(args[i], dims[i], 0) for i in mapped]

    def one(xs_):
        full = list(args)
        for i, x in zip(mapped, xs_):
            full[i] = x
        return tuple(_attention_p.bind(*full, **params))

    out = jax.lax.map(one, xs)
    return list(out), [0] * len(out)


def _eager(*args, **params):
    return jax.jit(functools.partial(_attention_p.bind, **params))(*args)


_attention_p = jex_core.Primitive("flexjax_cpu_attention")
_attention_p.multiple_results = True
_attention_p.def_impl(_eager)
_attention_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(_attention_p, _lowering)
batching.primitive_batchers[_attention_p] = _batch
