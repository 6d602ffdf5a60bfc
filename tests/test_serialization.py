"""BlockMasks and traced mods through pickle, cloudpickle and jax.export; repr inside jit."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flexjax
from flexjax import flex_attention, masks, mods
from flexjax._trace import trace_mod

S, H, BLOCK = 128, 2, 32
IDS = jnp.asarray(np.arange(S) // 40, jnp.int32)

LIBRARY_MASKS = {
    "full": lambda: None,
    "causal": lambda: masks.causal,
    "sliding_window": lambda: masks.sliding_window(20),
    "document": lambda: masks.document(IDS),
    "and_masks": lambda: flexjax.and_masks(masks.causal, masks.sliding_window(50), masks.document(IDS)),
    "or_masks": lambda: flexjax.or_masks(masks.prefix_lm(np.array([10, 70])), masks.padding(np.array([90, 128]))),
    "causal_bottom_right": lambda: masks.causal_bottom_right(S, np.array([S, 100])),
}


def _inputs():
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
    return tuple(jax.random.normal(key, (2, S, H, 16)) for key in (k1, k2, k3, k4))


def _build(mask_mod):
    return flexjax.create_block_mask(mask_mod, 2, None, S, S, block_size=BLOCK)


def _assert_same_mask(got, want):
    assert isinstance(got, flexjax.BlockMask)
    assert got.mask == want.mask and repr(got) == repr(want)
    if want.mask is not None:
        assert got.mask.uses == want.mask.uses
    assert (got.seq_lengths, got.block_size, got.kv_band) == (want.seq_lengths, want.block_size, want.kv_band)
    g_children, w_children = got.tree_flatten()[0], want.tree_flatten()[0]
    for g, w in zip(jax.tree.leaves(g_children), jax.tree.leaves(w_children), strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    q, k, v, _ = _inputs()
    np.testing.assert_array_equal(np.asarray(flex_attention(q, k, v, block_mask=got, backend="xla")),
                                  np.asarray(flex_attention(q, k, v, block_mask=want, backend="xla")))


# Default: the compositions (they hold the other masks); `make test-all`: each one alone.
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in ("and_masks", "or_masks", "full") else
                                               pytest.mark.slow) for n in sorted(LIBRARY_MASKS)])
def test_pickle_round_trip_library_masks(name):
    bm = _build(LIBRARY_MASKS[name]())
    _assert_same_mask(pickle.loads(pickle.dumps(bm)), bm)


def test_pickle_library_mods_and_traced_mods():
    table = jnp.asarray(np.random.default_rng(0).normal(size=(H, 2 * S - 1)), jnp.float32)
    for fn, kind in [(masks.document(IDS), "mask"), (mods.relative_bias(table), "score"),
                     (mods.soft_cap(jnp.float32(5.0)), "score"), (mods.t5_relative_bucket_bias(table[:, :8], 8, 20),
                                                                 "score")]:
        again = pickle.loads(pickle.dumps(fn))
        assert again.__name__ == fn.__name__
        want = trace_mod(fn, kind, arg_name="mod")
        got = pickle.loads(pickle.dumps(want))
        assert got.static() == want.static() and got.uses == want.uses
        for g, w in zip(got.consts, want.consts, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        assert trace_mod(again, kind, arg_name="mod").static() == want.static()


def test_cloudpickle_round_trip_lambda_mask():
    cloudpickle = pytest.importorskip("cloudpickle")
    lengths = jnp.asarray([100, 128], jnp.int32)
    window = 24
    bm = _build(lambda b, h, q_idx, kv_idx: (jnp.abs(q_idx - kv_idx) <= window) & (kv_idx < lengths[b]))
    _assert_same_mask(pickle.loads(cloudpickle.dumps(bm)), bm)


def test_pickle_block_mask_built_inside_jit_says_how_to_fix():
    bm = jax.jit(lambda ids: _build(masks.document(ids)))(IDS)
    with pytest.raises(TypeError, match="closes over arrays traced inside jit.*built outside jit"):
        pickle.dumps(bm)


class GrowingMask:
    """A mask_mod capturing an array that grows each time it is unpickled."""

    def __init__(self, n):
        self.table = jnp.arange(n, dtype=jnp.int32)

    def __call__(self, b, h, q_idx, kv_idx):
        return self.table[jnp.clip(kv_idx, 0, self.table.shape[0] - 1)] <= q_idx

    def __getstate__(self):
        return {"n": self.table.shape[0] + 1}

    def __setstate__(self, state):
        self.__init__(state["n"])


def test_unpickle_checks_captured_arrays_against_the_pickled_ones():
    data = pickle.dumps(_build(GrowingMask(S)))
    with pytest.raises(ValueError, match=r"captures arrays of \(shape, dtype\) \(\(\(129,\), dtype\('int32'\)\),\)"):
        pickle.loads(data)


def _export_round_trip(bm, score_mod=None):
    """Exports f(q, k, v, bm) -> (out, grads), serializes it to bytes, loads it and calls it."""
    pytest.importorskip("flatbuffers")
    q, k, v, do = _inputs()

    def f(q, k, v, bm):
        def loss(q, k, v):
            out = flex_attention(q, k, v, score_mod, bm, backend="xla")
            return jnp.sum(out * do), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, grads

    exported = jax.export.export(jax.jit(f))(q, k, v, bm)
    data = exported.serialize()
    assert isinstance(data, (bytes, bytearray))
    loaded = jax.export.deserialize(data)
    got = loaded.call(q, k, v, bm)
    want = jax.jit(f)(q, k, v, bm)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
    return data


def test_export_forward_and_grad_with_block_mask_argument():
    _export_round_trip(_build(LIBRARY_MASKS["and_masks"]()), mods.alibi(H))


@pytest.mark.slow  # (make test's budget: test_export_forward_and_grad_with_block_mask_argument exports by default)
def test_export_lambda_mask_in_a_fresh_process(tmp_path):
    cloudpickle = pytest.importorskip("cloudpickle")
    offset = jnp.asarray([3, 9], jnp.int32)
    bm = _build(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + offset[b])
    (tmp_path / "f.bin").write_bytes(_export_round_trip(bm))
    q, k, v, _ = _inputs()
    (tmp_path / "args.pkl").write_bytes(cloudpickle.dumps((q, k, v, bm)))
    np.save(tmp_path / "want.npy", np.asarray(flex_attention(q, k, v, block_mask=bm, backend="xla")))
    script = textwrap.dedent(f"""
        import pickle, jax, numpy as np
        import flexjax  # registers BlockMask's serialization, as any loader must
        loaded = jax.export.deserialize(open({str(tmp_path / "f.bin")!r}, "rb").read())
        q, k, v, bm = pickle.loads(open({str(tmp_path / "args.pkl")!r}, "rb").read())
        out, grads = loaded.call(q, k, v, bm)
        np.testing.assert_allclose(np.asarray(out), np.load({str(tmp_path / "want.npy")!r}), atol=1e-6)
        print("ok", bm.mask.name)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={"JAX_PLATFORMS": "cpu", "PATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok", "<lambda>"]


def test_repr_and_str_inside_jit_show_the_static_facts():
    shown = []

    @jax.jit
    def f(ids):
        bm = flexjax.create_block_mask(masks.document(ids), None, None, S, S, block_size=BLOCK)
        shown.extend([repr(bm), str(bm)])
        return bm.kv_num_blocks

    f(IDS)
    want = "BlockMask(shape=(1, 1, 128, 128), block_size=(32, 32), sparsity=traced, mask_mod=document)"
    assert shown[0] == want
    assert shown[1].startswith(want + "\n") and "outside jit" in shown[1]
    eager = flexjax.create_block_mask(masks.document(IDS), None, None, S, S, block_size=BLOCK)
    assert repr(eager) == want.replace("traced", "37.50%") and "█" in str(eager)
