"""The decode path (few queries: GQA rows packed, KV chunks merged by lse) and the cache idiom."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import assert_close

import flexjax
from flexjax import masks
from flexjax.backends.xla import _decode

B, HQ, HKV, D, SKV = 2, 4, 2, 16, 200


def _inputs(sq, skv=SKV, dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (B, sq, HQ, D)).astype(dtype)
    k = jax.random.normal(ks[1], (B, skv, HKV, D)).astype(dtype)
    v = jax.random.normal(ks[2], (B, skv, HKV, D)).astype(dtype)
    do = jax.random.normal(ks[3], (B, sq, HQ, D)).astype(dtype)
    tab = jax.random.normal(ks[4], (HQ,))
    return q, k, v, do, tab


def _score(tab):
    # A captured float table (its gradient is checked too), ALiBi-like.
    return lambda s, b, h, q_idx, kv_idx: s + 0.05 * tab[h] * (kv_idx - q_idx).astype(s.dtype)


# The xla backend's decode path in XLA ops (on AVX-512 CPUs its calls otherwise take the
# C++ kernel's packed decode tiles, which tests/test_cpu_kernel.py checks).
XLA_DECODE = {"cpu_kernel": False}


def _loss_and_grads(bm, backend, q, k, v, do, tab, kernel_options=None):
    def loss(q, k, v, tab):
        out, lse = flexjax.flex_attention(q, k, v, _score(tab), bm, return_lse=True, backend=backend,
                                          kernel_options=kernel_options)
        return jnp.sum(out * do) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

    (_, aux), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, tab)
    return aux, grads


@pytest.fixture
def decode_calls(monkeypatch):
    """The backends' calls of their decode paths, by backend."""
    from flexjax.backends.pallas import _decode as pallas_decode

    calls = []
    for name, module in (("xla", _decode), ("pallas", pallas_decode)):
        real = module.forward_with_residuals

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, "forward_with_residuals", spy)
    return calls


# (make test's budget: sq 3 in make test-extra; the others in make test-all.)
@pytest.mark.parametrize("sq", [pytest.param(1, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.ci_extra),
                                pytest.param(17, marks=pytest.mark.slow)])
def test_decode_path_matches_reference(sq, decode_calls):
    """GQA, ragged per-batch lengths, a captured-table score_mod: forward and gradients,
    xla and pallas (interpret mode)."""
    q, k, v, do, tab = _inputs(sq)
    lengths = jnp.array([SKV - 5, 37], jnp.int32)
    mask = flexjax.and_masks(masks.padding(lengths), masks.causal_bottom_right(sq, lengths))
    bm = flexjax.create_block_mask(mask, B, None, sq, SKV, block_size=(16 if sq > 16 else 32, 32))
    truth = _loss_and_grads(bm, "reference", q, k, v, do, tab)
    for opts in (None, XLA_DECODE):
        got = _loss_and_grads(bm, "xla", q, k, v, do, tab, opts)
        assert_close(f"xla decode sq={sq} {opts}", got, truth, truth, jnp.float32)
    # The pallas backward is its usual one (on the decode kernel's residuals): gradients
    # in the slow cases, the forward here, to keep the default suite short.
    if sq == 3:
        got = jax.jit(lambda q, k, v: flexjax.flex_attention(q, k, v, _score(tab), bm, return_lse=True,
                                                             backend="pallas"))(q, k, v)
        truth = truth[0]
    else:
        got = _loss_and_grads(bm, "pallas", q, k, v, do, tab)
    assert_close(f"pallas decode sq={sq}", got, truth, truth, jnp.float32)
    assert set(decode_calls) == {"xla", "pallas"}, f"decode paths taken: {decode_calls}"


@pytest.mark.slow
def test_decode_path_per_head_mask_and_q_blocks(decode_calls):
    """Lists that differ per query head and more than one q block are united exactly."""
    sq = 5
    q, k, v, do, tab = _inputs(sq, skv=96)
    window = jnp.array([7, 30, 50, 90], jnp.int32)

    def per_head(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + 90) & (kv_idx >= q_idx + 90 - window[h])

    bm = flexjax.create_block_mask(per_head, None, HQ, sq, 96, block_size=(4, 16))
    truth = _loss_and_grads(bm, "reference", q, k, v, do, tab)
    for backend in ("xla", "pallas"):
        got = _loss_and_grads(bm, backend, q, k, v, do, tab, XLA_DECODE if backend == "xla" else None)
        assert backend in decode_calls
        assert_close(f"{backend} per-head decode", got, truth, truth, jnp.float32)


@pytest.mark.slow
def test_decode_bfloat16():
    q, k, v, do, tab = _inputs(1, dtype=jnp.bfloat16)
    bm = flexjax.create_block_mask(masks.causal_bottom_right(1, SKV), None, None, 1, SKV, block_size=64)
    got = flexjax.flex_attention(q, k, v, block_mask=bm, backend="xla")
    truth = flexjax.flex_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                   block_mask=bm, backend="reference")
    ref16 = flexjax.flex_attention(q, k, v, block_mask=bm, backend="reference")
    assert_close("bf16 decode", got, truth, ref16, jnp.bfloat16)


