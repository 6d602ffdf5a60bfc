"""What would run, asked from this host for another platform (``explain(..., platform=)``), and paged / ragged
calls going through the platform's chooser (``paged.explain``) rather than always to xla."""

from __future__ import annotations

import importlib.util
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flexjax
from flexjax import backends, masks, paged

S = jax.ShapeDtypeStruct
B, H, K, D = 2, 8, 2, 128


def _mosaic_gpu_importable() -> bool:
    from flexjax.backends import mosaic_gpu
    return mosaic_gpu.MISSING is None


def test_dense_explain_on_each_platform():
    q = S((1, 1024, H, D), jnp.bfloat16)
    bm = flexjax.create_block_mask(masks.causal, None, None, 1024, 1024)
    assert flexjax.explain(q, q, q, block_mask=bm, platform="cpu").backend == "xla"
    cuda = flexjax.explain(q, q, q, block_mask=bm, platform="cuda")
    if _mosaic_gpu_importable():  # compute capability 9.0: the Hopper kernels
        assert cuda.backend == "mosaic_gpu", str(cuda)
    else:
        assert cuda.backend in ("triton", "pallas"), str(cuda)
        assert cuda.skipped_backends[0][0] == "mosaic_gpu"
    assert flexjax.explain(q, q, q, block_mask=bm, platform="gpu").backend == cuda.backend
    tpu = flexjax.explain(q, q, q, block_mask=bm, platform="tpu")
    assert (tpu.backend, tpu.forward) == ("pallas", "tiled"), str(tpu)
    # compute capability 8.0 is not mosaic_gpu's: triton's, which takes the option, where it imports
    try:
        sm80 = flexjax.explain(q, q, q, block_mask=bm, platform="cuda", kernel_options={"compute_capability": 80})
        assert sm80.backend == "triton", str(sm80)
    except NotImplementedError as e:
        assert "got 8.0" in str(e) and "'triton' package" in str(e)
    # the platform does not leak past the call
    assert backends.current_platform() == jax.default_backend()
    with pytest.raises(ValueError, match="platform must be one of"):
        flexjax.explain(q, q, q, block_mask=bm, platform="metal")


def test_xla_forward_names_the_cpu_kernel_only_on_cpu():
    q = S((1, 256, 4, 64), jnp.float32)
    here = flexjax.explain(q, q, q, block_mask=flexjax.create_block_mask(masks.causal, None, None, 256, 256),
                           backend="xla")
    assert here.forward == "cpu_kernel"
    there = flexjax.explain(q, q, q, block_mask=flexjax.create_block_mask(masks.causal, None, None, 256, 256),
                            backend="xla", platform="cuda")
    assert there.forward != "cpu_kernel"


