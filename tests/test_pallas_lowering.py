"""The pallas backend lowers for GPU (Triton) and TPU (Mosaic) from this CPU host.

``kernel_options={"target": ...}`` emits the platform's kernel whatever the host; the
lowering runs under an abstract mesh whose device is the target's (an H100 for cuda, a
TPU v5e for tpu). JAX 0.11's Triton lowering reads the GPU from that mesh when the host
has none (0.10 fell back to sm_90 by itself). Every catalog entry lowers forward and
backward for both targets (on TPU, relative bias and T5 through diagonal values); mods a
target cannot take raise the compiler's NotImplementedError naming the primitive and the
mod.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from catalog import BY_NAME, CATALOG, build
from jax import lax
from jax.experimental.pallas import triton as plgpu
from jax.sharding import AbstractDevice, AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flexjax

# (B, Sq, Skv, Hq, Hkv, D, Dv): GQA at a GPU-sized head dim, two 128-blocks per side.
SHAPE = (2, 256, 256, 4, 2, 64, 64)
TRITON_CALL = getattr(plgpu, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")  # exported since JAX 0.11
MOSAIC_CALL = "tpu_custom_call"
# The Triton lowering is what flexjax targets on GPU (DESIGN.md); JAX 0.11 deprecates it with a warning.
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def _lower(name_or_score_mod, target, grad: bool):
    """Lowered text of a catalog entry (or a bare score_mod) for ``target``.

    The BlockMask and the mods' arrays are built eagerly, outside the abstract mesh (JAX >= 0.11 gives an
    AbstractMesh Explicit axes, where eager ops fail); only the trace and lowering run inside it. TPU
    inputs are sharded over the mesh."""
    B, Sq, Skv, Hq, Hkv, D, Dv = SHAPE
    options = {"target": target}
    if isinstance(name_or_score_mod, str):
        _, params, attention = build(BY_NAME[name_or_score_mod], SHAPE, block_size=128)
    else:
        params = {}

        def attention(q, k, v, params, **kw):
            return flexjax.flex_attention(q, k, v, name_or_score_mod, return_lse=True, **kw)

    def fwd(q, k, v, params):
        return attention(q, k, v, params, backend="pallas", kernel_options=options)[0]

    def loss(q, k, v, params):
        return fwd(q, k, v, params).astype(jnp.float32).sum()

    f = jax.grad(loss, argnums=(0, 1, 2, 3)) if grad else fwd
    mesh = _cuda_mesh() if target == "cuda" else _tpu_mesh()
    sharding = NamedSharding(mesh, P()) if target == "tpu" else None
    q = jax.ShapeDtypeStruct((B, Sq, Hq, D), jnp.bfloat16, sharding=sharding)
    k = jax.ShapeDtypeStruct((B, Skv, Hkv, D), jnp.bfloat16, sharding=sharding)
    v = jax.ShapeDtypeStruct((B, Skv, Hkv, Dv), jnp.bfloat16, sharding=sharding)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(f).trace(q, k, v, params).lower(lowering_platforms=(target,)).as_text()


def _cuda_mesh():
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=1, platform="cuda")
    return AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,), abstract_device=device)


def _tpu_mesh():
    device = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    return AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,), abstract_device=device)


def _lowering_grid(target_index):
    """(name, grad) for every catalog entry; the default suite lowers each entry once per
    target, forward and backward on alternate targets (``make test-all``: all of them;
    ``make test-compile`` compiles every kernel)."""
    return [pytest.param(c.name, grad, id=f"{c.name}-{'fwd_bwd' if grad else 'fwd'}",
                         marks=() if (n + target_index) % 2 == int(grad) else pytest.mark.slow)
            for n, c in enumerate(CATALOG) for grad in (False, True)]


@pytest.mark.parametrize("name,grad", _lowering_grid(0))
def test_cuda_lowering(name, grad):
    text = _lower(name, "cuda", grad)
    # Forward: one kernel; with the backward also the dQ and dK/dV kernels.
    assert text.count(TRITON_CALL) == (3 if grad else 1)


@pytest.mark.parametrize("name,grad", _lowering_grid(1))
def test_tpu_lowering(name, grad):
    text = _lower(name, "tpu", grad)
    assert text.count(MOSAIC_CALL) == (3 if grad else 1)


@pytest.mark.parametrize("fn,prim", [
    (lambda s, b, h, q, k: s + jax.scipy.special.erf(s), "erf"),
    (lambda s, b, h, q, k: jnp.round(s), "round"),
    # Inside a sub-jaxpr: cond's branches are a tuple param.
    (lambda s, b, h, q, k: lax.cond(h > 0, jax.scipy.special.erf, lambda x: x, s), "erf"),
], ids=["erf", "round", "erf_in_cond"])
def test_cuda_unsupported_primitive_is_named(fn, prim):
    fn.__name__ = f"uses_{prim}"
    with pytest.raises(NotImplementedError, match=rf"uses_{prim}.*'{prim}'.*Triton"):
        _lower(fn, "cuda", grad=False)


_HALF = jnp.float32(0.5)


@jax.jit
def _scaled(x):
    return x * _HALF  # a nested jit that closes over an array: its jaxpr carries consts


def _nested_calls(score, b, h, q_idx, kv_idx):
    return jax.checkpoint(jnp.tanh)(jax.nn.relu(_scaled(score)))  # remat2, custom_jvp, jit


@pytest.mark.parametrize("target", ["cuda", "tpu"])
def test_call_primitives_are_inlined(target):
    """jit (with consts), custom_jvp and checkpoint ("remat2") bodies are inlined into the kernel.

    Their sub-jaxprs are ClosedJaxprs or open Jaxprs on JAX 0.10 and one Jaxpr class on 0.11.
    """
    text = _lower(_nested_calls, target, grad=True)
    assert text.count(TRITON_CALL if target == "cuda" else MOSAIC_CALL) == 3


def test_tpu_gather_error_names_the_mod():
    """A table read at an index that is not a function of kv_idx - q_idx alone cannot lower."""
    x = jnp.zeros((1, 8, 2, 16))
    table = jnp.zeros((2, 64))

    def product_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, (q_idx * kv_idx) % 64]

    with pytest.raises(NotImplementedError, match="product_bias.*'(dynamic_slice|gather)'.*Mosaic TPU"):
        flexjax.flex_attention(x, x, x, product_bias, backend="pallas", kernel_options={"target": "tpu"})


def _erf_score(score, b, h, q_idx, kv_idx):
    return score + jax.scipy.special.erf(score / 4.0)


def test_tpu_erf_gradient_lowers_or_is_refused():
    """JAX 0.12 differentiates erf through ``polynomial`` (which the mod compiler evaluates by Horner's rule, as
    JAX's own lowering does) and an exp at accuracy=HIGHEST, which Mosaic TPU cannot lower: that call is refused
    with the reason, never a crash while lowering."""
    try:
        text = _lower(_erf_score, "tpu", grad=True)
    except NotImplementedError as e:
        assert "accuracy" in str(e) and "_erf_score" in str(e), e
    else:
        assert text.count(MOSAIC_CALL) == 3


def test_erf_gradient_in_the_interpreter_matches_the_reference():
    q, k, v = (jax.random.normal(key, (1, 64, 2, 16)) for key in jax.random.split(jax.random.PRNGKey(1), 3))

    def loss(q, backend):
        return (flexjax.flex_attention(q, k, v, _erf_score, backend=backend) ** 2).sum()

    got = jax.grad(loss)(q, "pallas")
    want = jax.grad(loss)(q, "reference")
    assert jnp.max(jnp.abs(got - want)) < 1e-4
