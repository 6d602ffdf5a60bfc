"""PyTorch side of the CPU benchmark: torch FlexAttention (torch.compile) and SDPA.

Runs in its own process: torch's and XLA's thread pools slow each other down when they
share one. Same specs, timing rules and flop counts as ``bench_cpu.py``. Usually driven
by ``python -m benchmarks.run --torch``; on its own:

    python -m benchmarks.torch_baseline --suite ci
"""

from __future__ import annotations

import os
import platform
import sys
import time

if __package__ in (None, ""):  # run as a script: `python benchmarks/torch_baseline.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from benchmarks import specs as S

MAX_DENSE_GIB = float(os.environ.get("FLEXJAX_BENCH_MAX_DENSE_GIB", "8"))
# torch's create_block_mask evaluates the whole S x S mask at once: 10.8 GB peak RSS at
# S=32768 (4 documents, measured), too much for a shared 23 GB machine.
MAX_BUILD_S = int(os.environ.get("FLEXJAX_BENCH_TORCH_MAX_BUILD_S", "16384"))
_compiled_flex = torch.compile(flex_attention, dynamic=False)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi slopes for a power-of-two head count, as flexjax.mods.alibi_slopes."""
    return torch.tensor(2.0 ** (-8.0 * np.arange(1, num_heads + 1) / num_heads), dtype=torch.float32)


def mask_mod(spec):
    """The torch mask_mod of a spec's mask family (None for full attention)."""
    if spec.mask == "full":
        return None
    if spec.mask == "causal":
        return lambda b, h, q, kv: q >= kv
    if spec.mask == "sliding_window":
        w = spec.window
        return lambda b, h, q, kv: (q >= kv) & (q - kv <= w)
    if spec.mask == "causal_documents":
        doc = torch.from_numpy(S.document_ids(spec.S, spec.docs))
        return lambda b, h, q, kv: (q >= kv) & (doc[q] == doc[kv])
    raise ValueError(f"unknown mask family {spec.mask!r}")


def score_mod(spec):
    if spec.score_mod is None:
        return None
    if spec.score_mod == "alibi":
        slopes = alibi_slopes(spec.H)
        return lambda s, b, h, q, kv: s + slopes[h] * (kv - q)
    raise ValueError(f"unknown score_mod {spec.score_mod!r}")


def _dense_mask_and_bias(spec):
    """(S, S) bool mask and, for a score_mod, the additive (H, S, S) bias for SDPA."""
    idx = torch.arange(spec.S)
    mm = mask_mod(spec)
    mask = None if mm is None else mm(0, 0, idx[:, None], idx[None, :])
    bias = None
    if spec.score_mod == "alibi":
        slopes = alibi_slopes(spec.H)
        bias = slopes[:, None, None] * (idx[None, None, :] - idx[None, :, None]).float()
    return mask, bias


def _inputs(spec, requires_grad):
    g = torch.Generator().manual_seed(0)
    shape = (spec.B, spec.H, spec.S, spec.D)
    dtype = getattr(torch, spec.dtype)
    return [torch.randn(shape, generator=g, dtype=dtype, requires_grad=requires_grad) for _ in range(4)]


def _record(spec, **fields) -> dict:
    return {"kind": "attention", "side": "torch", "spec": spec.name, "label": spec.label, "mode": spec.mode,
            "S": spec.S, "B": spec.B, "H": spec.H, "D": spec.D, "dtype": spec.dtype, "mask": spec.mask,
            "score_mod": spec.score_mod, "pairs": spec.pairs, "density": spec.pairs / spec.S**2,
            "flops": spec.flops} | fields


def _time(spec, impl, call, detail) -> dict:
    """First call (compiles where torch.compile is involved), then the shared timing rules."""
    t0 = time.perf_counter()
    call()
    first_s = time.perf_counter() - t0
    m = S.measure(call, lambda x: x)
    return _record(spec, impl=impl, status="ok", compile_s=round(first_s, 3), **m,
                   eff_gflops=spec.flops / (m["median_ms"] * 1e-3) / 1e9, impl_detail=detail)


def _fwd_bwd(attn, q, k, v, do):
    def call():
        for x in (q, k, v):
            x.grad = None
        out = attn()
        out.backward(do)
        return out

    return call


