"""Library factories: which mod arguments they read, causal alignments, traced parameters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flexjax
from flexjax import flex_attention, masks, mods
from flexjax._trace import trace_mod

IDS = np.repeat(np.arange(4), 16).astype(np.int32)  # (64,)
IDS2 = np.stack([IDS, IDS[::-1]])  # (2, 64)
Q, KV, SCORE = "q_idx", "kv_idx", "score"

# (id, make mod, kind, the arguments its jaxpr must read). A mask that does not depend on
# b (or h) must not read it, or create_block_mask refuses B=None (H=None).
USES = [
    ("causal", lambda: masks.causal, "mask", {Q, KV}),
    ("chunked_causal", lambda: masks.chunked_causal(8), "mask", {Q, KV}),
    ("dilated", lambda: masks.dilated(3), "mask", {Q, KV}),
    ("sliding_window", lambda: masks.sliding_window(4, 2), "mask", {Q, KV}),
    ("prefix_lm_int", lambda: masks.prefix_lm(5), "mask", {Q, KV}),
    ("prefix_lm_batch1", lambda: masks.prefix_lm(np.array([5])), "mask", {Q, KV}),
    ("prefix_lm_batch2", lambda: masks.prefix_lm(np.array([5, 9])), "mask", {"b", Q, KV}),
    ("document_1d", lambda: masks.document(IDS), "mask", {Q, KV}),
    ("document_batch1", lambda: masks.document(IDS[None], IDS[None]), "mask", {Q, KV}),
    ("document_2d", lambda: masks.document(IDS2), "mask", {"b", Q, KV}),
    ("document_1d_q_2d_kv", lambda: masks.document(IDS, IDS2), "mask", {"b", Q, KV}),
    ("document_cu_1d", lambda: masks.document_from_cu_seqlens(np.array([0, 10, 64]), 64), "mask", {Q, KV}),
    ("document_cu_2d", lambda: masks.document_from_cu_seqlens(np.array([[0, 10, 64], [0, 5, 9]]), 64), "mask",
     {"b", Q, KV}),
    ("padding_batch1", lambda: masks.padding(np.array([40])), "mask", {KV}),
    ("padding_batch2", lambda: masks.padding(np.array([40, 64])), "mask", {"b", KV}),
    ("causal_bottom_right", lambda: masks.causal_bottom_right(16, 64), "mask", {Q, KV}),
    ("causal_bottom_right_batch2", lambda: masks.causal_bottom_right(1, np.array([30, 64])), "mask", {"b", Q, KV}),
    ("causal_with_offset", lambda: masks.causal_with_offset(-3), "mask", {Q, KV}),
    ("causal_with_offset_scalar_array", lambda: masks.causal_with_offset(jnp.int32(3)), "mask", {Q, KV}),
    ("causal_with_offset_batch1", lambda: masks.causal_with_offset(np.array([3])), "mask", {Q, KV}),
    ("causal_with_offset_batch2", lambda: masks.causal_with_offset(np.array([3, 7])), "mask", {"b", Q, KV}),
    ("and_masks", lambda: flexjax.and_masks(masks.causal, masks.document(IDS)), "mask", {Q, KV}),
    ("or_masks", lambda: flexjax.or_masks(masks.sliding_window(2), masks.padding(np.array([3, 4]))), "mask",
     {"b", Q, KV}),
    ("soft_cap", lambda: mods.soft_cap(20.0), "score", {SCORE}),
    ("soft_cap_array", lambda: mods.soft_cap(jnp.float32(20.0)), "score", {SCORE}),
    ("alibi", lambda: mods.alibi(4), "score", {SCORE, "h", Q, KV}),
    ("alibi_1h", lambda: mods.alibi(1), "score", {SCORE, Q, KV}),
    ("relative_bias", lambda: mods.relative_bias(np.ones((2, 9), np.float32)), "score", {SCORE, "h", Q, KV}),
    ("relative_bias_1h", lambda: mods.relative_bias(np.ones((1, 9), np.float32)), "score", {SCORE, Q, KV}),
    ("t5", lambda: mods.t5_relative_bucket_bias(np.ones((2, 8), np.float32), 8, 20), "score", {SCORE, "h", Q, KV}),
    ("t5_1h", lambda: mods.t5_relative_bucket_bias(np.ones((1, 8), np.float32), 8, 20), "score", {SCORE, Q, KV}),
]


@pytest.mark.parametrize("make,kind,uses", [c[1:] for c in USES], ids=[c[0] for c in USES])
def test_reads_b_and_h_only_when_it_depends_on_them(make, kind, uses):
    assert trace_mod(make(), kind, arg_name=f"{kind}_mod").uses == uses


@pytest.mark.parametrize("make", [c[1] for c in USES if c[2] == "mask" and "b" not in c[3]],
                         ids=[c[0] for c in USES if c[2] == "mask" and "b" not in c[3]])
def test_batch_independent_masks_build_with_B_None(make):
    mm = make()
    bm = flexjax.create_block_mask(mm, None, None, 64, 64, block_size=16)
    per_batch = flexjax.create_block_mask(mm, 2, 2, 64, 64, block_size=16)
    assert bm.shape == (1, 1, 64, 64)
    np.testing.assert_array_equal(np.broadcast_to(np.asarray(bm.block_states()), (2, 2, 4, 4)),
                                  np.asarray(per_batch.block_states()))


def _dense(mm, B, Sq, Skv):
    return np.asarray(flexjax.create_mask(mm, B, None, Sq, Skv))[:, 0]


# ----------------------------------------------------------------------------------
# Causal alignments.


@pytest.mark.parametrize("sq,skv", [(5, 12), (12, 12), (12, 5), (1, 9)])
def test_causal_bottom_right_ints(sq, skv):
    got = _dense(masks.causal_bottom_right(sq, skv), 1, sq, skv)[0]
    q, kv = np.arange(sq)[:, None], np.arange(skv)[None, :]
    np.testing.assert_array_equal(got, kv <= q + skv - sq)
    if sq == 1:
        assert got.all()  # a decode step sees the whole cache
    if sq == skv:
        np.testing.assert_array_equal(got, _dense(masks.causal, 1, sq, skv)[0])


def test_causal_is_top_left_aligned():
    got = _dense(masks.causal, 1, 1, 9)[0]
    np.testing.assert_array_equal(got, [np.arange(9) == 0])  # kept, as in PyTorch


def test_causal_bottom_right_per_batch_cache_lengths():
    """Decode with a padded cache: batch b has kv_lengths[b] valid keys, then the queries."""
    sq, skv = 3, 16
    kv_lengths = np.array([7, 16])
    got = _dense(masks.causal_bottom_right(sq, kv_lengths), 2, sq, skv)
    q, kv = np.arange(sq)[:, None], np.arange(skv)[None, :]
    for b in range(2):
        want = kv <= q + kv_lengths[b] - sq
        np.testing.assert_array_equal(got[b], want)
        assert not got[b][:, kv_lengths[b]:].any()  # padding past the cache is masked


def test_causal_with_offset():
    q, kv = np.arange(10)[:, None], np.arange(14)[None, :]
    for offset in (0, 4, -3):
        np.testing.assert_array_equal(_dense(masks.causal_with_offset(offset), 1, 10, 14)[0], kv <= q + offset)
    np.testing.assert_array_equal(_dense(masks.causal_with_offset(0), 1, 10, 14), _dense(masks.causal, 1, 10, 14))
    np.testing.assert_array_equal(_dense(masks.causal_with_offset(4), 1, 10, 14),
                                  _dense(masks.causal_bottom_right(10, 14), 1, 10, 14))
    offsets = np.array([2, -1])
    got = _dense(masks.causal_with_offset(offsets), 2, 10, 14)
    for b in range(2):
        np.testing.assert_array_equal(got[b], kv <= q + offsets[b])


def test_causal_alignment_picture():
    """The README's picture: a 256-token chunk after a 768-token cache, 128 blocks."""
    top_left = flexjax.create_block_mask(masks.causal, None, None, 256, 1024)
    bottom_right = flexjax.create_block_mask(masks.causal_bottom_right(256, 1024), None, None, 256, 1024)
    assert top_left.to_string().splitlines()[2:] == ["░░              |", "██░░            |"]
    assert bottom_right.to_string().splitlines()[2:] == ["████████████░░  |", "██████████████░░|"]


