"""Every primitive of the library's mods, of common jnp functions, and of their gradients has a translation
in both mod code generators: the C++ of the xla backend's CPU kernel and the triton backend's Triton source.

New JAX releases bring new primitives: JAX 0.11 differentiates ``tanh`` through ``one_minus_square``
and traces ``jnp.log2`` as ``log2``; JAX 0.12 adds ``polynomial`` and bitcasts inside ``erf``'s
derivative. A generator without a translation refuses the mod quietly: the xla backend runs its
slower XLA loops instead of its C++ kernel, and the triton backend refuses the call. So each mod
here is checked twice on the JAX that runs the suite:

- its primitives, and those of its derivative (the jaxpr the triton generator differentiates: the
  kernel part's VJP in the score, hoisted rows and columns and loaded array values; the CPU
  kernel's VJP in the score is the same function of fewer inputs), against each generator's
  ``SUPPORTED_PRIMITIVES``, less those flexjax erases or inlines before generating;
- through the generators' own entries (``cpu._codegen.generate`` / ``generate_vjp``,
  ``triton._codegen.generate``), which must not refuse.

Neither needs a compiler, Triton or a GPU. Which implementation serves soft_cap on this machine
(``flexjax.explain``) is checked last, where the C++ kernel is usable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from catalog import CATALOG

import flexjax
from flexjax import masks, mods
from flexjax._jaxpr import CALL_BODY, collect_prims, open_jaxpr
from flexjax._modcompiler import compile_mod
from flexjax._modir import SHAPE_ONLY
from flexjax._trace import trace_mod
from flexjax.backends.triton import _codegen as triton_codegen
from flexjax.backends.xla import cpu
from flexjax.backends.xla.cpu import _codegen as cpu_codegen

JAX = f"JAX {jax.__version__}"
# What flexjax removes before a generator sees it: shape-only primitives on one-element values, and the
# calls it inlines (their bodies' primitives are collected with the rest).
ERASED = SHAPE_ONLY | frozenset(CALL_BODY)
GENERATORS = {"cpu (C++)": cpu_codegen.SUPPORTED_PRIMITIVES, "triton": triton_codegen.SUPPORTED_PRIMITIVES}

B, H, SQ, SKV = 2, 4, 64, 64
IDS = np.repeat(np.arange(4), 16).astype(np.int32)  # (64,)
TABLE = np.linspace(-1.0, 1.0, H * 9, dtype=np.float32).reshape(H, 9)


def _sm(fn):
    """A score_mod applying ``fn`` to the score."""
    return lambda score, b, h, q_idx, kv_idx: fn(score)


# The library's factories: every name of flexjax.mods and flexjax.masks that makes (or is) a mod,
# with the instances checked. ``test_every_library_factory_is_covered`` keeps this complete.
LIBRARY = {
    "soft_cap": [("score", mods.soft_cap(30.0)), ("score", mods.soft_cap(jnp.float32(20.0)))],
    "alibi": [("score", mods.alibi(H)), ("score", mods.alibi(1))],
    "alibi_from_slopes": [("score", mods.alibi_from_slopes(jnp.linspace(0.1, 0.9, H)))],
    "relative_bias": [("score", mods.relative_bias(TABLE))],
    "t5_relative_bucket_bias": [("score", mods.t5_relative_bucket_bias(TABLE[:, :8], 8, 20)),
                                ("score", mods.t5_relative_bucket_bias(TABLE[:, :8], 8, 20, bidirectional=False))],
    "causal": [("mask", masks.causal)],
    "causal_with_offset": [("mask", masks.causal_with_offset(-3)),
                           ("mask", masks.causal_with_offset(np.array([3, 7])))],
    "causal_bottom_right": [("mask", masks.causal_bottom_right(16, 64)),
                            ("mask", masks.causal_bottom_right(1, np.array([30, 64])))],
    "chunked_causal": [("mask", masks.chunked_causal(8))],
    "dilated": [("mask", masks.dilated(3))],
    "document": [("mask", masks.document(IDS)), ("mask", masks.document(IDS, np.stack([IDS, IDS[::-1]])))],
    "document_from_cu_seqlens": [("mask", masks.document_from_cu_seqlens(np.array([0, 10, 64]), 64))],
    "padding": [("mask", masks.padding(np.array([40, 64])))],
    "prefix_lm": [("mask", masks.prefix_lm(5)), ("mask", masks.prefix_lm(np.array([5, 9])))],
    "sliding_window": [("mask", masks.sliding_window(4, 2))],
    "tree": [("mask", masks.tree(np.array([-1, 0, 0, 1, 1, 2]), 8))],
}
# Helpers that make no mod.
NOT_MODS = {"alibi_slopes", "t5_relative_position_bucket", "segment_ids_from_cu_seqlens"}

# Score_mods of common jnp / jax.nn functions (their derivatives are where new primitives show up).
FUNCTIONS = {
    "tanh": _sm(lambda s: 30.0 * jnp.tanh(s / 30.0)),
    "sigmoid": _sm(jax.nn.sigmoid),
    "exp": _sm(lambda s: jnp.exp(s * 0.1)),
    "exp2": _sm(lambda s: jnp.exp2(s * 0.1)),
    "log": _sm(lambda s: jnp.log(jnp.abs(s) + 1.0)),
    "log2": _sm(lambda s: jnp.log2(jnp.abs(s) + 1.0)),
    "log1p": _sm(lambda s: jnp.log1p(jnp.abs(s))),
    "expm1": _sm(jnp.expm1),
    "sqrt": _sm(lambda s: jnp.sqrt(jnp.abs(s) + 1.0)),
    "rsqrt": _sm(lambda s: jax.lax.rsqrt(jnp.abs(s) + 1.0)),
    "abs": _sm(jnp.abs),
    "square": _sm(jnp.square),
    "integer_power": _sm(lambda s: s**3 - s**-2),
    "power": _sm(lambda s: jnp.power(jnp.abs(s) + 0.5, 1.7)),
    "erf": _sm(jax.lax.erf),
    "sin_cos": _sm(lambda s: jnp.sin(s) * jnp.cos(s)),
    "clip": _sm(lambda s: jnp.clip(s, -2.0, 2.0)),
    "sign_floor_ceil": _sm(lambda s: jnp.sign(s) * s + jnp.floor(s) + jnp.ceil(s)),
    "divide": _sm(lambda s: s / (jnp.abs(s) + 1.0)),
    "max_min_where": lambda s, b, h, q_idx, kv_idx: jnp.where(q_idx >= kv_idx, jnp.maximum(s, 0.0),
                                                              jnp.minimum(s, -1.0)),
    "relu_softplus": _sm(lambda s: jax.nn.relu(s) + jax.nn.softplus(s)),
    "gelu_tanh": _sm(jax.nn.gelu),
    "silu": _sm(jax.nn.silu),
    "elu": _sm(jax.nn.elu),
    "log_sigmoid": _sm(jax.nn.log_sigmoid),
    "logaddexp": _sm(lambda s: jnp.logaddexp(s, 0.0)),
    "hypot": _sm(lambda s: jnp.hypot(s, 1.0)),
    # Functions of positions and of a captured array, with a gradient to the array's loaded values.
    "tanh_of_table": lambda s, b, h, q_idx, kv_idx: s + 2.0 * jnp.tanh(jnp.asarray(TABLE)[h, (kv_idx - q_idx) % 9]),
    "erf_of_positions": lambda s, b, h, q_idx, kv_idx: s * jax.lax.erf((q_idx - kv_idx).astype(jnp.float32) * 0.1),
}


def _cases():
    out = []
    for factory, instances in LIBRARY.items():
        out += [(f"{factory}[{i}]", kind, fn) for i, (kind, fn) in enumerate(instances)]
    for c in CATALOG:
        if c.score is not None:
            out.append((f"catalog:{c.name}/score", "score", c.score(c.params(H, SQ, SKV), H, SQ, SKV)))
        if c.mask is not None:
            out.append((f"catalog:{c.name}/mask", "mask", c.mask(B, H, SQ, SKV)))
    out += [(f"jnp:{name}", "score", fn) for name, fn in FUNCTIONS.items()]
    return out


CASES = _cases()


def _derivative_prims(cm) -> set:
    """Primitives of the kernel part's VJP as the triton generator traces it (``_codegen._vjp_nodes``),
    the bodies of the calls it keeps included."""
    read_dtypes = [node.out_avals[0].dtype for node in cm.reads()]
    nodes, _, _, _ = triton_codegen._vjp_nodes(cm, read_dtypes)
    prims = set()
    for node in nodes:
        prims.add(node.prim.name)
        body = node.params.get(CALL_BODY.get(node.prim.name, ""))
        if body is not None:
            collect_prims(open_jaxpr(body)[0], prims)
    return prims


def _entries(static, avals, kind):
    """(what, generator, call) for every entry a generator offers for this mod."""
    out = [("the forward", "cpu (C++)", lambda: cpu_codegen.generate(static, avals)),
           ("the packed-heads forward", "cpu (C++)", lambda: cpu_codegen.generate(static, avals, packed=True))]
    if kind == "score":
        out.append(("the VJP in the score", "cpu (C++)", lambda: cpu_codegen.generate_vjp(static, avals)))
    out.append(("the forward" + (" or the VJP" if kind == "score" else ""), "triton",
                lambda: triton_codegen.generate(compile_mod(static, "triton"), "m")))
    return out


@pytest.mark.parametrize("name,kind,fn", CASES, ids=[c[0] for c in CASES])
def test_generators_translate_the_mod_and_its_derivative(name, kind, fn):
    traced = trace_mod(fn, kind, arg_name=f"{kind}_mod")
    static = traced.static()
    avals = tuple(jax.ShapeDtypeStruct(np.shape(c), jnp.result_type(c)) for c in traced.consts)
    problems = []

    # 1. The primitives of the mod and of its derivative, against each generator's table.
    where = {p: "the mod" for p in collect_prims(static.jaxpr)}
    if kind == "score":
        try:
            derivative = _derivative_prims(compile_mod(static, "triton"))
        except NotImplementedError:
            derivative = set()  # the mod compiler refuses it: step 2 says why
        for p in sorted(derivative):
            where.setdefault(p, "its derivative")
    for gen, supported in GENERATORS.items():
        for p in sorted(set(where) - ERASED - supported):
            problems.append(f"{JAX}: primitive {p!r} (in {where[p]}) of mod {name!r} has no translation in the "
                            f"{gen} code generator")

    # 2. The generators' own entries.
    for what, gen, call in _entries(static, avals, kind):
        try:
            call()
        except NotImplementedError as e:
            problems.append(f"{JAX}: the {gen} code generator refuses {what} of mod {name!r}: {e}")
    assert not problems, "\n".join(problems)


def test_every_library_factory_is_covered():
    """A new factory in flexjax.mods or flexjax.masks must join LIBRARY (or NOT_MODS)."""
    names = set(mods.__all__) | set(masks.__all__)
    assert names - NOT_MODS == set(LIBRARY), "add the new factory to LIBRARY in tests/test_primitive_coverage.py"


def test_new_primitives_translate_where_jax_has_them():
    """The primitives JAX added since 0.10 are in both tables (they are keyed by name, so JAX 0.10 runs too)."""
    for gen, supported in GENERATORS.items():
        missing = {"one_minus_square", "log2", "polynomial", "bitcast_convert_type"} - supported
        assert not missing, f"{JAX}: the {gen} code generator lacks {sorted(missing)}"


@pytest.mark.skipif(not cpu.usable(), reason="no AVX-512 CPU or no C++ compiler")
def test_soft_cap_forward_and_backward_run_in_the_cpu_kernel():
    """soft_cap (30 tanh(s / 30)): forward and backward in the C++ kernel, not the XLA loops, on every JAX."""
    S, Hq, D = 128, 2, 16
    q, k, v = (jax.random.normal(key, (1, S, Hq, D)) for key in jax.random.split(jax.random.PRNGKey(0), 3))
    bm = flexjax.create_block_mask(masks.causal, None, None, S, S, block_size=64)
    score_mod = mods.soft_cap(30.0)
    why = flexjax.explain(q, k, v, score_mod, bm, backend="xla")
    assert (why.forward, why.backward) == ("cpu_kernel", "cpu_kernel"), f"{JAX}: {why}"

    def loss(q, k, v):
        return jnp.sum(flexjax.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, backend="xla") ** 2)

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()
    assert "flexjax_cpu_forward" in hlo and "flexjax_cpu_backward" in hlo, f"{JAX}: soft_cap left the C++ kernel"
    got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    def ref_loss(q, k, v):
        return jnp.sum(flexjax.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, backend="reference") ** 2)

    for g, w, n in zip(got, jax.grad(ref_loss, argnums=(0, 1, 2))(q, k, v), "qkv"):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=3e-5, rtol=1e-4, err_msg=f"d{n}")
