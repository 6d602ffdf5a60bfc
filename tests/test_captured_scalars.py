"""Captured 0-d and size-1 arrays in mods, on every backend, and the mod compiler's refusals.

Mods may close over scalars: a temperature, an offset inside an index, a divisor, a
padding length. Every kernel backend must take them (as hoisted values), eagerly and as
values traced under ``jit``, forward and backward; and no mod may make a backend's "can
you serve this" question raise anything but a refusal (``NotImplementedError``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from catalog import SHAPES, check_case, inputs
from checks import assert_close
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from targets import TARGETS, Target, budgeted

import flexjax
from flexjax import _modcompiler
from flexjax._trace import trace_mod
from flexjax.backends.triton import _codegen as triton_codegen
from flexjax.backends.xla.cpu import _codegen as cpu_codegen

# The registry's float32 targets (tests/targets.py; kernels in interpret mode), and the xla backend's XLA
# loops beside its C++ kernel, which its target runs on CPU.
XLA_LOOPS = Target("xla_loops", "xla", {"cpu_kernel": False})


def _float32(t) -> bool:
    return t.backend != "reference" and t.dtype == jnp.float32


def _with_loops(budget: list, slow: bool = True) -> list:
    return budget + [pytest.param(XLA_LOOPS, id=XLA_LOOPS.id, marks=pytest.mark.slow if slow else ())]


# The xla backend runs these catalog entries in test_xla.py and test_cpu_kernel.py; the rest of
# this grid runs under `make test-all` (the tests below cover every backend by default).
@pytest.mark.parametrize("target,name", [
    *budgeted(lambda t: _float32(t) and t.backend != "xla", default=("pallas",),
              values=lambda t: [("captured_scalars", "captured_scalars")]),
    *budgeted(lambda t: _float32(t) and t.backend != "xla", values=lambda t: [("padding_zero_length",) * 2],
              marked=False),
])
def test_catalog_scalars(target, name):
    check_case(target.backend, name, (1, 100, 150, 2, 1, 16, 16) if target.id == "pallas" else SHAPES["gqa_unequal"],
               kernel_options=target.options)


def _scalar_attention(q, k, v, temp, shift, off, div, lim, flag, bias1, **kw):
    """Mods reading captured 0-d ints and floats (score, index, mask_mod), a size-1 array,
    and a mask_mod that returns a captured boolean as is."""
    S = q.shape[1]
    table = jnp.linspace(-1.0, 1.0, 2 * S - 1, dtype=jnp.float32)

    def score_mod(score, b, h, q_idx, kv_idx):
        rel = table[q_idx - kv_idx + off]
        return jnp.squeeze(score * temp * bias1) + shift * rel + ((q_idx - kv_idx) // div).astype(jnp.float32)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((q_idx - kv_idx) // div < lim) | ((q_idx < 3) & flag)

    bm = flexjax.create_block_mask(mask_mod, None, None, S, k.shape[1], block_size=16)
    return flexjax.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True, **kw)


def _scalars():
    return dict(temp=jnp.float32(0.8), shift=jnp.float32(0.5), off=jnp.int32(47), div=jnp.int32(3),
                lim=jnp.int32(5), flag=jnp.bool_(True), bias1=jnp.asarray([1.25], jnp.float32))


# The kernel templates by default, one eagerly and one under jit (the xla backend runs the
# catalog's captured_scalars entry in test_xla.py and test_cpu_kernel.py); every backend in
# both modes under `make test-all`.
# (make test's budget: the GPU template under jit in make test-extra, the others in make test-all;
# make test runs test_catalog_scalars.)
_MODES = lambda t: [(False, "eager"), (True, "jit")]  # noqa: E731


@pytest.mark.parametrize("target,traced", [
    *budgeted(lambda t: _float32(t) and t.id != "pallas", values=_MODES),
    *[pytest.param(t, traced, id=f"{t.id}-{name}", marks=pytest.mark.ci_extra if traced else pytest.mark.slow)
      for t in TARGETS if t.id == "pallas" for traced, name in _MODES(t)],
    *[pytest.param(XLA_LOOPS, traced, id=f"{XLA_LOOPS.id}-{name}", marks=pytest.mark.slow)
      for traced, name in _MODES(XLA_LOOPS)],
])
def test_scalars_forward_and_backward(target, traced):
    """Out, lse and the gradients to q, k, v and the float scalars, against the reference.

    ``jit``: the scalars are arguments of the jitted function, so the mods close over tracers
    and the BlockMask is built inside it.
    """
    impl, options = target.backend, target.options
    q, k, v, do = inputs((1, 48, 48, 2, 1, 16, 16), jnp.float32)
    sc = _scalars()
    floats = {n: sc[n] for n in ("temp", "shift", "bias1")}
    ints = {n: sc[n] for n in ("off", "div", "lim", "flag")}

    def run(backend_, kernel_options):
        def loss(q, k, v, floats, ints):
            out, lse = _scalar_attention(q, k, v, **floats, **ints, backend=backend_, kernel_options=kernel_options)
            return jnp.sum(out * do) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

        f = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
        if traced:
            f = jax.jit(f)
            (_, aux), grads = f(q, k, v, floats, ints)
        else:
            # Eager: the scalars are concrete; only the gradient transform traces q, k, v, floats.
            (_, aux), grads = jax.value_and_grad(
                functools.partial(loss, ints=ints), argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, floats)
        return aux, grads

    got = run(impl, options)
    want = run("reference", None)
    assert_close(f"scalars/{target.id}", got, want, want, jnp.float32)


@pytest.mark.parametrize("target", _with_loops(budgeted(_float32, default=("pallas", "pallas_tpu"))))
def test_mods_that_return_a_captured_scalar(target):
    """A score_mod returning a captured float (uniform attention) and a mask_mod returning a
    captured bool: the mod's output is the captured array itself."""
    impl, options = target.backend, target.options
    q, k, v, _ = inputs((1, 40, 40, 2, 2, 16, 16), jnp.float32)
    const, allow = jnp.float32(0.25), jnp.bool_(True)
    bm = flexjax.create_block_mask(lambda b, h, q_idx, kv_idx: allow, None, None, 40, 40, block_size=16)

    def f(backend_, kernel_options):
        return flexjax.flex_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: const, block_mask=bm,
                                      backend=backend_, kernel_options=kernel_options)

    np.testing.assert_allclose(f(impl, options), f("reference", None), atol=2e-5)
    np.testing.assert_allclose(f(impl, options), jnp.broadcast_to(v.mean(1, keepdims=True), v.shape), atol=2e-5)