# ----------------------------------------------------------------------------------
# Traced parameters.


def _lists(bm):
    """What two BlockMasks of one mask share: each list's counts and its entries up to them.

    The widths and the entries past each row's count may differ (compact lists eagerly,
    nKV wide under jit).
    """
    lists = [np.asarray(x) for x in bm.tree_flatten()[0][:8]]
    out = []
    for num, idx in zip(lists[0::2], lists[1::2]):
        valid = np.arange(idx.shape[-1]) < num[..., None]
        out += [num, np.where(valid, idx, -1)[..., : max(int(num.max()), 1)]]
    return out


@pytest.mark.parametrize(
    "make,value",
    [
        (lambda x: masks.sliding_window(x), 20),
        pytest.param(lambda x: masks.sliding_window(3, x), 40, marks=pytest.mark.slow),
        (lambda x: masks.prefix_lm(x), 70),
        pytest.param(lambda x: masks.causal_with_offset(x), -10, marks=pytest.mark.slow),
        pytest.param(lambda x: masks.causal_bottom_right(x, 128), 30, marks=pytest.mark.slow),
        (lambda x: masks.causal_bottom_right(1, x), 90),
    ],
    ids=["sliding_window_left", "sliding_window_right", "prefix_lm", "causal_with_offset",
         "causal_bottom_right_q", "causal_bottom_right_kv"],
)
def test_traced_int_parameters_build_the_concrete_block_mask(make, value):
    @jax.jit
    def build(x):
        mm = make(x)
        assert mm.__name__ in ("sliding_window", "prefix_lm", "causal_with_offset", "causal_bottom_right")
        return flexjax.create_block_mask(mm, None, None, 128, 128, block_size=32)

    got = build(jnp.int32(value))
    want = flexjax.create_block_mask(make(value), None, None, 128, 128, block_size=32)
    for g, w in zip(_lists(got), _lists(want)):
        np.testing.assert_array_equal(g, w)
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (1, 128, 2, 16)) for i in range(3))
    np.testing.assert_allclose(np.asarray(flex_attention(q, k, v, block_mask=got, backend="xla")),
                               np.asarray(flex_attention(q, k, v, block_mask=want, backend="xla")), atol=1e-6)


