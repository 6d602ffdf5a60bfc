"""What is specific to the pallas backend, in interpret mode on CPU (conformance.py has the rest).

The GPU template (what Triton runs) is exercised by default; the TPU template (scalar
prefetch, hoisted row/col blocks) through ``kernel_options={"target": "tpu",
"interpret": True}``. Shapes are small and lengths unequal and not multiples of the
block, so padding, GQA and edge tiles are always on the path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from catalog import CATALOG, SHAPES, check_case, inputs

import flexjax

TPU_INTERPRET = {"target": "tpu", "interpret": True}


def _check(name, shape="gqa_unequal", dtype=jnp.float32, kernel_options=None, block_size=64):
    return check_case("pallas", name, SHAPES[shape], dtype, kernel_options, block_size)


@pytest.mark.slow
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name", [c.name for c in CATALOG])
def test_catalog_all_shapes(name, shape):
    _check(name, shape)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("name", [c.name for c in CATALOG])
def test_catalog_low_precision(name, dtype):
    _check(name, dtype=dtype)


# T5 reads its table along kv_idx - q_idx: a diagonal value on TPU (relative bias at 128-aligned
# tiles is in test_pallas_tpu_diagonal.py; the whole catalog in the slow test below).
# (sliding_window+alibi runs by default in conformance.py.)
@pytest.mark.slow
@pytest.mark.parametrize("name", ["padding", "document+t5"])
def test_catalog_tpu_template(name):
    _check(name, kernel_options=TPU_INTERPRET)


@pytest.mark.slow
@pytest.mark.parametrize("name", [c.name for c in CATALOG])
def test_catalog_tpu_template_all(name):
    _check(name, kernel_options=TPU_INTERPRET)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")  # JAX 0.11
@pytest.mark.parametrize("name", [c.name for c in CATALOG])
def test_catalog_on_gpu(name):
    """The compiled Triton kernels (no interpreter) against the reference, bfloat16.

    The whole catalog at small shapes; benchmarks/gpu_tests.py (gpu_check.sh, no pytest) checks
    the production shapes it times (bfloat16, D=128, GQA 16/4, S up to 8192) on fewer cases.
    """
    _check(name, dtype=jnp.bfloat16, kernel_options={"target": "cuda"})


def test_kernel_options_are_checked():
    q, k, v, _ = inputs(SHAPES["mha"], jnp.float32)
    bm = flexjax.create_block_mask(flexjax.masks.causal, None, None, 192, 192, block_size=64)

    def call(options):
        return flexjax.flex_attention(q, k, v, block_mask=bm, backend="pallas", kernel_options=options)

    with pytest.raises(ValueError, match="unknown kernel_options key 'blok_q'"):
        call({"blok_q": 16})
    with pytest.raises(ValueError, match="block_q.*divide the BlockMask's block"):
        call({"block_q": 48})
    with pytest.raises(ValueError, match="target"):
        call({"target": "metal"})
    with pytest.raises(NotImplementedError, match="TPU tiles must be multiples"):
        call({"target": "tpu", "interpret": True, "block_q": 32})


def test_platform_order():
    from flexjax.backends import platform_backends

    for platform in ("gpu", "cuda"):
        # mosaic_gpu first (tests/test_mosaic_gpu.py), triton where jax-triton imports
        # (tests/test_triton_backend_dispatch.py), then pallas.
        assert platform_backends(platform)[:3] == ("mosaic_gpu", "triton", "pallas")
        assert platform_backends(platform)[-1] == "xla"
    assert platform_backends("tpu") == ("pallas", "xla")
    assert platform_backends("cpu") == ("xla",)
