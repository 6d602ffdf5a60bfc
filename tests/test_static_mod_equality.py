"""StaticMod equality, the key of every compiled-kernel cache: two mods equal only when they compute the same,
including the values of arrays a nested ``jax.jit`` in the mod closes over (its jaxpr prints their shapes only)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flexjax
from flexjax._trace import trace_mod


def _table_mod(values, short_names=False):
    table = np.asarray(values, np.float32)
    inner = jax.jit(lambda kv: jnp.asarray(table)[kv])  # the table is baked into the nested jaxpr

    def bias(score, b, h, q_idx, kv_idx):
        return score + inner(kv_idx)

    def bias_short(s, b, h, q, kv):
        return s + inner(kv)

    return bias_short if short_names else bias


def test_mods_differing_only_in_a_nested_jit_constant_are_not_equal():
    a, b, a2 = (_table_mod(np.arange(16.0) * f) for f in (1.0, 3.0, 1.0))
    sa, sb, sa2 = (trace_mod(m, "score", arg_name="score_mod").static() for m in (a, b, a2))
    assert sa != sb and hash(sa) != hash(sb)
    assert sa == sa2 and hash(sa) == hash(sa2)  # the same values: the same kernels (jit caches hit)


@pytest.mark.parametrize("short_names", [False, True])
def test_they_do_not_share_a_compiled_kernel(short_names):
    q = jax.random.normal(jax.random.key(0), (1, 16, 2, 16))
    a, b = _table_mod(np.arange(16.0), short_names), _table_mod(np.arange(16.0) * 3, short_names)
    out_a = flexjax.flex_attention(q, q, q, score_mod=a)
    out_b = flexjax.flex_attention(q, q, q, score_mod=b)
    for mod, out in ((a, out_a), (b, out_b)):
        want = flexjax.flex_attention(q, q, q, score_mod=mod, backend="reference")
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-6)
