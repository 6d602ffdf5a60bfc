"""The mod code generator: every generated function computes what the mod compiler's JAX evaluation does.

Each mod's forward and backward functions run in a probe kernel on one (BM, BN) tile under
Triton's interpreter, and are compared with ``CompiledMod.evaluate`` (the code the pallas
backend runs) and its ``jax.vjp``; the same probe kernels compile for sm_90 and sm_80
through ``triton.compile``, so the code the interpreter checked is code a GPU takes.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

from catalog import CATALOG  # noqa: E402

from flexjax import masks, mods  # noqa: E402
from flexjax._modcompiler import compile_mod  # noqa: E402
from flexjax._trace import trace_mod  # noqa: E402
from flexjax.backends.triton import _codegen, _launch  # noqa: E402

pytestmark = pytest.mark.triton  # runs under make test-compile (Triton and torch installed)

B, H, SQ, SKV = 2, 4, 96, 80
BM, BN = 32, 64


def _zoo_score(score, b, h, q_idx, kv_idx):
    """Float primitives: transcendental, rounding, powers, clamps, NaN-propagating min/max."""
    a = jnp.abs(score)
    x = jnp.where(q_idx >= kv_idx, jnp.exp(score * 0.25) + jnp.log1p(a) - jnp.expm1(-a * 0.1),
                  jax.nn.sigmoid(score) + jnp.tanh(score * 3.0))
    x = x + jnp.sqrt(a + 1.0) * jax.lax.rsqrt(a + 2.0) + score**3 * 0.01 + jnp.power(a + 0.5, 1.7) * 0.1
    x = x + jnp.clip(score, -1.0, 1.0) + jnp.maximum(score, 0.0) - jnp.minimum(score, -0.5) + jnp.sign(score)
    x = x + jnp.floor(score) * 0.5 + jnp.ceil(score) * 0.25 + jnp.sin(score) * jnp.cos(score)
    x = x + jax.lax.erf(score * 0.5) + jnp.log(a + 1.0) + jnp.exp2(score * 0.1) + score / (a + 3.0)
    return jnp.where(jnp.isfinite(x), x, 0.0) + 1.0 / (score**2 + 1.0)


def _zoo_int(score, b, h, q_idx, kv_idx):
    """Integer primitives on negative operands: floor division, remainders, shifts, sign, bools."""
    d = q_idx - kv_idx
    x = (d // 3).astype(jnp.float32) + (d % 5).astype(jnp.float32) + jax.lax.rem(d, 7).astype(jnp.float32)
    x = x + jax.lax.div(d, 4).astype(jnp.float32) + jnp.sign(d).astype(jnp.float32) + ((q_idx >> 1) << 2) * 0.01
    keep = (~(q_idx < kv_idx) | (h == 1)) ^ (b == 0)
    return jnp.where(keep, score + x, score - x) + jnp.maximum(d, -3) * 0.1 + jax.lax.shift_right_logical(d, 28)


def _relu_softplus(score, b, h, q_idx, kv_idx):
    """custom_jvp functions: their own rule (relu' = 0 at 0) must reach the generated VJP."""
    return jax.nn.relu(score) + 0.5 * jax.nn.softplus(score)


def _fill_table(table):
    def fill(score, b, h, q_idx, kv_idx):
        idx = q_idx - kv_idx + 20
        return score + table.at[h, idx].get(mode="fill", fill_value=-1.5) + table[(h + 1) % 4, kv_idx % 7]

    return fill


def _cases():
    """(name, kind, mod) for the catalog, the library and the zoo."""
    out = []
    for c in CATALOG:
        p = c.params(H, SQ, SKV)
        if c.score is not None:
            out.append((f"{c.name}/score", "score", c.score(p, H, SQ, SKV)))
        if c.mask is not None:
            out.append((f"{c.name}/mask", "mask", c.mask(B, H, SQ, SKV)))
    table = 0.3 * jax.random.normal(jax.random.PRNGKey(1), (H, 60))
    out += [
        ("zoo_float", "score", _zoo_score),
        ("zoo_int", "score", _zoo_int),
        ("fill_gather", "score", _fill_table(table)),
        ("soft_cap_array", "score", mods.soft_cap(jnp.asarray(1.5))),
        ("custom_jvp_relu_softplus", "score", _relu_softplus),
        ("alibi_slopes", "score", mods.alibi_from_slopes(jnp.linspace(0.1, 0.9, H))),
        ("sliding_window", "mask", masks.sliding_window(17)),
        ("dilated", "mask", masks.dilated(3) if hasattr(masks, "dilated") else masks.causal),
        ("document_1d", "mask", masks.document(jnp.arange(SQ) // 30, jnp.arange(SKV) // 30)),
        ("prefix_lm_per_batch", "mask", masks.prefix_lm(jnp.asarray([5, 40]))),
        ("causal_offset", "mask", masks.causal_with_offset(-7)),
        ("and_or", "mask", masks.and_masks(masks.causal, masks.sliding_window(9))
         if hasattr(masks, "and_masks") else masks.causal),
    ]
    return out


CASES = _cases()
IDS = [c[0] for c in CASES]


def _compiled(kind, fn):
    traced = trace_mod(fn, kind, arg_name=f"{kind}_mod")
    return traced, compile_mod(traced.static(), "triton")


def _probe_source(gm: _codegen.GeneratedMod, kind: str, backward: bool) -> str:
    rows = [f"r{k}_ptr" for k in range(gm.rows)]
    cols = [f"c{k}_ptr" for k in range(gm.cols)]
    arrs = [f"a{k}" for k in range(gm.arrays)]
    params = ", ".join(["score_ptr", "dout_ptr", *rows, *cols, *arrs, "out_ptr", "b", "h", "q_start",
                        "kv_start", "q_len", "kv_len", "BM: tl.constexpr", "BN: tl.constexpr"])
    body = [
        "    m = tl.arange(0, BM)",
        "    n = tl.arange(0, BN)",
        "    q_idx = tl.minimum(q_start + m, q_len - 1)[:, None]",
        "    kv_idx = tl.minimum(kv_start + n, kv_len - 1)[None, :]",
        "    tile = m[:, None] * BN + n[None, :]",
        "    score = tl.load(score_ptr + tile)",
        "    dout = tl.load(dout_ptr + tile)",
    ]
    body += [f"    r{k} = tl.load(r{k}_ptr + m)[:, None]" for k in range(gm.rows)]
    body += [f"    c{k} = tl.load(c{k}_ptr + n)[None, :]" for k in range(gm.cols)]
    lead = ["b", "h", "q_idx", "kv_idx"] if kind == "mask" else ["score", "b", "h", "q_idx", "kv_idx"]
    call = ", ".join(lead + [f"r{k}" for k in range(gm.rows)] + [f"c{k}" for k in range(gm.cols)] + arrs)
    if backward:
        n_out = 1 + sum(gm.row_float) + sum(gm.col_float) + 2 * len(gm.grad_reads)
        body.append(f"    res = {gm.bwd}({call}, dout)")
        body += [f"    tl.store(out_ptr + {i} * BM * BN + tile, res[{i}].to(tl.float32))" for i in range(n_out)]
    else:
        body.append(f"    res = {gm.fwd}({call})")
        body.append("    tl.store(out_ptr + tile, res.to(tl.float32))")
    name = "probe_bwd" if backward else "probe_fwd"
    return "\n".join(["import triton", "import triton.language as tl", "", "", gm.source, "",
                      f"@triton.jit\ndef {name}({params}):", *body]) + "\n"


def _inputs(traced, cm, b, h, q_start, kv_start):
    rng = np.random.default_rng(b * 7 + h)
    score = (3.0 * rng.standard_normal((BM, BN))).astype(np.float32)
    score[0, :4] = [0.0, -0.0, 1e-6, -40.0]
    dout = rng.standard_normal((BM, BN)).astype(np.float32)
    sq, skv = SQ + BM, SKV + BN
    rows, cols, arrays = cm.prologue(traced.consts, B, H, SQ, SKV, sq, skv)

    def pick(x, uses, start, size):
        ub, uh = uses
        return np.asarray(x)[b if ub else 0, h if uh else 0, start:start + size]

    rows = [pick(r, u, q_start, BM) for r, u in zip(rows, cm.row_uses)]
    cols = [pick(c, u, kv_start, BN) for c, u in zip(cols, cm.col_uses)]
    arrays = [np.asarray(a).astype(np.int32) if np.asarray(a).dtype == np.bool_ else np.asarray(a)
              for a in arrays]
    return score, dout, rows, cols, arrays


def _reference(cm, score, dout, rows, cols, arrays, b, h, q_start, kv_start):
    """(out, [dscore, drow sums, dcol sums, (flat idx, d) per float read]) from CompiledMod.evaluate."""
    q = jnp.minimum(q_start + jnp.arange(BM, dtype=jnp.int32), SQ - 1)[:, None]
    kv = jnp.minimum(kv_start + jnp.arange(BN, dtype=jnp.int32), SKV - 1)[None, :]
    rows_t = [jnp.asarray(r)[:, None] for r in rows]
    cols_t = [jnp.asarray(c)[None, :] for c in cols]
    arrs = [jnp.asarray(a) for a in arrays]
    reads = []

    def load(k, idx):
        val = arrs[k][tuple(idx)]
        flat = jnp.ravel_multi_index(tuple(jnp.broadcast_to(i, val.shape) for i in idx), arrs[k].shape,
                                     mode="clip")
        reads.append((k, flat, val))
        return val

    s = jnp.asarray(score) if cm.mod.kind == "score" else None
    out = cm.evaluate(s, jnp.int32(b), jnp.int32(h), q, kv, rows_t, cols_t, load)
    if cm.mod.kind == "mask":
        return np.asarray(out), None
    fl = lambda x: jnp.issubdtype(x.dtype, jnp.inexact)  # noqa: E731
    loaded = [val for _, _, val in reads]

    def f(s_, rf, cf, lf):
        it_r, it_c, it_l = iter(rf), iter(cf), iter(lf)
        rs = [next(it_r) if fl(x) else x for x in rows_t]
        cs = [next(it_c) if fl(x) else x for x in cols_t]
        ls = iter([next(it_l) if fl(x) else x for x in loaded])
        return cm.evaluate(s_, jnp.int32(b), jnp.int32(h), q, kv, rs, cs, lambda k, idx: next(ls))

    _, vjp = jax.vjp(f, s, [x for x in rows_t if fl(x)], [x for x in cols_t if fl(x)], [x for x in loaded if fl(x)])
    ds, drows, dcols, dreads = vjp(jnp.asarray(dout))
    grads = [ds] + [d[:, 0] for d in drows] + [d[0, :] for d in dcols]
    for (_, flat, _val), d in zip([r for r in reads if fl(r[2])], dreads):
        grads += [jnp.broadcast_to(flat, (BM, BN)), jnp.broadcast_to(d, (BM, BN))]
    return np.asarray(out), [np.asarray(g) for g in grads]


def _run(fn, score, dout, rows, cols, arrays, n_out, b, h, q_start, kv_start):
    t = lambda x: torch.from_numpy(np.array(x))  # noqa: E731
    out = torch.zeros((n_out, BM, BN), dtype=torch.float32)
    fn[(1,)](t(score), t(dout), *map(t, rows), *map(t, cols), *map(t, arrays), out,
                                     b, h, q_start, kv_start, SQ, SKV, BM=BM, BN=BN)
    return out.numpy()


TILES = [(0, 0, 0, 0), (1, 3, 64, 16), (1, 2, 32, 64)]  # (b, h, q_start, kv_start); the last runs past SKV


@pytest.mark.parametrize("name,kind,fn", CASES, ids=IDS)
def test_generated_mod_matches_the_compiler(name, kind, fn):
    traced, cm = _compiled(kind, fn)
    gm = _codegen.generate(cm, "m")
    assert _codegen.generate(cm, "m") is gm  # cached by the mod's key
    fwd = _launch.load(_probe_source(gm, kind, backward=False), True).probe_fwd
    bwd = (_launch.load(_probe_source(gm, kind, backward=True), True).probe_bwd
           if gm.bwd else None)
    for b, h, q_start, kv_start in TILES:
        score, dout, rows, cols, arrays = _inputs(traced, cm, b, h, q_start, kv_start)
        want, grads = _reference(cm, score, dout, rows, cols, arrays, b, h, q_start, kv_start)
        got = _run(fwd, score, dout, rows, cols, arrays, 1, b, h, q_start, kv_start)[0]
        np.testing.assert_allclose(got, np.broadcast_to(want, (BM, BN)).astype(np.float32), rtol=2e-6, atol=2e-6,
                                   err_msg=f"{name} forward at {(b, h, q_start, kv_start)}")
        if bwd is None:
            continue
        got = _run(bwd, score, dout, rows, cols, arrays, len(grads), b, h, q_start, kv_start)
        n_fr, n_fc = sum(gm.row_float), sum(gm.col_float)
        for i, want_g in enumerate(grads):
            g, atol = got[i], 2e-5
            if 1 <= i < 1 + n_fr + n_fc:
                # Rows (cols) sum the tile over kv (q): the order of that sum differs from XLA's.
                axis = 1 if i < 1 + n_fr else 0
                g, atol = g.sum(axis=axis), 2e-5 + 1e-6 * np.abs(g).sum(axis=axis)
            bad = np.abs(g - want_g) > atol + 2e-5 * np.abs(want_g)
            assert not bad.any(), (f"{name} backward output {i} at {(b, h, q_start, kv_start)}: "
                                   f"got {g[bad][:5]}, want {want_g[bad][:5]}")


def test_unsupported_primitive_is_named_before_any_kernel():
    def cumulative(score, b, h, q_idx, kv_idx):
        return score + jnp.arctan2(score, 2.0)

    _, cm = _compiled("score", cumulative)
    with pytest.raises(NotImplementedError, match="primitive 'atan2' in mod 'cumulative'"):
        _codegen.generate(cm, "m")


@pytest.mark.parametrize("arch", [90, 80])
def test_generated_mods_compile_for_cuda(arch):
    """Every catalog and zoo mod's probe kernels compile to cubin for sm_{arch} (triton.compile)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for name, kind, fn in CASES:
        traced, cm = _compiled(kind, fn)
        gm = _codegen.generate(cm, "m")
        _, _, rows, cols, arrays = _inputs(traced, cm, 0, 0, 0, 0)
        for backward in ((False, True) if gm.bwd else (False,)):
            mod = _launch.load(_probe_source(gm, kind, backward), False)
            fn_ = mod.probe_bwd if backward else mod.probe_fwd
            tmap = {"float32": "fp32", "int32": "i32", "float16": "fp16", "bfloat16": "bf16"}
            sig = {"score_ptr": "*fp32", "dout_ptr": "*fp32"}
            sig.update({f"r{k}_ptr": "*" + tmap[np.asarray(r).dtype.name] for k, r in enumerate(rows)})
            sig.update({f"c{k}_ptr": "*" + tmap[np.asarray(c).dtype.name] for k, c in enumerate(cols)})
            sig.update({f"a{k}": "*" + tmap[np.asarray(a).dtype.name] for k, a in enumerate(arrays)})
            sig.update({"out_ptr": "*fp32", "b": "i32", "h": "i32", "q_start": "i32", "kv_start": "i32",
                        "q_len": "i32", "kv_len": "i32", "BM": "constexpr", "BN": "constexpr"})
            src = ASTSource(fn_, sig, constexprs={"BM": BM, "BN": BN})
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
            assert "cubin" in compiled.asm, f"{name} ({'bwd' if backward else 'fwd'}) for sm_{arch}"


def test_every_catalog_primitive_has_a_translation():
    """The primitives of the catalog's and the library's mods, and of their VJPs, all translate."""
    seen = set()
    for _, kind, fn in CASES:
        _, cm = _compiled(kind, fn)
        seen |= {n.prim.name for n, s in zip(cm.nodes, cm.side) if s == "k"}
        _codegen.generate(cm, "m")
    assert seen <= _codegen.SUPPORTED_PRIMITIVES
    assert {"tanh", "dynamic_slice", "select_n", "rem", "div"} <= seen


def test_triton_backend_uses_the_custom_jvp_rule():
    """Scores of exactly 0 (zero queries): relu's rule gives 0 there, its inlined max(x, 0) 0.5."""
    import flexjax

    B, S, H, D = 1, 128, 2, 16
    q = jnp.zeros((B, S, H, D)).at[:, ::2].set(jax.random.normal(jax.random.PRNGKey(0), (B, S // 2, H, D)))
    k = jax.random.normal(jax.random.PRNGKey(1), (B, S, H, D))
    v = jax.random.normal(jax.random.PRNGKey(2), (B, S, H, D))
    bm = flexjax.create_block_mask(flexjax.masks.causal, None, None, S, S, block_size=64)

    def grads(backend):
        def loss(q, k, v):
            return jnp.sum(flexjax.flex_attention(q, k, v, _relu_softplus, bm, backend=backend) ** 2)

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    for name, g, w in zip("qkv", grads("triton"), grads("reference")):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-4, err_msg=f"d{name}")