# -- the mod compiler on random mods -----------------------------------------------------------

_N = 12  # positions of the evaluation grid; the tables are this long (indices are clamped)
_INT_OPS = ("add", "sub", "mul", "floordiv", "rem", "max", "where", "read1")
_FLOAT_OPS = ("add", "mul", "tanh", "where", "read1f", "read2f", "convert")


@st.composite
def _int_expr(draw, depth):
    leaves = ("q", "kv", "b", "h", "lit", "cint")
    kind = draw(st.sampled_from(leaves + (_INT_OPS if depth else ())))
    if kind in leaves:
        return (kind, draw(st.integers(-3, 5))) if kind in ("lit", "cint") else (kind,)
    if kind == "where":
        return (kind, draw(_bool_expr(depth - 1)), draw(_int_expr(depth - 1)), draw(_int_expr(depth - 1)))
    if kind == "read1":
        return (kind, draw(_int_expr(depth - 1)))
    if kind in ("floordiv", "rem"):  # by a captured, nonzero divisor
        return (kind, draw(_int_expr(depth - 1)), draw(st.integers(1, 4)))
    return (kind, draw(_int_expr(depth - 1)), draw(_int_expr(depth - 1)))


@st.composite
def _float_expr(draw, depth, score):
    leaves = ("cfloat", "flit") + (("score",) if score else ())
    kind = draw(st.sampled_from(leaves + (_FLOAT_OPS if depth else ())))
    if kind in ("cfloat", "flit"):
        return (kind, draw(st.sampled_from([-1.5, 0.5, 2.0])))
    if kind == "score":
        return (kind,)
    if kind == "tanh":
        return (kind, draw(_float_expr(depth - 1, score)))
    if kind == "where":
        return (kind, draw(_bool_expr(depth - 1)), draw(_float_expr(depth - 1, score)),
                draw(_float_expr(depth - 1, score)))
    if kind in ("read1f", "convert"):
        return (kind, draw(_int_expr(depth - 1)))
    if kind == "read2f":
        return (kind, draw(_int_expr(depth - 1)))
    return (kind, draw(_float_expr(depth - 1, score)), draw(_float_expr(depth - 1, score)))


