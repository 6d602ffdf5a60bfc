"""flexjax.paged.flex_attention_ragged / write_and_attend: mixed prefill and decode batches
over paged KV equal flex_attention run sequence by sequence on the gathered cache."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import assert_close
from targets import budgeted

import flexjax
from flexjax import masks, paged

HQ, HKV, D, PS, MAX_PAGES, NUM_PAGES = 4, 2, 16, 16, 6, 40
# Sequences: a prefill chunk of 7 at length 40, two decode steps, a whole 33-token
# prefill, an idle sequence (no new token); three rows of padding at the end.
KV_LENS = np.array([40, 1, 70, 33, 5], np.int32)
Q_LENS = np.array([7, 1, 1, 33, 0], np.int32)


def _cu(q_lens):
    return np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)


def _setup(dtype=jnp.float32, seed=0, pad=3):
    cu = _cu(Q_LENS)
    table = paged.page_table_for(KV_LENS, PS, MAX_PAGES, num_pages=NUM_PAGES, seed=seed)
    ks = jax.random.split(jax.random.key(seed), 4)
    k_pages = jax.random.normal(ks[0], (NUM_PAGES, PS, HKV, D)).astype(dtype)
    v_pages = jax.random.normal(ks[1], (NUM_PAGES, PS, HKV, D)).astype(dtype)
    q = jax.random.normal(ks[2], (int(cu[-1]) + pad, HQ, D)).astype(dtype)
    slopes = jax.random.uniform(ks[3], (HQ,), minval=0.05, maxval=0.3)
    return cu, jnp.asarray(table), k_pages, v_pages, q, slopes


def _alibi(slopes):
    def alibi(s, b, h, q_idx, kv_idx):
        return s - slopes[h] * jnp.abs(q_idx - kv_idx).astype(s.dtype)
    return alibi


def _window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 20)


def _per_sequence(q, k_pages, v_pages, table, kv_lens, cu, score_mod, mask_mod):
    """Attention sequence by sequence on the gathered cache, dense (the semantics of
    flex_attention: fully masked rows give 0 and lse -inf); (out (T, Hq, D), lse (Hq, T)).
    Sequence i's queries sit at kv_lens[i] - q_len_i + r; the mods see b = i. All tokens at
    once, in one jitted function (each token against its own sequence's whole cache)."""
    base = mask_mod or masks.causal

    @jax.jit
    def dense(q, k_pages, v_pages, table, kv_lens, cu):
        T, S = q.shape[0], kv_lens.shape[0]
        K, V = (jnp.repeat(paged.gather(x, table).astype(jnp.float32), HQ // HKV, axis=2) for x in (k_pages, v_pages))
        x = jnp.arange(T)
        s = jnp.clip(jnp.searchsorted(cu, x, side="right") - 1, 0, S - 1)
        live = x < cu[-1]
        pos = kv_lens[s] - (cu[s + 1] - cu[s]) + (x - cu[s])
        scores = jnp.einsum("thd,tlhd->thl", q.astype(jnp.float32), K[s]) / np.sqrt(q.shape[-1])
        b, h = s[:, None, None], jnp.arange(HQ)[None, :, None]
        q_idx, kv_idx = pos[:, None, None], jnp.arange(K.shape[1])[None, None, :]
        if score_mod is not None:
            scores = score_mod(scores, b, h, q_idx, kv_idx)
        ok = base(b, h, q_idx, kv_idx) & (kv_idx < kv_lens[s][:, None, None]) & live[:, None, None]
        scores = jnp.where(ok, scores, -jnp.inf)
        lse = jax.nn.logsumexp(scores, axis=-1)  # (T, Hq)
        p = jnp.where(ok, jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
        out = jnp.einsum("thl,tlhd->thd", p, V[s])
        return out.astype(q.dtype), lse.T

    return dense(q, k_pages, v_pages, table, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(cu, jnp.int32))


# (make test's budget: one case in make test-extra; the others in make test-all.)
@pytest.mark.parametrize("backend,mask_name,dtype", [
    pytest.param("xla", "causal", jnp.float32, marks=pytest.mark.slow),
    pytest.param("xla", "window", jnp.bfloat16, marks=pytest.mark.ci_extra),
    pytest.param("pallas", "window", jnp.float32, marks=pytest.mark.slow),
    pytest.param("pallas", "causal", jnp.float16, marks=pytest.mark.slow),
    pytest.param("xla", "causal", jnp.float16, marks=pytest.mark.slow),
])
def test_ragged_matches_per_sequence(backend, mask_name, dtype):
    """Mixed chunk / decode / whole prefill / idle sequences, GQA, ALiBi in logical positions,
    a random page table: out and lse equal the per-sequence reference, padding rows are 0
    with lse -inf."""
    cu, table, k_pages, v_pages, q, slopes = _setup(dtype)
    mask = None if mask_name == "causal" else _window
    got, aux = paged.flex_attention_ragged(q, k_pages, v_pages, table, KV_LENS, cu, score_mod=_alibi(slopes),
                                           mask_mod=mask, return_aux=flexjax.AuxRequest(lse=True), backend=backend)
    assert got.shape == q.shape and got.dtype == dtype and aux.lse.shape == (HQ, q.shape[0])
    f32 = [x.astype(jnp.float32) for x in (q, k_pages, v_pages)]
    truth = _per_sequence(f32[0], f32[1], f32[2], table, KV_LENS, cu, _alibi(slopes), mask)
    # (the same-dtype reference: inputs in the dtype, dense float32 math, output rounded)
    ref = _per_sequence(q, k_pages, v_pages, table, KV_LENS, cu, _alibi(slopes), mask)
    assert_close("ragged", (got, aux.lse), truth, ref, dtype)
    assert float(jnp.abs(got[cu[-1]:].astype(jnp.float32)).max()) == 0.0
    assert bool(jnp.all(jnp.isneginf(aux.lse[:, cu[-1]:])))


# (make test's budget: xla in make test-extra, the others in make test-all.)
@pytest.mark.parametrize("target", budgeted(lambda t: t.paged, extra=("xla",)))
def test_ragged_gradients(target):
    """Gradients to the query and to the captured ALiBi slopes equal the per-sequence reference's."""
    cu, table, k_pages, v_pages, q, slopes = _setup()
    do = jax.random.normal(jax.random.key(7), q.shape)
    live = (jnp.arange(q.shape[0]) < cu[-1])[:, None, None]

    def loss_ragged(q, slopes):
        o = paged.flex_attention_ragged(q, k_pages, v_pages, table, KV_LENS, cu, score_mod=_alibi(slopes),
                                        mask_mod=_window, **target.kw())
        return jnp.sum(jnp.where(live, o * do, 0.0))

    def loss_ref(q, slopes):
        o, _ = _per_sequence(q, k_pages, v_pages, table, KV_LENS, cu, _alibi(slopes), _window)
        return jnp.sum(jnp.where(live, o * do, 0.0))

    got = jax.grad(loss_ragged, (0, 1))(q, slopes)
    truth = jax.grad(loss_ref, (0, 1))(q, slopes)
    assert_close("grads", got, truth, truth, jnp.float32)


@pytest.mark.ci_extra  # (make test's budget)
def test_ragged_reads_only_reachable_pages():
    """Pages no query can reach (past a sliding window, or unassigned past a length) are
    filled with NaN: a tile that read them would poison its rows."""
    cu, table, k_pages, v_pages, q, slopes = _setup()
    # Sequence 2 (length 70, one query at position 69, window 20): keys 0..49 are out of
    # reach, so its pages 0 and 1 (keys 0..31) must not be read.
    poisoned = np.asarray(table)[2, :2]
    k_bad = k_pages.at[poisoned].set(jnp.nan)
    v_bad = v_pages.at[poisoned].set(jnp.nan)
    got = paged.flex_attention_ragged(q, k_bad, v_bad, table, KV_LENS, cu, mask_mod=_window)
    want = paged.flex_attention_ragged(q, k_pages, v_pages, table, KV_LENS, cu, mask_mod=_window)
    rows = slice(int(cu[2]), int(cu[3]))
    assert not bool(jnp.isnan(got[rows]).any())
    np.testing.assert_allclose(np.asarray(got[rows]), np.asarray(want[rows]), rtol=0, atol=0)


@pytest.mark.slow  # (make test's budget: test_speculative_tree_verify reads per-sequence tables by b too)
def test_ragged_mods_see_sequence_index():
    """``b`` is the sequence: a per-sequence table read by b (a prefix length per sequence,
    prefix-LM in logical positions) gives each sequence its own mask."""
    cu, table, k_pages, v_pages, q, slopes = _setup()
    prefix = jnp.asarray([10, 0, 60, 5, 0], jnp.int32)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix[b]) | (q_idx >= kv_idx)

    got = paged.flex_attention_ragged(q, k_pages, v_pages, table, KV_LENS, cu, mask_mod=prefix_lm)
    truth, _ = _per_sequence(q, k_pages, v_pages, table, KV_LENS, cu, None, prefix_lm)
    assert_close("prefix", got, truth, truth, jnp.float32)


@pytest.mark.slow  # (make test's budget: test_serving_loop_one_compile compiles once over changing mixes too)
def test_ragged_one_compile_for_changing_mixes():
    """cu_q_lens and kv_lengths traced: every mix up to the capacities runs the same executable."""
    cu, table, k_pages, v_pages, q, slopes = _setup()
    step = jax.jit(lambda q, lens, cu: paged.flex_attention_ragged(q, k_pages, v_pages, table, lens, cu))
    for q_lens in ([3, 1, 1, 1, 0], [10, 0, 2, 28, 5], [0, 0, 0, 1, 1], list(Q_LENS)):
        q_lens = np.array(q_lens, np.int32)
        lens = np.maximum(KV_LENS, q_lens)
        c = _cu(q_lens)
        got = step(q, lens, c)
        truth, _ = _per_sequence(q, k_pages, v_pages, table, lens, c, None, None)
        assert_close(f"mix {q_lens.tolist()}", got, truth, truth, jnp.float32)
    assert step._cache_size() == 1


# (make test's budget: xla in make test-extra, the others in make test-all.)
@pytest.mark.parametrize("target", budgeted(lambda t: t.paged, extra=("xla",)))
def test_write_and_attend_equals_write_then_attend(target):
    """The fused call writes each new token at its logical position (dropping a token past
    the sequence's pages and padding rows) and attends over the written pages."""
    cu, table, k_pages, v_pages, q, slopes = _setup()
    T = q.shape[0]
    ks = jax.random.split(jax.random.key(3), 2)
    k_new = jax.random.normal(ks[0], (T, HKV, D))
    v_new = jax.random.normal(ks[1], (T, HKV, D))
    # Sequence 1 loses its only page: its length then reaches an unassigned page, which the call refuses
    # (when the step runs) rather than read some page. Its token is dropped, not written elsewhere.
    table = table.at[1].set(-1)
    fused = jax.jit(functools.partial(paged.write_and_attend, **target.kw()))
    with pytest.raises(Exception, match=r"page_table\[1, 0\] = -1 is unassigned"):
        jax.block_until_ready(fused(q, k_new, v_new, k_pages, v_pages, table, KV_LENS, cu))
    previous = paged.set_runtime_checks(False)  # the rest compares the write itself, unchecked
    try:
        out, k2, v2 = jax.jit(functools.partial(paged.write_and_attend, **target.kw()))(
            q, k_new, v_new, k_pages, v_pages, table, KV_LENS, cu)
        # The same through flex_attention_ragged's k_new / v_new.
        out2, k3, v3 = jax.jit(functools.partial(paged.flex_attention_ragged, **target.kw()))(
            q, k_pages, v_pages, table, KV_LENS, cu, k_new=k_new, v_new=v_new)
    finally:
        paged.set_runtime_checks(previous)
    # The same write through paged.write, sequence by sequence.
    k_ref, v_ref = k_pages, v_pages
    for i in range(len(KV_LENS)):
        n = int(cu[i + 1] - cu[i])
        if n:
            k_ref, v_ref = paged.write(k_ref, v_ref, table[i:i + 1], KV_LENS[i:i + 1] - n,
                                       k_new[None, cu[i]:cu[i + 1]], v_new[None, cu[i]:cu[i + 1]])
    np.testing.assert_array_equal(np.asarray(k2), np.asarray(k_ref))
    np.testing.assert_array_equal(np.asarray(v2), np.asarray(v_ref))
    np.testing.assert_array_equal(np.asarray(k3), np.asarray(k_ref))
    np.testing.assert_allclose(np.asarray(out2), np.asarray(out), rtol=1e-5, atol=1e-6)
    keep = np.ones(len(KV_LENS), bool)
    keep[1] = False
    want = paged.flex_attention_ragged(q, k_ref, v_ref, jnp.maximum(table, 0), KV_LENS, cu, **target.kw())
    for i in np.nonzero(keep)[0]:
        np.testing.assert_allclose(np.asarray(out[cu[i]:cu[i + 1]]), np.asarray(want[cu[i]:cu[i + 1]]),
                                   rtol=1e-5, atol=1e-6)


def test_ragged_bad_input():
    cu, table, k_pages, v_pages, q, slopes = _setup()
    with pytest.raises(ValueError, match="query must be"):
        paged.flex_attention_ragged(q[None], k_pages, v_pages, table, KV_LENS, cu)
    with pytest.raises(ValueError, match="cu_q_lens must be"):
        paged.flex_attention_ragged(q, k_pages, v_pages, table, KV_LENS, cu[:-1])
    with pytest.raises(ValueError, match="kv_lengths must be"):
        paged.flex_attention_ragged(q, k_pages, v_pages, table, KV_LENS[:2], cu)
    with pytest.raises(ValueError, match="new queries but kv_lengths"):  # more new tokens than the sequence holds
        paged.flex_attention_ragged(q, k_pages, v_pages, table, np.array([3, 1, 70, 33, 5], np.int32), cu)
    with pytest.raises(ValueError, match="never decrease"):
        paged.flex_attention_ragged(q, k_pages, v_pages, table, KV_LENS, np.array([0, 5, 3, 9, 42, 42], np.int32))
    with pytest.raises(NotImplementedError, match="backend"):
        paged.flex_attention_ragged(q, k_pages, v_pages, table, KV_LENS, cu, backend="triton_nonexistent")
    with pytest.raises(ValueError, match="k_new / v_new"):
        paged.write_and_attend(q, q, q, k_pages, v_pages, table, KV_LENS, cu)


def test_tree_mask_dense():
    """masks.tree: node i sees the prefix and its ancestors (itself included); queries before
    the tree are causal."""
    parents = np.array([-1, 0, 0, 1, 1, 2, -1, 6], np.int32)
    P = 5
    dense = np.asarray(flexjax.create_mask(masks.tree(parents, P), 1, 1, P + 8, P + 8)[0, 0])
    want = np.tril(np.ones((P + 8, P + 8), bool))
    want[P:, P:] = False
    for i in range(8):
        j = i
        while j >= 0:
            want[P + i, P + j] = True
            j = parents[j]
    np.testing.assert_array_equal(dense, want)
    with pytest.raises(ValueError, match="parent must be -1 or an earlier node"):
        masks.tree(np.array([-1, 2, 0]), P)
    with pytest.raises(TypeError, match="integer array"):
        masks.tree(np.array([-1.0, 0.0]), P)


# (make test's budget: test_tree_mask_dense checks the mask by default; these in make test-all.)
@pytest.mark.parametrize("target", budgeted(lambda t: t.paged, marked=False))
def test_speculative_tree_verify(target):
    """Verifying draft trees in a ragged call: each sequence's new tokens are its tree's nodes
    (a (num_seqs, n) parent array, traced), b picks the sequence's tree; equal to the
    per-sequence reference. A 40-node tree needs two ancestor words per node."""
    cu, table, k_pages, v_pages, _, slopes = _setup()
    rng = np.random.default_rng(4)
    n = 40
    parents = np.stack([np.array([-1] + [int(rng.integers(-1, i)) for i in range(1, n)], np.int32)
                        for _ in range(3)])
    kv = np.array([45, 41, 90], np.int32)
    q_lens = np.array([n, 1, n], np.int32)  # the middle sequence decodes one token
    cu = _cu(q_lens)
    table = jnp.asarray(paged.page_table_for(kv, PS, MAX_PAGES, num_pages=NUM_PAGES, seed=2))
    q = jax.random.normal(jax.random.key(11), (int(cu[-1]), HQ, D))
    verify = jax.jit(lambda q, parents, kv: paged.flex_attention_ragged(
        q, k_pages, v_pages, table, kv, cu, score_mod=_alibi(slopes),
        mask_mod=masks.tree(parents, kv - q_lens), **target.kw()))
    got = verify(q, parents, kv)
    truth, _ = _per_sequence(q, k_pages, v_pages, table, kv, cu, _alibi(slopes), masks.tree(parents, kv - q_lens))
    assert_close("tree", got, truth, truth, jnp.float32)


def test_serving_loop_one_compile():
    """A continuous-batching loop of 50 steps: sequences join with prompts of varying length
    (prefilled in chunks of at most 16), decode, finish and free their pages; the step
    (reserve, write_and_attend, the pools donated) compiles once. The last step's output
    equals the per-sequence reference over the pages as written."""
    S, T, CHUNK = 4, 24, 16
    num_pages, ps, max_pages = 32, 16, 8
    k_pages, v_pages = paged.allocate(num_pages, ps, HKV, D)
    table = jnp.full((S, max_pages), -1, jnp.int32)
    free = jnp.ones(num_pages, bool)

    @jax.jit
    def step(q, k_new, v_new, k_pages, v_pages, table, free, lens, q_lens):
        table, free, ok = paged.reserve(table, free, lens, ps)
        cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens)]).astype(jnp.int32)
        out, k_pages, v_pages = paged.write_and_attend(q, k_new, v_new, k_pages, v_pages, table, lens, cu)
        return out, k_pages, v_pages, table, free, ok

    rng = np.random.default_rng(0)
    prompt = rng.integers(8, 40, S)  # tokens each sequence still has to prefill
    lens = np.zeros(S, np.int32)
    done_at = rng.integers(60, 100, S)
    for t in range(50):
        q_lens = np.where(prompt > 0, np.minimum(prompt, CHUNK), 1).astype(np.int32)
        while q_lens.sum() > T:  # the step's token budget: defer the last prefill
            i = int(np.nonzero(q_lens > 1)[0][-1])
            q_lens[i] = max(1, q_lens[i] - (q_lens.sum() - T))
        prompt = np.maximum(prompt - q_lens, 0)
        lens = lens + q_lens
        ks = jax.random.split(jax.random.key(t), 3)
        q, k_new, v_new = (jax.random.normal(x, (T, h, D)) for x, h in zip(ks, (HQ, HKV, HKV)))
        out, k_pages, v_pages, table, free, ok = step(q, k_new, v_new, k_pages, v_pages, table, free,
                                                      jnp.asarray(lens), jnp.asarray(q_lens))
        assert bool(ok)
        finished = lens >= done_at
        if finished.any():  # a finished sequence frees its pages; a new one takes its row
            table, free = paged.release(table, free, jnp.asarray(finished))
            lens = np.where(finished, 0, lens).astype(np.int32)
            prompt = np.where(finished, rng.integers(8, 40, S), prompt)
    assert step._cache_size() == 1
    cu = _cu(q_lens)
    truth, _ = _per_sequence(q, k_pages, v_pages, jnp.maximum(table, 0), lens, cu, None, None)
    live = np.nonzero(~finished)[0]
    assert live.size
    for i in live:
        np.testing.assert_allclose(np.asarray(out[cu[i]:cu[i + 1]]), np.asarray(truth[cu[i]:cu[i + 1]]),
                                   atol=2e-6, rtol=1e-5)


