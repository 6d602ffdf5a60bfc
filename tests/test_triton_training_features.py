"""Sinks, max_scores, dropout and forward-mode AD through the public API on the triton backend.

The checks are tests/test_training_features.py's (dense jnp reimplementations, JAX's own
derivatives of them), run here with ``backend="triton"`` under Triton's interpreter.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")
from test_training_features import HQ, B, S, _close, _dense, _flex, _inputs  # noqa: E402

import flexjax  # noqa: E402

pytestmark = pytest.mark.triton  # runs under make test-compile (Triton and torch installed)

TRITON = {"backend": "triton"}


def test_sinks_max_scores_and_grads():
    q, k, v, table = _inputs()
    sinks = jnp.array([0.5, -1.0, 2.0, 0.0])
    out, aux = _flex(q, k, v, table, TRITON, sinks=sinks, return_aux=flexjax.AuxRequest(lse=True, max_scores=True))
    out_r, lse_r, max_r = _dense(q, k, v, table, sinks=sinks)
    _close(out, out_r)
    _close(aux.lse, lse_r)
    _close(aux.max_scores, max_r)

    def loss(f, q, table, sinks):
        return (f(q, table, sinks) ** 2).sum()

    flex = lambda q, t, s: _flex(q, k, v, t, TRITON, sinks=s)  # noqa: E731
    dense = lambda q, t, s: _dense(q, k, v, t, sinks=s)[0]  # noqa: E731
    for g, g_r in zip(jax.grad(functools.partial(loss, flex), argnums=(0, 1, 2))(q, table, sinks),
                      jax.grad(functools.partial(loss, dense), argnums=(0, 1, 2))(q, table, sinks)):
        _close(g, g_r, 1e-4)


def test_dropout_and_jvp_match_dense():
    q, k, v, table = _inputs(1)
    rng = jax.random.key(4)
    keep = flexjax.dropout_mask(rng, 0.2, B, HQ, S, S)
    flex = lambda q, t: _flex(q, k, v, t, TRITON, dropout_rate=0.2, dropout_rng=rng)  # noqa: E731
    dense = lambda q, t: _dense(q, k, v, t, keep=keep, rate=0.2)[0]  # noqa: E731
    tq, tt = jax.random.normal(jax.random.key(1), q.shape), jax.random.normal(jax.random.key(2), table.shape)
    out, t_out = jax.jvp(flex, (q, table), (tq, tt))
    out_r, t_out_r = jax.jvp(dense, (q, table), (tq, tt))
    _close(out, out_r)
    _close(t_out, t_out_r, 1e-4)
    assert np.isfinite(np.asarray(t_out)).all()