@st.composite
def _bool_expr(draw, depth):
    kind = draw(st.sampled_from(("cmp", "cbool") + (("and", "or", "not", "fcmp") if depth else ())))
    if kind == "cbool":
        return (kind, draw(st.booleans()))
    if kind == "cmp":
        return (kind, draw(st.sampled_from(["lt", "le", "eq", "ne"])), draw(_int_expr(max(depth - 1, 0))),
                draw(_int_expr(max(depth - 1, 0))))
    if kind == "fcmp":
        return (kind, draw(_float_expr(depth - 1, False)), draw(_float_expr(depth - 1, False)))
    if kind == "not":
        return (kind, draw(_bool_expr(depth - 1)))
    return (kind, draw(_bool_expr(depth - 1)), draw(_bool_expr(depth - 1)))


class _Builder:
    """Turns an expression tree into a mod closing over concrete arrays (captured scalars and tables).

    The scalars are made here, outside the mod: a ``jnp.int32(3)`` made while the mod is
    traced would be a literal, not a captured array.
    """

    def __init__(self):
        self.cint = {v: jnp.int32(v) for v in range(-3, 6)}
        self.cfloat = {v: jnp.float32(v) for v in (-1.5, 0.5, 2.0)}
        self.cbool = {v: jnp.bool_(v) for v in (False, True)}
        self.t1 = jnp.arange(_N, dtype=jnp.int32) % 5 - 2
        self.t1f = jnp.linspace(-1.0, 1.0, _N, dtype=jnp.float32)
        self.t2 = jnp.reshape(jnp.linspace(-2.0, 2.0, 2 * _N, dtype=jnp.float32), (2, _N))

    def int_(self, e, a):
        k = e[0]
        if k in ("q", "kv", "b", "h"):
            return a[k]
        if k == "lit":
            return e[1]
        if k == "cint":
            return self.cint[e[1]]
        if k == "where":
            return jnp.where(self.bool_(e[1], a), self.int_(e[2], a), self.int_(e[3], a))
        if k == "read1":
            return self.t1[self.int_(e[1], a)]
        x = self.int_(e[1], a)
        if k == "floordiv":
            return x // self.cint[e[2]]
        if k == "rem":
            return x % self.cint[e[2]]
        y = self.int_(e[2], a)
        return {"add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "max": jnp.maximum}[k](x, y)

    def float_(self, e, a):
        k = e[0]
        if k == "cfloat":
            return self.cfloat[e[1]]
        if k == "flit":
            return e[1]
        if k == "score":
            return a["score"]
        if k == "tanh":
            return jnp.tanh(self.float_(e[1], a))
        if k == "where":
            return jnp.where(self.bool_(e[1], a), self.float_(e[2], a), self.float_(e[3], a))
        if k == "read1f":
            return self.t1f[jnp.clip(self.int_(e[1], a), 0, _N - 1)]
        if k == "read2f":
            return self.t2[a["h"] % 2, self.int_(e[1], a)]
        if k == "convert":
            return jnp.asarray(self.int_(e[1], a)).astype(jnp.float32)
        x, y = self.float_(e[1], a), self.float_(e[2], a)
        return x + y if k == "add" else x * y

    def bool_(self, e, a):
        k = e[0]
        if k == "cbool":
            return self.cbool[e[1]]
        if k == "cmp":
            return getattr(jnp, {"lt": "less", "le": "less_equal", "eq": "equal", "ne": "not_equal"}[e[1]])(
                self.int_(e[2], a), self.int_(e[3], a))
        if k == "fcmp":
            return jnp.less(self.float_(e[1], a), self.float_(e[2], a))
        if k == "not":
            return ~self.bool_(e[1], a)
        x, y = self.bool_(e[1], a), self.bool_(e[2], a)
        return (x & y) if k == "and" else (x | y)

    def score_mod(self, e):
        def random_score(score, b, h, q_idx, kv_idx):
            a = dict(score=score, b=b, h=h, q=q_idx, kv=kv_idx)
            return jnp.asarray(self.float_(e, a), jnp.float32) + 0.0 * score
        return random_score

    def mask_mod(self, e):
        def random_mask(b, h, q_idx, kv_idx):
            return self.bool_(e, dict(b=b, h=h, q=q_idx, kv=kv_idx)) | jnp.bool_(False)
        return random_mask


def _evaluate_split(cm, consts, score):
    """The compiled mod's prologue + kernel part over the whole (b, h, q, kv) grid."""
    B, H = 2, 2
    rows, cols, arrays = cm.prologue(consts, B, H, _N, _N, _N, _N)
    out = []
    for b in range(B):
        for h in range(H):
            pick = lambda x: x[b if x.shape[0] > 1 else 0, h if x.shape[1] > 1 else 0]  # noqa: E731
            r = tuple(pick(x)[:, None] for x in rows)
            c = tuple(pick(x)[None, :] for x in cols)
            qi = jnp.arange(_N, dtype=jnp.int32)[:, None]
            ki = jnp.arange(_N, dtype=jnp.int32)[None, :]
            out.append(cm.evaluate(score, jnp.int32(b), jnp.int32(h), qi, ki, r, c,
                                   lambda k, idx: arrays[k][tuple(idx)]))
    return jnp.stack(out).reshape(B, H, _N, _N)


def _evaluate_dense(mod, consts, score):
    b = jnp.arange(2, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(2, dtype=jnp.int32)[None, :, None, None]
    qi = jnp.arange(_N, dtype=jnp.int32)[None, None, :, None]
    ki = jnp.arange(_N, dtype=jnp.int32)[None, None, None, :]
    args = (b, h, qi, ki) if score is None else (score, b, h, qi, ki)
    return jnp.broadcast_to(mod(consts, *args), (2, 2, _N, _N))


def _check_compiles(traced, kind):
    """Every target compiles the mod or refuses it with NotImplementedError; the split is exact."""
    static = traced.static()
    score = (jnp.linspace(-3.0, 3.0, _N * _N, dtype=jnp.float32).reshape(_N, _N) if kind == "score" else None)
    for target in _modcompiler.TARGETS:
        try:
            cm = _modcompiler.compile_mod(static, target)
        except NotImplementedError:
            continue
        if target == "triton":
            try:
                triton_codegen.generate(cm, prefix=kind)
            except NotImplementedError:
                pass
        if target == "interpret":
            got = _evaluate_split(cm, traced.consts, score)
            want = _evaluate_dense(static, traced.consts, score)
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-6,
                                       atol=1e-6, err_msg=f"{traced.name} split for {target}")
    avals = tuple(jax.ShapeDtypeStruct(np.shape(c), jnp.result_type(c)) for c in traced.consts)
    try:
        cpu_codegen.generate(static, avals)
    except NotImplementedError:
        pass


_SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.ci_extra  # (make test-extra: 3-9 s; cheaper siblings run in make test)
@_SETTINGS
@given(_float_expr(3, True))
def test_random_score_mods_compile_or_refuse(expr):
    traced = trace_mod(_Builder().score_mod(expr), "score", arg_name="score_mod")
    _check_compiles(traced, "score")


@pytest.mark.ci_extra  # (make test-extra: 3-9 s; cheaper siblings run in make test)
@_SETTINGS
@given(_bool_expr(3))
def test_random_mask_mods_compile_or_refuse(expr):
    traced = trace_mod(_Builder().mask_mod(expr), "mask", arg_name="mask_mod")
    _check_compiles(traced, "mask")


@pytest.mark.parametrize("expr", [
    ("add", ("score",), ("read2f", ("add", ("sub", ("q",), ("kv",)), ("cint", 3)))),  # table[h, q - kv + off]
    ("mul", ("score",), ("convert", ("floordiv", ("sub", ("q",), ("kv",)), 3))),  # captured divisor
    ("where", ("cmp", "lt", ("q",), ("cint", 2)), ("cfloat", 2.0), ("score",)),  # captured scalar in a where
], ids=["index_offset", "divisor", "where"])
def test_captured_scalar_score_mods_compile_for_every_target(expr):
    """The regression of issue 28: these raised KeyError('const') in the mod compiler."""
    traced = trace_mod(_Builder().score_mod(expr), "score", arg_name="score_mod")
    _check_compiles(traced, "score")
    for target in ("interpret", "cuda", "triton"):
        _modcompiler.compile_mod(traced.static(), target)


def test_internal_errors_become_refusals(monkeypatch):
    """A bug inside the mod compiler is a refusal with the cause, so backend=None moves on."""
    def broken(mod, target):
        raise KeyError("boom")

    monkeypatch.setattr(_modcompiler, "_compile_mod", broken)
    _modcompiler.compile_mod.cache_clear()
    traced = trace_mod(lambda s, b, h, q, kv: s * 1.5, "score", arg_name="score_mod")
    try:
        with pytest.raises(NotImplementedError, match="KeyError.*flexjax bug") as info:
            _modcompiler.compile_mod(traced.static(), "interpret")
        assert isinstance(info.value.__cause__, KeyError)
        q, k, v, _ = inputs((1, 32, 32, 1, 1, 16, 16), jnp.float32)
        with pytest.raises(NotImplementedError, match="backend 'pallas' cannot serve this call.*KeyError"):
            flexjax.flex_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s * 1.5, backend="pallas")
    finally:
        _modcompiler.compile_mod.cache_clear()