@pytest.mark.slow  # (make test's budget: test_serving_loop_one_compile runs a longer loop)
def test_readme_serving_loop_runs():
    """The README's continuous-batching loop runs as printed, and compiles once."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("## Continuous batching", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    env = {}
    exec(compile(code, "README.md", "exec"), env)
    assert env["step"]._cache_size() == 1
    assert bool(env["ok"]) and not bool(jnp.isnan(env["out"]).any())


@pytest.mark.slow  # (the TPU kernel in Pallas' interpreter: about 10 s)
@pytest.mark.parametrize("pool", ["float", "int8"])
def test_ragged_tpu_kernel_interpreted(pool):
    """The TPU decode kernel (scalar-prefetched lists and page table, DMA'd tiles; an int8
    pool's scales in SMEM) serves the ragged call exactly in interpret mode (D=128)."""
    d = 128
    cu = _cu(Q_LENS)
    table = jnp.asarray(paged.page_table_for(KV_LENS, PS, MAX_PAGES, num_pages=NUM_PAGES, seed=0))
    ks = jax.random.split(jax.random.key(0), 3)
    k_pages, v_pages = (jax.random.normal(x, (NUM_PAGES, PS, HKV, d)) for x in ks[:2])
    q = jax.random.normal(ks[2], (int(cu[-1]) + 2, HQ, d))
    kw = {}
    if pool == "int8":
        k_pages, k_scale = paged.quantize(k_pages, "int8")
        v_pages, v_scale = paged.quantize(v_pages, "int8")
        kw = dict(k_scale=k_scale, v_scale=v_scale)
    call = lambda **o: paged.flex_attention_ragged(q, k_pages, v_pages, table, KV_LENS, cu,  # noqa: E731
                                                   mask_mod=_window, **kw, **o)
    got = call(backend="pallas", kernel_options={"target": "tpu", "interpret": True})
    want = call(backend="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)


@pytest.mark.triton  # (Triton's interpreter: make test-compile's venv)
@pytest.mark.parametrize("pool", ["float", "int8", "float8_e4m3fn"])
def test_ragged_and_paged_on_triton(pool):
    """The triton forward kernel reads pages through the table (dequantizing int8 / float8
    tiles as it loads them): the ragged call and a paged decode step equal xla's."""
    pytest.importorskip("triton")
    pytest.importorskip("torch")
    cu, table, k_pages, v_pages, q, slopes = _setup()
    d = D * 2  # (a power of two: the pools are read unpadded)
    ks = jax.random.split(jax.random.key(1), 3)
    k_pages, v_pages = (jax.random.normal(x, (NUM_PAGES, PS, HKV, d)) for x in ks[:2])
    q = jax.random.normal(ks[2], (q.shape[0], HQ, d))
    kw = {}
    if pool != "float":
        k_pages, k_scale = paged.quantize(k_pages, pool)
        v_pages, v_scale = paged.quantize(v_pages, pool)
        kw = dict(k_scale=k_scale, v_scale=v_scale)
    if pool == "float8_e4m3fn":  # (the interpreter refuses it; tests_compile/decode_suite.py compiles it for cuda)
        with pytest.raises(NotImplementedError, match="cannot take float8_e4m3fn"):
            paged.flex_attention_ragged(q, k_pages, v_pages, table, KV_LENS, cu, backend="triton", **kw)
        return
    ragged = lambda backend: paged.flex_attention_ragged(  # noqa: E731
        q, k_pages, v_pages, table, KV_LENS, cu, score_mod=_alibi(slopes), mask_mod=_window, backend=backend, **kw)
    np.testing.assert_allclose(np.asarray(ragged("triton")), np.asarray(ragged("xla")), atol=2e-6)
    q1 = q[:len(KV_LENS), None]
    step = lambda backend: paged.flex_attention(q1, k_pages, v_pages, table, KV_LENS, backend=backend, **kw)  # noqa: E731
    np.testing.assert_allclose(np.asarray(step("triton")), np.asarray(step("xla")), atol=2e-6)


@pytest.mark.slow  # (make test's budget: sinks go through the shared epilogue, tested on every entry point)
def test_ragged_sinks_and_max_scores():
    """Sinks join each row's normalizer as in flex_attention; return_aux gives lse and
    max_scores shaped (Hq, T); jax.grad reaches the sinks."""
    cu, table, k_pages, v_pages, q, slopes = _setup()
    sinks = jnp.linspace(-1.0, 1.0, HQ)
    out, aux = paged.flex_attention_ragged(q, k_pages, v_pages, table, KV_LENS, cu, sinks=sinks,
                                           return_aux=flexjax.AuxRequest(lse=True, max_scores=True))
    ref, lse = _per_sequence(q, k_pages, v_pages, table, KV_LENS, cu, None, None)
    new = jnp.logaddexp(lse, sinks[:, None])
    live = np.arange(q.shape[0]) < cu[-1]
    want = jnp.where(live[:, None, None], ref * jnp.exp(lse - new).T[:, :, None], 0.0)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-6)
    np.testing.assert_allclose(np.asarray(aux.lse[:, live]), np.asarray(new[:, live]), atol=2e-5)
    assert aux.max_scores.shape == (HQ, q.shape[0])
    g = jax.grad(lambda s: jnp.sum(paged.flex_attention_ragged(q, k_pages, v_pages, table, KV_LENS, cu, sinks=s)
                                   * live[:, None, None]))(sinks)
    assert g.shape == (HQ,) and bool(jnp.all(jnp.isfinite(g))) and bool(jnp.any(g != 0))
