"""The triton backend lowers for GPU from this CPU host.

``kernel_options={"target": "cuda"}`` emits the jax_triton kernels whatever the host;
jax_triton compiles each Triton kernel (to sm_90 or sm_80 code) while lowering, so a
template or a generated mod that Triton rejects fails here. Forward is one kernel; with
the backward also the dQ and dK/dV kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from catalog import BY_NAME, build

pytestmark = pytest.mark.triton  # runs under make test-compile (Triton and torch installed)

pytest.importorskip("jax_triton")

# (B, Sq, Skv, Hq, Hkv, D, Dv): GQA at a GPU-sized head dim, two 128-blocks per side.
SHAPE = (2, 256, 256, 4, 2, 64, 64)
TRITON_CALL = "triton_kernel_call"
NAMES = ("full", "causal+soft_cap", "sliding_window+alibi", "prefix_lm+relative_bias", "document+t5")


def _lower(name, grad: bool, dtype=jnp.bfloat16, shape=SHAPE, block_size=128, **options):
    B, Sq, Skv, Hq, Hkv, D, Dv = shape
    _, params, attention = build(BY_NAME[name], shape, block_size=block_size)
    options = {"target": "cuda", **options}

    def fwd(q, k, v, params):
        return attention(q, k, v, params, backend="triton", kernel_options=options)[0]

    def loss(q, k, v, params):
        return fwd(q, k, v, params).astype(jnp.float32).sum()

    f = jax.grad(loss, argnums=(0, 1, 2, 3)) if grad else fwd
    q = jax.ShapeDtypeStruct((B, Sq, Hq, D), dtype)
    k = jax.ShapeDtypeStruct((B, Skv, Hkv, D), dtype)
    v = jax.ShapeDtypeStruct((B, Skv, Hkv, Dv), dtype)
    return jax.jit(f).trace(q, k, v, params).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwd_bwd"])
@pytest.mark.parametrize("name", NAMES)
def test_cuda_lowering(name, grad):
    assert _lower(name, grad).count(TRITON_CALL) == (3 if grad else 1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["f32", "f16"])
def test_cuda_lowering_sm80_ragged(dtype):
    """sm_80 tables, float32 (exact dots) and float16, and lengths / head dims that need padding."""
    text = _lower("prefix_lm+relative_bias", True, dtype, (1, 200, 130, 4, 1, 40, 24), compute_capability=80)
    assert text.count(TRITON_CALL) == 3


@pytest.mark.parametrize("block_size,options", [((48, 80), {}), (64, {"block_q": 192, "bwd_block_kv": 192})],
                         ids=["block_48x80", "tile_192"])
def test_cuda_lowering_any_multiple_of_16(block_size, options):
    """Blocks and tiles that are not powers of two, with captured scalars in both mods: the
    kernels compile with power-of-two sub-tiles (issue 28)."""
    assert _lower("captured_scalars", True, block_size=block_size, **options).count(TRITON_CALL) == 3


def test_cuda_lowering_autotune():
    assert _lower("causal+soft_cap", True, autotune=True, num_warps=4).count(TRITON_CALL) == 3


# Shared memory per block: 227 KiB on sm_90, 163 KiB on sm_80.
_SMEM = {90: 227 * 1024, 80: 163 * 1024}


@pytest.mark.parametrize("head_dim,cc", [(64, 90), (128, 90), (128, 80)])
def test_default_tiles_fit_shared_memory(head_dim, cc, tmp_path, monkeypatch):
    """The heuristics' kernels for the worst catalog mod (a table gather, with gradients) fit."""
    from jax_triton import triton_lib

    monkeypatch.setattr(triton_lib, "_JAX_TRITON_DUMP_DIR", str(tmp_path))
    # A length no other test lowers, so jax_triton compiles (and reports) every kernel afresh.
    S = 384 + head_dim
    _lower("prefix_lm+relative_bias", True, shape=(1, S, S, 4, 2, head_dim, head_dim), compute_capability=cc)
    used = {}
    for info in tmp_path.glob("*/*.compile_info"):
        kernel, size = info.read_text().split(": shared_mem_bytes:")
        used[kernel] = max(used.get(kernel, 0), int(size))
    assert set(used) == {"flexjax_fwd", "flexjax_dq", "flexjax_dkv"}
    assert max(used.values()) <= _SMEM[cc], used
