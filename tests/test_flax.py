"""flexjax.flax.attention_fn in Flax's attention modules (issue 33, item 2: the attention_fn part).

The same module with flax's own attention function and with flexjax's, from the same
parameters: equal outputs and parameter gradients (no dropout), under ``nnx.jit`` and
``nnx.grad``, and in linen; with dropout, flexjax's keep mask is its own, so only its
statistics are checked (train vs eval differ, eval is deterministic).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
from flax import linen, nnx  # noqa: E402

import flexjax.flax  # noqa: E402

B, T, F, N = 2, 24, 32, 4


def _x():
    return jax.random.normal(jax.random.PRNGKey(1), (B, T, F))


def _nnx_pair(**kw):
    mods = [nnx.MultiHeadAttention(num_heads=N, in_features=F, decode=False, rngs=nnx.Rngs(0), **kw)
            for _ in range(2)]
    mods[1].attention_fn = flexjax.flax.make_attention_fn("xla")
    return mods


@pytest.mark.ci_extra  # (make test-extra: 3-9 s; cheaper siblings run in make test)
def test_nnx_outputs_and_grads_match_flax():
    ref, ours = _nnx_pair()
    x = _x()
    mask = nnx.make_causal_mask(jnp.ones((B, T)))

    @nnx.jit
    def loss_grad(m, x):
        return nnx.grad(lambda m: jnp.sum(m(x, mask=mask) ** 2))(m)

    np.testing.assert_allclose(ours(x, mask=mask), ref(x, mask=mask), atol=2e-5)
    g_ours, g_ref = loss_grad(ours, x), loss_grad(ref, x)
    for a, b in zip(jax.tree.leaves(nnx.state(g_ours)), jax.tree.leaves(nnx.state(g_ref))):
        np.testing.assert_allclose(a, b, atol=2e-4 * max(1.0, float(jnp.max(jnp.abs(b)))))


def test_nnx_is_causal_and_padding_mask():
    ref, ours = _nnx_pair()
    x = _x()
    pad = jnp.arange(T)[None, :] < jnp.array([T, 17])[:, None]
    mask = nnx.make_attention_mask(pad, pad)  # (B, 1, T, T), float as flax makes it
    got = ours(x, mask=mask, is_causal=True)
    want = ref(x, mask=nnx.combine_masks(mask, nnx.make_causal_mask(jnp.ones((B, T)))))
    # Rows with a key (padded queries have none in the padding mask: flexjax gives 0 there).
    rows = np.asarray(pad)[:, :, None]
    np.testing.assert_allclose(np.where(rows, got, 0), np.where(rows, want, 0), atol=2e-5)


def test_linen_matches_flax():
    x = _x()
    ref = linen.MultiHeadDotProductAttention(num_heads=N, qkv_features=F)
    ours = linen.MultiHeadDotProductAttention(num_heads=N, qkv_features=F,
                                              attention_fn=flexjax.flax.make_attention_fn("xla"))
    params = ref.init(jax.random.PRNGKey(0), x)
    mask = linen.make_causal_mask(jnp.ones((B, T)))
    np.testing.assert_allclose(ours.apply(params, x, mask=mask), ref.apply(params, x, mask=mask), atol=2e-5)


def test_dropout_trains_and_evaluates():
    (ours,) = _nnx_pair(dropout_rate=0.5)[1:]
    x = _x()
    ours.eval()
    a, b = ours(x), ours(x)
    np.testing.assert_array_equal(a, b)  # deterministic in eval
    ours.train()
    c = ours(x, rngs=nnx.Rngs(dropout=3))
    assert not np.allclose(a, c)


def test_batch_axes_and_refusals():
    fn = flexjax.flax.make_attention_fn("reference")
    q = jax.random.normal(jax.random.PRNGKey(2), (2, 3, 10, N, 8))  # two batch axes
    out = fn(q, q, q)
    ref = jax.vmap(lambda x: jax.nn.dot_product_attention(x, x, x))(q)
    np.testing.assert_allclose(out, ref, atol=2e-5)
    with pytest.raises(NotImplementedError, match="sow"):
        fn(q, q, q, module=object())
    with pytest.raises(ValueError, match="implementation"):
        flexjax.flax.make_attention_fn("cudnn")
    with pytest.raises(ValueError, match="dropout_rng"):
        fn(q, q, q, dropout_rate=0.1)


# -- FlexMultiHeadAttention ------------------------------------------------------------------

def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _layer(**kw):
    return flexjax.flax.FlexMultiHeadAttention(N, F, num_kv_heads=2, mask_mod=_causal, implementation="xla",
                                               rngs=nnx.Rngs(0), **kw)


def _by_hand(layer, x):
    """The layer's projections around jax.nn.dot_product_attention (causal, GQA)."""
    hd = layer.head_dim
    q = layer.query(x).reshape(B, T, N, hd)
    k = layer.key(x).reshape(B, T, 2, hd)
    v = layer.value(x).reshape(B, T, 2, hd)
    return layer.out(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(B, T, N * hd))