def test_traced_per_batch_cache_lengths_inside_jit():
    kv_lengths = np.array([40, 128], np.int32)
    build = jax.jit(lambda n: flexjax.create_block_mask(masks.causal_bottom_right(8, n), 2, None, 8, 128,
                                                        block_size=32))
    want = flexjax.create_block_mask(masks.causal_bottom_right(8, kv_lengths), 2, None, 8, 128, block_size=32)
    for g, w in zip(_lists(build(kv_lengths)), _lists(want)):
        np.testing.assert_array_equal(g, w)


def test_concrete_jax_scalars_are_checked_and_named_like_ints():
    assert mods.soft_cap(jnp.float32(30)).__name__ == "soft_cap_30"
    assert masks.sliding_window(jnp.int32(3), np.int64(1)).__name__ == "sliding_window_3_1"
    assert masks.prefix_lm(jnp.int32(7)).__name__ == "prefix_lm_7"
    assert masks.causal_with_offset(jnp.int32(-2)).__name__ == "causal_with_offset_-2"
    assert masks.causal_bottom_right(256, 1024).__name__ == "causal_bottom_right_256_1024"
    assert masks.causal_with_offset(np.array([1, 2])).__name__ == "causal_with_offset"
    assert masks.causal_bottom_right(1, np.array([1, 2])).__name__ == "causal_bottom_right"
    with pytest.raises(ValueError, match="sliding_window: left must be >= 0, got -1"):
        masks.sliding_window(jnp.int32(-1))
    with pytest.raises(ValueError, match="soft_cap: cap must be finite and > 0, got -2.0"):
        mods.soft_cap(jnp.float32(-2))
    with pytest.raises(ValueError, match="prefix_len must be >= 0, got -1"):
        masks.prefix_lm(jnp.int32(-1))


