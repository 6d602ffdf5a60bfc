"""The mosaic_gpu backend on a CPU host: its kernels in Mosaic GPU's interpreter against the reference,
its refusals, and its place in the GPU dispatch order.

The interpreter simulates the kernels' three warpgroups, shared memory, TMA copies, barriers and
wgmma (about 5 s for a forward and 10-20 s for a backward at these shapes on 2 cores), so
``make test`` runs one catalog entry (sm_90a) and lowers the sm_100a kernels; the tests marked
``mosaic_gpu`` (every entry the backend takes on both archs, float16 and bfloat16, MHA / GQA /
ragged lengths, dropout) run in ``make test-compile``.

Both archs' kernels run here: sm_90a's (``compute_capability`` 90, the default) as written, and
sm_100a's (``compute_capability=100``: 128-row warpgroups, accumulators in tensor memory) with the
tcgen05 MMA and the tensor memory emulated by wgmma and a shared-memory buffer
(``_mma.Blackwell(emulate=True)``), which the interpreter has instead. The kernels' sm_90a and
sm_100a compiles are ``tests_compile/mosaic_gpu_suite.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from catalog import BY_NAME, CATALOG, build, check_case

import flexjax
from flexjax import backends, masks, mods

# (B, Sq, Skv, Hq, Hkv, D, Dv): the kernels take head dims that are multiples of 64 and Dv = D.
SHAPES = {
    "mha": (1, 192, 192, 2, 2, 64, 64),
    "gqa_ragged": (1, 130, 250, 4, 2, 64, 64),
    "mqa_ragged": (1, 201, 97, 2, 1, 64, 64),
    # make test's: one CTA of 50 queries (ragged), 64 keys, two query heads on one kv head.
    "small_gqa_ragged": (1, 50, 64, 2, 1, 64, 64),
}
# Entries that gather from a captured table by q_idx and kv_idx together (relative bias, T5
# buckets): refused (the kernels do not gather), served by triton.
GATHERS = ("prefix_lm+relative_bias", "document+t5", "per_head_mask+relative_bias", "captured_scalars")
TAKEN = [c.name for c in CATALOG if c.name not in GATHERS]
# The default entry (GQA, ragged lengths, a score_mod reading h, a sliding window).
DEFAULT = ("sliding_window+alibi", "small_gqa_ragged", jnp.bfloat16)
ARCHS = {"sm_90a": 90, "sm_100a": 100}


def _grid():
    shapes = [s for s in SHAPES if not s.startswith("small")]
    # make test's budget: sm_90a's default entry runs in make test-extra; sm_100a's (the same kernels with the
    # tcgen05 unit emulated) in make test-compile with every other sm_100a entry, while make test
    # lowers the real sm_100a kernels (test_backend_none_picks_mosaic_gpu_on_blackwell).
    out = [pytest.param(*DEFAULT, arch, id=f"default-{arch}-" + "-".join(map(str, DEFAULT[:2])),
                        marks=(pytest.mark.ci_extra,) if arch == "sm_90a" else (pytest.mark.mosaic_gpu,))
           for arch in ARCHS]
    for n, name in enumerate(TAKEN):
        # sm_90a: every entry once, bfloat16 and float16 in turn (the same kernels with another element
        # type; both dtypes on every entry took 20 runs of 25-70 s, the longest part of make test-compile).
        dtype = (jnp.bfloat16, jnp.float16)[n % 2]
        shape = shapes[n % len(shapes)]
        out.append(pytest.param(name, shape, dtype, "sm_90a", id=f"{name}-{shape}-{jnp.dtype(dtype).name}",
                                marks=(pytest.mark.mosaic_gpu,)))
        # sm_100a: every entry once, at another shape.
        shape = shapes[(n + 1) % len(shapes)]
        out.append(pytest.param(name, shape, jnp.bfloat16, "sm_100a", id=f"{name}-{shape}-bfloat16-sm_100a",
                                marks=(pytest.mark.mosaic_gpu,)))
    return out


@pytest.mark.parametrize("name,shape,dtype,arch", _grid())
def test_catalog_in_the_interpreter(name, shape, dtype, arch):
    """out, lse, dq, dk, dv and the captured arrays' gradients against the float32 reference."""
    check_case("mosaic_gpu", name, SHAPES[shape], dtype, kernel_options={"compute_capability": ARCHS[arch]})


