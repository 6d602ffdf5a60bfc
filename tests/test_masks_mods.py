"""flexjax.masks and flexjax.mods against independent NumPy references."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flexjax import masks, mods

B, H = 2, 3
SHAPES = [(37, 45), (41, 41)]
MODES = ["broadcast_2d", "broadcast_4d", "vmap"]


# ----------------------------------------------------------------------------------
# Evaluating a mod on the full (B, H, Sq, Skv) grid, three ways.


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def evaluate(mod, mode, sq, skv, score=None):
    """Returns mod over the (B, H, sq, skv) grid as a jax array.

    Jitted, as the library traces mods (and one compilation is cheaper than eager
    dispatch compiling each primitive at each shape).

    broadcast_2d: b, h int32 scalars, q (sq, 1), kv (1, skv), as the tiles call mods.
    broadcast_4d: every index a broadcasting 4-D array.
    vmap: scalar calls under nested jax.vmap, as PyTorch's create_mask does.
    """
    extra = () if score is None else (score,)
    if mode == "broadcast_2d":
        q = jnp.arange(sq, dtype=jnp.int32)[:, None]
        kv = jnp.arange(skv, dtype=jnp.int32)[None, :]
        rows = []
        for b in range(B):
            for h in range(H):
                args = tuple(s[b, h] for s in extra)
                out = mod(*args, jnp.int32(b), jnp.int32(h), q, kv)
                rows.append(jnp.broadcast_to(out, (sq, skv)))
        return jnp.stack(rows).reshape(B, H, sq, skv)
    if mode == "broadcast_4d":
        b = jnp.arange(B, dtype=jnp.int32).reshape(B, 1, 1, 1)
        h = jnp.arange(H, dtype=jnp.int32).reshape(1, H, 1, 1)
        q = jnp.arange(sq, dtype=jnp.int32).reshape(1, 1, sq, 1)
        kv = jnp.arange(skv, dtype=jnp.int32).reshape(1, 1, 1, skv)
        return jnp.broadcast_to(mod(*extra, b, h, q, kv), (B, H, sq, skv))
    assert mode == "vmap"
    s = len(extra)
    f = mod
    for axis in (3, 2, 1, 0):  # innermost vmap over kv_idx, outermost over b
        f = jax.vmap(f, in_axes=(0,) * s + tuple(0 if i == axis else None for i in range(4)))
    aranges = [jnp.arange(n, dtype=jnp.int32) for n in (B, H, sq, skv)]
    return f(*extra, *aranges)


def np_grid(sq, skv):
    """int64 index arrays b, h, q, kv broadcasting to (B, H, sq, skv)."""
    return (
        np.arange(B).reshape(B, 1, 1, 1),
        np.arange(H).reshape(1, H, 1, 1),
        np.arange(sq).reshape(1, 1, sq, 1),
        np.arange(skv).reshape(1, 1, 1, skv),
    )


# ----------------------------------------------------------------------------------
# Independent references.


def ref_alibi_slopes(n):
    """The ALiBi reference code (ofirpress/attention_with_linear_biases), verbatim."""

    def get_slopes_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (
        get_slopes_power_of_2(closest_power_of_2)
        + ref_alibi_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2]
    )


def ref_t5_bucket(relative_position, bidirectional, num_buckets, max_distance, dtype):
    """Hugging Face T5Attention._relative_position_bucket in NumPy, floats in `dtype`."""
    relative_position = np.asarray(relative_position, np.int64)
    relative_buckets = np.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).astype(np.int64) * num_buckets
        relative_position = np.abs(relative_position)
    else:
        relative_position = -np.minimum(relative_position, 0)
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    with np.errstate(divide="ignore"):
        large = (
            np.log(relative_position.astype(dtype) / dtype(max_exact))
            / dtype(math.log(max_distance / max_exact))
            * dtype(num_buckets - max_exact)
        )
    large = max_exact + np.where(is_small, 0, large).astype(np.int64)
    large = np.minimum(large, num_buckets - 1)
    return relative_buckets + np.where(is_small, relative_position, large)


def sorted_ids(rng, batch, length, num_docs):
    return np.sort(rng.integers(0, num_docs, size=(batch, length)), axis=-1)


@functools.cache
def mask_cases(sq, skv):
    """(id, mask_mod, numpy reference over (b, h, q, kv)) for the grid sq x skv."""
    rng = np.random.default_rng(sq * 1000 + skv)
    q_ids = sorted_ids(rng, B, sq, 5)
    kv_ids = sorted_ids(rng, B, skv, 5)
    ids_1d = np.sort(rng.integers(0, 4, size=sq))
    prefix = np.array([4, 20])
    lengths = np.array([skv - 7, skv])
    cases = [
        ("causal", masks.causal, lambda b, h, q, kv: q >= kv),
        (
            "chunked_causal_8",
            masks.chunked_causal(8),
            lambda b, h, q, kv: (q // 8 == kv // 8) & (q >= kv),
        ),
        ("chunked_causal_1", masks.chunked_causal(1), lambda b, h, q, kv: q == kv),
        (
            "sliding_window_5",
            masks.sliding_window(5),
            lambda b, h, q, kv: (q - 5 <= kv) & (kv <= q),
        ),
        (
            "sliding_window_3_7",
            masks.sliding_window(3, 7),
            lambda b, h, q, kv: (q - 3 <= kv) & (kv <= q + 7),
        ),
        (
            "prefix_lm_10",
            masks.prefix_lm(10),
            lambda b, h, q, kv: (kv < 10) | (kv <= q),
        ),
        ("prefix_lm_0", masks.prefix_lm(0), lambda b, h, q, kv: kv <= q),
        (
            "prefix_lm_per_batch",
            masks.prefix_lm(prefix),
            lambda b, h, q, kv: (kv < prefix[b]) | (kv <= q),
        ),
        (
            "document_2d",
            masks.document(q_ids, kv_ids),
            lambda b, h, q, kv: q_ids[b, q] == kv_ids[b, kv],
        ),
        (
            "document_1d_q_2d_kv",
            masks.document(ids_1d, kv_ids),
            lambda b, h, q, kv: ids_1d[q] == kv_ids[b, kv],
        ),
        (
            "padding",
            masks.padding(lengths),
            lambda b, h, q, kv: kv < lengths[b],
        ),
        ("dilated_3", masks.dilated(3), lambda b, h, q, kv: (q - kv) % 3 == 0),
        (
            "causal_bottom_right",
            masks.causal_bottom_right(sq, skv),
            lambda b, h, q, kv: kv <= q + skv - sq,
        ),
        (
            "causal_bottom_right_per_batch",
            masks.causal_bottom_right(sq, lengths),
            lambda b, h, q, kv: kv <= q + lengths[b] - sq,
        ),
        (
            "causal_with_offset_per_batch",
            masks.causal_with_offset(prefix - 9),
            lambda b, h, q, kv: kv <= q + (prefix - 9)[b],
        ),
        ("dilated_1", masks.dilated(1), lambda b, h, q, kv: np.ones_like(q == kv)),
    ]
    if sq == skv:
        cases.append(
            (
                "document_self_1d",
                masks.document(ids_1d),
                lambda b, h, q, kv: ids_1d[q] == ids_1d[kv],
            )
        )
    return cases


@functools.cache
def score_cases(sq, skv):
    """(id, score_mod, numpy reference over (score, b, h, q, kv), table or None)."""
    rng = np.random.default_rng(7 + sq)
    slopes = np.array([0.1, -0.2, 0.3], np.float32)
    big = max(sq, skv)
    table_big = rng.normal(size=(H, 2 * big - 1)).astype(np.float32)
    table_small = rng.normal(size=(H, 2 * 8 - 1)).astype(np.float32)
    t5_32 = rng.normal(size=(H, 32)).astype(np.float32)
    t5_8 = rng.normal(size=(H, 8)).astype(np.float32)
    alibi3 = np.array(ref_alibi_slopes(H))

    def rel(table, s):
        return lambda x, b, h, q, kv: x + table[h, np.clip(kv - q + s - 1, 0, 2 * s - 2)]

    def t5(table, bidirectional, nb, md):
        def ref(x, b, h, q, kv):
            return x + table[h, ref_t5_bucket(kv - q, bidirectional, nb, md, np.float64)]

        return ref

    return [
        ("soft_cap_30", mods.soft_cap(30.0), lambda x, *_: 30 * np.tanh(x / 30)),
        ("soft_cap_0.5", mods.soft_cap(0.5), lambda x, *_: 0.5 * np.tanh(x / 0.5)),
        (
            "alibi_3h",
            mods.alibi(H),
            lambda x, b, h, q, kv: x + alibi3[h] * (kv - q),
        ),
        (
            "alibi_from_slopes",
            mods.alibi_from_slopes(slopes),
            lambda x, b, h, q, kv: x + slopes[h] * (kv - q),
        ),
        ("relative_bias_full", mods.relative_bias(table_big), rel(table_big, big)),
        ("relative_bias_clipped", mods.relative_bias(table_small), rel(table_small, 8)),
        (
            "t5_32_128",
            mods.t5_relative_bucket_bias(t5_32, 32, 128),
            t5(t5_32, True, 32, 128),
        ),
        (
            "t5_32_128_unidirectional",
            mods.t5_relative_bucket_bias(t5_32, 32, 128, bidirectional=False),
            t5(t5_32, False, 32, 128),
        ),
        (
            "t5_8_20",
            mods.t5_relative_bucket_bias(t5_8, 8, 20),
            t5(t5_8, True, 8, 20),
        ),
    ]


def grid_cases(cases_fn):
    """(case id, sq, skv) for every case defined on every grid shape."""
    return [pytest.param(c[0], sq, skv, marks=() if n == 0 else pytest.mark.slow)
            for n, (sq, skv) in enumerate(SHAPES) for c in cases_fn(sq, skv)]


# ----------------------------------------------------------------------------------
# Values.


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,sq,skv", grid_cases(mask_cases))
def test_mask_matches_reference(name, sq, skv, mode):
    mask_mod, ref = {c[0]: c[1:] for c in mask_cases(sq, skv)}[name]
    got = evaluate(mask_mod, mode, sq, skv)
    assert got.dtype == jnp.bool_
    want = np.broadcast_to(ref(*np_grid(sq, skv)), (B, H, sq, skv))
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,sq,skv", grid_cases(score_cases))
def test_score_mod_matches_reference(name, sq, skv, mode):
    score_mod, ref = {c[0]: c[1:] for c in score_cases(sq, skv)}[name]
    score = np.random.default_rng(0).normal(scale=20.0, size=(B, H, sq, skv))
    score = score.astype(np.float32)
    got = evaluate(score_mod, mode, sq, skv, jnp.asarray(score))
    assert got.dtype == jnp.float32
    want = ref(score.astype(np.float64), *np_grid(sq, skv))
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=2e-5)


@pytest.mark.parametrize("name", [c[0] for c in score_cases(*SHAPES[0])])
def test_score_mod_keeps_score_dtype(name):
    score_mod = {c[0]: c[1] for c in score_cases(*SHAPES[0])}[name]
    score = jnp.ones((B, H, 4, 5), jnp.bfloat16)
    assert evaluate(score_mod, "broadcast_4d", 4, 5, score).dtype == jnp.bfloat16


def test_alibi_slopes_known_values():
    np.testing.assert_array_equal(mods.alibi_slopes(8), 2.0 ** -np.arange(1, 9))
    known_12 = [
        0.5,
        0.25,
        0.125,
        0.0625,
        0.03125,
        0.015625,
        0.0078125,
        0.00390625,
        0.7071067811865476,
        0.3535533905932738,
        0.1767766952966369,
        0.08838834764831845,
    ]
    np.testing.assert_allclose(mods.alibi_slopes(12), known_12, rtol=1e-15)


@pytest.mark.parametrize("num_heads", [1, 2, 3, 5, 6, 7, 12, 16, 24, 40, 64, 96])
def test_alibi_slopes_match_reference_code(num_heads):
    got = mods.alibi_slopes(num_heads)
    assert isinstance(got, np.ndarray) and got.shape == (num_heads,)
    np.testing.assert_allclose(got, ref_alibi_slopes(num_heads), rtol=1e-14)


T5_CONFIGS = [
    (nb, md, bi)
    for nb in (4, 5, 6, 8, 12, 16, 31, 32, 33, 64, 100)
    for md in (3, 7, 20, 100, 128, 1000)
    for bi in (True, False)
    if md > (nb // 2 if bi else nb) // 2
]


@pytest.mark.parametrize("nb,md,bi", T5_CONFIGS)
def test_t5_bucket_matches_exact_formula(nb, md, bi):
    rel = np.arange(-1500, 1501)
    got = np.asarray(mods.t5_relative_position_bucket(rel, nb, md, bi))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, ref_t5_bucket(rel, bi, nb, md, np.float64))
    assert got.min() >= 0 and got.max() < nb


@pytest.mark.parametrize("bi", [True, False])
def test_t5_bucket_matches_float32_t5_default_config(bi):
    rel = np.arange(-3000, 3001)
    got = np.asarray(mods.t5_relative_position_bucket(rel, 32, 128, bi))
    np.testing.assert_array_equal(got, ref_t5_bucket(rel, bi, 32, 128, np.float32))


def test_t5_bucket_exact_where_float32_log_lands_on_an_integer():
    # log(10 / 1) / log(100 / 1) * 2 == 1 exactly: distance 10 opens the next bucket.
    got = mods.t5_relative_position_bucket(np.array([-10, -9, 9, 10]), 6, 100)
    np.testing.assert_array_equal(np.asarray(got), [2, 1, 4, 5])


# ----------------------------------------------------------------------------------
# Packed documents.


@pytest.mark.parametrize(
    "cu_seqlens",
    [
        np.array([0, 5, 12, 30]),
        np.array([3, 10, 37]),
        np.array([[0, 5, 12, 30], [0, 20, 37, 37]]),
    ],
    ids=["1d_padded_tail", "1d_padded_head", "2d"],
)
@pytest.mark.parametrize("mode", MODES)
def test_document_from_cu_seqlens(cu_seqlens, mode):
    s = 37
    cu = np.broadcast_to(cu_seqlens, (B, cu_seqlens.shape[-1]))
    explicit = np.full((B, s), -1)
    for b in range(B):
        for i in range(cu.shape[1] - 1):
            explicit[b, cu[b, i] : cu[b, i + 1]] = i
    got_ids = masks.segment_ids_from_cu_seqlens(cu_seqlens, s)
    np.testing.assert_array_equal(np.broadcast_to(got_ids, (B, s)), explicit)

    got = np.asarray(evaluate(masks.document_from_cu_seqlens(cu_seqlens, s), mode, s, s))
    kv_explicit = np.where(explicit == -1, -2, explicit)
    via_ids = evaluate(masks.document(explicit, kv_explicit), mode, s, s)
    np.testing.assert_array_equal(got, np.asarray(via_ids))
    b, _, q, kv = np_grid(s, s)
    want = (explicit[b, q] == explicit[b, kv]) & (explicit[b, q] >= 0)
    np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape))
    pad = explicit < 0
    assert not got.transpose(0, 2, 1, 3)[pad].any()  # padding queries see nothing
    assert not got.transpose(0, 3, 1, 2)[pad].any()  # padding keys are seen by none


def test_factories_accept_traced_arrays():
    s = 16

    @jax.jit
    def build(cu, lengths, prefix, ids):
        return [
            evaluate(m, "broadcast_4d", s, s)
            for m in (
                masks.document_from_cu_seqlens(cu, s),
                masks.padding(lengths),
                masks.prefix_lm(prefix),
                masks.document(ids),
            )
        ]

    cu = np.array([0, 6, 11])
    lengths = np.array([3, 16])
    prefix = np.array([2, 9])
    ids = np.repeat(np.arange(4), 4)
    got = build(cu, lengths, prefix, ids)
    want = [
        evaluate(m, "broadcast_4d", s, s)
        for m in (
            masks.document_from_cu_seqlens(cu, s),
            masks.padding(lengths),
            masks.prefix_lm(prefix),
            masks.document(ids),
        )
    ]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# ----------------------------------------------------------------------------------
# Gradients to captured arrays.


def bias_counts(columns, width):
    """(H, width) number of grid cells whose bias reads table[h, column]."""
    counts = np.zeros((H, width))
    for h in range(H):
        np.add.at(counts[h], columns.ravel(), B)
    return counts


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("s_table", [8, 45])
def test_grad_reaches_relative_bias_table(s_table, mode):
    sq, skv = SHAPES[0]
    table = jnp.asarray(np.random.default_rng(1).normal(size=(H, 2 * s_table - 1)))
    score = jnp.zeros((B, H, sq, skv), jnp.float32)

    def total(t):
        return evaluate(mods.relative_bias(t), mode, sq, skv, score).sum()

    _, _, q, kv = np_grid(sq, skv)
    columns = np.clip(kv - q + s_table - 1, 0, 2 * s_table - 2)
    want = bias_counts(columns, 2 * s_table - 1)
    np.testing.assert_allclose(np.asarray(jax.grad(total)(table)), want)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bi", [True, False])
def test_grad_reaches_t5_table(bi, mode):
    sq, skv = SHAPES[0]
    table = jnp.asarray(np.random.default_rng(2).normal(size=(H, 8)), jnp.float32)
    score = jnp.zeros((B, H, sq, skv), jnp.float32)

    def total(t):
        return evaluate(mods.t5_relative_bucket_bias(t, 8, 20, bi), mode, sq, skv, score).sum()

    _, _, q, kv = np_grid(sq, skv)
    want = bias_counts(ref_t5_bucket(kv - q, bi, 8, 20, np.float64), 8)
    np.testing.assert_allclose(np.asarray(jax.grad(total)(table)), want)


def test_grad_reaches_alibi_slopes():
    sq, skv = SHAPES[0]
    score = jnp.zeros((B, H, sq, skv), jnp.float32)

    def total(slopes):
        return evaluate(mods.alibi_from_slopes(slopes), "vmap", sq, skv, score).sum()

    _, _, q, kv = np_grid(sq, skv)
    want = np.full(H, B * (kv - q).sum(dtype=np.float64))
    np.testing.assert_allclose(jax.grad(total)(jnp.ones(H)), want)


# ----------------------------------------------------------------------------------
# Names and argument validation.

IDS = np.array([[0, 0, 1], [0, 1, 1]])


@pytest.mark.parametrize(
    "mod,name",
    [
        (masks.causal, "causal"),
        (masks.chunked_causal(16), "chunked_causal_16"),
        (masks.sliding_window(256), "sliding_window_256_0"),
        (masks.sliding_window(4, 2), "sliding_window_4_2"),
        (masks.prefix_lm(7), "prefix_lm_7"),
        (masks.prefix_lm(np.array([1, 2])), "prefix_lm"),
        (masks.document(IDS), "document"),
        (masks.document_from_cu_seqlens(np.array([0, 3]), 4), "document"),
        (masks.padding(np.array([3, 4])), "padding"),
        (masks.dilated(4), "dilated_4"),
        (mods.soft_cap(30.0), "soft_cap_30"),
        (mods.soft_cap(2.5), "soft_cap_2.5"),
        (mods.alibi(8), "alibi_8h"),
        (mods.alibi_from_slopes(np.ones(12)), "alibi_12h"),
        (mods.relative_bias(np.zeros((2, 7))), "relative_bias"),
        (mods.t5_relative_bucket_bias(np.zeros((2, 32)), 32, 128), "t5_bias_32_128"),
        (
            mods.t5_relative_bucket_bias(np.zeros((2, 32)), 32, 128, False),
            "t5_bias_32_128_unidirectional",
        ),
    ],
)
def test_names(mod, name):
    assert mod.__name__ == name


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: masks.chunked_causal(0), ValueError, "chunk must be >= 1, got 0"),
        (lambda: masks.chunked_causal(2.0), TypeError, "chunk must be an int, got float"),
        (lambda: masks.chunked_causal(True), TypeError, "chunk must be an int, got bool"),
        (lambda: masks.sliding_window(-1), ValueError, "left must be >= 0, got -1"),
        (lambda: masks.sliding_window(3, -2), ValueError, "right must be >= 0, got -2"),
        (lambda: masks.sliding_window(1.5), TypeError, "left must be an int"),
        (lambda: masks.prefix_lm(-1), ValueError, "prefix_len must be >= 0, got -1"),
        (lambda: masks.prefix_lm(np.ones((2, 2), int)), ValueError, r"prefix_len.*\(2, 2\)"),
        (lambda: masks.prefix_lm(np.array([1.0])), TypeError, "prefix_len.*float"),
        (lambda: masks.prefix_lm(2.5), TypeError, "prefix_len"),
        (lambda: masks.document(np.zeros((2, 3, 4), int)), ValueError, "segment_ids.*(2, 3, 4)"),
        (lambda: masks.document(np.zeros(5)), TypeError, "segment_ids must be an integer"),
        (
            lambda: masks.document(np.zeros((2, 5), int), np.zeros((3, 5), int)),
            ValueError,
            "batch size 2 but kv_segment_ids has 3",
        ),
        (
            lambda: masks.document(np.zeros(5, int), np.zeros(5)),
            TypeError,
            "kv_segment_ids must be an integer",
        ),
        (
            lambda: masks.document_from_cu_seqlens(np.array([0.0, 3.0]), 5),
            TypeError,
            "cu_seqlens must be an integer",
        ),
        (lambda: masks.document_from_cu_seqlens(np.array([0]), 5), ValueError, "cu_seqlens"),
        (lambda: masks.document_from_cu_seqlens(np.array([0, 3]), 0), ValueError, "seq_len"),
        (lambda: masks.document_from_cu_seqlens(np.array([0, 3]), 5.0), TypeError, "seq_len"),
        (lambda: masks.padding(np.array([[3]])), ValueError, r"kv_lengths.*\(1, 1\)"),
        (lambda: masks.padding(5), ValueError, r"kv_lengths must have shape \(B,\)"),
        (lambda: masks.padding(np.array([3.0])), TypeError, "kv_lengths must be an integer"),
        (lambda: masks.dilated(0), ValueError, "stride must be >= 1, got 0"),
        (lambda: masks.dilated(None), TypeError, "stride must be an int, got NoneType"),
        (lambda: mods.soft_cap(0), ValueError, "cap must be finite and > 0, got 0"),
        (lambda: mods.soft_cap(-1.0), ValueError, "cap must be finite and > 0"),
        (lambda: mods.soft_cap(float("inf")), ValueError, "cap must be finite"),
        (lambda: mods.soft_cap("3"), TypeError, "cap must be a float, got str"),
        (lambda: mods.alibi(0), ValueError, "num_heads must be >= 1, got 0"),
        (lambda: mods.alibi(2.0), TypeError, "num_heads must be an int, got float"),
        (lambda: mods.alibi_slopes(-3), ValueError, "num_heads"),
        (lambda: mods.alibi_from_slopes(np.ones((2, 2))), ValueError, r"slopes.*\(2, 2\)"),
        (lambda: mods.relative_bias(np.ones((3, 4))), ValueError, r"table.*\(3, 4\)"),
        (lambda: mods.relative_bias(np.ones(5)), ValueError, r"table.*\(5,\)"),
        (lambda: mods.relative_bias(np.ones((3, 5), int)), TypeError, "table must be a floating"),
        (
            lambda: mods.t5_relative_bucket_bias(np.ones((3, 16)), 32, 128),
            ValueError,
            r"table must have shape \(H, num_buckets=32\), got shape \(3, 16\)",
        ),
        (
            lambda: mods.t5_relative_bucket_bias(np.ones((3, 2)), 2, 128),
            ValueError,
            "num_buckets must be >= 4",
        ),
        (
            lambda: mods.t5_relative_bucket_bias(np.ones((3, 32)), 32, 8),
            ValueError,
            "max_distance must be > 8",
        ),
        (
            lambda: mods.t5_relative_bucket_bias(np.ones((3, 32), int), 32, 128),
            TypeError,
            "table must be a floating",
        ),
        (
            lambda: mods.t5_relative_bucket_bias(np.ones((3, 32)), 32.0, 128),
            TypeError,
            "num_buckets must be an int, got float",
        ),
        (
            lambda: mods.t5_relative_position_bucket(0, 32, 1.5),
            TypeError,
            "t5_relative_position_bucket: max_distance must be an int",
        ),
        (
            lambda: mods.t5_relative_position_bucket(0, 1, 4, bidirectional=False),
            ValueError,
            "num_buckets must be >= 2",
        ),
    ],
)
def test_argument_validation(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_public_names():
    assert sorted(masks.__all__) == [
        "causal",
        "causal_bottom_right",
        "causal_with_offset",
        "chunked_causal",
        "dilated",
        "document",
        "document_from_cu_seqlens",
        "padding",
        "prefix_lm",
        "segment_ids_from_cu_seqlens",
        "sliding_window",
        "tree",
    ]
    assert sorted(mods.__all__) == [
        "alibi",
        "alibi_from_slopes",
        "alibi_slopes",
        "relative_bias",
        "soft_cap",
        "t5_relative_bucket_bias",
        "t5_relative_position_bucket",
    ]
    for module in (masks, mods):
        for name in module.__all__:
            assert callable(getattr(module, name))
