"""The xla backend's C++ CPU kernel (flexjax/backends/xla/cpu) against the dense reference.

The kernel serves the xla backend's forward on AVX-512 CPUs with a C++ compiler; the
backward stays the xla backend's. Every check here first asserts that the kernel really
ran (its FFI call is in the lowered HLO), then compares forward, lse and all gradients
with the reference backend, as tests/test_xla.py does for the XLA loops.
"""

from __future__ import annotations

import contextlib
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from catalog import BY_NAME, CATALOG, build, check_case, inputs, loss_and_grads
from checks import assert_close

import flexjax
from flexjax import masks, mods
from flexjax.backends.xla import cpu

pytestmark = pytest.mark.skipif(not cpu.usable(), reason="no AVX-512 CPU or no C++ compiler")

# Head dims the kernel takes (Dv a multiple of 16), ragged lengths and GQA.
KSHAPES = {
    "mha": (2, 192, 192, 4, 4, 16, 16),
    "gqa_ragged": (2, 130, 250, 4, 2, 24, 32),
    "mqa_ragged": (1, 201, 97, 4, 1, 8, 16),
}


def _lowered(case, shape, **kw):
    _, params, attention = build(case, shape)
    q, k, v, _ = inputs(shape, jnp.float32)
    return jax.jit(lambda q, k, v, p: attention(q, k, v, p, **kw)).lower(q, k, v, params).as_text()


def _assert_kernel(case, shape, **kw):
    assert "flexjax_cpu_forward" in _lowered(case, shape, backend="xla", **kw), "the C++ kernel did not run"


_GRID = [(c.name, s) for n, c in enumerate(CATALOG) for s in [list(KSHAPES)[n % len(KSHAPES)]]]


# Default suite: the cases whose mods or lists differ most; `make test-all` runs the rest
# ("full", "causal" and "prefix_lm" masks are also served by the kernel in the other files).
_DEFAULT = ("causal+soft_cap", "document+t5", "per_head_mask+relative_bias")


@pytest.mark.parametrize("name,shape", [
    pytest.param(c, s, id=f"{c}-{s}", marks=() if c in _DEFAULT else pytest.mark.slow) for c, s in _GRID])
def test_catalog_float32(name, shape):
    _assert_kernel(BY_NAME[name], KSHAPES[shape])
    check_case("xla", name, KSHAPES[shape])


@pytest.mark.slow  # `make test-all`; the catalog grid above covers the default suite
@pytest.mark.parametrize("name", ["causal+soft_cap", "document+t5", "sliding_window+alibi"])
def test_catalog_bfloat16(name):
    check_case("xla", name, KSHAPES["gqa_ragged"], jnp.bfloat16)


@pytest.mark.slow  # `make test-all`; the catalog grid above covers the default suite
@pytest.mark.parametrize("block_size", [(128, 128), (32, 64), (128, 64)])
def test_block_sizes(block_size):
    """Mask blocks other than 64, including row tiles that are not a multiple of 64."""
    shape = (1, 300, 300, 2, 2, 64, 64)
    for name in ("causal", "sliding_window+alibi", "prefix_lm+relative_bias"):
        check_case("xla", name, shape, block_size=block_size)


@pytest.mark.slow  # `make test-all`; the catalog grid above covers the default suite
def test_wide_heads():
    """D and Dv of 128 and 80 (Dv 64 + 16)."""
    check_case("xla", "causal+soft_cap", (1, 160, 160, 2, 1, 128, 80))


def _dense(q, k, v, score_mod, mask_mod):
    """Reference attention through the reference backend (a dense S x S mask)."""
    B, Sq, H, _ = q.shape
    bm = flexjax.create_block_mask(mask_mod, None, None, Sq, k.shape[1]) if mask_mod else None
    return flexjax.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, backend="reference")


def _compare(score_mod=None, mask_mod=None, S=150, H=2, D=16, atol=3e-5):
    q, k, v, _ = inputs((1, S, S, H, H, D, D), jnp.float32, seed=3)
    bm = flexjax.create_block_mask(mask_mod, None, None, S, S, block_size=32) if mask_mod else None
    f = jax.jit(lambda q, k, v: flexjax.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm))
    assert "flexjax_cpu_forward" in f.lower(q, k, v).as_text()
    ref = jax.jit(lambda q, k, v: flexjax.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,
                                                         backend="reference"))
    np.testing.assert_allclose(np.asarray(f(q, k, v)), np.asarray(ref(q, k, v)), atol=atol, rtol=1e-5)