def _qkv(shape=(1, 128, 2, 64), dtype=jnp.bfloat16, hkv=None):
    B, S, H, D = shape
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    q = jax.random.normal(ks[0], shape, jnp.float32).astype(dtype)
    kv = (B, S, hkv or H, D)
    return q, jax.random.normal(ks[1], kv, jnp.float32).astype(dtype), jax.random.normal(ks[2], kv).astype(dtype)


# (Gradients of captured rows and columns, max_scores / min_scores, MHA / MQA, fully masked rows,
# determinism, huge scores, traced masks and dropout on sm_90a: tests/conformance.py's mosaic_gpu target.)


# -- refusals (no kernel runs) --------------------------------------------------------------------

def _reason(q, k, v, **kw):
    with pytest.raises(NotImplementedError, match="backend 'mosaic_gpu' cannot serve this call") as e:
        flexjax.flex_attention(q, k, v, backend="mosaic_gpu", **kw)
    return str(e.value)


def test_refuses_float32_with_the_reason():
    q, k, v = _qkv(dtype=jnp.float32)
    assert "16-bit" in _reason(q, k, v)


def test_refuses_head_dims_not_multiple_of_64():
    q, k, v = _qkv((1, 128, 2, 48))
    assert "multiples of 64" in _reason(q, k, v)


def test_refuses_gathers_by_both_indices():
    q, k, v = _qkv()
    table = jnp.zeros((2, 255))
    reason = _reason(q, k, v, score_mod=mods.relative_bias(table))
    assert "both q_idx and kv_idx" in reason and "triton" in reason


# Rows with many full tiles: at 32-key steps over 64-key blocks, the last CTA's rows (256-319, causal)
# take 2 partial steps and 8 full ones, so the forward's pipelined loop (FlashAttention-3's
# intra-warpgroup overlap: Q K^T of step t issued with P·V of step t - 1, ``_kernels.fwd_overlap``)
# runs 7 times after its prologue; the catalog's shapes have at most one full tile per row.
PIPELINED = dict(shape=(1, 320, 320, 2, 1, 64, 64), kernel_options={"compute_capability": 90, "block_kv": 32})


@pytest.mark.mosaic_gpu
@pytest.mark.parametrize("name", ["causal", "causal+soft_cap", "full"])
def test_pipelined_full_tiles(name):
    check_case("mosaic_gpu", name, PIPELINED["shape"], jnp.bfloat16, kernel_options=PIPELINED["kernel_options"])


@pytest.mark.mosaic_gpu
@pytest.mark.parametrize("name,D", [("causal", 64), ("causal+soft_cap", 64), ("full", 64), ("causal+soft_cap", 128)])
def test_pipelined_chain_on_blackwell(name, D):
    """sm_100a's forward runs every tile pipelined (``_Tcgen05Unit.qk_pv``: Q K^T and the previous
    tile's P·V committed to two tensor-core barriers, the softmax run while P·V is in flight), the
    partial ones masked, with 64-key steps whose scores are read from tensor memory in two 32-column
    chunks (``_mma._InTmem``) and whose P alternates between two buffers. Causal: the second CTA
    (query rows 256 .. 511) walks 4 partial tiles of 64 keys, then 4 full ones; "full": no partial
    tile (the chain's unmasked first step). With the masked steps run unmasked, or every chunk's
    exponent taken from the first chunk, causal's out is off by 1.3-2. At head dim 128 the same
    (JAX 0.10: 32-key steps, the partial tiles one per step, ``_kernels.fwd_chain_partial``)."""
    check_case("mosaic_gpu", name, (1, 512, 512, 1, 1, D, D), jnp.bfloat16,
               kernel_options={"compute_capability": 100})


@pytest.mark.mosaic_gpu
def test_pipelined_full_tiles_with_dropout():
    """The same walk with dropout: the keep mask is applied in the pipelined steps' softmax."""
    from test_dropout_kernels import check

    from flexjax.backends import mosaic_gpu as backend

    check(backend, "causal", kernel_options=PIPELINED["kernel_options"], shape=PIPELINED["shape"][:-1],
          dtype=jnp.bfloat16)


@pytest.mark.mosaic_gpu
def test_head_dim_128_backward():
    """Head dim 128 with the default tiles: dK/dV's two consumer warpgroups (128 key rows per CTA,
    the second padded: 200 keys) and 64-query steps, the partial ones (the diagonal tiles) run as two
    32-query sub-steps and the full one below them whole, with a score_mod whose slope is folded into P."""
    check_case("mosaic_gpu", "causal+soft_cap", (1, 160, 200, 2, 1, 128, 128), jnp.bfloat16,
               kernel_options={"compute_capability": 90})