@pytest.mark.parametrize("page", [64, 128])
def test_paged_and_ragged_calls_name_a_kernel_backend_off_cpu(page):
    L = 1024
    q = S((B, 1, H, D), jnp.bfloat16)
    kp = S((B * L // page, page, K, D), jnp.bfloat16)
    table, lens = S((B, L // page), jnp.int32), S((B,), jnp.int32)
    qr, cu = S((64, H, D), jnp.bfloat16), S((B + 1,), jnp.int32)
    for call in (lambda **kw: paged.explain(q, kp, kp, table, lens, **kw),
                 lambda **kw: paged.explain(qr, kp, kp, table, lens, cu_q_lens=cu, **kw)):
        here = call()
        assert here.backend == "xla" and here.forward == "cpu_kernel" and here.backward == "paged_backward"
        cuda = call(platform="cuda")
        assert cuda.backend in ("triton", "pallas"), str(cuda)
        assert ("mosaic_gpu", "no paged path") in cuda.skipped_backends
        tpu = call(platform="tpu")
        if page % 128 == 0:  # the TPU kernel's kv tiles are multiples of 128
            assert (tpu.backend, tpu.forward) == ("pallas", "decode"), str(tpu)
        else:
            assert tpu.backend == "xla" and "multiple of 128" in tpu.skipped_backends[0][1]


@pytest.mark.ci_extra  # (make test's 5-minute budget: about 4 s here; make test reached 5:12)
def test_paged_explain_is_what_runs_and_a_named_backend_is_kept():
    """On this host paged.explain names the backend the call then runs; a named backend that has no paged path
    is refused; kernel_options no backend the platform tries takes are refused, naming the backend."""
    L, page = 64, 16
    ks = jax.random.split(jax.random.key(0), 3)
    kp = jax.random.normal(ks[0], (B * L // page, page, K, 16))
    q = jax.random.normal(ks[1], (B, 1, H, 16))
    table = jnp.asarray(paged.page_table_for([L] * B, page, L // page))
    lens = jnp.array([40, 64], jnp.int32)
    exp = paged.explain(q, kp, kp, table, lens)
    assert exp.backend == "xla"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing passed over on CPU, nothing warned
        out = paged.flex_attention(q, kp, kp, table, lens)
    want = paged.flex_attention(q, kp, kp, table, lens, backend="xla")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    assert paged.explain(q, kp, kp, table, lens, backend="pallas").backend == "pallas"
    with pytest.raises(NotImplementedError, match="paths on the"):
        paged.explain(q, kp, kp, table, lens, backend="mosaic_gpu")
    with pytest.raises(ValueError, match="kernel_options key 'target' is taken by backend"):
        paged.flex_attention(q, kp, kp, table, lens, kernel_options={"target": "tpu"})
    with pytest.raises(ValueError, match="block_mask, not a mask_mod"):
        paged.explain(q, kp, kp, table, lens, mask_mod=masks.causal)


@pytest.mark.skipif(importlib.util.find_spec("jax_triton") is None, reason="jax-triton is not installed")
def test_paged_on_cuda_names_triton_where_it_imports():
    q = S((B, 1, H, D), jnp.bfloat16)
    kp = S((32, 64, K, D), jnp.bfloat16)
    exp = paged.explain(q, kp, kp, S((B, 16), jnp.int32), S((B,), jnp.int32), platform="cuda")
    assert exp.backend == "triton", str(exp)


def test_paged_chooser_warns_for_refusals_not_for_backends_without_a_paged_path():
    from flexjax._paged_core import choose_paged
    from flexjax.backends._contract import Plan

    with backends.for_platform("cuda"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan, skipped = choose_paged("paged", None, lambda n: "a test refusal" if n == "triton" else
                                     Plan(n, "decode", "paged_backward", "paged_backward"))
    assert plan.backend == "pallas"
    assert [n for n, _ in skipped] == ["mosaic_gpu", "triton"]
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "'triton'" in messages[0] and "a test refusal" in messages[0], messages


# -- one plan per call ---------------------------------------------------------------------------

def _record_plans(monkeypatch, module, names=("forward_with_residuals", "backward")):
    """The plan each of ``module``'s passes receives, as it runs."""
    seen = []
    for name in names:
        original = getattr(module, name)

        def wrapped(*args, _original=original, _name=name, **kwargs):
            seen.append((_name, kwargs.get("plan")))
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapped)
    return seen


@pytest.mark.parametrize("name", ["xla", "pallas"])
def test_explain_reports_the_plan_that_runs(monkeypatch, name):
    """explain's plan is the one the call's forward and backward receive (passed through the custom_jvp,
    not decided again), and the backend resolves its options once for the call."""
    module = importlib.import_module(f"flexjax.backends.{name}")
    table = jnp.linspace(-1.0, 1.0, 64)

    def bias(score, b, h, q_idx, kv_idx):
        return score + table[q_idx - kv_idx + 31]

    x = jax.random.normal(jax.random.key(0), (1, 32, 2, 16), jnp.float32)
    bm = flexjax.create_block_mask(masks.causal, None, None, 32, 32, block_size=16)
    plan = flexjax.explain(x, x, x, bias, bm, backend=name).plan
    assert plan is not None and (plan.backend, plan.forward) == (name, flexjax.explain(x, x, x, bias, bm,
                                                                                       backend=name).forward)
    seen = _record_plans(monkeypatch, module)
    resolves = []
    original_resolve = module.resolve
    monkeypatch.setattr(module, "resolve", lambda *a: resolves.append(1) or original_resolve(*a))

    def loss(x, table_):
        def mod(score, b, h, q_idx, kv_idx):
            return score + table_[q_idx - kv_idx + 31]
        return flexjax.flex_attention(x, x, x, mod, bm, backend=name).sum()

    jax.grad(loss, argnums=(0, 1))(x, table)
    # (the forward is traced twice: custom_jvp traces its primal function too)
    assert {n for n, _ in seen} == {"forward_with_residuals", "backward"}, seen
    assert all(p == plan for _, p in seen), (seen, plan)
    assert len(resolves) == 1, resolves


def test_the_cpu_kernels_fallback_and_qkv_backward_are_in_the_plan():
    """The C++ kernel's other lowering (jax.export) is the plan's, and so is the backward of a call whose
    captured arrays are not differentiated: explain shows both."""
    x = S((1, 256, 4, 64), jnp.float32)
    table = jnp.zeros((512,))

    def bias(score, b, h, q_idx, kv_idx):
        return score + table[q_idx - kv_idx + 255]

    bm = flexjax.create_block_mask(masks.causal, None, None, 256, 256)
    exp = flexjax.explain(x, x, x, bias, bm, backend="xla")
    plan = exp.plan
    assert plan.forward == "cpu_kernel" and plan.forward_fallback in ("band", "loops")
    assert plan.backward == "loops" and plan.backward_qkv == "cpu_kernel", plan
    assert plan.backward_for((True,)) == "loops" and plan.backward_for((False,)) == "cpu_kernel"
    text = str(exp)
    assert "gradients of q, k and v alone: 'cpu_kernel'" in text and "jax.export" in text
    assert "options: (KernelOptions(" in text
    on_cuda = flexjax.explain(x, x, x, bias, bm, backend="xla", platform="cuda").plan
    assert on_cuda.forward_fallback is None and on_cuda.forward in ("band", "loops")


def test_paged_explain_reports_the_paged_plan():
    q = S((B, 1, H, D), jnp.bfloat16)
    kp = S((16, 128, K, D), jnp.bfloat16)
    exp = paged.explain(q, kp, kp, S((B, 8), jnp.int32), S((B,), jnp.int32))
    assert exp.plan.backend == "xla" and exp.plan.forward == "cpu_kernel" and exp.plan.forward_fallback == "decode"
    tpu = paged.explain(q, kp, kp, S((B, 8), jnp.int32), S((B,), jnp.int32), platform="tpu").plan
    assert tpu.backend == "pallas" and tpu.options.target == "tpu"
