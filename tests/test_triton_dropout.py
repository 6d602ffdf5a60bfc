"""Fused dropout in the triton backend (Triton's interpreter) against the dense reimplementation.

The harness is tests/test_dropout_kernels.py's (the backend's forward_with_residuals and
backward against ``jax.vjp`` of softmax * ``dropout_mask`` / (1 - rate) @ V). The hash
itself is also checked on its own: the template's Triton spelling, interpreted, gives
``flexjax._dropout.keep_mask`` bit for bit, and compiled for sm_90 its shifts are logical.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")
from test_dropout_kernels import RATE, case, check, key_and_mask, run  # noqa: E402

from flexjax import _dropout  # noqa: E402
from flexjax.backends import triton as triton_backend  # noqa: E402
from flexjax.backends.triton import _launch, _templates  # noqa: E402

pytestmark = pytest.mark.triton  # runs under make test-compile (Triton and torch installed)


def test_dropout_float16():
    check(triton_backend, "causal", dtype=jnp.float16)


def test_rate_zero_is_the_plain_source():
    """Rate 0: the plain kernels' source (no hash), and the seed is ignored."""
    make, q, k, v, do, dlse, sc, mc, lists = case("causal")
    assert triton_backend._generated(None, make(0.0).mask, False, False)[2] == triton_backend._generated(
        None, make(0.0).mask, False)[2]
    assert "fmix" not in triton_backend._generated(None, make(0.0).mask, False)[2]
    seed, _ = key_and_mask(make(RATE), q, k)
    plain = run(triton_backend, make(0.0), q, k, v, do, dlse, sc, mc, lists, None)
    seeded = run(triton_backend, make(0.0), q, k, v, do, dlse, sc, mc, lists, seed)
    for x, y in zip(jax.tree.leaves(plain), jax.tree.leaves(seeded)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_residuals():
    make, q, k, v, do, dlse, sc, mc, lists = case("causal")
    spec = make(RATE)
    seed, _ = key_and_mask(spec, q, k)
    out, lse, res = triton_backend.forward_with_residuals(spec, q, k, v, sc, mc, lists, dropout_seed=seed)
    np.testing.assert_allclose(np.asarray(res.lse()), np.asarray(lse), rtol=1e-6, atol=1e-6)


# -- the hash on its own ---------------------------------------------------------------------

_PROBE_BODY = """

@triton.jit
def probe(SEED, OUT, b, h, q_start, kv_start, TQ: tl.constexpr, TK: tl.constexpr, DROP_T: tl.constexpr):
    seed0 = tl.load(SEED).to(tl.uint32, bitcast=True)
    seed1 = tl.load(SEED + 1).to(tl.uint32, bitcast=True)
    q_idx = (q_start + tl.arange(0, TQ))[:, None]
    kv_idx = (kv_start + tl.arange(0, TK))[None, :]
{hash}
    tl.store(OUT + tl.arange(0, TQ)[:, None] * TK + tl.arange(0, TK)[None, :], keep.to(tl.int32))
"""


def _probe_source(plan):
    lines = [*_templates._row_hash_lines(plan), *_templates._col_hash_lines(plan), _templates._KEEP]
    return ("import triton\nimport triton.language as tl\n\n\n" + _templates._FMIX
            + _PROBE_BODY.format(hash="\n".join("    " + ln for ln in lines)))


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_triton_hash_is_the_jax_hash(rate):
    """The template's hash lines, interpreted, give keep_mask bit for bit (indices past 2**16,
    seeds with the top bit set, b and h > 0)."""
    import torch

    plan = _templates.Plan(score=None, mask=None, dropout=True)
    kernel = _launch.load(_probe_source(plan), True).probe
    seed = np.array([0xDEADBEEF, 0x9E3779B9], np.uint32)
    b, h, q0, k0, TQ, TK = 3, 5, 70_000, 123_456, 16, 32
    out = torch.zeros(TQ, TK, dtype=torch.int32)
    with _launch._INTERPRET_LOCK, _launch._scalar_index():
        kernel[(1,)](torch.from_numpy(seed.view(np.int32).copy()), out, b, h, q0, k0, TQ=TQ, TK=TK,
                     DROP_T=_dropout.threshold(rate))
    want = _dropout.keep_mask(jnp.asarray(seed), b, h, q0 + jnp.arange(TQ)[:, None], k0 + jnp.arange(TK)[None, :],
                              rate)
    np.testing.assert_array_equal(out.numpy().astype(bool), np.asarray(want))


def test_triton_hash_compiles_to_logical_shifts():
    """For sm_90 every shift of the hash is logical (arith.shrui), and the kernel compiles."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    plan = _templates.Plan(score=None, mask=None, dropout=True)
    kernel = _launch.load(_probe_source(plan), False).probe
    sig = {"SEED": "*i32", "OUT": "*i32", "b": "i32", "h": "i32", "q_start": "i32", "kv_start": "i32",
           "TQ": "constexpr", "TK": "constexpr", "DROP_T": "constexpr"}
    src = ASTSource(kernel, sig, constexprs={"TQ": 16, "TK": 32, "DROP_T": _dropout.threshold(0.3)})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    ttir = compiled.asm["ttir"]
    assert ttir.count("arith.shrui") >= 3 and "arith.shrsi" not in ttir
    assert "cubin" in compiled.asm


def test_dropout_lowers_for_cuda():
    """Forward and both backward kernels with dropout lower (and so compile) for sm_90 through jax_triton."""
    pytest.importorskip("jax_triton")
    B, S, Hq, Hkv, D = 1, 256, 4, 2, 64
    make, *_, sc, mc, lists = case("causal+relative_bias", (B, S, S, Hq, Hkv, D), block_size=128)
    spec = make(RATE, {"target": "cuda"})

    def f(q, k, v, do, seed):
        out, lse, res = triton_backend.forward_with_residuals(spec, q, k, v, sc, mc, lists, dropout_seed=seed)
        grads = triton_backend.backward(spec, q, k, v, out, lse, do, jnp.zeros_like(lse), sc, mc, lists,
                                        (True,) * len(sc), res, dropout_seed=seed)
        return out, grads

    x = jax.ShapeDtypeStruct((B, S, Hq, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, S, Hkv, D), jnp.bfloat16)
    seed = jax.ShapeDtypeStruct((2,), jnp.uint32)
    text = jax.jit(f).trace(x, kv, kv, x, seed).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("triton_kernel_call") == 3