@pytest.mark.mosaic_gpu
def test_interpreter_compiles_a_kernel_once_for_every_cta():
    """Mosaic GPU's interpreter runs each warpgroup of each CTA as an XLA:CPU computation. JAX 0.10
    jitted it through a closure made anew per call, so every CTA compiled the kernel again (over
    half of an interpreted test's time); ``_kernels._interpret_params`` puts JAX 0.11's fix in place.
    A forward of 8 CTAs (4 query tiles of 128 rows, 2 heads), 3 warpgroups each: without the fix 24
    compiles of the warpgroup body (JAX 0.10's ``_run``; ``_kernels._eval_thread`` with the fix;
    ``_run`` again from JAX 0.11), with it one."""
    from jax._src import dispatch

    compiles = []

    def listener(event, secs, fun_name=None, **_):
        if event == dispatch.BACKEND_COMPILE_EVENT and fun_name in ("jit(_run)", "jit(_eval_thread)"):
            compiles.append(fun_name)

    q, k, v = _qkv((1, 512, 2, 64))
    fwd = jax.jit(lambda q, k, v: flexjax.flex_attention(q, k, v, backend="mosaic_gpu",
                                                         kernel_options={"compute_capability": 90}))
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        out = jax.block_until_ready(fwd(q, k, v))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert 1 <= len(compiles) <= 2, compiles
    ref = flexjax.flex_attention(q, k, v, backend="reference")
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2, rtol=2e-2)


@pytest.mark.mosaic_gpu
def test_dropout_on_blackwell():
    """Fused dropout on sm_100a's kernels (tcgen05 emulated) against the dense truth (tests/test_dropout_kernels.py's
    harness: out, lse, dq, dk, dv through the backend's forward_with_residuals and backward): the kernels
    regenerate ``_dropout``'s keep mask per tile, the same bits as every backend (sm_90a's: conformance)."""
    from test_dropout_kernels import check

    from flexjax.backends import mosaic_gpu as backend

    check(backend, "causal", kernel_options={"compute_capability": 100}, shape=(1, 100, 150, 4, 2, 64),
          dtype=jnp.bfloat16)


def test_refuses_other_compute_capabilities():
    q, k, v = _qkv()
    reason = _reason(q, k, v, kernel_options={"target": "cuda", "compute_capability": 80})
    assert "9.0" in reason and "10.0" in reason


def test_takes_hopper_and_blackwell():
    """Compute capabilities 9.0 and 10.0 are served (the call is planned, no kernel runs), with
    each arch's CTA: 128 query rows on sm_90a, 256 on sm_100a."""
    from flexjax.backends import mosaic_gpu as backend

    q, k, v = _qkv()
    for cc, rows in ((90, 128), (100, 256)):
        e = flexjax.explain(q, k, v, backend="mosaic_gpu", kernel_options={"target": "cuda", "compute_capability": cc})
        assert e.backend == "mosaic_gpu"
        assert backend.heuristics(cc).block_q == rows


