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


@pytest.mark.ci_extra  # (make test's 5-minute budget: 4-8 s here; make test reached 5:05)
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


@pytest.mark.ci_extra  # (make test's budget)
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


@pytest.mark.ci_extra  # (make test's 5-minute budget: 4-8 s here; make test reached 5:05)
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


# -- FlexMultiHeadAttention(sparse=SparseAttention(...)): MoBA and NSA --------------------------

ST, SBLOCK, STOPK = 256, 32, 3  # 8 blocks of 32, 3 chosen per query block
_SPARSE = {"moba": flexjax.flax.SparseAttention("moba", SBLOCK, STOPK),
           "nsa": flexjax.flax.SparseAttention("nsa", SBLOCK, STOPK, window=48, compress_size=16, stride=8)}


def _sparse_layer(kind):
    """GQA (4 query heads on 2 kv heads), ALiBi as the layer's score_mod."""
    return flexjax.flax.FlexMultiHeadAttention(N, F, num_kv_heads=2, score_mod=flexjax.mods.alibi(N),
                                               sparse=_SPARSE[kind], implementation="xla", rngs=nnx.Rngs(0))


def _sparse_x(seed):
    return jax.random.normal(jax.random.PRNGKey(seed), (B, ST, F))


def _doc_ids():
    """Two packed documents a row, split at 100 and at 170: the call's mask_mod."""
    return jnp.asarray(np.arange(ST)[None, :] >= np.array([[100], [170]]), jnp.int32)


def _np_topk(scores, eligible, k):
    """bool (B, H, nQ, nKV): each row's k highest scores among the eligible blocks (ties to the lower index),
    fewer where fewer are eligible. Asserts that the k-th and the next differ, so the float32 layer's choice is
    the same."""
    s = np.where(eligible, scores, -np.inf)
    order = np.argsort(-s, axis=-1, kind="stable")
    ranked = np.take_along_axis(s, order, -1)
    both = np.isfinite(ranked[..., k - 1]) & np.isfinite(ranked[..., k]) if k < s.shape[-1] else np.zeros(1, bool)
    gap = np.abs(ranked[..., k - 1][both] - ranked[..., k][both])
    assert gap.size == 0 or gap.min() > 1e-4 * max(1.0, np.abs(ranked[np.isfinite(ranked)]).max()), gap.min()
    chosen = np.zeros(s.shape, bool)
    np.put_along_axis(chosen, order[..., :k], True, -1)
    return chosen & (s > -np.inf)


def _sparse_choice(sp, qn, kn, eligible):
    """bool (B, H, T, T): the pairs in the kv blocks each query block chooses, in NumPy (float64) from the
    projected queries and keys (B, T, heads, head_dim), among the ``eligible`` blocks (B, 1, nQ, nKV)."""
    nb, bi, i, hd, G = ST // SBLOCK, np.arange(ST // SBLOCK), np.arange(ST), qn.shape[-1], N // 2

    def rules(s):  # the future never, the diagonal always
        return np.where(bi[None, :] > bi[:, None], -np.inf, np.where(bi[None, :] == bi[:, None], np.inf, s))

    if sp.kind == "moba":
        qbar = qn.reshape(B, nb, SBLOCK, N, hd).mean(2)
        kbar = np.repeat(kn.reshape(B, nb, SBLOCK, 2, hd).mean(2), G, axis=2)
        scores = rules(np.einsum("bihd,bjhd->bhij", qbar, kbar))
    else:
        l, d = sp.compress_size, sp.stride
        t = np.arange((ST - l) // d + 1)
        kcmp = kn[:, t[:, None] * d + np.arange(l)].mean(2)  # (B, n, 2, hd)
        logits = np.einsum("bshd,bthd->bhst", qn, np.repeat(kcmp, G, axis=2)) / np.sqrt(hd)
        ended = t[None, :] * d + l - 1 <= i[:, None]  # (T, n)
        logits = np.where(ended, logits, -np.inf)
        e = np.exp(logits - np.maximum(logits.max(-1, keepdims=True), -1e300))  # 0 where not ended
        p = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)  # a query with no ended block: 0
        overlap = (t[:, None] * d <= (bi[None, :] + 1) * SBLOCK - 1) & (t[:, None] * d + l - 1 >= bi[None, :] * SBLOCK)
        pq = p.reshape(B, 2, G, nb, SBLOCK, -1).sum((2, 4))  # the GQA group's heads and the block's queries
        scores = rules(np.repeat(np.einsum("bhqt,tj->bhqj", pq, overlap.astype(float)), G, axis=1))
    return np.repeat(np.repeat(_np_topk(scores, eligible, STOPK), SBLOCK, 2), SBLOCK, 3)


