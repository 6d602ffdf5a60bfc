"""Page tables and lengths that cannot be right are refused by every paged read, eagerly (ValueError) and
when a jitted step runs (an error carrying the same text); writes past a sequence's pages never land in
another sequence's page."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flexjax import paged

NUM_PAGES, PAGE, HKV, HQ, D, MAXP = 10, 16, 2, 4, 16, 6
B = 2


def _pools():
    keys = jax.random.split(jax.random.key(0), 2)
    return tuple(jax.random.normal(k, (NUM_PAGES, PAGE, HKV, D)) for k in keys)


def _table():
    t = np.full((B, MAXP), -1, np.int32)
    t[0, :3] = [0, 1, 2]
    t[1, :2] = [5, 6]
    return t


def _decode(table, lengths, jit=False):
    k_pages, v_pages = _pools()
    q = jnp.ones((B, 1, HQ, D))
    f = lambda t, n: paged.flex_attention(q, k_pages, v_pages, t, n)  # noqa: E731
    return (jax.jit(f) if jit else f)(jnp.asarray(table), jnp.asarray(lengths, jnp.int32))


def _ragged(table, lengths, jit=False):
    k_pages, v_pages = _pools()
    q = jnp.ones((4, HQ, D))
    cu = jnp.array([0, 1, 2], jnp.int32)
    f = lambda t, n: paged.flex_attention_ragged(q, k_pages, v_pages, t, n, cu)  # noqa: E731
    return (jax.jit(f) if jit else f)(jnp.asarray(table), jnp.asarray(lengths, jnp.int32))


def _write_and_attend(table, lengths, jit=False):
    k_pages, v_pages = _pools()
    q, k_new = jnp.ones((4, HQ, D)), jnp.ones((4, HKV, D))
    cu = jnp.array([0, 1, 2], jnp.int32)
    f = lambda t, n: paged.write_and_attend(q, k_new, k_new, k_pages, v_pages, t, n, cu)[0]  # noqa: E731
    return (jax.jit(f) if jit else f)(jnp.asarray(table), jnp.asarray(lengths, jnp.int32))


CALLS = {"flex_attention": _decode, "flex_attention_ragged": _ragged, "write_and_attend": _write_and_attend}


def _bad_inputs():
    past_pool = _table()
    past_pool[0, 1] = 12  # inside sequence 0's 40 tokens
    past_pool_unread = _table()
    past_pool_unread[1, 5] = 12  # past sequence 1's length: still cannot be right
    return {
        "entry past the pool": (past_pool, [40, 20], r"page_table\[0, 1\] = 12 is past the pool's 10 pages"),
        "entry past the pool, unread": (past_pool_unread, [40, 20], r"page_table\[1, 5\] = 12"),
        "length past the table": (_table(), [100, 20], r"kv_lengths\[0\] = 100 but the page table holds 96"),
        "negative length": (_table(), [40, -1], r"kv_lengths\[1\] = -1"),
        "length reaching an unassigned page": (_table(), [40, 33], r"sequence 1 .* page_table\[1, 2\] = -1 is "
                                                                   r"unassigned.*paged\.reserve"),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
@pytest.mark.parametrize("call", list(CALLS))
def test_bad_tables_and_lengths_are_refused_eagerly(call, case):
    table, lengths, message = _bad_inputs()[case]
    with pytest.raises(ValueError, match=message):
        CALLS[call](table, lengths)


@pytest.mark.parametrize("case", ["entry past the pool", "length past the table", "length reaching an unassigned page"])
@pytest.mark.parametrize("call", list(CALLS))
def test_bad_tables_and_lengths_are_refused_under_jit(call, case):
    table, lengths, message = _bad_inputs()[case]
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(CALLS[call](table, lengths, jit=True))


@pytest.mark.parametrize("call", list(CALLS))
def test_good_tables_pass(call):
    out = CALLS[call](_table(), [40, 20], jit=True)
    assert bool(jnp.all(jnp.isfinite(out)))


def test_runtime_checks_can_be_switched_off():
    table = _table()
    table[0, 1] = 12
    previous = paged.set_runtime_checks(False)
    try:
        jax.block_until_ready(_decode(table, [40, 20], jit=True))  # unchecked: the caller vouches for the table
    finally:
        paged.set_runtime_checks(previous)
    with pytest.raises(ValueError):  # eager calls are always checked
        _decode(table, [40, 20])


def test_page_table_for_leaves_unused_entries_unassigned():
    table = paged.page_table_for([40, 20], PAGE, MAXP, num_pages=NUM_PAGES)
    assert table.tolist() == [[0, 1, 2, -1, -1, -1], [3, 4, -1, -1, -1, -1]]


def test_write_past_a_sequences_pages_lands_nowhere():
    """A write at a position whose page is unassigned is dropped: no other sequence's page changes."""
    k_pages, v_pages = _pools()
    table = jnp.asarray(paged.page_table_for([40, 20], PAGE, MAXP, num_pages=NUM_PAGES))
    k_new = jnp.full((B, HKV, D), 7.0)
    pos = jnp.array([60, 50], jnp.int32)  # both past their pages
    k2, v2 = paged.write(k_pages, v_pages, table, pos, k_new, k_new)
    np.testing.assert_array_equal(np.asarray(k2), np.asarray(k_pages))
    np.testing.assert_array_equal(np.asarray(v2), np.asarray(v_pages))


@pytest.mark.ci_extra  # (make test's budget)
def test_paged_and_ragged_calls_check_scale_and_kernel_options_as_flex_attention_does():
    """One rule for every entry point: a scale that is not a real number is a TypeError, a kernel_options key no
    backend takes a ValueError naming it (before: float(scale) took "0.5" and the paged path passed unknown
    keys to its backend)."""
    k_pages, v_pages = paged.allocate(8, 8, 2, 16)
    table = jnp.asarray(paged.page_table_for([16, 16], 8, 4, num_pages=8))
    q = jnp.ones((B, 1, 4, 16))
    cu = jnp.array([0, 1, 2], jnp.int32)
    lens = jnp.array([16, 16], jnp.int32)
    calls = (lambda **kw: paged.flex_attention(q, k_pages, v_pages, table, lens, **kw),
             lambda **kw: paged.flex_attention_ragged(q[:, 0], k_pages, v_pages, table, lens, cu, **kw))
    for call in calls:
        with pytest.raises(TypeError, match="scale must be a Python float"):
            call(scale="0.5")
        with pytest.raises(TypeError, match="scale must be a Python float"):
            call(scale=jnp.float32(0.5))
        with pytest.raises(ValueError, match="unknown kernel_options key 'blok_q'"):
            call(kernel_options={"blok_q": 16})
        np.testing.assert_allclose(np.asarray(call(scale=0.5)), np.asarray(call(scale=np.float32(0.5))))