def test_flex_layer_matches_by_hand_under_jit_and_grad():
    layer, x = _layer(), _x()

    def grads(fn):
        return nnx.jit(lambda layer, x: nnx.grad(lambda m: jnp.sum(fn(m, x) ** 2))(layer))(layer, x)

    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(layer, x), _by_hand(layer, x), atol=2e-5)
    g = grads(lambda m, x: m(x))
    g_ref = grads(_by_hand)
    for a, b in zip(jax.tree.leaves(nnx.state(g)), jax.tree.leaves(nnx.state(g_ref))):
        np.testing.assert_allclose(a, b, atol=2e-4 * max(1.0, float(jnp.max(jnp.abs(b)))))


@pytest.mark.ci_extra  # (make test-extra: 3-9 s; cheaper siblings run in make test)
def test_flex_layer_under_remat():
    layer, x = _layer(), _x()

    def loss(m, fn):
        return jnp.sum(fn(m, x) ** 2)

    g = nnx.grad(lambda m: loss(m, nnx.remat(lambda m, x: m(x))))(layer)
    g_ref = nnx.grad(lambda m: loss(m, lambda m, x: m(x)))(layer)
    for a, b in zip(jax.tree.leaves(nnx.state(g)), jax.tree.leaves(nnx.state(g_ref))):
        np.testing.assert_allclose(a, b, atol=1e-6 * max(1.0, float(jnp.max(jnp.abs(b)))))


def test_flex_layers_under_scan():
    L = 3

    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return flexjax.flax.FlexMultiHeadAttention(N, F, mask_mod=_causal, implementation="xla", rngs=rngs)

    layers = make(nnx.Rngs(0))
    x = _x()

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def stack(x, layer):
        return x + layer(x)

    got = stack(x, layers)
    graphdef, state = nnx.split(layers)
    want = x
    for i in range(L):  # the same layers one by one
        want = want + nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))(want)
    np.testing.assert_allclose(got, want, atol=5e-5)


def test_flex_layer_decode_matches_the_full_forward():
    layer, x = _layer(), _x()
    full = layer(x)
    layer.init_cache(B, T)
    prefill = layer(x[:, :10], decode=True)
    steps = [layer(x[:, t:t + 1], decode=True) for t in range(10, T)]
    np.testing.assert_allclose(jnp.concatenate([prefill, *steps], axis=1), full, atol=3e-5)
    assert int(layer.cache_index[...]) == T


def test_flex_layer_refusals():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        flexjax.flax.FlexMultiHeadAttention(N, F, num_kv_heads=3, rngs=nnx.Rngs(0))
    layer = _layer(dropout_rate=0.1, deterministic=False)
    with pytest.raises(ValueError, match="rngs"):
        layer(_x())
    with pytest.raises(ValueError, match="init_cache"):
        _layer()(_x(), decode=True)
    layer = _layer()
    layer.init_cache(B, T)
    layer(_x(), decode=True)
    with pytest.raises(ValueError, match="overflows"):  # a full cache: a clamped write would be wrong
        layer(_x()[:, :1], decode=True)
    layer.init_cache(B, T)
    layer(_x()[:, :20], decode=True)
    with pytest.raises(Exception, match="overflows"):  # under jit: at run time, from a host callback
        nnx.jit(lambda m, x: m(x, decode=True))(layer, _x()[:, :8]).block_until_ready()


# -- FlexMultiHeadAttention's paged decode cache (flexjax.paged) -------------------------------

def _alibi_sinks_layer():
    """GQA, causal, ALiBi (reads absolute positions in decode) and a learnable sink per head."""
    layer = _layer(score_mod=flexjax.mods.alibi(N), num_sinks=1)
    layer.sinks[...] = jnp.linspace(-1.0, 1.0, N)[:, None]
    return layer


def test_flex_layer_paged_decode_matches_contiguous_and_full_forward():
    """Token by token (one compile a cache) through pages of 8 under nnx.jit."""
    layer, x = _alibi_sinks_layer(), _x()
    full = nnx.jit(lambda m, x: m(x))(layer, x)
    step = nnx.jit(lambda m, x: m(x, decode=True))
    outs = {}
    for name, paging in (("contiguous", {}), ("paged", {"page_size": 8})):
        layer.init_cache(B, T, **paging)
        outs[name] = jnp.concatenate([step(layer, x[:, t:t + 1]) for t in range(T)], axis=1)
    np.testing.assert_allclose(outs["paged"], outs["contiguous"], atol=1e-5)
    np.testing.assert_allclose(outs["paged"], full, atol=3e-5)
    np.testing.assert_array_equal(layer.cache_index[...], [T, T])
    assert sorted(np.asarray(layer.page_table[...]).ravel().tolist()) == list(range(6))  # 3 pages of 8 each
    assert not bool(layer.free_pages[...].any())


