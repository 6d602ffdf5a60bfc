"""flexjax.paged: attention through a page table equals attention on the gathered cache."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import assert_close
from targets import budgeted

import flexjax
from flexjax import masks, paged

B, HQ, HKV, D, PS, MAX_PAGES = 3, 4, 2, 16, 32, 6
KV_LEN = PS * MAX_PAGES


def _setup(sq, seed=0):
    lengths = np.array([150, 37, 96])
    table = paged.page_table_for(lengths, PS, MAX_PAGES, num_pages=20, seed=seed)
    ks = jax.random.split(jax.random.key(seed), 5)
    k_pages = jax.random.normal(ks[0], (20, PS, HKV, D))
    v_pages = jax.random.normal(ks[1], (20, PS, HKV, D))
    q = jax.random.normal(ks[2], (B, sq, HQ, D))
    do = jax.random.normal(ks[3], (B, sq, HQ, D))
    slopes = jax.random.uniform(ks[4], (HQ,), minval=0.01, maxval=0.2)
    return jnp.asarray(lengths, jnp.int32), jnp.asarray(table), k_pages, v_pages, q, do, slopes


def _alibi(slopes):
    return lambda s, b, h, q_idx, kv_idx: s - slopes[h] * jnp.abs(q_idx - kv_idx).astype(s.dtype)


def _no_cpu_kernel(monkeypatch):
    from flexjax.backends.xla import cpu

    monkeypatch.setattr(cpu, "reason", lambda *a, **k: "switched off by the test")


@pytest.mark.parametrize("sq,xla_path", [(1, "kernel"), (1, "xla_ops"),
                                         pytest.param(4, "kernel", marks=pytest.mark.slow),
                                         pytest.param(4, "xla_ops", marks=pytest.mark.slow)])
def test_paged_matches_gathered_cache(sq, xla_path, monkeypatch):
    """Random page table, ragged lengths, GQA, a sliding window and ALiBi in logical
    positions: forward, lse and the gradients of q, the pools and the slopes. The xla
    backend's forward is the C++ kernel reading pages in place where it runs ("kernel"),
    or its XLA decode path ("xla_ops")."""
    from flexjax.backends.xla import cpu

    if xla_path == "xla_ops":
        _no_cpu_kernel(monkeypatch)
    elif not cpu.usable():
        pytest.skip("no AVX-512 CPU or no C++ compiler")
    lengths, table, k_pages, v_pages, q, do, slopes = _setup(sq)
    # Queries sit at the end of each sequence (bottom-right), window 64 in logical positions.
    def window(b, h, q_idx, kv_idx):
        return kv_idx >= q_idx + lengths[b] - sq - 64

    mask = flexjax.and_masks(masks.causal_bottom_right(sq, lengths), window)
    bm = flexjax.create_block_mask(mask, B, None, sq, KV_LEN, block_size=(16, 32))

    def paged_loss(q, k_pages, v_pages, slopes, backend):
        out, lse = paged.flex_attention(q, k_pages, v_pages, table, lengths, _alibi(slopes), bm, return_lse=True,
                                        backend=backend)
        return jnp.sum(out * do) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

    def ref_loss(q, k_pages, v_pages, slopes):
        k, v = paged.gather(k_pages, table), paged.gather(v_pages, table)
        full = flexjax.create_block_mask(flexjax.and_masks(mask, masks.padding(lengths)), B, None, sq, KV_LEN,
                                         block_size=(16, 32))
        out, lse = flexjax.flex_attention(q, k, v, _alibi(slopes), full, return_lse=True, backend="reference")
        return jnp.sum(out * do) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))  # noqa: E731
    (_, truth), g_truth = grad(ref_loss)(q, k_pages, v_pages, slopes)
    xla_grad = grad(functools.partial(paged_loss, backend="xla"))
    hlo = xla_grad.lower(q, k_pages, v_pages, slopes).as_text()
    assert ("flexjax_cpu_forward" in hlo) == (xla_path == "kernel")
    (_, got), g_got = xla_grad(q, k_pages, v_pages, slopes)
    assert_close(f"paged xla ({xla_path})", (got, g_got), (truth, g_truth), (truth, g_truth), jnp.float32)
    if xla_path == "xla_ops":
        return
    # pallas: gradients in the slow case (the backward is pallas' usual one on the
    # gathered cache), the forward here.
    if sq == 1:
        got = jax.jit(lambda *a: paged_loss(*a, backend="pallas")[1])(q, k_pages, v_pages, slopes)
        assert_close("paged pallas", got, truth, truth, jnp.float32)
    else:
        (_, got), g_got = grad(functools.partial(paged_loss, backend="pallas"))(q, k_pages, v_pages, slopes)
        assert_close("paged pallas", (got, g_got), (truth, g_truth), (truth, g_truth), jnp.float32)


# xla in make test-extra, the others in make test-all (make test's budget): sinks and aux go through the
# shared epilogue.
@pytest.mark.parametrize("target", budgeted(lambda t: t.paged, extra=("xla",)))
def test_sinks_and_aux_lse(target):
    """Attention sinks and AuxRequest(lse=True) through the page table: forward, lse and the
    gradients of q, the pools and the sinks equal flex_attention on the gathered cache, on
    both paged backends (pallas in interpret mode); max_scores equals flex_attention's."""
    lengths, table, k_pages, v_pages, q, do, _ = _setup(1, seed=2)
    sinks = jnp.linspace(-1.0, 1.0, HQ)
    bm = flexjax.create_block_mask(masks.causal_bottom_right(1, lengths), B, None, 1, KV_LEN, block_size=(16, 32))

    def paged_loss(q, k_pages, v_pages, sinks):
        out, aux = paged.flex_attention(q, k_pages, v_pages, table, lengths, block_mask=bm, sinks=sinks,
                                        return_aux=flexjax.AuxRequest(lse=True), **target.kw())
        return jnp.sum(out * do) + 0.1 * jnp.sum(aux.lse), (out, aux.lse)

    def ref_loss(q, k_pages, v_pages, sinks):
        full = flexjax.create_block_mask(flexjax.and_masks(masks.causal_bottom_right(1, lengths),
                                                           masks.padding(lengths)), B, None, 1, KV_LEN,
                                         block_size=(16, 32))
        out, lse = flexjax.flex_attention(q, paged.gather(k_pages, table), paged.gather(v_pages, table),
                                          block_mask=full, sinks=sinks, return_lse=True, backend="reference")
        return jnp.sum(out * do) + 0.1 * jnp.sum(lse), (out, lse)

    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))  # noqa: E731
    (_, want), g_want = grad(ref_loss)(q, k_pages, v_pages, sinks)
    (_, got), g_got = grad(paged_loss)(q, k_pages, v_pages, sinks)
    assert_close("paged sinks", (got, g_got), (want, g_want), (want, g_want), jnp.float32)
    # max_scores: each row's max over the sequence's valid keys, as flex_attention's on the gathered cache.
    both = flexjax.AuxRequest(lse=True, max_scores=True)
    _, aux = paged.flex_attention(q, k_pages, v_pages, table, lengths, block_mask=bm, return_aux=both,
                                  **target.kw())
    full = flexjax.create_block_mask(flexjax.and_masks(masks.causal_bottom_right(1, lengths), masks.padding(lengths)),
                                     B, None, 1, KV_LEN, block_size=(16, 32))
    _, want_aux = flexjax.flex_attention(q, paged.gather(k_pages, table), paged.gather(v_pages, table),
                                         block_mask=full, return_aux=both, backend="reference")
    assert aux.max_scores.shape == (B, HQ, 1) and aux.max_scores.dtype == jnp.float32
    np.testing.assert_allclose(aux.max_scores, want_aux.max_scores, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(aux.lse, want_aux.lse, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="sinks must have shape"):
        paged.flex_attention(q, k_pages, v_pages, table, lengths, block_mask=bm, sinks=jnp.zeros(HQ + 1))


@pytest.mark.parametrize("target", budgeted(lambda t: t.paged, default=("pallas",), extra=("xla",)))
def test_jvp_matches_the_gathered_cache(target):
    """jax.jvp through the page table (q, the pools and a captured ALiBi table perturbed) equals
    jax.jvp of flex_attention on the gathered cache; out and lse tangents, on both paged
    backends (pallas in interpret mode)."""
    lengths, table, k_pages, v_pages, q, _, slopes = _setup(1, seed=3)
    bm = flexjax.create_block_mask(masks.causal_bottom_right(1, lengths), B, None, 1, KV_LEN, block_size=(16, 32))
    full = flexjax.create_block_mask(flexjax.and_masks(masks.causal_bottom_right(1, lengths), masks.padding(lengths)),
                                     B, None, 1, KV_LEN, block_size=(16, 32))

    def paged_f(q, k_pages, v_pages, slopes):
        return paged.flex_attention(q, k_pages, v_pages, table, lengths, _alibi(slopes), bm, return_lse=True,
                                    **target.kw())

    def ref_f(q, k_pages, v_pages, slopes):
        return flexjax.flex_attention(q, paged.gather(k_pages, table), paged.gather(v_pages, table), _alibi(slopes),
                                      full, return_lse=True, backend="reference")

    ks = jax.random.split(jax.random.key(7), 4)
    primals = (q, k_pages, v_pages, slopes)
    tangents = tuple(jax.random.normal(kk, x.shape, x.dtype) for kk, x in zip(ks, primals))
    got = jax.jit(lambda p, t: jax.jvp(paged_f, p, t))(primals, tangents)
    want = jax.jit(lambda p, t: jax.jvp(ref_f, p, t))(primals, tangents)
    finite = jax.tree.map(lambda x: jnp.where(jnp.isfinite(x), x, 0.0), (got, want))
    assert_close("paged jvp", finite[0], finite[1], finite[1], jnp.float32)


def test_write():
    """write() puts new tokens where the gathered logical cache has them."""
    lengths, table, k_pages, v_pages, _, _, _ = _setup(1, seed=1)
    k_new = jnp.ones((B, 2, HKV, D))
    pos = lengths - 2
    k2, v2 = jax.jit(paged.write)(k_pages, v_pages, table, pos, k_new, 2 * k_new)
    k_log, v_log = paged.gather(k2, table), paged.gather(v2, table)
    for b in range(B):
        p = int(pos[b])
        np.testing.assert_array_equal(np.asarray(k_log[b, p:p + 2]), 1.0)
        np.testing.assert_array_equal(np.asarray(v_log[b, p:p + 2]), 2.0)
    # A table of distinct pages: every other position stays as it was; tokens past the
    # capacity (or before 0) are dropped, never written into another slot; a scalar position
    # serves every sequence.
    table = jnp.asarray(np.random.default_rng(0).permutation(k_pages.shape[0])[:B * MAX_PAGES].reshape(B, -1),
                        jnp.int32)
    k2, v2 = jax.jit(paged.write)(k_pages, v_pages, table, pos, k_new, 2 * k_new)
    k_old, v_old = paged.gather(k_pages, table), paged.gather(v_pages, table)
    for b in range(B):
        p = int(pos[b])
        for new, old in ((paged.gather(k2, table), k_old), (paged.gather(v2, table), v_old)):
            np.testing.assert_array_equal(np.asarray(new[b, :p]), np.asarray(old[b, :p]))
            np.testing.assert_array_equal(np.asarray(new[b, p + 2:]), np.asarray(old[b, p + 2:]))
    cap = table.shape[1] * k_pages.shape[1]
    edge = jnp.array([cap - 1, -1] + [0] * (B - 2), jnp.int32)
    k3, v3 = jax.jit(paged.write)(k_pages, v_pages, table, edge, k_new, 2 * k_new)
    k_log = np.asarray(paged.gather(k3, table))
    np.testing.assert_array_equal(k_log[0, cap - 1], 1.0)
    np.testing.assert_array_equal(k_log[0, :cap - 1], np.asarray(k_old[0, :cap - 1]))
    np.testing.assert_array_equal(k_log[1, 0], 1.0)
    np.testing.assert_array_equal(k_log[1, 1:], np.asarray(k_old[1, 1:]))
    np.testing.assert_array_equal(np.asarray(k3)[np.setdiff1d(np.arange(k_pages.shape[0]), np.asarray(table))],
                                  np.asarray(k_pages)[np.setdiff1d(np.arange(k_pages.shape[0]), np.asarray(table))])
    k4, _ = paged.write(k_pages, v_pages, table, 3, k_new, k_new)
    np.testing.assert_array_equal(np.asarray(paged.gather(k4, table))[:, 3:5], 1.0)
    # An unassigned logical page (a negative entry) takes no write: no pool page changes.
    k5, _ = paged.write(k_pages, v_pages, jnp.full_like(table, -1), pos, k_new, k_new)
    np.testing.assert_array_equal(np.asarray(k5), np.asarray(k_pages))
    with pytest.raises(ValueError, match="positions"):
        paged.write(k_pages, v_pages, table, jnp.zeros(B + 1, jnp.int32), k_new, k_new)
    with pytest.raises(ValueError, match="same B and T"):
        paged.write(k_pages, v_pages, table, pos, k_new, k_new[:, :1])


def test_errors():
    lengths, table, k_pages, v_pages, q, _, _ = _setup(1)
    bm = flexjax.create_block_mask(None, None, None, 1, KV_LEN, block_size=(16, 64))
    with pytest.raises(ValueError, match="page_size"):
        paged.flex_attention(q, k_pages, v_pages, table, lengths, block_mask=bm)
    with pytest.raises(ValueError, match="KV_LEN"):
        paged.flex_attention(q, k_pages, v_pages, table, lengths,
                             block_mask=flexjax.create_block_mask(None, None, None, 1, 100))
    with pytest.raises(ValueError, match="kv_lengths"):
        paged.flex_attention(q, k_pages, v_pages, table, lengths[:2])
    with pytest.raises(NotImplementedError, match="paths on the xla, pallas, triton backends"):
        paged.flex_attention(q, k_pages, v_pages, table, lengths, backend="mosaic_gpu")
    with pytest.raises(NotImplementedError, match="no dropout"):
        paged.flex_attention(q, k_pages, v_pages, table, lengths, dropout_rate=0.1, dropout_rng=jax.random.key(0))
    with pytest.raises(ValueError, match="dropout_rate"):
        paged.flex_attention(q, k_pages, v_pages, table, lengths, dropout_rate=1.5)
    out = paged.flex_attention(q, k_pages, v_pages, table, lengths, dropout_rate=0.0)  # rate 0: as without
    np.testing.assert_array_equal(np.asarray(out), np.asarray(paged.flex_attention(q, k_pages, v_pages, table,
                                                                                    lengths)))


def _lowered_decode_steps(target: str, device: str, D: int, block: int, L: int, score_mod=None):
    """The HLO text of a contiguous and a paged decode step (bf16, B=2, Hq=4, Hkv=2, pages of
    ``block``) lowered for ``target`` from this CPU host."""
    from jax.sharding import AbstractDevice, AbstractMesh

    bm = flexjax.create_block_mask(masks.causal, None, None, L, L, block_size=block)
    opts = {"target": target}

    def contiguous(q, k, v, pos):
        return flexjax.flex_attention(q, k, v, score_mod, paged.decode_block_mask(bm, pos), backend="pallas",
                                      kernel_options=opts)

    def paged_step(q, kp, vp, table, pos):
        return paged.flex_attention(q, kp, vp, table, pos + 1, score_mod, paged.decode_block_mask(bm, pos),
                                    backend="pallas", kernel_options=opts)

    q = jax.ShapeDtypeStruct((2, 1, 4, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, L, 2, D), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((8, block, 2, D), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((2,), jnp.int32)
    table = jax.ShapeDtypeStruct((2, L // block), jnp.int32)
    mesh = AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                        abstract_device=AbstractDevice(device, 1, target))
    with jax.sharding.use_abstract_mesh(mesh):
        return [jax.jit(f).trace(*args).lower(lowering_platforms=(target,)).as_text()
                for f, args in ((contiguous, (q, k, k, pos)), (paged_step, (q, pages, pages, table, pos)))]


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_pallas_decode_kernels_lower_for_cuda(monkeypatch):
    """The decode and paged kernels lower through Triton from this CPU host (page table as an int32 ref),
    also with an ALiBi score_mod, whose heads are packed in the tile rows (each row's head a
    (rows, 1) tile, a per-head table read by it)."""
    from flexjax.backends.pallas import _decode as pallas_decode

    packed = []
    real = pallas_decode._packs
    monkeypatch.setattr(pallas_decode, "_packs", lambda *a: packed.append(real(*a)) or packed[-1])
    slopes = jnp.linspace(0.1, 0.8, 4)
    for score in (None, _alibi(slopes)):
        for text in _lowered_decode_steps("cuda", "NVIDIA H100 80GB HBM3", D=64, block=64, L=256, score_mod=score):
            assert "flexjax_decode" in text
    assert packed == [True] * 4


# -- the TPU decode kernel (Mosaic template, interpret mode here) ------------------------------

TPU_INTERPRET = {"target": "tpu", "interpret": True}


@pytest.fixture
def tpu_decode_calls(monkeypatch):
    """The packing (G: heads in one tile, 1: one program per query head) of each TPU decode kernel call."""
    from flexjax.backends.pallas import _decode as pallas_decode

    calls = []
    real = pallas_decode._tpu_call

    def spy(*args, **kwargs):
        calls.append(args[10])
        return real(*args, **kwargs)

    monkeypatch.setattr(pallas_decode, "_tpu_call", spy)
    return calls


# make test-all (make test's budget); tests_compile/decode_suite.py compiles the kernel for v5e in CI.
@pytest.mark.slow
@pytest.mark.parametrize("sq", [1, 3])
def test_tpu_decode_kernel_matches_reference(sq, tpu_decode_calls):
    """The TPU kernel (tiles copied by DMA, double-buffered) on a contiguous cache and on
    pages: GQA heads packed (soft-cap), one program per head (ALiBi reads h), a captured
    bias along kv_idx, a sliding window in logical positions; out and lse against the
    reference on the gathered cache."""
    from flexjax import mods

    Bt, Hq, Hkv, Dt, ps, max_pages = 2, 4, 2, 128, 128, 4
    L = ps * max_pages
    ks = jax.random.split(jax.random.key(3), 5)
    lengths = jnp.array([400, 70], jnp.int32)
    table = jnp.asarray(paged.page_table_for(np.asarray(lengths), ps, max_pages, num_pages=9, seed=1))
    k_pages, v_pages = (jax.random.normal(kk, (9, ps, Hkv, Dt)) for kk in ks[:2])
    q = jax.random.normal(ks[2], (Bt, sq, Hq, Dt))
    bias = jax.random.normal(ks[3], (L,))
    slopes = jax.random.uniform(ks[4], (Hq,), minval=0.01, maxval=0.2)
    k, v = paged.gather(k_pages, table), paged.gather(v_pages, table)

    def window(b, h, q_idx, kv_idx):
        return kv_idx >= q_idx + lengths[b] - sq - 300

    # kv blocks of 32: ten tiles in the first sequence's window, so each of a row's four
    # chunks copies two or three (the second by the double buffer's other slot).
    mask = flexjax.and_masks(masks.causal_bottom_right(sq, lengths), window)
    bm = flexjax.create_block_mask(mask, Bt, None, sq, L, block_size=(128, 32))
    full = flexjax.create_block_mask(flexjax.and_masks(mask, masks.padding(lengths)), Bt, None, sq, L,
                                     block_size=(128, 32))
    cases = [("soft-cap", mods.soft_cap(5.0), Hq // Hkv), ("alibi", _alibi(slopes), 1),
             ("kv bias", lambda s, b, h, q_idx, kv_idx: s + bias[kv_idx], Hq // Hkv)]
    for name, score, pack in cases:
        truth = flexjax.flex_attention(q, k, v, score, full, return_lse=True, backend="reference")
        tpu_decode_calls.clear()
        got = jax.jit(lambda q, k, v: flexjax.flex_attention(q, k, v, score, full, return_lse=True, backend="pallas",
                                                             kernel_options=TPU_INTERPRET))(q, k, v)
        assert_close(f"tpu decode {name}", got, truth, truth, jnp.float32)
        got = jax.jit(lambda q, kp, vp: paged.flex_attention(q, kp, vp, table, lengths, score, bm, return_lse=True,
                                                             backend="pallas", kernel_options=TPU_INTERPRET)
                      )(q, k_pages, v_pages)
        assert_close(f"tpu paged {name}", got, truth, truth, jnp.float32)
        assert tpu_decode_calls == [pack, pack], name


def test_tpu_decode_kernel_gate(tpu_decode_calls):
    """Head dims the kernel cannot slice by DMA (not multiples of 128): a contiguous cache
    takes the TPU's tiled kernels (same result), flexjax.paged raises and says why."""
    lengths, table, k_pages, v_pages, q, _, _ = _setup(1)
    bm = flexjax.create_block_mask(masks.causal_bottom_right(1, lengths), B, None, 1, KV_LEN, block_size=(16, 32))
    k = paged.gather(k_pages, table)
    truth = flexjax.flex_attention(q, k, paged.gather(v_pages, table), block_mask=bm, backend="reference")
    got = flexjax.flex_attention(q, k, paged.gather(v_pages, table), block_mask=bm, backend="pallas",
                                 kernel_options=TPU_INTERPRET)
    assert_close("tpu tiled kernels (D=16)", got, truth, truth, jnp.float32)
    assert tpu_decode_calls == []
    with pytest.raises(NotImplementedError, match="multiples of 128, got D=16"):
        paged.flex_attention(q, k_pages, v_pages, table, lengths, block_mask=bm, backend="pallas",
                             kernel_options=TPU_INTERPRET)


def test_tpu_decode_kernels_lower_for_tpu(tpu_decode_calls):
    """The decode and paged kernels lower to Mosaic from this CPU host (tests_compile/decode_suite.py
    compiles them with libtpu for TPU v5e)."""
    for text in _lowered_decode_steps("tpu", "TPU v5 lite", D=128, block=128, L=512):
        assert "tpu_custom_call" in text and "flexjax_decode" in text
    assert tpu_decode_calls == [2, 2]


@pytest.mark.slow
def test_tpu_decode_gradients(tpu_decode_calls):
    """jax.grad through the TPU decode kernel's forward, paged and contiguous: the backward
    is the TPU template's (on the gathered cache for pages), interpret mode."""
    from flexjax import mods

    lengths = jnp.array([400, 70], jnp.int32)
    table = jnp.asarray(paged.page_table_for(np.asarray(lengths), 128, 4, num_pages=9, seed=1))
    ks = jax.random.split(jax.random.key(4), 3)
    k_pages, v_pages = (jax.random.normal(kk, (9, 128, 2, 128)) for kk in ks[:2])
    q = jax.random.normal(ks[2], (2, 1, 4, 128))
    mask = masks.causal_bottom_right(1, lengths)
    bm = flexjax.create_block_mask(mask, 2, None, 1, 512)
    full = flexjax.create_block_mask(flexjax.and_masks(mask, masks.padding(lengths)), 2, None, 1, 512)

    def loss(q, kp, vp):
        return jnp.sum(paged.flex_attention(q, kp, vp, table, lengths, mods.soft_cap(5.0), bm, backend="pallas",
                                            kernel_options=TPU_INTERPRET) ** 2)

    def ref(q, kp, vp):
        out = flexjax.flex_attention(q, paged.gather(kp, table), paged.gather(vp, table), mods.soft_cap(5.0), full,
                                     backend="reference")
        return jnp.sum(out ** 2)

    def contiguous_loss(q, k, v):
        out = flexjax.flex_attention(q, k, v, mods.soft_cap(5.0), full, backend="pallas",
                                     kernel_options=TPU_INTERPRET)
        return jnp.sum(out ** 2)

    got = jax.grad(loss, argnums=(0, 1, 2))(q, k_pages, v_pages)
    truth = jax.grad(ref, argnums=(0, 1, 2))(q, k_pages, v_pages)
    assert_close("tpu paged gradients", got, truth, truth, jnp.float32)
    assert tpu_decode_calls and set(tpu_decode_calls) == {2}
    tpu_decode_calls.clear()
    k, v = paged.gather(k_pages, table), paged.gather(v_pages, table)
    got = jax.grad(contiguous_loss, argnums=(0, 1, 2))(q, k, v)
    truth = jax.grad(lambda q, k, v: jnp.sum(flexjax.flex_attention(q, k, v, mods.soft_cap(5.0), full,
                                                                    backend="reference") ** 2),
                     argnums=(0, 1, 2))(q, k, v)
    assert_close("tpu contiguous gradients", got, truth, truth, jnp.float32)
    assert tpu_decode_calls and set(tpu_decode_calls) == {2}


@pytest.mark.ci_extra  # (make test's 5-minute budget: about 4 s here; make test reached 5:12)
def test_length_lists_without_sorts():
    """One q block a row (decoding): the kv lengths cut the lists without sorting them where
    they are ascending (prefixes, and the full tile across the length joining the partial
    ones), and through the sort where they are not (a BlockMask with its rows' lists
    reversed). Every case's lists hold the same tiles as the sorted states' (lengths inside a
    full tile, inside a partial one, on a tile edge, 0, the whole cache; a batch-1 mask
    broadcast over B), and the transposed lists equal them; the step's sort lies only in the
    unsorted lists' branch. A paged call over the reversed lists equals one over the
    sorted."""
    from flexjax._block_mask import _states_from_lists, lists_from_states

    L, bkv, B = 1024, 64, 6
    lengths = jnp.array([1000, 960, 700, 0, 1024, 290], jnp.int32)
    nkv = L // bkv
    tiles = np.zeros((1, 1, 1, nkv), np.int8)  # full tiles 0-3 and 10-15, partial 4 and 9
    tiles[..., :4], tiles[..., 10:], tiles[..., [4, 9]] = 2, 2, 1
    bm = flexjax.BlockMask.from_states(jnp.asarray(tiles), (), seq_lengths=(1, L), block_size=(64, bkv), mask=None)

    def reverse(n, idx):  # each row's first n entries in the opposite order
        w = idx.shape[-1]
        t = jnp.arange(w)
        return jnp.where(t < n[..., None], jnp.take_along_axis(idx, jnp.clip(n[..., None] - 1 - t, 0, w - 1), -1), idx)

    rev = flexjax.BlockMask(bm.kv_num_blocks, reverse(bm.kv_num_blocks, bm.kv_indices), bm.full_kv_num_blocks,
                            reverse(bm.full_kv_num_blocks, bm.full_kv_indices), bm.q_num_blocks, bm.q_indices,
                            bm.full_q_num_blocks, bm.full_q_indices, bm.mask_consts, seq_lengths=bm.seq_lengths,
                            block_size=bm.block_size, mask=bm.mask)

    def states(lists):
        kn, ki, fn, fi = lists[:4]
        return jnp.maximum(_states_from_lists(kn, ki, 1, nkv), _states_from_lists(fn, fi, 2, nkv))

    st = np.array(states((bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)))
    st = np.broadcast_to(st, (B,) + st.shape[1:]).copy()
    j = np.arange(nkv)
    n = np.asarray(lengths)[:, None, None, None]
    want = np.where(j * bkv >= n, 0, np.where((st == 2) & ((j + 1) * bkv > n), 1, st))
    want_lists = lists_from_states(jnp.asarray(want, jnp.int8))
    cut = jax.jit(lambda bm, lengths: tuple(paged._with_lengths(bm, lengths, B).tile_lists()))
    hlo = cut.lower(bm, lengths).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):].split("\n}\n")[0]
    assert " sort(" in hlo and " sort(" not in entry, "the sort is not confined to the unsorted lists' branch"
    for m, what in ((bm, "ascending"), (rev, "reversed")):
        got = cut(m, lengths)
        np.testing.assert_array_equal(np.asarray(states(got)), want, err_msg=what)
        for g, w, name in zip(got[4:], want_lists[4:], ("q_num", "q_idx", "full_q_num", "full_q_idx")):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{what} {name}")
    assert (int(bm.kv_num_blocks[0, 0, 0]), int(bm.full_kv_num_blocks[0, 0, 0])) == (2, 10)
    # (960: on a tile edge, 700 and 1000 inside full tiles, 290 inside a partial one)
    assert int(want_lists[0][0, 0, 0]) == 3 and int(want_lists[0][5, 0, 0]) == 1

    ps, Hkv, D = 128, 2, 32
    ks = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(ks[0], (B, 1, 4, D))
    k_pages, v_pages = (jax.random.normal(kk, (B * L // ps, ps, Hkv, D)) for kk in ks[1:])
    table = jnp.asarray(paged.page_table_for(np.full(B, L), ps, L // ps, seed=1))
    run = jax.jit(lambda bm: paged.flex_attention(q, k_pages, v_pages, table, lengths, block_mask=bm))
    a, b = run(bm), run(rev)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert bool(jnp.isfinite(a[lengths > 0]).all())


@pytest.mark.slow  # (make test's budget: test_ragged.py::test_serving_loop_one_compile reserves, writes and
# releases as sequences grow, join and leave)
def test_reserve_and_release_serve_growing_sequences():
    """Pages assigned on demand inside one jitted step (reserve, write, attend) while the
    sequences grow token by token; a finished sequence's pages are released and reused by
    the next; every step equals flex_attention on a contiguous cache of the same tokens, and
    a pool too small for a step says so (ok False, nothing assigned)."""
    ps, max_pages, num_pages, Bs = 8, 4, 7, 2
    cap = ps * max_pages
    bm = flexjax.create_block_mask(masks.causal, None, None, cap, cap, block_size=(16, 8))
    k_pages, v_pages = paged.allocate(num_pages, ps, HKV, D)
    table = jnp.full((Bs, max_pages), -1, jnp.int32)
    free = jnp.ones((num_pages,), bool)
    compiles = []

    @jax.jit
    def step(k_pages, v_pages, table, free, pos, q, k_new, v_new):
        compiles.append(1)
        table, free, ok = paged.reserve(table, free, pos + 1, ps)
        k_pages, v_pages = paged.write(k_pages, v_pages, table, pos, k_new, v_new)
        out = paged.flex_attention(q, k_pages, v_pages, table, pos + 1, block_mask=paged.decode_block_mask(bm, pos))
        return k_pages, v_pages, table, free, ok, out

    key = jax.random.key(3)
    k_log = np.zeros((Bs, cap, HKV, D), np.float32)
    v_log = np.zeros((Bs, cap, HKV, D), np.float32)
    pos = np.array([0, 5], np.int32)
    # Sequence 1 starts at position 5 (its first five keys: the zeros of a fresh page).
    for t in range(26):
        key, *ks = jax.random.split(key, 4)
        q = jax.random.normal(ks[0], (Bs, 1, HQ, D))
        k_new, v_new = jax.random.normal(ks[1], (Bs, HKV, D)), jax.random.normal(ks[2], (Bs, HKV, D))
        if t == 14:  # sequence 0 is done: its pages go back to the pool; a new one starts there
            table, free = jax.jit(paged.release)(table, free, jnp.array([True, False]))
            assert int(free.sum()) == num_pages - int((np.asarray(table) >= 0).sum())
            pos[0] = 0
            k_log[0] = v_log[0] = 0.0
        k_pages, v_pages, table, free, ok, out = step(k_pages, v_pages, table, free, jnp.asarray(pos), q, k_new,
                                                      v_new)
        assert bool(ok)
        tab = np.asarray(table)
        assigned = tab[tab >= 0]
        assert len(set(assigned.tolist())) == assigned.size  # no page serves two places
        assert not np.asarray(free)[assigned].any() and int(np.asarray(free).sum()) == num_pages - assigned.size
        k_log[np.arange(Bs), pos], v_log[np.arange(Bs), pos] = np.asarray(k_new), np.asarray(v_new)
        want = flexjax.flex_attention(q, jnp.asarray(k_log), jnp.asarray(v_log), backend="reference",
                                      block_mask=flexjax.create_block_mask(masks.causal_with_offset(jnp.asarray(pos)),
                                                                           Bs, None, 1, cap))
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)
        pos = pos + 1
    assert len(compiles) == 1
    # Sequence 1 (at 31 tokens) holds 4 pages, sequence 0 (12 tokens) 2: one page is free, so
    # growing sequence 0 to 25 tokens (2 more pages) cannot be served: ok False, nothing changes.
    t2, f2, ok = paged.reserve(table, free, jnp.array([25, 31]), ps)
    assert not bool(ok)
    np.testing.assert_array_equal(np.asarray(t2), np.asarray(table))
    np.testing.assert_array_equal(np.asarray(f2), np.asarray(free))
    _, _, ok = paged.reserve(table, free, jnp.array([20, 31]), ps)
    assert bool(ok)
    _, _, ok = paged.reserve(table, free, jnp.array([12, cap + 1]), ps)  # past the capacity
    assert not bool(ok)
    with pytest.raises(TypeError, match="free_pages"):
        paged.reserve(table, jnp.ones(num_pages, jnp.int32), 3, ps)
    with pytest.raises(ValueError, match="new_lengths"):
        paged.reserve(table, free, jnp.zeros(3, jnp.int32), ps)


@pytest.mark.ci_extra  # (make test's 5-minute budget: 4-8 s here; make test reached 5:05)
def test_paged_backward_reads_pages_through_the_table():
    """jax.grad of a paged call forms no logical cache: no value of its jaxpr (the backward's
    included) has an axis of max_pages * page_size positions; its gradients still equal those
    of flex_attention on the gathered cache."""
    lengths, table, k_pages, v_pages, q, do, slopes = _setup(2)
    table = jnp.pad(table, ((0, 0), (0, 31)))  # 37 logical pages: a capacity of 1184 positions
    cap = table.shape[1] * PS

    def loss(q, k_pages, v_pages, slopes):
        o = paged.flex_attention(q, k_pages, v_pages, table, lengths, _alibi(slopes))
        return jnp.sum(o * do)

    grad = jax.grad(loss, (0, 1, 2, 3))
    jaxpr = jax.make_jaxpr(grad)(q, k_pages, v_pages, slopes)

    def shapes(jx):
        for eqn in jx.eqns:
            for v in eqn.outvars:
                yield getattr(v.aval, "shape", ())
            for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else ():
                yield from shapes(sub)
            for p in eqn.params.values():
                inner = getattr(p, "jaxpr", p)
                if hasattr(inner, "eqns"):
                    yield from shapes(inner)

    assert not [s for s in shapes(jaxpr.jaxpr) if cap in s]
    got = grad(q, k_pages, v_pages, slopes)

    def loss_gathered(q, k_pages, v_pages, slopes):
        K, V = paged.gather(k_pages, table), paged.gather(v_pages, table)
        mask = flexjax.create_block_mask(masks.padding(lengths), B, None, q.shape[1], cap)
        o = flexjax.flex_attention(q, K, V, _alibi(slopes), block_mask=mask, backend="reference")
        return jnp.sum(o * do)

    want = jax.grad(loss_gathered, (0, 1, 2, 3))(q, k_pages, v_pages, slopes)
    assert_close("grads", got, want, want, jnp.float32)