def test_fa3_tiles_and_forms():
    """sm_90a's default tiles are FlashAttention-3's where the compile suite found them spill-free
    (``heuristics``' docstring), and the GPU forms read transposed views and take A from registers,
    the interpreter's forms neither (its tiles are transposed in XLA and A goes through shared memory)."""
    from flexjax.backends import mosaic_gpu as backend
    from flexjax.backends.mosaic_gpu import _kernels, _mma

    o = backend.heuristics(90, 128)
    assert (o.block_kv, o.bwd_block_kv, o.bwd_block_q) == (128, 64, 64)
    assert backend.heuristics(90, 64).bwd_block_q == 64
    d = backend.heuristics(90, 128, dropout=True)
    assert (d.block_kv, d.bwd_block_q) == (64, 32)
    gpu, interp = _mma.Hopper(), _mma.Hopper(emulate=True)
    assert gpu.views and gpu.register_a and not interp.views and not interp.register_a
    assert _mma.Blackwell().views and not _mma.Blackwell().register_a
    # Two dK/dV consumers on sm_90a (in the interpreter too: the same kernel), one on sm_100a.
    assert _kernels.dkv_consumers(gpu) == _kernels.dkv_consumers(interp) == 2
    assert _kernels.dkv_rows(gpu) == 128 and _kernels.dkv_rows(_mma.Blackwell()) == 128
    # dK/dV's partial steps at head dim 128 on sm_90a run in 32-query sub-steps, the full ones whole.
    assert _kernels.dkv_masked_q(gpu, 128, 64) == _kernels.dkv_masked_q(interp, 128, 64) == 32
    assert _kernels.dkv_masked_q(gpu, 64, 64) == 64 and _kernels.dkv_masked_q(gpu, 128, 32) == 32
    assert _kernels.dkv_masked_q(_mma.Blackwell(), 128, 32) == 32
    # No P tile and no transposed copies in the GPU form's shared memory.
    assert _kernels.smem_bytes(128, 128, 32, 2, gpu)["fwd"] < _kernels.smem_bytes(128, 128, 32, 2, interp)["fwd"]
    # sm_100a: 64-key forward steps, its scores read from tensor memory in 32-column chunks and P
    # written to one of two shared-memory buffers as it goes (in the interpreter too).
    assert backend.heuristics(100, 64).block_kv == 64
    assert backend.heuristics(100, 128).block_kv == (32 if _kernels.JAX_010 else 64)
    assert _kernels.p_buffers(_mma.Blackwell()) == _kernels.p_buffers(_mma.Blackwell(emulate=True)) == 2
    assert (_kernels.p_buffers(gpu), _kernels.p_buffers(interp)) == (0, 1) and _mma.SCORE_CHUNK == 32


def test_refuses_tiles_past_shared_memory():
    """sm_100a at head dim 64 with 128-key forward steps: Q, two stages of K and V, and two P buffers
    per consumer come to 224 KiB, and the row statistics take it past what a block may have
    (Mosaic GPU refused the kernel at 233612 bytes): refused before compiling, with the reason."""
    q, k, v = _qkv((1, 128, 2, 64))
    reason = _reason(q, k, v, kernel_options={"target": "cuda", "compute_capability": 100, "block_kv": 128})
    assert "forward kernel needs" in reason and "shared memory" in reason
    flexjax.explain(q, k, v, backend="mosaic_gpu", kernel_options={"target": "cuda", "compute_capability": 100})


def test_heaviest_first():
    """The grids walk rows with the most tiles first (causal: the last query rows), ties in order;
    each kernel row of a list row that it splits in ``sub`` gets its list row's weight."""
    from flexjax.backends.mosaic_gpu import _kernels

    n = jnp.array([[[1, 2, 3, 2]]], jnp.int32)
    f = jnp.array([[[0, 0, 1, 1]]], jnp.int32)
    assert _kernels.heaviest_first(n, f, 1).tolist() == [[[2, 3, 1, 0]]]
    assert _kernels.heaviest_first(n, f, 2).tolist() == [[[4, 5, 6, 7, 2, 3, 0, 1]]]
    both = jnp.concatenate([n, n[..., ::-1]], axis=1)
    assert _kernels.heaviest_first(both, both * 0, 1, axis_sum=1).tolist() == [[[1, 2, 0, 3]]]


def test_refuses_past_tensor_memory(monkeypatch):
    """sm_100a's accumulators live in tensor memory; a call whose tiles need more columns than an SM
    has is refused with the reason (here the limit is lowered: the shared-memory limit binds first
    at every head dim and tile the backend takes)."""
    from flexjax.backends.mosaic_gpu import _kernels

    q, k, v = _qkv()
    monkeypatch.setattr(_kernels, "TMEM_COLUMNS", 128)
    reason = _reason(q, k, v, kernel_options={"target": "cuda", "compute_capability": 100})
    assert "tensor-memory columns" in reason
    flexjax.explain(q, k, v, backend="mosaic_gpu", kernel_options={"target": "cuda", "compute_capability": 90})


def test_option_errors_name_the_key():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="num_stages"):
        flexjax.flex_attention(q, k, v, backend="mosaic_gpu", kernel_options={"num_stages": 1})
    # Three warpgroups per kernel: num_warps is not one of its keys.
    with pytest.raises(ValueError, match="'num_warps' is taken by backend 'pallas' and 'triton', not by "
                                         "backend='mosaic_gpu'"):
        flexjax.flex_attention(q, k, v, backend="mosaic_gpu", kernel_options={"num_warps": 4})


