"""The quantized pools' error bound, by property tests over random write orders and sizes: with per-(page, head)
scales, every element of a page is its value quantized once with the page's final scale (the scale grows only by
factors that requantize exactly), so int8 stays within half a step of that scale and float8_e4m3fn within 2**-4
of its magnitude; the final scale is at most 3x (int8) / 2x (float8) the page's amax / qmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from flexjax import paged
from flexjax._paged_core import gather

PAGE, MAXP, HKV, D, NUM_PAGES = 8, 4, 2, 4, 8
QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}
_write = jax.jit(paged.write)  # one compile per token count

# One write: (sequence, first position, tokens, magnitude); positions may repeat (an overwrite) and come
# in any order.
WRITE = st.tuples(st.integers(0, 1), st.integers(0, MAXP * PAGE - 12), st.sampled_from([1, 3, 8, 12]),
                  st.sampled_from([0.01, 0.3, 1.0, 1.1, 1.3, 2.0, 5.0, 40.0]))


def _run(dtype, writes, seed):
    rng = np.random.default_rng(seed)
    table = np.array([[0, 2, 4, 6], [1, 3, 5, 7]], np.int32)
    k_pages, v_pages = paged.allocate(NUM_PAGES, PAGE, HKV, D, getattr(jnp, dtype))
    k_scale = v_scale = jnp.zeros((NUM_PAGES, HKV), jnp.float32)
    truth = np.zeros((2, MAXP * PAGE, HKV, D), np.float32)
    written = np.zeros((2, MAXP * PAGE), bool)
    history = np.zeros((NUM_PAGES, HKV), np.float32)  # the largest magnitude each page and head ever held
    for b, start, n, magnitude in writes:
        x = (rng.standard_normal((1, n, HKV, D)) * magnitude).astype(np.float32)
        k_pages, v_pages, k_scale, v_scale = _write(k_pages, v_pages, jnp.asarray(table[b:b + 1]), start,
                                                         jnp.asarray(x), jnp.asarray(x), k_scale=k_scale,
                                                         v_scale=v_scale)
        truth[b, start:start + n] = x[0]
        written[b, start:start + n] = True
        for t in range(start, start + n):
            page = table[b, t // PAGE]
            history[page] = np.maximum(history[page], np.abs(x[0, t - start]).max(-1))
    for pages, scale in ((k_pages, k_scale), (v_pages, v_scale)):
        got = np.asarray(gather(pages, jnp.asarray(table), scale))
        s = np.asarray(scale)
        per_token = s[table][:, :, None, :].repeat(PAGE, 2).reshape(2, MAXP * PAGE, HKV)[..., None]
        err = np.abs(got - truth)[written]
        x = np.abs(truth)[written]
        step = per_token.repeat(D, -1)[written]
        if dtype == "int8":
            assert np.all(err <= step / 2 * (1 + 1e-5) + 1e-30), (err - step / 2).max()  # half a step
        else:
            assert np.all(err <= 2.0 ** -4 * x + 2.0 ** -10 * step * (1 + 1e-5) + 1e-30), err.max()
        used = history > 0
        grow = 3.0 if dtype == "int8" else 2.0
        assert np.all(s[used] <= grow * history[used] / QMAX[dtype] * (1 + 1e-5)), (s[used] / history[used]).max()
        assert np.all(s[used] >= history[used] / QMAX[dtype] * (1 - 1e-6))  # nothing clipped


@settings(deadline=None)
@given(writes=st.lists(WRITE, min_size=1, max_size=10), seed=st.integers(0, 2 ** 16))
def test_int8_pages_within_half_a_step_of_their_final_scale(writes, seed):
    _run("int8", writes, seed)


@settings(deadline=None)
@given(writes=st.lists(WRITE, min_size=1, max_size=10), seed=st.integers(0, 2 ** 16))
def test_float8_pages_within_their_mantissa_of_the_final_scale(writes, seed):
    _run("float8_e4m3fn", writes, seed)


def test_single_token_writes_of_growing_magnitude():
    """The case that broke the old bound: 16 single-token writes to one page, each a little larger (an int8
    scale that grew 15 times, its earlier tokens requantized each time, was off by 2x the promise)."""
    for dtype in ("int8", "float8_e4m3fn"):
        _run(dtype, [(0, t, 1, 1.0 + 0.05 * t) for t in range(PAGE)] * 2, seed=0)


def test_released_pages_start_a_new_scale():
    """A page freed by release (with the scales) and reserved by another sequence is quantized from its new
    content, not from the scale of what it held before."""
    table = jnp.full((2, MAXP), -1, jnp.int32)
    free = jnp.ones(NUM_PAGES, bool)
    k_pages, v_pages = paged.allocate(NUM_PAGES, PAGE, HKV, D, jnp.int8)
    scale = jnp.zeros((NUM_PAGES, HKV), jnp.float32)
    table, free, ok = paged.reserve(table, free, jnp.array([PAGE, 0]), PAGE)
    big = jnp.full((1, PAGE, HKV, D), 50.0)
    k_pages, v_pages, ks, vs = paged.write(k_pages, v_pages, table[:1], 0, big, big, k_scale=scale, v_scale=scale)
    page = int(table[0, 0])
    table, free, ks, vs = paged.release(table, free, jnp.array([True, False]), k_scale=ks, v_scale=vs)
    assert float(ks[page].max()) == 0.0 and bool(free[page])
    table, free, ok = paged.reserve(table, free, jnp.array([0, PAGE]), PAGE)
    assert int(table[1, 0]) == page
    small = jnp.asarray(np.random.default_rng(0).standard_normal((1, PAGE, HKV, D)), jnp.float32)
    k_pages, v_pages, ks, vs = paged.write(k_pages, v_pages, table[1:], 0, small, small, k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(np.asarray(ks[page]), np.abs(np.asarray(small[0])).max((0, 2)) / 127.0, rtol=1e-6)