# -- the other paths a mod reaches: sinks, dropout, jvp, decode and paged ----------------------

def _scalar_mods():
    temp, off, div = jnp.float32(0.8), jnp.int32(63), jnp.int32(3)
    table = jnp.linspace(-1.0, 1.0, 127, dtype=jnp.float32)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * temp + table[q_idx - kv_idx + off]

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx) // div < jnp.int32(9) + div

    return score_mod, mask_mod


# In make test-all (make test's budget): sinks, dropout and jax.jvp each have default tests
# (test_training_features.py), and captured scalars test_scalars_forward_and_backward.
@pytest.mark.parametrize("target", budgeted(lambda t: _float32(t) and t.id != "pallas_tpu", marked=False))
def test_scalars_with_sinks_dropout_and_jvp(target):
    impl, options = target.backend, target.options
    q, k, v, _ = inputs((1, 64, 64, 2, 2, 16, 16), jnp.float32)
    score_mod, mask_mod = _scalar_mods()
    bm = flexjax.create_block_mask(mask_mod, None, None, 64, 64, block_size=32)
    sinks = jnp.asarray([0.5, -1.0])
    rng = jax.random.PRNGKey(4)

    def f(q, backend_, kernel_options, **kw):
        return flexjax.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, backend=backend_,
                                      kernel_options=kernel_options, **kw)

    for kw in ({"sinks": sinks}, {"dropout_rate": 0.25, "dropout_rng": rng}):
        np.testing.assert_allclose(f(q, impl, options, **kw), f(q, "reference", None, **kw), atol=2e-5, rtol=2e-5)
    tangent = jnp.ones_like(q) * 0.1
    got = jax.jvp(lambda q: f(q, impl, options), (q,), (tangent,))
    want = jax.jvp(lambda q: f(q, "reference", None), (q,), (tangent,))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("target", budgeted(lambda t: _float32(t) and t.paged and t.id != "pallas_tpu",
                                            marked=False))