@pytest.mark.ci_extra  # (make test-extra: 3-9 s; cheaper siblings run in make test)
def test_flex_layer_paged_cache_shares_its_pool_and_raises_past_it():
    """A pool of 4 pages of 8 for two sequences of up to 24: full at 16 tokens each (a write
    past it raises, at run time under jit, and leaves the cache as it was); releasing sequence 0
    lets it start over beside sequence 1, each at its own position."""
    layer, x = _alibi_sinks_layer(), _x()
    fresh = jax.random.normal(jax.random.PRNGKey(5), (8, F))  # sequence 0's successor
    forward = nnx.jit(lambda m, x: m(x))
    full, full_fresh = forward(layer, x), forward(layer, x.at[0, :8].set(fresh))  # causal: [0, :8] is fresh's
    layer.init_cache(B, T, page_size=8, num_pages=4)
    step = nnx.jit(lambda m, x: m(x, decode=True))
    np.testing.assert_allclose(step(layer, x[:, :16]), full[:, :16], atol=3e-5)
    with pytest.raises(Exception, match="overflows"):  # from a host callback
        step(layer, x[:, 8:24]).block_until_ready()
    np.testing.assert_array_equal(layer.cache_index[...], [16, 16])
    layer.release_cache(jnp.array([True, False]))
    np.testing.assert_array_equal(layer.cache_index[...], [0, 16])
    got = step(layer, jnp.stack([fresh, x[1, 16:24]]))
    np.testing.assert_allclose(got[0], full_fresh[0, :8], atol=3e-5)
    np.testing.assert_allclose(got[1], full[1, 16:24], atol=3e-5)
    with pytest.raises(Exception, match="overflows"):  # sequence 1 is at 24 of 24
        step(layer, x[:, :8]).block_until_ready()
    with pytest.raises(ValueError, match="paged cache"):
        layer.init_cache(B, T)
        layer.release_cache(jnp.array([True, False]))
    with pytest.raises(ValueError, match="page_size"):
        layer.init_cache(B, T, num_pages=4)
    with pytest.raises(ValueError, match="num_sinks"):
        _layer(num_sinks=-1)


@pytest.mark.parametrize("paging", [{}, {"page_size": 8}], ids=["contiguous", "paged"])
def test_flex_layer_bfloat16_cache_is_written_in_place_on_cpu(paging):
    """A bfloat16 decode cache on CPU is held as its uint16 bits (``cache_dtype`` says bfloat16): XLA:CPU
    converts a bfloat16 buffer to float32 and back around every scatter or dynamic_update_slice into it, the
    whole cache each step; the compiled decode step has no float32 copy of the cache, and decodes as a
    float32 cache holding the same bfloat16 values does."""
    if jax.default_backend() != "cpu":
        pytest.skip("the uint16 storage is CPU's")
    layer, x = _alibi_sinks_layer(), _x()
    step = nnx.jit(lambda m, x: m(x, decode=True))
    outs = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        layer.init_cache(B, T, dtype, **paging)
        assert layer.cache_dtype == jnp.dtype(dtype)
        outs[dtype] = [step(layer, x[:, t:t + 4].astype(jnp.bfloat16).astype(jnp.float32)) for t in range(0, T, 4)]
    assert layer.cached_key.dtype == jnp.uint16
    for a, b in zip(outs[jnp.float32], outs[jnp.bfloat16]):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-2)  # (the keys rounded to bfloat16)
    # A bfloat16 model's step (a float32 one converts the cache to its dtype to attend, as it must).
    layer = flexjax.flax.FlexMultiHeadAttention(N, F, num_kv_heads=2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    layer.init_cache(B, T, jnp.bfloat16, **paging)
    graphdef, state = nnx.split(layer)

    @jax.jit
    def one(state, x):
        m = nnx.merge(graphdef, state)
        return m(x, decode=True), nnx.state(m)

    hlo = one.lower(state, x[:, :1].astype(jnp.bfloat16)).compile().as_text()
    shape = ",".join(str(n) for n in layer.cached_key.shape)
    widened = [ln for ln in hlo.splitlines() if re.search(rf"= f32\[{shape}\]", ln)
               and re.search(r"scatter|dynamic-update-slice|dynamic_update_slice", ln)]
    assert not widened, widened  # (the write in float32: the whole cache converted and back)
