"""examples/gpt.py at a toy size: packing, a training step, and decoding through the paged cache equal to
the training forward and to the same weights on jax.nn.dot_product_attention (float32). `make example`
trains it for real."""

import importlib.util
import pathlib
import re
import sys

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
from flax import nnx  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "gpt_example", pathlib.Path(__file__).resolve().parent.parent / "examples" / "gpt.py")
gpt = sys.modules["gpt_example"] = importlib.util.module_from_spec(_spec)  # (dataclasses look it up there)
_spec.loader.exec_module(gpt)

CFG = gpt.Config(d_model=32, layers=2, heads=2, kv_heads=1, window=8, seq=32, block=16, dtype=jnp.float32)


def test_packing():
    corpus = gpt.Corpus.pack([b"ab", b"cde"])
    np.testing.assert_array_equal(corpus.tokens, [gpt.BOS, 97, 98, gpt.BOS, 99, 100, 101])
    np.testing.assert_array_equal(corpus.doc_ids, [0, 0, 0, 1, 1, 1, 1])
    assert corpus.unigram_entropy() == pytest.approx(np.log(5))
    batch = gpt.Corpus.pack([bytes(range(1, 1 + n)) for n in (3, 9, 4, 7)] * 4).batch(np.random.default_rng(0), 3, 16)
    np.testing.assert_array_equal(batch["tokens"][:, 1:], batch["targets"][:, :-1])
    # A target counts where it continues its input's document (a BOS target never does).
    np.testing.assert_array_equal(batch["weights"] == 0, batch["targets"] == gpt.BOS)


# `make example` (in CI) trains and checks the decode at a real size; make test-all runs this too.
@pytest.mark.slow
def test_train_step_lowers_the_loss():
    model = gpt.GPT(CFG, rngs=nnx.Rngs(0))
    optimizer = gpt.make_optimizer(model, 1e-2, 20)
    docs = [bytes(np.random.default_rng(n).integers(97, 100, 5 + 3 * n).astype(np.uint8)) for n in range(12)]
    batch = gpt.Corpus.pack(docs).batch(np.random.default_rng(0), 2, CFG.seq)
    losses = [float(gpt.train_step(model, optimizer, batch)) for _ in range(3)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


# `make example` (in CI) trains and checks the decode at a real size; make test-all runs this too.
@pytest.mark.slow
def test_decoding_matches_the_forward_and_jax_nn():
    """Through the paged cache, token by token from BOS (one compile a path) past the window, against the
    same weights on jax.nn.dot_product_attention and against the training forward over the result."""
    model = gpt.GPT(CFG, rngs=nnx.Rngs(1))
    for block in model.blocks:  # nonzero sinks, so that they count
        block.attn.sinks[...] = jnp.linspace(-1.0, 1.0, CFG.heads)[:, None]
    out = gpt.generate(model, np.full((2, 1), gpt.BOS), 11, page_size=8)
    err, agree = gpt.logits_agree(out["flex_logits"], out["jax_nn_logits"], jnp.float32)
    assert agree, err
    tokens = jnp.asarray(out["tokens"][:, :-1])  # the forward over the whole text, one document a row
    full = nnx.jit(lambda m, t: m(t, gpt.packed_attend(CFG, jnp.zeros(t.shape, jnp.int32))))(model, tokens)
    np.testing.assert_allclose(out["flex_logits"], full, atol=1e-4)
    assert out["tokens"].shape == (2, 12) and np.isfinite([out["flex_tokens_per_s"], out["jax_nn_tokens_per_s"]]).all()


@pytest.mark.ci_extra  # (make test's budget)
def test_sparse_example_quick_prints_both_losses(capsys):
    """examples/gpt_sparse.py --quick: the dense and the MoBA model a few steps each, both losses finite and
    printed with their step times. (`python examples/gpt_sparse.py` trains them at the default size.)"""
    spec = importlib.util.spec_from_file_location(
        "gpt_sparse_example", pathlib.Path(__file__).resolve().parent.parent / "examples" / "gpt_sparse.py")
    gpt_sparse = sys.modules["gpt_sparse_example"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt_sparse)
    assert gpt_sparse.main(["--quick", "--check"]) == 0
    out = capsys.readouterr().out
    for name in ("dense", "sparse"):
        line = re.search(rf"^{name} +\(.*\): train loss (\S+) .* held out (\S+); (\S+) ms per training step", out, re.M)
        assert line, out
        assert np.isfinite([float(x) for x in line.groups()]).all(), line.group(0)
    assert re.search(r"^sparse / dense time per training step: \d+\.\d\d", out, re.M), out