def run_attention(spec) -> list[dict]:
    out = []
    grad = spec.mode == "fwd+bwd"
    q, k, v, do = _inputs(spec, requires_grad=grad)
    do = do.detach()

    mm, sm = mask_mod(spec), score_mod(spec)
    bm = None if mm is None else create_block_mask(mm, None, None, spec.S, spec.S, device="cpu")
    # Every spec recompiles flex_attention; past dynamo's recompile limit (8) torch would
    # silently run it eagerly (measured 6.7 s instead of ~0.1 s), so start each spec fresh.
    torch._dynamo.reset()
    detail = "torch.compile(flex_attention), CPU template; first call includes compile"
    if grad:
        try:
            # Eager call on tiny inputs: torch checks backward support up front. (A failing
            # torch.compile'd call would leave the compiled function running eagerly.)
            tiny = [torch.randn(1, 1, 128, 16, requires_grad=True) for _ in range(3)]
            flex_attention(*tiny)
        except NotImplementedError as e:  # torch 2.13: "FlexAttention does not support backward on CPU"
            out.append(_record(spec, impl="torch.flex_attention", status="n/a", note=f"n/a: {e}"[:200]))
        else:
            flex = lambda: _compiled_flex(q, k, v, score_mod=sm, block_mask=bm)  # noqa: E731
            out.append(_time(spec, "torch.flex_attention", _fwd_bwd(flex, q, k, v, do), detail + ", fwd+bwd"))
    else:
        with torch.no_grad():
            out.append(_time(spec, "torch.flex_attention",
                             lambda: _compiled_flex(q, k, v, score_mod=sm, block_mask=bm), detail))

    need = S.dense_bytes(spec, 3 if not grad else 6) / 2**30
    if spec.mask != "causal" or spec.score_mod is not None:
        mask, bias = _dense_mask_and_bias(spec)
        if bias is not None:
            attn_mask = bias.masked_fill(~mask, float("-inf")) if mask is not None else bias
            detail = "float attn_mask (bias, -inf where masked)"
        else:
            attn_mask, detail = mask, "bool attn_mask"
        if need > MAX_DENSE_GIB:
            out.append(_record(spec, impl="torch.sdpa", status="skipped",
                               note=f"skipped: needs ~{need:.1f} GiB of dense scores"))
            return out
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # noqa: E731
    else:
        sdpa, detail = (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), "is_causal=True"
    if grad:
        out.append(_time(spec, "torch.sdpa", _fwd_bwd(sdpa, q, k, v, do), detail + ", fwd+bwd"))
    else:
        with torch.no_grad():
            out.append(_time(spec, "torch.sdpa", sdpa, detail))
    return out


def run_build(spec) -> list[dict]:
    """Time of torch's create_block_mask: the first call and repeated calls."""
    base = {"kind": "build", "side": "torch", "impl": "torch.create_block_mask", "spec": spec.name, "S": spec.S,
            "mask": spec.mask, "window": spec.window, "docs": spec.docs, "block": spec.block}
    if spec.S > MAX_BUILD_S:
        return [base | {"status": "skipped", "note": f"skipped: S > FLEXJAX_BENCH_TORCH_MAX_BUILD_S={MAX_BUILD_S} "
                        "(torch builds the whole S x S mask; ~10 GiB at S=32768)"}]
    mm = mask_mod(spec)

    def build():
        return create_block_mask(mm, None, None, spec.S, spec.S, device="cpu", BLOCK_SIZE=spec.block)

    t0 = time.perf_counter()
    build()
    first_ms = (time.perf_counter() - t0) * 1e3
    m = S.measure(build, lambda x: x)
    return [base | {"status": "ok", "first_ms": first_ms, **m}]


def run_spec(name: str) -> list[dict]:
    spec = S.find(name)
    try:
        if isinstance(spec, S.MemorySpec):
            return []
        if isinstance(spec, S.BuildSpec):
            return run_build(spec)
        return run_attention(spec)
    except Exception as e:
        return [S.error_record("torch", name, e)]


def machine_info() -> dict:
    return {"kind": "machine", "side": "torch", "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version()}


def main(argv=None) -> int:
    p = S.arg_parser(__doc__)
    args = p.parse_args(argv)
    S.use_suite_timing(args.suite)
    if args.worker:
        S.serve(run_spec, machine_info)
        return 0
    return S.run_standalone(args, run_spec, machine_info)


if __name__ == "__main__":
    sys.exit(main())
