"""max_scores and lse against PyTorch FlexAttention's own definition of them.

PyTorch 2.13 refuses ``return_aux=AuxRequest(max_scores=True)`` on CPU ("not supported on
CPU/MPS"), so the comparison is with its eager reference, ``math_attention`` (the dense
implementation its kernels are tested against; it returns lse and max in log2 units).

Here rather than in tests/ because this venv (build/venv-compile) has torch; `make test`'s
does not, and torch is never a runtime dependency.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import flexjax

pytestmark = pytest.mark.triton  # runs under make test-compile (Triton and torch installed)

torch = pytest.importorskip("torch")
tfa = pytest.importorskip("torch.nn.attention.flex_attention")
hop = pytest.importorskip("torch._higher_order_ops.flex_attention")

B, S, H, D = 2, 96, 4, 16


def _prefix_causal(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & ((b == 0) | (q_idx >= 10))


def _soft_cap(score, b, h, q_idx, kv_idx):
    return 20.0 * jnp.tanh(score / 20.0) + 0.1 * h


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_max_scores_and_lse_match_pytorch(backend):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, S, H, D)).astype(np.float32) for _ in range(3))
    bm = flexjax.create_block_mask(_prefix_causal, B, None, S, S, block_size=32)
    out, aux = flexjax.flex_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), _soft_cap, bm,
                                      backend=backend, return_aux=flexjax.AuxRequest(lse=True, max_scores=True))

    def t_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((b == 0) | (q_idx >= 10))

    def t_score(score, b, h, q_idx, kv_idx):
        return 20.0 * torch.tanh(score / 20.0) + 0.1 * h

    t_bm = tfa.create_block_mask(t_mask, B, None, S, S, device="cpu", BLOCK_SIZE=32)
    tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3))) for x in (q, k, v))
    with torch.no_grad():
        t_out, t_lse2, t_max2 = hop.math_attention(tq, tk, tv, t_score, t_bm.as_tuple(), 1.0 / np.sqrt(D), {})
    np.testing.assert_allclose(np.asarray(out), t_out.numpy().transpose(0, 2, 1, 3), rtol=2e-5, atol=2e-5)
    t_max = t_max2.numpy() * np.log(2.0)
    ours = np.asarray(aux.max_scores)
    assert np.isneginf(ours[1, :, :10]).all() and np.isneginf(t_max[1, :, :10]).all()
    np.testing.assert_allclose(ours, t_max, rtol=1e-5, atol=1e-5)
    # lse: -inf on fully masked rows in both.
    np.testing.assert_allclose(np.asarray(aux.lse), t_lse2.numpy() * np.log(2.0), rtol=1e-5, atol=1e-5)