# (make test's budget: sq 1 in make test-extra, sq 3 in make test-all.)
@pytest.mark.parametrize("sq", [pytest.param(1, marks=pytest.mark.ci_extra), pytest.param(3, marks=pytest.mark.slow)])
def test_decode_block_mask_matches_offset_mask(sq):
    """decode_block_mask(bm, positions, q_len) == the mask built for those positions directly
    (q_len = 1 gathers each sequence's row as it is; q_len = 3 unites the rows its queries
    fall in), a per-head mask too; forward, and at q_len = 1 gradients (the backward walks
    the transposed lists)."""
    L = 256
    window = jnp.array([7, 30, 50, 200], jnp.int32)

    def per_head(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx >= q_idx - window[h])

    pos = jnp.array([70, 191], jnp.int32)  # 191 + 2 crosses a q-block boundary
    q, k, v, do, _ = _inputs(sq, skv=L)
    for mask, H in ((masks.causal, None), (per_head, HQ)):
        bm_full = flexjax.create_block_mask(mask, None, H, L, L, block_size=32)
        step_bm = jax.jit(lambda p: flexjax.paged.decode_block_mask(bm_full, p, sq))(pos)
        assert step_bm.shape == (B, H or 1, sq, L)
        shifted = lambda b, h, q_idx, kv_idx: mask(b, h, q_idx + pos[b], kv_idx)  # noqa: E731
        direct = flexjax.create_block_mask(shifted, B, H, sq, L, block_size=32)

        def loss(q, k, v, bm, backend):
            return jnp.sum(flexjax.flex_attention(q, k, v, block_mask=bm, backend=backend) * do)

        got = flexjax.flex_attention(q, k, v, block_mask=step_bm, backend="xla")
        truth = flexjax.flex_attention(q, k, v, block_mask=direct, backend="reference")
        assert_close(f"decode_block_mask sq={sq} H={H}", got, truth, truth, jnp.float32)
        if sq == 1:
            got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, step_bm, "xla")
            truth = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, direct, "reference")
            assert_close(f"decode_block_mask grads H={H}", got, truth, truth, jnp.float32)
    # Tiles past the position are absent: the causal row of batch 0 has blocks 0..2 only.
    bm_full = flexjax.create_block_mask(masks.causal, None, None, L, L, block_size=32)
    dense = np.asarray(flexjax.paged.decode_block_mask(bm_full, pos, sq).to_dense())
    assert dense[0, 0, 0].sum() == 3 and dense[1, 0, 0].sum() == (6 if sq == 1 else 7)


def test_getitem_rows_traced():
    """bm[:, :, row] with a traced row: the row's tiles, mask_mod shifted by row * block_q."""
    L = 128
    bm = flexjax.create_block_mask(masks.causal, None, None, L, L, block_size=32)
    rows = jax.jit(lambda r: bm[:, :, r])(jnp.int32(2))
    assert rows.shape == (1, 1, 32, L)
    np.testing.assert_array_equal(np.asarray(rows.to_dense())[0, 0, 0], [1, 1, 1, 0])
    dense = flexjax.create_mask(rows.mask_mod, None, None, 32, L)
    np.testing.assert_array_equal(np.asarray(dense), np.asarray(flexjax.create_mask(masks.causal, None, None,
                                                                                      L, L))[:, :, 64:96])
    with pytest.raises(IndexError, match="q-block row"):
        bm[:, :, 1.5]


def test_cache_steps_compile_once():
    """100 decode steps of a growing sequence, one jitted step function: one compilation."""
    L = 512
    bm = flexjax.create_block_mask(masks.causal, None, None, L, L, block_size=64)
    ks = jax.random.split(jax.random.key(1), 3)
    k_cache = jax.random.normal(ks[0], (1, L, HKV, D))
    v_cache = jax.random.normal(ks[1], (1, L, HKV, D))
    traces = []

    @jax.jit
    def step(k_cache, v_cache, q, pos):
        traces.append(1)
        return flexjax.flex_attention(q, k_cache, v_cache, block_mask=flexjax.paged.decode_block_mask(bm, pos))

    q = jax.random.normal(ks[2], (1, 1, HQ, D))
    for pos in range(100, 200):
        out = step(k_cache, v_cache, q, jnp.int32(pos))
    assert len(traces) == 1 and step._cache_size() == 1
    pos = 199
    ref = flexjax.flex_attention(q, k_cache, v_cache, backend="reference",
                                 block_mask=flexjax.create_block_mask(masks.causal_with_offset(pos), None, None,
                                                                      1, L, block_size=64))
    assert_close("step 199", out, ref, ref, jnp.float32)