def test_scalars_in_decode_and_paged_calls(target):
    """One query row (the decode kernels) over a contiguous and a paged cache."""
    impl, options = target.backend, target.options
    B, S, page = 2, 64, 16
    q, k, v, _ = inputs((B, 1, S, 4, 2, 16, 16), jnp.float32)
    score_mod, _ = _scalar_mods()
    lengths = jnp.asarray([0, 37], jnp.int32)  # batch 0's cache is empty
    bm = flexjax.create_block_mask(flexjax.masks.padding(lengths), B, None, 1, S, block_size=(1, page))
    got = flexjax.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, backend=impl, kernel_options=options)
    want = flexjax.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, backend="reference")
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    table = jnp.arange(B * S // page, dtype=jnp.int32)[::-1].reshape(B, S // page)
    k_pages = jnp.zeros((B * S // page, page, 2, 16)).at[table.reshape(-1)].set(k.reshape(B * S // page, page, 2, 16))
    v_pages = jnp.zeros((B * S // page, page, 2, 16)).at[table.reshape(-1)].set(v.reshape(B * S // page, page, 2, 16))
    paged = flexjax.paged.flex_attention(q, k_pages, v_pages, table, lengths, score_mod, backend=impl,
                                         kernel_options=options)
    np.testing.assert_allclose(paged, want, atol=2e-5, rtol=2e-5)


def test_any_crash_in_the_serve_question_is_a_refusal(monkeypatch):
    """Whatever a backend's resolve raises (it must not) is its reason: backend=None warns and
    moves on, a named backend re-raises (``_contract.make_plan`` guards it)."""
    import warnings

    from flexjax.backends import pallas

    def crash(spec, q, k, v):
        raise RuntimeError("kaput")

    monkeypatch.setattr(pallas, "resolve", crash)
    from flexjax import backends

    monkeypatch.setitem(backends._PLATFORM_ORDER, jax.default_backend(), ("pallas", "xla"))
    q, k, v, _ = inputs((1, 32, 32, 1, 1, 16, 16), jnp.float32)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = flexjax.flex_attention(q, k, v)
    assert any("RuntimeError: kaput" in str(w.message) and "using 'xla'" in str(w.message) for w in seen)
    np.testing.assert_allclose(out, flexjax.flex_attention(q, k, v, backend="reference"), atol=2e-5)
    with pytest.raises(NotImplementedError, match="backend 'pallas' cannot serve.*RuntimeError: kaput"):
        flexjax.flex_attention(q, k, v, backend="pallas")
