"""flex_attention under plain jax.jit with q/k/v sharded over a mesh (data / tensor parallelism).

No ``attention_specs``: inputs sharded along batch and/or heads, over Explicit axes (the
default of ``jax.make_mesh``) or Auto axes, give the output, lse and gradients (q, k, v, a
captured bias table) of one device, forward and ``jax.grad`` inside ``jit``, and no shard
receives another's q, k or v.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from catalog import sweep
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import flexjax
from flexjax import masks, mods

B, S, H, D = 4, 64, 4, 16
BLOCK = 16

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

# Where q, k, v (and the document ids, with the batch) are sharded on a ("data", "model") mesh.
LAYOUTS = {
    "batch": P("data", None, None, None),
    "heads": P(None, None, "model", None),
    "batch_heads": P("data", None, "model", None),
}


def _mesh(axis_type):
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)


def _inputs(hkv):
    ks = jax.random.split(jax.random.key(0), 6)
    q = jax.random.normal(ks[0], (B, S, H, D), jnp.float32)
    k = jax.random.normal(ks[1], (B, S, hkv, D), jnp.float32)
    v = jax.random.normal(ks[2], (B, S, hkv, D), jnp.float32)
    table = 0.5 * jax.random.normal(ks[3], (H, 2 * S - 1), jnp.float32)
    # Per-batch documents (the mask reads b), boundaries off the 16-token blocks.
    lengths = np.array([[37, 27], [10, 54], [64, 0], [20, 44]])
    ids = jnp.asarray(np.stack([np.repeat([0, 1], n) for n in lengths]), jnp.int32)
    dout = jax.random.normal(ks[4], (B, S, H, D), jnp.float32)
    dlse = jax.random.normal(ks[5], (B, H, S), jnp.float32)
    return q, k, v, table, ids, dout, dlse


# kind -> k/v heads (GQA for the relative bias, whose table gets a gradient).
KINDS = {"causal": H, "document": H, "relative_bias": 2}


def _loss(kind, q, k, v, table, ids, dout, dlse):
    """A loss over out and lse, the BlockMask built inside the traced function; aux: (out, lse)."""
    score_mod, block_mask = None, None
    if kind == "causal":
        block_mask = flexjax.create_block_mask(masks.causal, None, None, S, S, block_size=BLOCK)
    elif kind == "document":
        block_mask = flexjax.create_block_mask(flexjax.and_masks(masks.causal, masks.document(ids)), B, None,
                                               S, S, block_size=BLOCK)
    else:
        score_mod = mods.relative_bias(table)
    out, lse = flexjax.flex_attention(q, k, v, score_mod, block_mask, return_lse=True)
    loss = (out * dout).sum() + (jnp.where(jnp.isfinite(lse), lse, 0.0) * dlse).sum()
    return loss, (out, lse)


def _step(kind):
    return jax.jit(jax.value_and_grad(functools.partial(_loss, kind), argnums=(0, 1, 2, 3), has_aux=True))


@functools.cache
def _one_device(kind):
    (_, (out, lse)), grads = _step(kind)(*_inputs(KINDS[kind]))
    return out, lse, grads


def _assert_close(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want), err_msg=what)
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], atol=2e-5, rtol=2e-5, err_msg=what)


def _sharded_inputs(mesh, layout, hkv):
    q, k, v, table, ids, dout, dlse = _inputs(hkv)
    spec = LAYOUTS[layout]
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
    return (put(q, spec), put(k, spec), put(v, spec), put(table, P()), put(ids, P(spec[0])),
            put(dout, spec), put(dlse, P(spec[0], spec[2])))


def _float_collectives(compiled) -> list[tuple[str, str]]:
    """(collective, shape) of every float32 array a compiled computation communicates."""
    found = []
    for line in compiled.as_text().splitlines():
        m = re.search(r"= (.*?) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)[-a-z]*\(", line)
        if m:
            found += [(m.group(2), shape) for shape in re.findall(r"f32\[([\d,]*)\]", m.group(1))]
    return found


CASES = [(t, layout, kind) for t in ("explicit", "auto") for layout in LAYOUTS for kind in KINDS]
# Default: head and batch-and-head sharding on Explicit axes, head sharding on Auto (documents
# and batch-only sharding are in `make test-all`, which runs them all).
DEFAULT = [("explicit", "heads", "causal"), ("explicit", "batch_heads", "relative_bias"),
           ("auto", "heads", "relative_bias")]


# (explicit-batch_heads-relative_bias in make test-extra: make test's budget.)
@pytest.mark.parametrize("axis_type,layout,kind", sweep(CASES, DEFAULT, ids=["-".join(c) for c in CASES],
                                                       extra=[("explicit", "batch_heads", "relative_bias")]))
def test_jit_and_grad_match_one_device(axis_type, layout, kind):
    """Output, lse and gradients under jit(value_and_grad) equal one device's; nothing big moves."""
    mesh = _mesh(AxisType.Explicit if axis_type == "explicit" else AxisType.Auto)
    with jax.set_mesh(mesh):
        args = _sharded_inputs(mesh, layout, KINDS[kind])
        compiled = _step(kind).lower(*args).compile()
        (_, (out, lse)), grads = compiled(*args)
    want_out, want_lse, want_grads = _one_device(kind)
    _assert_close(out, want_out, "out")
    _assert_close(lse, want_lse, "lse")
    for name, g, want in zip(("dq", "dk", "dv", "dtable"), grads, want_grads, strict=True):
        _assert_close(g, want, name)
    assert out.sharding.spec == grads[0].sharding.spec == LAYOUTS[layout]
    collectives = _float_collectives(compiled)
    # The loss and the table gradient are summed over the shards; q, k, v never travel.
    assert all(op == "all-reduce" for op, _ in collectives), collectives
    if axis_type == "explicit":
        assert {shape for _, shape in collectives} <= {"", f"{H},{2 * S - 1}"}, collectives