def test_decode_path_gate():
    """Long queries and dropout take the normal path; the decode path has the same backward."""
    spec_fields = {"score": None, "mask": None, "scale": 1.0, "q_len": 1, "kv_len": 8, "block_size": (8, 8)}
    from flexjax._api import AttentionSpec

    q = jnp.zeros((1, 1, 1, 8))
    assert _decode.serves(AttentionSpec(**spec_fields), q)
    assert not _decode.serves(AttentionSpec(**{**spec_fields, "q_len": _decode.DECODE_MAX_Q + 1}), q)
    assert not _decode.serves(AttentionSpec(**spec_fields, dropout_rate=0.1), q)
    assert not _decode.serves(AttentionSpec(**spec_fields, kernel_options=(("block_q", 8),)), q)


def test_pallas_packs_gqa_rows(monkeypatch):
    """Mods that never read h: the pallas decode kernel puts a GQA group's heads in one tile."""
    from flexjax import mods
    from flexjax.backends.pallas import _decode as pallas_decode

    packed = []
    real = pallas_decode._packs
    monkeypatch.setattr(pallas_decode, "_packs", lambda *a: packed.append(real(*a)) or packed[-1])
    sq = 3
    q, k, v, _, _ = _inputs(sq)
    lengths = jnp.array([SKV - 5, 37], jnp.int32)
    mask = flexjax.and_masks(masks.padding(lengths), masks.causal_bottom_right(sq, lengths))
    bm = flexjax.create_block_mask(mask, B, None, sq, SKV, block_size=32)

    def attend(backend):
        return jax.jit(lambda q, k, v: flexjax.flex_attention(q, k, v, mods.soft_cap(3.0), bm, return_lse=True,
                                                              backend=backend))(q, k, v)

    truth = attend("reference")
    assert_close("pallas packed decode", attend("pallas"), truth, truth, jnp.float32)
    assert packed == [True]


# (make test's budget: sq 1 in make test-extra, sq 3 in make test-all.)
@pytest.mark.parametrize("sq", [pytest.param(1, marks=pytest.mark.ci_extra), pytest.param(3, marks=pytest.mark.slow)])
def test_pallas_packs_gqa_rows_of_mods_that_read_h(sq, monkeypatch):
    """Mods that read h pack a GQA group's heads into one tile too (GPU template, interpret
    mode here), each row getting its own head: ALiBi from a captured float table (hoisted
    per head; gradients of q, k, v and the table too, through the backward that reads the
    packed forward's row statistics), a per-head table read by h and kv_idx - q_idx in the
    kernel, and arithmetic on h; forward and lse against the reference. A mask_mod reading h
    has per-head lists (its BlockMask is built with H=Hq): one program per head, same checks."""
    from flexjax.backends.pallas import _decode as pallas_decode

    packed = []
    real = pallas_decode._packs
    monkeypatch.setattr(pallas_decode, "_packs", lambda *a: packed.append(real(*a)) or packed[-1])
    q, k, v, do, tab = _inputs(sq, seed=sq)
    rel = jax.random.normal(jax.random.key(9), (HQ, 2 * SKV))
    lengths = jnp.array([SKV - 5, 61], jnp.int32)
    causal = masks.causal_bottom_right(sq, lengths)

    def odd_heads_see_less(b, h, q_idx, kv_idx):  # heads 1 and 3 see only the last 40 positions
        return (h % 2 == 0) | (kv_idx >= lengths[b] - 40)

    scores = {"alibi": _score,
              "table[h, kv - q]": lambda t: lambda s, b, h, q_idx, kv_idx: s + rel[h, kv_idx - q_idx + SKV],
              "h arithmetic": lambda t: lambda s, b, h, q_idx, kv_idx: s * (1.0 + 0.25 * h.astype(s.dtype))}
    cases = [(name, score, flexjax.and_masks(masks.padding(lengths), causal), None, True)
             for name, score in scores.items()]
    cases += [("mask reads h", _score, flexjax.and_masks(masks.padding(lengths), causal, odd_heads_see_less), HQ,
               False)]
    for name, score, mask, heads, packs in cases:
        bm = flexjax.create_block_mask(mask, B, heads, sq, SKV, block_size=32)

        def loss(q, k, v, tab, backend, score=score, bm=bm):
            out, lse = flexjax.flex_attention(q, k, v, score(tab), bm, return_lse=True, backend=backend)
            return jnp.sum(out * do) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

        if name == "alibi":
            run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True), static_argnums=4)
        else:
            run = jax.jit(lambda *a, loss=loss: loss(*a)[1], static_argnums=4)
        want = run(q, k, v, tab, "reference")
        packed.clear()
        got = run(q, k, v, tab, "pallas")
        assert_close(f"pallas decode, {name}", got, want, want, jnp.float32)
        assert packed and set(packed) == {packs}, name