def test_first_on_gpu():
    assert "mosaic_gpu" in backends.available_backends()
    for platform in ("gpu", "cuda"):
        assert backends.platform_backends(platform) == ("mosaic_gpu", "triton", "pallas", "xla")


def test_explain_names_the_kernels():
    q, k, v = _qkv()
    bm = flexjax.create_block_mask(masks.causal, None, None, 128, 128)
    e = flexjax.explain(q, k, v, block_mask=bm, backend="mosaic_gpu")
    assert (e.backend, e.forward, e.backward) == ("mosaic_gpu", "warp_specialized", "warp_specialized")


@pytest.mark.mosaic_gpu
def test_catalog_entries_taken_are_the_non_gathering_ones():
    """The refusals' dividing line on the catalog: every entry is either taken or gathers."""
    q, k, v = _qkv((1, 128, 2, 64))
    for case in CATALOG:
        bm_, params, _ = build(BY_NAME[case.name], (1, 128, 128, 2, 2, 64, 64))
        score = case.score(params, 2, 128, 128) if case.score else None
        try:
            flexjax.explain(q, k, v, score_mod=score, block_mask=bm_, backend="mosaic_gpu")
            taken = True
        except NotImplementedError:
            taken = False
        assert taken == (case.name not in GATHERS), case.name


# -- dispatch when lowering for a Hopper GPU from this CPU host -----------------------------------

def _lower_for_h100(score_mod, grad: bool = False, device="NVIDIA H100 80GB HBM3", options=None):
    """Lowered text of a causal call with ``backend=None`` and the GPU's backend order, for cuda."""
    import warnings

    from jax.sharding import AbstractDevice, AbstractMesh

    S = 256
    bm = flexjax.create_block_mask(masks.causal, None, None, S, S)

    def fwd(q, k, v):
        return flexjax.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,
                                      kernel_options={"target": "cuda", **(options or {})})

    f = jax.grad(lambda q, k, v: fwd(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)) if grad else fwd
    q = jax.ShapeDtypeStruct((1, S, 2, 64), jnp.bfloat16)
    mesh = AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                        abstract_device=AbstractDevice(device, 1, "cuda"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(f).trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
    return text, [str(w.message) for w in seen if "flexjax" in str(w.message)]


def test_backend_none_picks_mosaic_gpu_on_hopper(monkeypatch):

    monkeypatch.setitem(backends._PLATFORM_ORDER, jax.default_backend(), backends.platform_backends("cuda"))
    text, warned = _lower_for_h100(mods.soft_cap(20.0), grad=True)
    assert "mosaic_gpu" in text and not warned
    assert text.count("flexjax_mgpu_") >= 3 or text.count("mosaic_gpu") >= 3  # forward, dQ, dK/dV


def test_backend_none_picks_mosaic_gpu_on_blackwell(monkeypatch):
    """Compute capability 10.0 (named, as a CPU host cannot read it from a B200): the sm_100a kernels."""
    from flexjax.backends.mosaic_gpu import _mma

    monkeypatch.setitem(backends._PLATFORM_ORDER, jax.default_backend(), backends.platform_backends("cuda"))
    built = []
    unit = _mma.Blackwell.unit
    monkeypatch.setattr(_mma.Blackwell, "unit", lambda self, *a: built.append(self.emulate) or unit(self, *a))
    text, warned = _lower_for_h100(mods.soft_cap(20.0), grad=True, device="NVIDIA B200",
                                   options={"compute_capability": 100})
    assert "mosaic_gpu" in text and not warned
    assert len(built) >= 3 and not any(built)  # forward, dQ and dK/dV on tcgen05, none emulated


@pytest.mark.parametrize("cc", [90, 100])
def test_dropout_lowers_for_cuda(cc):
    """Forward and backward with dropout lower for each arch (make test; the kernels run against
    the dense truth in test_dropout, make test-compile)."""
    from jax.sharding import AbstractDevice, AbstractMesh

    S = 256
    bm = flexjax.create_block_mask(masks.causal, None, None, S, S)

    def loss(q, k, v, key):
        out = flexjax.flex_attention(q, k, v, block_mask=bm, backend="mosaic_gpu", dropout_rate=0.1, dropout_rng=key,
                                     kernel_options={"target": "cuda", "compute_capability": cc})
        return out.astype(jnp.float32).sum()

    q = jax.ShapeDtypeStruct((1, S, 2, 64), jnp.bfloat16)
    mesh = AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                        abstract_device=AbstractDevice("NVIDIA GPU", 1, "cuda"))
    key = jax.random.PRNGKey(0)  # eagerly, outside the mesh: JAX >= 0.11 gives it Explicit axes, where eager ops fail
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, q, key).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 3