def test_explicit_eager_without_set_mesh_and_ragged_lengths():
    """Explicit-sharded arrays called eagerly, no jax.set_mesh, lengths not multiples of the blocks."""
    mesh = _mesh(AxisType.Explicit)
    q, k, v, *_ = _inputs(H)
    q, k, v = q[:, :50], k[:, :60], v[:, :60]
    bm = flexjax.create_block_mask(masks.causal, None, None, 50, 60, block_size=BLOCK)
    spec = LAYOUTS["batch_heads"]
    qs, ks, vs = (jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v))
    out = flexjax.flex_attention(qs, ks, vs, block_mask=bm)
    assert jax.typeof(out).sharding.spec == spec
    _assert_close(out, flexjax.flex_attention(q, k, v, block_mask=bm), "out")


def test_mqa_heads_sharded():
    """One k/v head (whole on every shard) with the query heads sharded over 2 devices."""
    mesh = _mesh(AxisType.Explicit)
    q, k, v, table, *_ = _inputs(1)
    with jax.set_mesh(mesh):
        qs = jax.reshard(q, P(None, None, "model", None))
        out = jax.jit(lambda q, k, v: flexjax.flex_attention(q, k, v, mods.relative_bias(table)))(qs, k, v)
    assert jax.typeof(out).sharding.spec == P(None, None, "model", None)
    _assert_close(out, flexjax.flex_attention(q, k, v, mods.relative_bias(table)), "out")


@pytest.mark.parametrize("which", ["query", "key"])
def test_sequence_sharded_outside_attention_specs_raises(which):
    mesh = _mesh(AxisType.Explicit)
    q, k, v, *_ = _inputs(H)
    with jax.set_mesh(mesh):
        spec = P("data", "model", None, None)
        if which == "query":
            q = jax.reshard(q, spec)
        else:
            k, v = jax.reshard(k, spec), jax.reshard(v, spec)
        with pytest.raises(ValueError, match=rf"{which} is sharded over mesh axis 'model' along its sequence.*"
                                             r"flexjax\.sharding\.attention_specs\(query_specs="):
            jax.jit(flexjax.flex_attention)(q, k, v)


def test_head_dim_sharded_raises():
    mesh = _mesh(AxisType.Explicit)
    q, k, v, *_ = _inputs(H)
    with jax.set_mesh(mesh):
        q = jax.reshard(q, P(None, None, None, "model"))
        with pytest.raises(ValueError, match="query is sharded over mesh axis 'model' along head_dim"):
            jax.jit(flexjax.flex_attention)(q, k, v)


def test_bias_table_sharded_over_heads_explicit():
    """A captured table sharded over an Explicit axis is read whole inside the mod."""
    q, k, v, table, _, _, _ = _inputs(H)
    bm = flexjax.create_block_mask(masks.causal, None, None, S, S, block_size=BLOCK)

    def loss(q, k, v, table):
        return jnp.sum(flexjax.flex_attention(q, k, v, mods.relative_bias(table), bm) ** 2)

    grad = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3)))
    want = grad(q, k, v, table)
    mesh = _mesh(AxisType.Explicit)
    with jax.set_mesh(mesh):
        put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
        qkv = [put(x, LAYOUTS["batch_heads"]) for x in (q, k, v)]
        got = grad(*qkv, put(table, P("model", None)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-5)