def test_traced_parameters_keep_dtype_and_shape_checks():
    @jax.jit
    def check(i, f, v):
        with pytest.raises(TypeError, match="sliding_window: left must be an int or an integer scalar array, "
                                            "got traced float32 array of shape"):
            masks.sliding_window(f)
        with pytest.raises(TypeError, match="left must be an int.*got traced int32 array of shape \\(2,\\)"):
            masks.sliding_window(v)
        with pytest.raises(TypeError, match="soft_cap: cap must be a float, got traced int32 array"):
            mods.soft_cap(i)
        with pytest.raises(TypeError, match="cap must be a float, got traced float32 array of shape \\(2,\\)"):
            mods.soft_cap(v.astype(jnp.float32))
        with pytest.raises(TypeError, match="prefix_len must be an integer array, got dtype float32"):
            masks.prefix_lm(f[None])
        return i

    check(jnp.int32(1), jnp.float32(1), jnp.arange(2, dtype=jnp.int32))


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: masks.causal_bottom_right(0, 4), ValueError, "causal_bottom_right: q_len must be >= 1, got 0"),
        (lambda: masks.causal_bottom_right(2, -1), ValueError, "kv_len must be >= 0, got -1"),
        (lambda: masks.causal_bottom_right(2.0, 4), TypeError, "q_len must be an int.*got float"),
        (lambda: masks.causal_bottom_right(np.array([1, 2]), np.array([3, 4, 5])), ValueError,
         "q_len has batch size 2 but kv_len has 3"),
        (lambda: masks.causal_bottom_right(1, np.ones((2, 2), int)), ValueError, r"kv_len.*\(2, 2\)"),
        (lambda: masks.causal_with_offset(1.5), TypeError, "causal_with_offset: offset must be an int"),
        (lambda: masks.causal_with_offset(np.array([1.0, 2.0])), TypeError, "offset must be an integer array"),
        (lambda: masks.causal_with_offset(True), TypeError, "offset must be an int.*got bool"),
    ],
)
def test_causal_argument_validation(make, error, match):
    with pytest.raises(error, match=match):
        make()


def _attention_inputs(S=64, H=2):
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (2.0 * jax.random.normal(key, (1, S, H, 16)) for key in (k1, k2, k3, k4))
    return q, k, v, do


def test_grad_reaches_a_traced_soft_cap():
    q, k, v, do = _attention_inputs()
    bm = flexjax.create_block_mask(masks.causal, None, None, 64, 64, block_size=32)

    def loss(cap, backend):
        return jnp.sum(flex_attention(q, k, v, mods.soft_cap(cap), bm, scale=1.0, backend=backend) * do)

    cap = jnp.float32(3.0)
    got = jax.jit(jax.grad(loss), static_argnums=1)(cap, "xla")
    want = jax.grad(loss)(cap, "reference")
    np.testing.assert_allclose(float(got), float(want), rtol=1e-4)
    eps = 1e-2
    fd = (loss(cap + eps, "reference") - loss(cap - eps, "reference")) / (2 * eps)
    assert abs(float(got)) > 1.0
    np.testing.assert_allclose(float(got), float(fd), rtol=1e-2)


def test_traced_alibi_slopes_under_jit():
    q, k, v, do = _attention_inputs()
    bm = flexjax.create_block_mask(masks.causal, None, None, 64, 64, block_size=32)
    slopes = jnp.asarray(mods.alibi_slopes(2), jnp.float32)

    def loss(slopes, backend):
        out = flex_attention(q, k, v, mods.alibi_from_slopes(slopes), bm, backend=backend)
        return jnp.sum(out * do), out

    (_, out), grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(slopes, "xla")
    eager = flex_attention(q, k, v, mods.alibi(2), bm, backend="xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(eager), atol=1e-5)
    want = jax.grad(lambda s: loss(s, "reference")[0])(slopes)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want), rtol=1e-4, atol=1e-4)