def test_backend_none_falls_past_mosaic_gpu_for_a_gather(monkeypatch):

    monkeypatch.setitem(backends._PLATFORM_ORDER, jax.default_backend(), backends.platform_backends("cuda"))
    text, warned = _lower_for_h100(mods.relative_bias(jnp.zeros((2, 511))))
    assert any("'mosaic_gpu'" in w and "both q_idx and kv_idx" in w for w in warned), warned


@pytest.mark.mosaic_gpu
def test_sinks_and_auxiliary_outputs():
    """Sinks and return_aux go through the library's shared epilogue: out, lse, max_scores,
    min_scores (its max_scores of the negated scores) and the sinks' gradient as the reference gives them
    (with a score_mod, soft-cap, that conformance's max / min test does not take)."""
    q, k, v = _qkv()
    S = q.shape[1]
    sinks = jnp.asarray([0.5, -1.0])
    bm = flexjax.create_block_mask(masks.causal, None, None, S, S, block_size=64)
    aux = flexjax.AuxRequest(lse=True, max_scores=True, min_scores=True)

    def run(backend, q, k, v, sinks):
        out, a = flexjax.flex_attention(q, k, v, score_mod=mods.soft_cap(5.0), block_mask=bm, sinks=sinks,
                                        return_aux=aux, backend=backend)
        return out, a

    def loss(sinks, backend, q, k, v):
        out, _ = run(backend, q, k, v, sinks)
        return jnp.sum(out.astype(jnp.float32) * jnp.linspace(-1, 1, q.shape[-1]))

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    (out, a), (ref, ra) = run("mosaic_gpu", q, k, v, sinks), run("reference", *f32, sinks)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=3e-2)
    np.testing.assert_allclose(np.asarray(a.lse), np.asarray(ra.lse), atol=2e-2)
    np.testing.assert_allclose(np.asarray(a.max_scores), np.asarray(ra.max_scores), atol=5e-2)
    np.testing.assert_allclose(np.asarray(a.min_scores), np.asarray(ra.min_scores), atol=5e-2)
    g = jax.grad(loss)(sinks, "mosaic_gpu", q, k, v)
    gr = jax.grad(loss)(sinks, "reference", *f32)
    np.testing.assert_allclose(np.asarray(g), np.asarray(gr), atol=3e-2 * max(1.0, float(np.abs(gr).max())))


def test_kernels_pin_lane_semantics(monkeypatch):
    """The kernels are written for (and compiled and checked with) Lane lowering semantics; JAX 0.11 made
    Warpgroup the default, so every kernel passes Lane itself."""
    from jax.experimental.pallas import mosaic_gpu as plgpu


    monkeypatch.setitem(backends._PLATFORM_ORDER, jax.default_backend(), backends.platform_backends("cuda"))
    seen, kernel = [], plgpu.kernel
    monkeypatch.setattr(plgpu, "kernel", lambda *a, **kw: seen.append(kw.get("compiler_params")) or kernel(*a, **kw))
    jax.clear_caches()  # kernels an earlier test in this process traced would not be built again
    _lower_for_h100(mods.soft_cap(17.25), grad=True)
    assert len(seen) >= 3, seen  # forward, dQ, dK/dV
    assert all(p is not None and p.lowering_semantics == plgpu.LoweringSemantics.Lane for p in seen), seen


@pytest.mark.parametrize("score", ["soft_cap", "alibi"])
def test_calls_served_by_mosaic_gpu_never_reach_pallas_triton(monkeypatch, score):
    """Pallas' Triton lowering is deprecated from JAX 0.11 (a warning per kernel): a call that mosaic_gpu
    serves with backend=None lowers no Pallas-Triton kernel and raises no such warning."""
    import warnings

    from jax.experimental.pallas import triton as pl_triton


    monkeypatch.setitem(backends._PLATFORM_ORDER, jax.default_backend(), backends.platform_backends("cuda"))
    mod = mods.soft_cap(20.0) if score == "soft_cap" else mods.alibi(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text, _ = _lower_for_h100(mod, grad=True)
    assert "mosaic_gpu" in text
    assert getattr(pl_triton, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton") not in text
    assert not [w for w in caught if "Pallas Triton" in str(w.message)]