def _sparse_by_hand(layer, x, doc_ids, chosen=None):
    """The layer by hand: its projections, the blocks chosen in NumPy (float64) from the projected q / k, and
    dense attention over the implied (B, H, T, T) masks (jnp, HIGHEST precision), gated for NSA. ``chosen``:
    the choice from an earlier call, for jax.grad (which does not differentiate it)."""
    sp, hd = layer.sparse, layer.head_dim
    q = layer.query(x).reshape(B, ST, N, hd)
    k = layer.key(x).reshape(B, ST, 2, hd)
    v = layer.value(x).reshape(B, ST, 2, hd)
    nb, i, ids = ST // SBLOCK, np.arange(ST), np.asarray(doc_ids)
    base = (i[:, None] >= i[None, :])[None, None] & (ids[:, None, :, None] == ids[:, None, None, :])  # (B, 1, T, T)
    if chosen is None:
        eligible = base.reshape(B, 1, nb, SBLOCK, nb, SBLOCK).any((3, 5))
        chosen = _sparse_choice(sp, np.asarray(q, np.float64), np.asarray(k, np.float64), eligible)
    slopes = jnp.asarray(flexjax.mods.alibi_slopes(N), jnp.float32)[:, None, None]

    def attend(q, k, v, allowed, alibi=True):
        k, v = jnp.repeat(k, N // k.shape[2], 2), jnp.repeat(v, N // v.shape[2], 2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / np.sqrt(hd)
        if alibi:
            s = s + slopes * (i[None, :] - i[:, None])
        s = jnp.where(allowed, s, -jnp.inf)
        m = s.max(-1, keepdims=True)
        e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0))
        p = e / jnp.where(e.sum(-1, keepdims=True) > 0, e.sum(-1, keepdims=True), 1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v, precision="highest")

    out = attend(q, k, v, base & chosen)
    if sp.kind == "nsa":
        l, d = sp.compress_size, sp.stride
        win = attend(q, k, v, base & (i[None, :] >= i[:, None] - (sp.window - 1)))
        t = np.arange((ST - l) // d + 1)
        keys = t[:, None] * d + np.arange(l)[None, :]  # (n, l)
        ok = (t[None, :] * d + l - 1 <= i[:, None])[None, None] & (
            ids[:, :, None, None] == ids[:, None, keys]).all(-1)[:, None]  # (B, 1, T, n)
        mean = lambda a: a[:, keys].mean(2)  # noqa: E731
        cmp = attend(q, mean(k), mean(v), ok, alibi=False)
        g = jax.nn.sigmoid(layer.gate(x)).reshape(B, ST, 3, N, 1)
        out = g[:, :, 0] * cmp + g[:, :, 1] * out + g[:, :, 2] * win
    return layer.out(out.reshape(B, ST, N * hd)), chosen


# (make test's budget: 8-12 s each; make test checks the layer by test_sparse_layer_with_every_block_...)
@pytest.mark.parametrize("kind", [pytest.param("moba", marks=pytest.mark.ci_extra),
                                  pytest.param("nsa", marks=pytest.mark.ci_extra)])
def test_sparse_layer_matches_by_hand_compiles_once_and_trains(kind):
    """Two inputs of one shape through one compile, each equal to the layer by hand; the gradients equal the by-hand
    layer's (the choice is not differentiated) and reach every projection (and NSA's gate)."""
    layer, ids, traces = _sparse_layer(kind), _doc_ids(), []

    @nnx.jit
    def forward(m, x, ids):
        traces.append(1)
        return m(x, mask_mod=flexjax.masks.document(ids))

    for seed in (1, 2):
        x = _sparse_x(seed)
        np.testing.assert_allclose(forward(layer, x, ids), _sparse_by_hand(layer, x, ids)[0], atol=3e-5)
    assert len(traces) == 1

    def loss(fn):
        return lambda m: jnp.sum(fn(m) ** 2)

    x = _sparse_x(1)
    chosen = _sparse_by_hand(layer, x, ids)[1]
    g = nnx.jit(nnx.grad(loss(lambda m: m(x, mask_mod=flexjax.masks.document(ids)))))(layer)
    g_ref = nnx.grad(loss(lambda m: _sparse_by_hand(m, x, ids, chosen)[0]))(layer)
    names = ["query", "key", "value", "out"] + (["gate"] if kind == "nsa" else [])
    for name in names:
        a, b = getattr(g, name).kernel[...], getattr(g_ref, name).kernel[...]
        assert float(jnp.abs(a).max()) > 0, name
        np.testing.assert_allclose(a, b, atol=2e-4 * float(jnp.abs(b).max()), err_msg=name)
    assert ("gate" in nnx.state(layer, nnx.Param)) == (kind == "nsa")


@pytest.mark.ci_extra  # (make test's 5-minute budget: about 4 s here; make test reached 5:12)
def test_sparse_layer_with_every_block_is_dense_causal_and_refusals():
    """top_k at least the number of kv blocks chooses every causal block (top_k is capped): the dense causal
    layer's output. Bad configurations name their field; the decode cache and a block_mask are refused."""
    x = _x()  # T = 24: blocks of 8, 3 of them
    dense = _layer(score_mod=flexjax.mods.alibi(N))
    moba = flexjax.flax.FlexMultiHeadAttention(N, F, num_kv_heads=2, score_mod=flexjax.mods.alibi(N),
                                               sparse=flexjax.flax.SparseAttention("moba", 8, 5),
                                               implementation="xla", rngs=nnx.Rngs(0))
    np.testing.assert_allclose(moba(x), dense(x), atol=2e-5)
    SA = flexjax.flax.SparseAttention
    assert SA("nsa", 64, 4) == SA("nsa", 64, 4, window=512, compress_size=32, stride=16)  # NSA's sizes
    for kw, field in (({"kind": "dense"}, "kind"), ({"block_size": 0}, "block_size"), ({"top_k": 2.0}, "top_k"),
                      ({"top_k": True}, "top_k"), ({"window": 64}, "window"), ({"stride": 4}, "stride"),
                      ({"kind": "nsa", "window": -1}, "window"), ({"kind": "nsa", "compress_size": 0}, "compress_size"),
                      ({"kind": "nsa", "stride": "8"}, "stride")):
        with pytest.raises(ValueError, match=f"SparseAttention: {field}"):
            SA(**kw)
    with pytest.raises(TypeError, match="SparseAttention"):
        flexjax.flax.FlexMultiHeadAttention(N, F, sparse={"kind": "moba"}, rngs=nnx.Rngs(0))
    with pytest.raises(NotImplementedError, match="full-sequence"):
        moba.init_cache(B, T)
    with pytest.raises(NotImplementedError, match="full-sequence"):
        moba(x, decode=True)
    with pytest.raises(ValueError, match="mask_mod, not a block_mask"):
        moba(x, block_mask=flexjax.create_block_mask(_causal, None, None, T, T))
    moba.sparse = SA("nsa", 8, 2)  # switched to NSA after construction: no gate parameter
    with pytest.raises(ValueError, match="gate"):
        moba(x)