def test_integer_primitives_in_masks():
    """Division and remainder (negative operands, by zero), min/max, abs, clamp, shifts, xor, select_n."""
    zero = jnp.int32(0)

    def mask(b, h, q, kv):
        d = q - kv
        by_zero = (d // (zero * q)) == -1  # XLA: x // 0 == -1 ... via lax.div below
        a = (jax.lax.div(d, 7) + jax.lax.rem(d, -5) + jax.lax.div(q, zero * kv) + jax.lax.rem(kv, zero * q)) % 3 != 1
        c = jnp.clip(d, -20, 30) > jnp.maximum(jnp.minimum(q, kv) // 9, 2)
        e = ((q >> 2) ^ (kv << 1)) & 7
        f = jnp.where(e > 3, jnp.abs(d) < 60, (q + kv) % 4 == 0)
        return (a | c | by_zero) & f | (q == kv)

    _compare(mask_mod=mask)


def test_float_primitives_in_score_mods():
    """Transcendental functions, powers, comparisons, casts and float <-> int conversions."""

    def score(s, b, h, q, kv):
        x = s / 4.0
        t = (jnp.tanh(x) + jax.nn.sigmoid(x) + jnp.exp(-jnp.abs(x)) + jnp.log1p(x * x) + jnp.sqrt(jnp.abs(x))
             + jnp.expm1(x * 0.1) + jax.lax.rsqrt(1.0 + x * x) + x ** 3 + jnp.sign(x) + jnp.floor(x) * 0.01)
        i = (s * 3.0).astype(jnp.int32)  # truncation toward zero
        w = jnp.where(i % 2 == 0, t, -t) + (q - kv).astype(jnp.float32) * 0.01
        return jnp.maximum(w, -3.0) + jnp.minimum(s, 1.0) + jax.nn.relu(s) + jnp.clip(s, -0.5, 0.5) ** 2

    _compare(score_mod=score, mask_mod=masks.causal)


def test_captured_arrays():
    """Reads of captured tables: per head, per (q, kv) with clamped out-of-range indices, 0-d scalars, bools."""
    S = 150
    table = jax.random.normal(jax.random.PRNGKey(1), (2, 2 * S - 1)) * 0.5
    grid = jax.random.normal(jax.random.PRNGKey(2), (S // 2, S // 2))
    temp = jnp.asarray(0.7, jnp.float32)
    keep = jax.random.bernoulli(jax.random.PRNGKey(3), 0.8, (S,))
    ids = jnp.asarray(np.repeat(np.arange(5), S // 5), jnp.int32)

    def score(s, b, h, q, kv):
        # grid[q, kv] reads past its end for q, kv >= 75: indices clamp, as in XLA.
        return s * temp + table[h, kv - q + S - 1] + grid[q, kv]

    def mask(b, h, q, kv):
        return (ids[q] == ids[kv]) & keep[kv] & (kv <= q)

    _compare(score_mod=score, mask_mod=mask)


@pytest.mark.slow  # `make test-all`; the catalog grid above covers the default suite
def test_library_mods():
    _compare(score_mod=mods.alibi(2), mask_mod=flexjax.and_masks(masks.causal, masks.sliding_window(40)))
    _compare(score_mod=mods.soft_cap(5.0), mask_mod=flexjax.or_masks(masks.prefix_lm(20), masks.causal))
    _compare(mask_mod=masks.chunked_causal(33))


def test_untranslatable_mod_runs_the_xla_loops():
    """A primitive without a C++ translation: the XLA loops run instead, with the same result."""

    def score(s, b, h, q, kv):
        return s + jnp.arctan2(q.astype(jnp.float32), kv.astype(jnp.float32) + 1.0)

    q, k, v, _ = inputs((1, 96, 96, 2, 2, 16, 16), jnp.float32)
    f = jax.jit(lambda q, k, v: flexjax.flex_attention(q, k, v, score_mod=score))
    assert "flexjax_cpu_forward" not in f.lower(q, k, v).as_text()
    ref = flexjax.flex_attention(q, k, v, score_mod=score, backend="reference")
    np.testing.assert_allclose(np.asarray(f(q, k, v)), np.asarray(ref), atol=3e-5, rtol=1e-5)
    from flexjax._trace import trace_mod
    traced = trace_mod(score, "score", arg_name="score_mod")
    with pytest.raises(NotImplementedError, match="atan2"):
        cpu._codegen.generate(traced.static(), ())


def test_switches():
    case, shape = BY_NAME["causal"], KSHAPES["mha"]
    assert "flexjax_cpu_forward" not in _lowered(case, shape, backend="xla", kernel_options={"cpu_kernel": False})
    with pytest.raises(ValueError, match="cpu_kernel"):
        _lowered(case, shape, backend="xla", kernel_options={"cpu_kernel": 1})
    # Explicit forward tiles ask for the XLA loops' tiling.
    assert "flexjax_cpu_forward" not in _lowered(case, shape, backend="xla", kernel_options={"block_q": 128})


def test_vmap_and_traced_block_mask():
    """vmap over an extra axis, and a BlockMask passed into jit as an argument."""
    shape = (1, 160, 160, 2, 2, 16, 16)
    q, k, v, _ = inputs(shape, jnp.float32)
    bm = flexjax.create_block_mask(masks.causal, None, None, 160, 160, block_size=32)

    def attn(q, k, v, bm, backend="xla"):
        return flexjax.flex_attention(q, k, v, score_mod=mods.soft_cap(3.0), block_mask=bm, backend=backend)

    f = jax.jit(jax.vmap(attn, in_axes=(0, None, None, None)))
    qs = jnp.stack([q, 2 * q])
    assert "flexjax_cpu_forward" in f.lower(qs, k, v, bm).as_text()
    got = f(qs, k, v, bm)
    for i in range(2):
        want = attn(qs[i], k, v, bm, backend="reference")
        np.testing.assert_allclose(np.asarray(got[i]), np.asarray(want), atol=3e-5, rtol=1e-5)


def test_fully_masked_and_neg_inf_rows():
    """Rows with no allowed key (out 0, lse -inf) and score_mods returning -inf, with default tiles."""
    for name in ("fully_masked_rows", "neg_inf_score"):
        _assert_kernel(BY_NAME[name], KSHAPES["mha"])
        check_case("xla", name, KSHAPES["mha"])


@pytest.mark.slow  # `make test-all`; the catalog grid above covers the default suite
def test_bf16_lse_and_gradients_match_loops():
    """The kernel and the XLA loops agree closely (the backward is shared)."""
    name, shape = "document+t5", KSHAPES["gqa_ragged"]
    _, params, attention = build(BY_NAME[name], shape)
    q, k, v, do = inputs(shape, jnp.float32)
    a = loss_and_grads(attention, q, k, v, do, params, backend="xla")
    b = loss_and_grads(attention, q, k, v, do, params, backend="xla", kernel_options={"cpu_kernel": False})
    assert_close(name, a, b, b, jnp.float32)


def _grad_hlo(case, shape, **kw):
    _, params, attention = build(case, shape)
    q, k, v, do = inputs(shape, jnp.float32)

    def loss(q, k, v, p):
        return jnp.sum(attention(q, k, v, p, backend="xla", **kw)[0] * do)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(q, k, v, params).as_text()


@pytest.mark.ci_extra  # (make test-extra: 3-9 s; cheaper siblings run in make test)
def test_backward_kernel_runs_unless_captured_arrays_need_gradients():
    """dq, dk, dv come from the C++ backward; a learned table's gradient sends the call to the XLA loops."""
    shape = (1, 150, 150, 4, 2, 16, 32)
    for name in ("sliding_window+alibi", "document+t5"):
        hlo = _grad_hlo(BY_NAME[name], shape)
        assert ("flexjax_cpu_backward" in hlo) == (name != "document+t5"), name
        check_case("xla", name, shape)
    assert "flexjax_cpu_backward" not in _grad_hlo(BY_NAME["causal"], shape, kernel_options={"cpu_kernel": False})


# prepass in make test-all, per_tile in make test-extra (make test's budget): "auto", which most backward tests
# take, is the prepass.
@pytest.mark.parametrize("prep", [pytest.param("prepass", marks=pytest.mark.slow),
                                  pytest.param("per_tile", marks=pytest.mark.ci_extra)])
def test_backward_prepares_q_do_and_delta_both_ways(prep, monkeypatch):
    """The backward's transposed q and dO and its delta come from a prepass (many visits per q
    tile) or from each visit (narrow bands, where the lists visit a q tile at most 4 times on
    average): forward, lse and every gradient match the reference either way (ragged GQA,
    a score_mod VJP, partial and full tiles)."""
    monkeypatch.setattr(cpu, "_BWD_PREP", prep)
    jax.clear_caches()
    shape = (1, 150, 150, 4, 2, 16, 32)  # ragged, GQA; head dims the backward kernel takes
    hlo = _grad_hlo(BY_NAME["sliding_window+alibi"], shape)
    assert "flexjax_cpu_backward" in hlo
    assert f"prep = {1 if prep == 'prepass' else 2} : i64" in hlo, "the backward did not take the mode asked for"
    check_case("xla", "sliding_window+alibi", shape)


def _decode_case(B, Sq, Hq, Hkv, D, Skv, lengths, seed=0):
    """Decode-shaped inputs and a per-head, per-query score_mod with a captured table (it reads
    h and q_idx, so packed tiles must give every lane its own head and position)."""
    ks = jax.random.split(jax.random.key(seed), 5)
    q, do = (jax.random.normal(kk, (B, Sq, Hq, D)) for kk in ks[:2])
    k, v = (jax.random.normal(kk, (B, Skv, Hkv, D)) for kk in ks[2:4])
    slopes = jax.random.uniform(ks[4], (Hq,), minval=0.01, maxval=0.2)
    lengths = jnp.asarray(lengths, jnp.int32)
    mask = flexjax.and_masks(masks.padding(lengths), masks.causal_bottom_right(Sq, lengths))

    def score(s, b, h, q_idx, kv_idx):
        return s - slopes[h] * jnp.abs(q_idx + lengths[b] - Sq - kv_idx).astype(s.dtype) + 0.1 * (h % 3)

    return q, k, v, do, mask, score


def _decode_check(q, k, v, do, bm, score, what):
    def loss(q, k, v, backend):
        out, lse = flexjax.flex_attention(q, k, v, score, bm, return_lse=True, backend=backend)
        return jnp.sum(out * do) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
    assert "flexjax_cpu_forward" in run.lower(q, k, v, "xla").as_text(), "the C++ kernel did not run"
    (_, got_aux), got = run(q, k, v, "xla")
    (_, want_aux), want = run(q, k, v, "reference")
    assert_close(what, (got_aux, got), (want_aux, want), (want_aux, want), jnp.float32)


@pytest.mark.parametrize("sq", [1, pytest.param(5, marks=pytest.mark.slow), 17])
def test_decode_tiles_pack_gqa_heads(sq, monkeypatch):
    """Few queries: a GQA group's heads share one tile's rows (mods read h and q_idx per lane;
    at Sq=17 a 16-lane group straddles two heads), ragged lengths, forward, lse and gradients."""
    packed = []
    real = cpu._packed_address
    monkeypatch.setattr(cpu, "_packed_address", lambda *a: packed.append(real(*a)) or packed[-1])
    q, k, v, do, mask, score = _decode_case(2, sq, 8, 2, 32, 300, [300, 77])
    bm = flexjax.create_block_mask(mask, 2, None, sq, 300, block_size=(32, 64))
    _decode_check(q, k, v, do, bm, score, f"packed decode sq={sq}")
    assert packed and all(packed), "no packed mod variant was built"


@pytest.mark.ci_extra  # (make test's 5-minute budget: 4-8 s here; make test reached 5:05)
def test_decode_splits_the_kv_range():
    """One sequence and one kv head: the tile list is split into shares run in parallel and
    merged by their row maxima; shares where a head has no allowed key (its score_mod gives
    -inf past key 40) and a sequence of length 0 (every row fully masked)."""
    q, k, v, do, mask, score = _decode_case(2, 2, 4, 1, 16, 2048, [2048, 0], seed=1)

    def gated(s, b, h, q_idx, kv_idx):
        return jnp.where((h == 1) & (kv_idx > 40), -jnp.inf, score(s, b, h, q_idx, kv_idx))

    bm = flexjax.create_block_mask(mask, 2, None, 2, 2048, block_size=64)
    _decode_check(q, k, v, do, bm, gated, "split decode")
    # The cache idiom: a block mask built once, a traced position per step.
    full = flexjax.create_block_mask(masks.causal, None, None, 2048, 2048, block_size=64)
    q1 = q[:1, :1]

    @jax.jit
    def step(q1, k, v, pos):
        return flexjax.flex_attention(q1, k, v, block_mask=flexjax.paged.decode_block_mask(full, pos))

    assert "flexjax_cpu_forward" in step.lower(q1, k[:1], v[:1], jnp.int32(5)).as_text()
    for pos in (5, 1000, 2047):
        want = flexjax.flex_attention(q1, k[:1], v[:1], backend="reference", block_mask=flexjax.create_block_mask(
            masks.causal_with_offset(pos), None, None, 1, 2048, block_size=64))
        assert_close(f"step {pos}", step(q1, k[:1], v[:1], jnp.int32(pos)), want, want, jnp.float32)


def _thread_masks():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            out[int(tid)] = os.sched_getaffinity(int(tid))
    return out


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and 2 CPUs")
def test_parallel_runs_leave_thread_affinity_as_it_was():
    """A pool task that lands on its caller's CPU moves off it for the run and restores its
    affinity afterwards: after many parallel decode steps, each right after a parallel XLA
    reduction (the pattern that lands the task there), every thread's mask is what it was,
    and every step gives the same result."""
    q, k, v, _, _, _ = _decode_case(2, 2, 8, 2, 64, 4096, [4096, 3000], seed=3)
    full = flexjax.create_block_mask(masks.causal, None, None, 4096, 4096)
    step = jax.jit(lambda q, k, v, pos: flexjax.flex_attention(
        q, k, v, block_mask=flexjax.paged.decode_block_mask(full, pos)))
    pos = jnp.array([4095, 2999], jnp.int32)
    q1 = q[:, :1]
    assert "flexjax_cpu_forward" in step.lower(q1, k, v, pos).as_text()
    big = jnp.ones((1 << 24,), jnp.float32)
    reduce = jax.jit(lambda x: x.sum())
    first = np.asarray(step(q1, k, v, pos))
    before, process = _thread_masks(), os.sched_getaffinity(0)
    for _ in range(40):
        reduce(big).block_until_ready()
        np.testing.assert_array_equal(np.asarray(step(q1, k, v, pos)), first)
    for tid, mask in _thread_masks().items():
        assert mask == before.get(tid, process), f"thread {tid}: affinity {mask}, was {before.get(tid, process)}"


# float32 in make test-all, bfloat16 in make test-extra (make test's budget): bfloat16 takes the same packing
# and widens its rows.
@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, marks=pytest.mark.slow),
                                   pytest.param(jnp.bfloat16, marks=pytest.mark.ci_extra)])
def test_decode_tiles_without_mods_pack_their_scores(dtype):
    """No score_mod: full decode tiles keep only their rows' scores, 16 / w columns to a vector
    (w: the tile's rows rounded up to a power of two; GQA groups of 1, 2, 3, 4 and 8 rows),
    while the diagonal tiles of the same items, masked, keep 16 lanes a column. Tiles of 36
    columns leave a vector's tail past the last column. The cache idiom (a causal block mask
    for the cache, each sequence's row at its own position), split shares; forward and lse
    against the reference on the same inputs, and (float32) gradients."""
    L = 300
    full = flexjax.create_block_mask(masks.causal, None, None, L, L, block_size=36)
    pos = jnp.array([250, 76], jnp.int32)  # (q blocks whose rows all lie below L: full tiles)
    # (The last two cases' scores spread over hundreds, and lie far below 0: a row max short
    # of its row's largest score would overflow exp, and one past it, from any other lane,
    # underflow every term.)
    cases = [(2, 2, 1, ""), (4, 2, 1, ""), (6, 2, 1, ""), (8, 2, 1, ""), (8, 2, 2, ""), (4, 2, 1, "spread"),
             (4, 2, 1, "far")]
    for hq, hkv, sq, kind in cases:
        q, k, v, _, _, _ = _decode_case(2, sq, hq, hkv, 32, L, [L, 77], seed=hq + sq)
        if kind == "spread":
            q = 40 * q
        if kind == "far":
            q, k = -40 * jnp.abs(q), jnp.abs(k)
        q, k, v = (x.astype(dtype) for x in (q, k, v))
        bm = flexjax.paged.decode_block_mask(full, pos, sq)
        assert int(bm.full_kv_num_blocks[0, 0, 0]) == 6 and int(bm.kv_num_blocks[0, 0, 0]) == 1
        run = jax.jit(lambda q, k, v, backend: flexjax.flex_attention(q, k, v, block_mask=bm, return_lse=True,
                                                                      backend=backend), static_argnums=3)
        assert "flexjax_cpu_forward" in run.lower(q, k, v, "xla").as_text(), "the C++ kernel did not run"
        got, want = run(q, k, v, "xla"), run(q, k, v, "reference")
        assert_close(f"{jnp.dtype(dtype).name} decode hq={hq} sq={sq} {kind}", got, want, want, dtype)
        if dtype == jnp.float32 and kind == "" and (hq, sq) in ((4, 1), (8, 2)):  # through its residuals
            do = jax.random.normal(jax.random.key(hq), got[0].shape)
            grads = jax.jit(jax.grad(lambda q, k, v, backend: jnp.sum(run(q, k, v, backend)[0] * do),
                                     argnums=(0, 1, 2)), static_argnums=3)
            want_g = grads(q, k, v, "reference")
            assert_close(f"decode grads hq={hq} sq={sq}", grads(q, k, v, "xla"), want_g, want_g, dtype)


# Both in make test-all, for make test's budget ("1": the AMD AVX512-BF16 form forced; "0": the
# widened rows, which test_decode_tiles_without_mods_pack_their_scores[bfloat16] runs by default).
@pytest.mark.parametrize("pair", [pytest.param("1", marks=pytest.mark.slow), pytest.param("0", marks=pytest.mark.slow)])
def test_decode_bfloat16_pair_products(pair, monkeypatch):
    """A bfloat16 cache on a CPU with AVX512-BF16 and pair products on: the decode product dots
    query rows that hold bfloat16 values with the keys two elements a lane, and takes P V two
    kv rows at a time with P rounded to bfloat16 (as the GPU kernels take P in the value
    dtype); with them off (or without AVX512-BF16), the split products (32 bfloat16 elements a
    load, split into their even and odd ones, query rows and O held in that order), on the same
    checks. Windows of 7
    keys at odd positions put the ranges' ends on odd rows, in tiles of 36 and a last tile of
    17 rows; the rows just outside each range hold NaN, which a pair's partner row must not
    read. GQA groups of 1, 2, 4 and 8 rows (packed scores) and a score_mod (16 lanes a
    column), head dims of 64, 48 (neither pair nor split products: the widened ones) and 96
    (a 64-column slab and a 32-column one), two kv heads an item; against the reference on the
    same values, within what rounding P to bfloat16 allows."""
    L, W = 305, 7
    win = flexjax.create_block_mask(masks.sliding_window(W), None, None, L, L, block_size=36)
    pos = jnp.array([303, 100, 41], jnp.int32)  # windows [297, 303], [94, 100], [35, 41]
    kv = jnp.arange(L)
    poison = (kv[None, :] == pos[:, None] - W - 1) | (kv[None, :] == pos[:, None] + 1)  # rows just outside

    def shift(s, b, h, q_idx, kv_idx):
        return s + 0.25 * ((h + kv_idx) % 3).astype(s.dtype)

    monkeypatch.setenv("FLEXJAX_CPU_PAIR_PRODUCTS", pair)
    assert cpu.pair_products() == (pair == "1")
    cases = [(1, 1, 64, None), (2, 1, 64, None), (4, 1, 64, None), (8, 1, 64, None), (4, 1, 64, shift),
             (4, 1, 48, None), (4, 2, 96, None)]
    if pair == "1" and not _cpu_flag("avx512_bf16"):
        cases = cases[-1:]  # (no pair products on this CPU: the same kernel path as pair "0" runs)
    for g, hkv, d, score in cases:
        ks = jax.random.split(jax.random.key(g * d), 3)
        q = jax.random.normal(ks[0], (3, 1, g * hkv, d)).astype(jnp.bfloat16)
        k, v = (jax.random.normal(kk, (3, L, hkv, d)).astype(jnp.bfloat16) for kk in ks[1:])
        kp, vp = (jnp.where(poison[:, :, None, None], jnp.nan, x).astype(jnp.bfloat16) for x in (k, v))
        bm = flexjax.paged.decode_block_mask(win, pos)
        run = jax.jit(lambda q, k, v, backend: flexjax.flex_attention(q, k, v, score, bm, return_lse=True,
                                                                      backend=backend), static_argnums=3)
        assert "flexjax_cpu_forward" in run.lower(q, kp, vp, "xla").as_text(), "the C++ kernel did not run"
        # (The reference's dense P V multiplies the masked NaN rows by 0: it runs on the clean cache.)
        (out, lse), (want, want_lse) = run(q, kp, vp, "xla"), run(q, k, v, "reference")
        out, want = out.astype(jnp.float32), want.astype(jnp.float32)
        what = f"g={g} hkv={hkv} d={d} score={score is not None}"
        assert bool(jnp.isfinite(out).all()), f"{what}: a row outside the range reached the output"
        # P rounded to bfloat16 moves each term by 2^-9 of p |v| at most, and the bfloat16
        # output rounds by 2^-9 of |out|: within 1% of the largest |out|, where a row lost or
        # misplaced (a 7th of the weight) moves an output row by ~0.1.
        err, tol = float(jnp.abs(out - want).max()), 1e-2 * max(1.0, float(jnp.abs(want).max()))
        assert err < tol, f"{what}: max abs error {err} (tolerance {tol})"
        assert float(jnp.abs(lse - want_lse).max()) < 1e-3, what


def _cpu_flag(name):
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and f" {name} " in f" {line.split(':', 1)[1].strip()} " for line in f)


def test_pair_products_switch(monkeypatch):
    """FLEXJAX_CPU_PAIR_PRODUCTS picks the products (checked: 0 or 1), and the choice reaches
    the kernel: on a CPU with AVX512-BF16 the two give different roundings (P in bfloat16 or
    float32) of the same attention, each close to the reference."""
    monkeypatch.setenv("FLEXJAX_CPU_PAIR_PRODUCTS", "yes")
    with pytest.raises(ValueError, match="FLEXJAX_CPU_PAIR_PRODUCTS"):
        cpu.pair_products()
    L = 512
    ks = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(ks[0], (2, 1, 8, 64)).astype(jnp.bfloat16)
    k, v = (jax.random.normal(kk, (2, L, 2, 64)).astype(jnp.bfloat16) for kk in ks[1:])
    bm = flexjax.paged.decode_block_mask(flexjax.create_block_mask(masks.causal, None, None, L, L),
                                         jnp.array([L - 1, 300], jnp.int32))
    outs = {}
    for pair in ("1", "0"):
        monkeypatch.setenv("FLEXJAX_CPU_PAIR_PRODUCTS", pair)
        run = jax.jit(lambda q, k, v: flexjax.flex_attention(q, k, v, block_mask=bm, return_lse=True))
        assert "flexjax_cpu_forward" in run.lower(q, k, v).as_text()
        outs[pair] = run(q, k, v)
    want, want_lse = flexjax.flex_attention(q, k, v, block_mask=bm, return_lse=True, backend="reference")
    for pair, (out, lse) in outs.items():
        assert_close(f"pair={pair}", out, want, want, jnp.bfloat16)
        assert float(jnp.abs(lse - want_lse).max()) < 1e-3
    if _cpu_flag("avx512_bf16"):
        f32 = {p: np.asarray(o.astype(jnp.float32)) for p, (o, _) in outs.items()}
        assert not np.array_equal(f32["1"], f32["0"]), "FLEXJAX_CPU_PAIR_PRODUCTS did not reach the kernel"


@pytest.mark.parametrize("dtype,sq", [(jnp.bfloat16, 1), (jnp.float16, 1), (jnp.bfloat16, 17),
                                      pytest.param(jnp.float16, 17, marks=pytest.mark.slow)])
def test_decode_reads_16bit_caches_in_place(dtype, sq):
    """bfloat16 and float16 caches: the forward kernel reads them as they are (no float32 copy
    of the cache in the program), widening each tile's rows exactly; packed heads (Sq=1: the
    dot-form product; Sq=17: the widened lane-broadcast one), ragged lengths, per-head and
    per-query mods, split shares (B=1) and several kv heads per item; forward and lse
    against the reference on the same 16-bit inputs, and the gradients."""
    q, k, v, do, mask, score = _decode_case(1, sq, 8, 2, 32, 700, [650], seed=2)
    q, k, v, do = (x.astype(dtype) for x in (q, k, v, do))
    bm = flexjax.create_block_mask(mask, 1, None, sq, 700, block_size=(32, 64))

    def loss(q, k, v, backend):
        out, lse = flexjax.flex_attention(q, k, v, score, bm, return_lse=True, backend=backend)
        return jnp.sum(out.astype(jnp.float32) * do), (out, lse)

    fwd = jax.jit(lambda q, k, v: loss(q, k, v, "xla"))
    hlo = fwd.lower(q, k, v).compile().as_text()
    assert "flexjax_cpu_forward" in hlo, "the C++ kernel did not run"
    assert "f32[1,700,2,32]" not in hlo, "the forward converted the cache to float32 whole"
    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
    (_, got_aux), got = run(q, k, v, "xla")
    (_, want_aux), want = run(q, k, v, "reference")
    assert_close(f"{jnp.dtype(dtype).name} decode sq={sq}", (got_aux, got), (want_aux, want), (want_aux, want),
                 dtype)


def test_16bit_caches_with_per_head_lists():
    """Per-head block masks (one head per tile, no packing) over a bfloat16 cache, at Sq=3 (the
    dot-form product) and Sq=40 (rows widened for the lane-broadcast one): the cache is read as
    it is, and the forward matches the reference on the same inputs."""
    B, L, Hq, Hkv, D = 2, 333, 4, 2, 32
    for sq in (3, 40):
        ks = jax.random.split(jax.random.key(sq), 3)
        q = jax.random.normal(ks[0], (B, sq, Hq, D), jnp.bfloat16)
        k, v = (jax.random.normal(kk, (B, L, Hkv, D), jnp.bfloat16) for kk in ks[1:])

        def window(b, h, q_idx, kv_idx, sq=sq):  # a window per head, at the end of the cache
            pos = q_idx + L - sq
            return (pos >= kv_idx) & (kv_idx > pos - 100 - 37 * h)

        bm = flexjax.create_block_mask(window, B, Hq, sq, L, block_size=(64, 32))
        f = jax.jit(lambda q, k, v, bm=bm: flexjax.flex_attention(q, k, v, block_mask=bm))
        hlo = f.lower(q, k, v).compile().as_text()
        assert "flexjax_cpu_forward" in hlo and f"f32[{B},{L},{Hkv},{D}]" not in hlo
        want = flexjax.flex_attention(q, k, v, block_mask=bm, backend="reference")
        assert_close(f"per-head bf16 sq={sq}", f(q, k, v), want, want, jnp.bfloat16)


def test_paged_decode_over_bfloat16_pools():
    """flexjax.paged over bfloat16 pools: the kernel reads the pages in place, as for float32."""
    lengths = np.array([300, 45])
    table = jnp.asarray(flexjax.paged.page_table_for(lengths, 64, 6, num_pages=14, seed=3))
    ks = jax.random.split(jax.random.key(3), 3)
    k_pages, v_pages = (jax.random.normal(kk, (14, 64, 2, 32), jnp.bfloat16) for kk in ks[:2])
    q = jax.random.normal(ks[2], (2, 1, 8, 32), jnp.bfloat16)
    lens = jnp.asarray(lengths, jnp.int32)
    bm = flexjax.create_block_mask(masks.causal_bottom_right(1, lens), 2, None, 1, 384, block_size=(16, 64))

    @functools.partial(jax.jit, static_argnums=0)
    def step(backend, q, k_pages, v_pages):
        return flexjax.paged.flex_attention(q, k_pages, v_pages, table, lens, block_mask=bm, backend=backend)

    hlo = step.lower("xla", q, k_pages, v_pages).compile().as_text()
    assert "flexjax_cpu_forward" in hlo and "f32[14,64,2,32]" not in hlo
    want = flexjax.flex_attention(q, *(p[table].reshape(2, 384, 2, 32) for p in (k_pages, v_pages)), block_mask=bm,
                                  backend="reference")
    assert_close("paged bf16", step("xla", q, k_pages, v_pages), want, want, jnp.bfloat16)


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 (simulated) devices")
def test_kernel_stays_out_of_calls_xla_partitions():
    """XLA's partitioner cannot split an FFI call (it would gather q, k and v onto every
    device): head-sharded arrays on Auto axes, with and without a mesh set, take the XLA
    path, with nothing but the loss gathered; one device takes the kernel."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("m",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    q, k, v, _ = inputs((1, 128, 128, 4, 4, 16, 16), jnp.float32)
    bm = flexjax.create_block_mask(masks.causal, None, None, 128, 128, block_size=32)
    f = jax.jit(lambda q, k, v: flexjax.flex_attention(q, k, v, mods.soft_cap(5.0), bm))
    assert "flexjax_cpu_forward" in f.lower(q, k, v).compile().as_text()
    want = f(q, k, v)
    sharded = [jax.device_put(x, NamedSharding(mesh, P(None, None, "m", None))) for x in (q, k, v)]
    for set_mesh in (False, True):
        with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
            g = jax.jit(lambda q, k, v: flexjax.flex_attention(q, k, v, mods.soft_cap(5.0), bm))
            text = g.lower(*sharded).compile().as_text()
            got = g(*sharded)
        assert "flexjax_cpu_forward" not in text and "all-gather" not in text, set_mesh
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-6)
