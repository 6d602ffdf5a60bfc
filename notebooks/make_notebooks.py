"""Writes the example notebooks with nbformat and executes them with nbclient (outputs stored).

    .venv/bin/python notebooks/make_notebooks.py            # write and execute all
    .venv/bin/python notebooks/make_notebooks.py 03         # only those whose name contains "03"
    .venv/bin/python notebooks/make_notebooks.py --no-run   # write without executing

The cells live here, so a change to a notebook is a change to this file; regenerate
and commit the .ipynb files with their outputs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import nbformat
from nbclient import NotebookClient

HERE = os.path.dirname(os.path.abspath(__file__))

def setup(names: str, timing: bool = False) -> str:
    """The first code cell: imports (``names`` from flexjax, if any) and the SMALL switch."""
    return f'''\
import os
{"import time" + chr(10) if timing else ""}
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import flexjax
{"from flexjax import " + names + chr(10) if names else ""}
# FLEXJAX_NOTEBOOK_SMALL=1 shrinks the shapes further (the test suite sets it).
SMALL = os.environ.get("FLEXJAX_NOTEBOOK_SMALL") == "1"
print("jax", jax.__version__, "on", jax.default_backend(), "| flexjax", flexjax.__version__, "| small:", SMALL)'''


DENSE = '''\
def dense_attention(q, k, v, mask, score_mod=None):
    """softmax(score_mod(q·kᵀ/sqrt(d)), masked) v with the whole (B, H, S, S) score matrix."""
    B, S, H, D = q.shape
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    if score_mod is not None:
        b = jnp.arange(B)[:, None, None, None]
        h = jnp.arange(H)[None, :, None, None]
        s = score_mod(s, b, h, jnp.arange(S)[:, None], jnp.arange(k.shape[1])[None, :])
    s = jnp.where(mask, s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)'''


def md(text: str):
    return nbformat.v4.new_markdown_cell(text)


def code(text: str):
    return nbformat.v4.new_code_cell(text)


def quickstart():
    return [
        md("# flexjax quickstart\n\n"
           "FlexAttention for JAX: you write attention variants as two small functions and flexjax turns them "
           "into block-sparse, differentiable attention.\n\n"
           "- a **`score_mod(score, b, h, q_idx, kv_idx) -> score`** rewrites one attention score "
           "(biases, soft-capping, ...);\n"
           "- a **`mask_mod(b, h, q_idx, kv_idx) -> bool`** says whether query `q_idx` may attend to key "
           "`kv_idx`. `create_block_mask` evaluates it tile by tile so that `flex_attention` skips the tiles "
           "where nothing attends.\n\n"
           "Layout is `jax.nn.dot_product_attention`'s: `(batch, seq, heads, head_dim)`."),
        code(setup("and_masks, create_block_mask, create_mask, flex_attention, masks, mods, or_masks")),
        md("## score_mod and mask_mod in ten lines"),
        code('''\
B, S, H, D = 2, (128 if SMALL else 256), 4, 64
q, k, v = jax.random.normal(jax.random.key(0), (3, B, S, H, D))

def causal(b, h, q_idx, kv_idx):               # mask_mod: True = attend
    return q_idx >= kv_idx

def tanh_cap(score, b, h, q_idx, kv_idx):      # score_mod: rewrites one score
    return 20.0 * jnp.tanh(score / 20.0)

block_mask = create_block_mask(causal, B=None, H=None, Q_LEN=S, KV_LEN=S, block_size=32)
out = flex_attention(q, k, v, score_mod=tanh_cap, block_mask=block_mask)
print(out.shape, repr(block_mask))'''),
        md("`out` is an ordinary JAX array: `flex_attention` works under `jax.jit`, `jax.grad` and `jax.vmap`. "
           "Check it against plain dense attention, which builds the whole `S x S` score matrix:"),
        code(DENSE + '''


dense = dense_attention(q, k, v, create_mask(causal, B, H, S, S), tanh_cap)
err = float(jnp.abs(out - dense).max())
print(f"max |flex_attention - dense| = {err:.2e}")
assert err < 1e-4'''),
        md("The block mask records, for each `32 x 32` tile, whether it is **empty** (skipped), **partial** "
           "(the mask_mod is applied inside it) or **full** (no masking needed). `to_string()` draws it as "
           "text; `block_mask.plot()` draws it with matplotlib, with the element-level mask beside it for "
           "short sequences."),
        code('''\
print(block_mask.to_string())
fig = block_mask.plot()'''),
        md("## A gallery of masks\n\n"
           "`flexjax.masks` has ready-made mask_mods, and `and_masks` / `or_masks` combine any of them. "
           "Below: causal, a sliding window, prefix-LM, packed documents, and a combination, a sliding "
           "window plus four *attention-sink* tokens that every query keeps (StreamingLLM): "
           "`or_masks(and_masks(causal, sliding_window), sink)`."),
        code('''\
bounds = np.round(np.cumsum([0, 0.15, 0.25, 0.2, 0.4]) * S).astype(int)   # four packed documents
doc_ids = jnp.asarray(np.repeat(np.arange(4), np.diff(bounds)), dtype=jnp.int32)

def sink(b, h, q_idx, kv_idx):
    return kv_idx < 4

gallery = {
    "causal": masks.causal,
    "sliding window (48)": masks.sliding_window(48),
    "prefix-LM (prefix S/4)": masks.prefix_lm(S // 4),
    "documents (causal)": and_masks(masks.causal, masks.document(doc_ids)),
    "sliding window | sinks": or_masks(and_masks(masks.causal, masks.sliding_window(32)), sink),
}
block_masks = {name: create_block_mask(m, None, None, S, S, block_size=32) for name, m in gallery.items()}

fig, axes = plt.subplots(2, len(gallery), figsize=(4 * len(gallery), 8))
for j, (name, bm) in enumerate(block_masks.items()):
    bm.plot(ax=(axes[0, j], axes[1, j]), element=True, legend=(j == 0),
            title=f"{name}\\n{bm.sparsity():.0f}% of tiles skipped")
fig.tight_layout()'''),
        md("Each of them against dense attention (with ALiBi as the score_mod, for good measure):"),
        code('''\
alibi = mods.alibi(H)
print(f"{'mask':<26}{'tiles skipped':>14}{'max |err|':>12}")
for name, bm in block_masks.items():
    out = flex_attention(q, k, v, alibi, bm)
    ref = dense_attention(q, k, v, create_mask(gallery[name], B, H, S, S), alibi)
    err = float(jnp.abs(out - ref).max())
    print(f"{name:<26}{bm.sparsity():>13.1f}%{err:>12.2e}")
    assert err < 1e-4, name'''),
        md("## Gradients\n\n"
           "`flex_attention` is differentiable in `q`, `k`, `v` and in any array a score_mod closes over, "
           "such as a learnable bias table (see `03_training_with_learned_bias.ipynb`)."),
        code('''\
table = 0.1 * jax.random.normal(jax.random.key(1), (H, 2 * S - 1))
bm = block_masks["causal"]
dense_mask = create_mask(masks.causal, B, H, S, S)

def loss_flex(q, table):
    return (flex_attention(q, k, v, mods.relative_bias(table), bm) ** 2).sum()

def loss_dense(q, table):
    return (dense_attention(q, k, v, dense_mask, mods.relative_bias(table)) ** 2).sum()

g_flex = jax.jit(jax.grad(loss_flex, argnums=(0, 1)))(q, table)
g_dense = jax.jit(jax.grad(loss_dense, argnums=(0, 1)))(q, table)
for name, a, b in zip(("dq", "dtable"), g_flex, g_dense):
    rel = float(jnp.abs(a - b).max() / jnp.abs(b).max())
    print(f"{name}: max relative difference {rel:.1e}")
    assert rel < 1e-4'''),
    ]


def mods_gallery():
    return [
        md("# score_mod gallery\n\n"
           "Each `flexjax.mods` factory returns a score_mod. For each one: a heat map of the scores it "
           "produces (`score_mod(q·k/sqrt(d), ...)`, one head, masked pairs left white) next to the block "
           "mask it is paired with, and a check of `flex_attention` against the dense `reference` backend."),
        code(setup("create_block_mask, create_mask, flex_attention, masks, mods")),
        code('''\
B, S, H, D = 1, (96 if SMALL else 128), 4, 32
BLOCK = 16
q, k, v = jax.random.normal(jax.random.key(0), (3, B, S, H, D))
raw = jnp.einsum("bqhd,bkhd->bhqk", q, k)[0] / np.sqrt(D)   # (H, S, S) scores before any score_mod
qi, ki = jnp.arange(S)[:, None], jnp.arange(S)[None, :]


def show(title, score_mod, mask_mod, head=0, raw_scores=raw, cmap="viridis", note=""):
    """Modified scores of one head (masked pairs blank) beside the block mask; checks flex vs reference."""
    bm = create_block_mask(mask_mod, None, None, S, S, block_size=BLOCK)
    s = score_mod(raw_scores[head], 0, head, qi, ki)
    allowed = np.asarray(create_mask(mask_mod, 1, H, S, S)[0, head])
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(11, 4.6))
    im = a0.imshow(np.where(allowed, np.asarray(s), np.nan), cmap=cmap, interpolation="nearest")
    fig.colorbar(im, ax=a0, fraction=0.046)
    a0.set_title(f"{title}: scores after score_mod, head {head}" + (f"\\n{note}" if note else ""), fontsize=10)
    a0.set_xlabel("kv index")
    a0.set_ylabel("q index")
    bm.plot(ax=a1, element=False)
    fig.tight_layout()
    out = flex_attention(q, k, v, score_mod, bm)
    ref = flex_attention(q, k, v, score_mod, bm, backend="reference")
    err = float(jnp.abs(out - ref).max())
    print(f"{title}: max |xla - reference| = {err:.1e}")
    assert err < 1e-4'''),
        md("## ALiBi\n\n"
           "`mods.alibi(H)` adds `slope[h] * (kv_idx - q_idx)`: a linear penalty on distance, a different "
           "slope per head (Press et al., https://arxiv.org/abs/2108.12409). Paired with a causal mask. "
           "Shown on zero scores, so the picture is the bias itself."),
        code('''\
zeros = jnp.zeros_like(raw)
for head in (0, H - 1):
    show("ALiBi", mods.alibi(H), masks.causal, head=head, raw_scores=zeros,
         note=f"slope {mods.alibi_slopes(H)[head]:.3f}")'''),
        md("## Soft-capping\n\n"
           "`mods.soft_cap(cap)` squashes scores into `(-cap, cap)` with `cap * tanh(score / cap)` (Gemma 2). "
           "Here the raw scores are scaled up 4x and capped at 2, with a sliding-window mask: the picture "
           "saturates at +-2."),
        code('''\
fig, ax = plt.subplots(figsize=(4.5, 3.2))
x = np.linspace(-8, 8, 200)
ax.plot(x, x, "--", color="0.6", label="identity")
ax.plot(x, mods.soft_cap(2.0)(jnp.asarray(x), 0, 0, 0, 0), label="soft_cap(2)")
ax.set_xlabel("score")
ax.legend()
ax.set_title("soft_cap(2)")

show("soft_cap(2)", mods.soft_cap(2.0), masks.sliding_window(32), raw_scores=4 * raw, cmap="coolwarm")'''),
        md("## Learnable relative bias\n\n"
           "`mods.relative_bias(table)` adds `table[h, kv_idx - q_idx + S - 1]`, one entry per head and "
           "distance; the table is usually a parameter trained through `jax.grad`. Here a hand-made table "
           "(a decaying ripple) with a prefix-LM mask, so distances of both signs appear."),
        code('''\
dist = np.arange(-(S - 1), S)
table = jnp.asarray(np.stack([np.cos(dist / (4 + 3 * h)) * np.exp(-np.abs(dist) / 40) for h in range(H)]),
                    dtype=jnp.float32)
show("relative_bias", mods.relative_bias(table), masks.prefix_lm(S // 3), raw_scores=zeros, cmap="RdBu_r")'''),
        md("## T5 bucketed relative bias\n\n"
           "`mods.t5_relative_bucket_bias(table, num_buckets, max_distance)` puts each distance into one of "
           "`num_buckets` buckets (exact for short distances, logarithmic up to `max_distance`) and adds "
           "`table[h, bucket]` (Raffel et al., https://arxiv.org/abs/1910.10683). The buckets first, then the "
           "bias with a document mask (three packed documents)."),
        code('''\
NB, MAXD = 16, 64
rel = np.arange(-S + 1, S)
buckets = np.asarray(mods.t5_relative_position_bucket(jnp.asarray(rel), NB, MAXD, bidirectional=True))
fig, ax = plt.subplots(figsize=(6, 3))
ax.step(rel, buckets, where="mid")
ax.set_xlabel("kv_idx - q_idx")
ax.set_ylabel("bucket")
ax.set_title(f"T5 buckets: num_buckets={NB}, max_distance={MAXD}, bidirectional")

t5_table = jnp.asarray(np.linspace(-1.0, 1.0, NB)[None, :].repeat(H, 0) * np.array([1, -1, 0.5, 2])[:, None],
                       dtype=jnp.float32)
ids = jnp.asarray(np.repeat(np.arange(3), [S // 4, S // 2, S - S // 4 - S // 2]), dtype=jnp.int32)
show("T5 bias", mods.t5_relative_bucket_bias(t5_table, NB, MAXD), masks.document(ids), raw_scores=zeros,
     cmap="RdBu_r")'''),
        md("## Your own score_mod\n\n"
           "Anything written with `jnp` on the five arguments works; arrays it closes over become inputs of "
           "the kernel (and get gradients). A head-dependent *and* position-dependent example: every head "
           "boosts keys at a multiple of its own period."),
        code('''\
periods = jnp.array([2, 3, 5, 8])

def periodic_boost(score, b, h, q_idx, kv_idx):
    return score + jnp.where((q_idx - kv_idx) % periods[h] == 0, 1.0, 0.0)

show("periodic_boost", periodic_boost, masks.causal, head=3, raw_scores=zeros, cmap="magma")'''),
    ]


def training():
    return [
        md("# Training with a learned relative-position bias\n\n"
           "A tiny causal transformer in pure JAX learns a synthetic task: **output the token that came `K` "
           "positions earlier**. The model has no positional embeddings; its only way to know where tokens "
           "are is a learnable relative-position table `bias[h, kv_idx - q_idx]`, added to the scores by a "
           "`score_mod`. `jax.grad` reaches the table through `flex_attention`.\n\n"
           "The same model is trained twice from the same initialization on the same batches: once with "
           "`flex_attention` (causal BlockMask), once with dense attention that materializes every score. "
           "The loss curves should coincide; the speed and memory differ."),
        code(setup("create_block_mask, flex_attention, masks, mods", timing=True)),
        code('''\
VOCAB, D_MODEL, HEADS, K = 16, 32, 2, 5
SEQ, BATCH = (64, 8) if SMALL else (128, 16)
STEPS, LR = (150 if SMALL else 300), 1e-2
HEAD_DIM = D_MODEL // HEADS


def init_params(key):
    ks = jax.random.split(key, 6)
    n = lambda k, shape, fan_in: jax.random.normal(k, shape) / np.sqrt(fan_in)  # noqa: E731
    return {
        "embed": n(ks[0], (VOCAB, D_MODEL), 1.0),
        "wq": n(ks[1], (D_MODEL, HEADS, HEAD_DIM), D_MODEL),
        "wk": n(ks[2], (D_MODEL, HEADS, HEAD_DIM), D_MODEL),
        "wv": n(ks[3], (D_MODEL, HEADS, HEAD_DIM), D_MODEL),
        "wo": n(ks[4], (HEADS, HEAD_DIM, D_MODEL), D_MODEL),
        "unembed": n(ks[5], (D_MODEL, VOCAB), D_MODEL),
        "rel_bias": jnp.zeros((HEADS, 2 * SEQ - 1)),   # learnable: entry SEQ-1+d for kv_idx - q_idx = d
    }


def batch(key, seq=SEQ, n=BATCH):
    """Random tokens; the target at position i is the token at i - K (positions i < K are not scored)."""
    x = jax.random.randint(key, (n, seq), 0, VOCAB)
    y = jnp.roll(x, K, axis=1)
    return x, y'''),
        md("The attention layer takes the attention function as an argument, so both models share every "
           "other line."),
        code('''\
def flex_attn(q, k, v, rel_bias, block_mask):
    return flex_attention(q, k, v, mods.relative_bias(rel_bias), block_mask)


def dense_attn(q, k, v, rel_bias, block_mask):
    """The same math with the whole (B, H, S, S) score matrix."""
    S = q.shape[1]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    idx = jnp.arange(S)
    s = s + rel_bias[:, idx[None, :] - idx[:, None] + S - 1][None]
    s = jnp.where(idx[:, None] >= idx[None, :], s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def loss_fn(params, x, y, attn, block_mask):
    h = params["embed"][x]                                          # (B, S, D_MODEL)
    q = jnp.einsum("bsd,dhe->bshe", h, params["wq"])
    k = jnp.einsum("bsd,dhe->bshe", h, params["wk"])
    v = jnp.einsum("bsd,dhe->bshe", h, params["wv"])
    a = attn(q, k, v, params["rel_bias"], block_mask)               # (B, S, HEADS, HEAD_DIM)
    h = h + jnp.einsum("bshe,hed->bsd", a, params["wo"])
    logits = h @ params["unembed"]
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]
    return nll[:, K:].mean()                                        # the first K positions have no source


def adam(lr, b1=0.9, b2=0.99, eps=1e-8):
    def init(p):
        z = jax.tree.map(jnp.zeros_like, p)
        return (z, z, 0)

    def update(g, state, p):
        m, v, t = state
        t = t + 1
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
        p = jax.tree.map(lambda p, m, v: p - lr * (m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + eps), p, m, v)
        return p, (m, v, t)

    return init, update


def make_step(attn):
    opt_init, opt_update = adam(LR)

    @jax.jit
    def step(params, opt_state, x, y, block_mask):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y, attn, block_mask)
        params, opt_state = opt_update(grads, opt_state, params)
        return params, opt_state, loss

    return opt_init, step'''),
        md("Train both. `block_mask` is built once (it depends only on the sequence length) and passed into "
           "the jitted step like any other pytree."),
        code('''\
block_mask = create_block_mask(masks.causal, None, None, SEQ, SEQ, block_size=32)
params0 = init_params(jax.random.key(0))
keys = jax.random.split(jax.random.key(1), STEPS)
curves, final, seconds = {}, {}, {}
for name, attn in (("flex_attention", flex_attn), ("dense", dense_attn)):
    opt_init, step = make_step(attn)
    params, opt_state = params0, opt_init(params0)
    losses = []
    t0 = time.perf_counter()
    for i in range(STEPS):
        x, y = batch(keys[i])
        params, opt_state, loss = step(params, opt_state, x, y, block_mask)
        losses.append(loss)
    curves[name] = np.asarray(jax.device_get(losses))
    seconds[name] = time.perf_counter() - t0
    final[name] = params
    print(f"{name:>15}: loss {curves[name][0]:.3f} -> {curves[name][-1]:.4f} in {seconds[name]:.1f} s "
          f"(incl. compile)")
gap = np.abs(curves["flex_attention"] - curves["dense"]).max()
print(f"largest difference between the two loss curves: {gap:.2e}")
assert curves["flex_attention"][-1] < 0.1 * curves["flex_attention"][0], "the model did not learn the task"
assert gap < 1e-2'''),
        code('''\
fig, (a0, a1) = plt.subplots(1, 2, figsize=(12, 4))
for name, style in (("flex_attention", "-"), ("dense", "--")):
    a0.plot(curves[name], style, label=name)
a0.set_yscale("log")
a0.set_xlabel("step")
a0.set_ylabel("cross-entropy")
a0.set_title(f"copy the token {K} back: loss (log scale)")
a0.legend()
d = np.arange(-(SEQ - 1), SEQ)
for h in range(HEADS):
    a1.plot(d, final["flex_attention"]["rel_bias"][h], label=f"head {h} (flex)")
    a1.plot(d, final["dense"]["rel_bias"][h], ":", color="k", linewidth=1, label="dense" if h == 0 else None)
a1.axvline(-K, color="red", alpha=0.3, linewidth=4, label=f"kv_idx - q_idx = -{K}")
a1.set_xlim(-4 * K, 0.5)
a1.set_xlabel("kv_idx - q_idx")
a1.set_title("learned relative bias (causal part near 0)")
a1.legend(fontsize=8)
fig.tight_layout()
peak = {h: int(d[: SEQ][np.argmax(final["flex_attention"]["rel_bias"][h][: SEQ])]) for h in range(HEADS)}
print("distance with the largest learned bias, per head:", peak)'''),
        md("## Speed and memory\n\n"
           "The same training step at longer sequences (batch 4). Time: median of a few jitted steps. "
           "Memory: the scratch space XLA plans for the compiled step (`memory_analysis().temp_size_in_bytes`), "
           "which for dense attention grows with `S^2` (the score matrix and its gradient) and for "
           "flex_attention with `S`. Memory is read from the compiled program without running it, so the "
           "longest length is only compiled."),
        code('''\
def measure(attn, seq, run):
    params = init_params(jax.random.key(0))
    params["rel_bias"] = jnp.zeros((HEADS, 2 * seq - 1))
    bm = create_block_mask(masks.causal, None, None, seq, seq)
    opt_init, step = make_step(attn)
    opt_state = opt_init(params)
    x, y = batch(jax.random.key(2), seq, 4)
    compiled = step.lower(params, opt_state, x, y, bm).compile()
    temp_mib = compiled.memory_analysis().temp_size_in_bytes / 2**20
    ms = float("nan")
    if run:
        jax.block_until_ready(compiled(params, opt_state, x, y, bm))
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(params, opt_state, x, y, bm))
            times.append((time.perf_counter() - t0) * 1e3)
        ms = float(np.median(times))
    return ms, temp_mib


lengths = [256, 1024, 4096] if not SMALL else [128, 512]
rows = []
for seq in lengths:
    run = seq <= 1024
    for name, attn in (("flex_attention", flex_attn), ("dense", dense_attn)):
        ms, mib = measure(attn, seq, run)
        rows.append((seq, name, ms, mib))
        step = f"{ms:8.1f} ms" if run else "(compiled only)"
        print(f"S={seq:>5} {name:>15}: step {step:>15}   XLA temp memory {mib:9.1f} MiB")'''),
        code('''\
fig, (a0, a1) = plt.subplots(1, 2, figsize=(11, 3.8))
for name, marker in (("flex_attention", "o"), ("dense", "s")):
    r = [row for row in rows if row[1] == name]
    timed = [row for row in r if not np.isnan(row[2])]
    a0.plot([row[0] for row in timed], [row[2] for row in timed], marker=marker, label=name)
    a1.plot([row[0] for row in r], [row[3] for row in r], marker=marker, label=name)
for a, title, unit in ((a0, "training step time", "ms"), (a1, "XLA temp memory of the step", "MiB")):
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("sequence length")
    a.set_ylabel(unit)
    a.set_title(title)
    a.legend()
fig.tight_layout()'''),
    ]


def performance():
    return [
        md("# Performance\n\n"
           "Plots the JSON lines written by the benchmark runner:\n\n"
           "```\npython -m benchmarks.run --suite ci --torch --out bench_results\n```\n\n"
           "By default this reads the small sample committed at `notebooks/data/bench_ci.jsonl` (a `--suite ci` "
           "run on a 2-core CPU; its timings are noisy and predate kernel tuning). Set `FLEXJAX_BENCH_JSONL` to "
           "plot another run, e.g. `bench_results/results.jsonl` from `--suite full`.\n\n"
           "*Effective* GFLOP/s count only the unmasked (q, kv) pairs (`4 * pairs * D * H * B` per forward, "
           "3.5x for forward + backward), so a dense implementation that computes masked pairs too is charged "
           "for them."),
        code('''\
import json
import os

import matplotlib.pyplot as plt
import numpy as np

path = os.environ.get("FLEXJAX_BENCH_JSONL", os.path.join("data", "bench_ci.jsonl"))
records = [json.loads(line) for line in open(path)]
machine = {k: v for r in records if r["kind"] == "machine" for k, v in r.items()}
print(f"{path}: {len(records)} records")
print("command:", machine.get("command"))
print("machine:", machine.get("cpu"), f"({machine.get('cpus_usable')} cores),", "jax", machine.get("jax"),
      "| torch", machine.get("torch", "not run"), "|", machine.get("date"))
attn = [r for r in records if r["kind"] == "attention"]
STYLE = {"flexjax": ("C0", "o"), "jax.nn.dot_product_attention": ("C1", "s"), "dense_jnp": ("C2", "^"),
         "torch.flex_attention": ("C3", "D"), "torch.sdpa": ("C4", "v")}'''),
        md("## Causal forward: time and effective GFLOP/s against sequence length"),
        code('''\
def series(mask, mode, impl, score_mod=None):
    rs = sorted((r for r in attn if r["mask"] == mask and r["mode"] == mode and r["impl"] == impl
                 and r.get("score_mod") == score_mod and r["status"] == "ok"), key=lambda r: r["S"])
    return [r["S"] for r in rs], [r["median_ms"] for r in rs], [r["eff_gflops"] for r in rs]


fig, (a0, a1) = plt.subplots(1, 2, figsize=(12, 4.2))
for impl, (color, marker) in STYLE.items():
    S, ms, gf = series("causal", "fwd", impl)
    if S:
        a0.plot(S, ms, marker=marker, color=color, label=impl)
        a1.plot(S, gf, marker=marker, color=color, label=impl)
a0.set_yscale("log")
a0.set_ylabel("median ms")
a1.set_ylabel("effective GFLOP/s")
for a, title in ((a0, "causal forward, B=1 H=8 D=64 float32: time"), (a1, "... effective GFLOP/s")):
    a.set_xscale("log", base=2)
    a.set_xlabel("sequence length")
    a.set_title(title)
    a.grid(alpha=0.3)
a0.legend(fontsize=8)
fig.tight_layout()'''),
        md("## Every spec at a glance\n\n"
           "Time of each implementation relative to flexjax (bars above 1: flexjax is faster), per spec. "
           "Missing bars: not applicable (torch FlexAttention has no CPU backward) or skipped."),
        code('''\
import textwrap

specs = list(dict.fromkeys(r["spec"] for r in attn))
labels = {r["spec"]: r["label"] for r in attn}
impls = [i for i in STYLE if any(r["impl"] == i for r in attn)]
fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(specs)), 4.2))
width = 0.8 / len(impls)
for j, impl in enumerate(impls):
    ratios = []
    for s in specs:
        flex = next((r for r in attn if r["spec"] == s and r["impl"] == "flexjax" and r["status"] == "ok"), None)
        r = next((r for r in attn if r["spec"] == s and r["impl"] == impl and r["status"] == "ok"), None)
        ratios.append(r["median_ms"] / flex["median_ms"] if (r and flex) else np.nan)
    ax.bar(np.arange(len(specs)) + j * width - 0.4 + width / 2, ratios, width, color=STYLE[impl][0], label=impl)
ax.axhline(1, color="k", linewidth=0.8)
ax.set_yscale("log")
ax.set_xticks(np.arange(len(specs)))
ax.set_xticklabels([textwrap.fill(labels[s], 20) for s in specs], fontsize=8)
ax.set_ylabel("time / flexjax time")
ax.set_title("relative time per spec (log scale)")
ax.legend(fontsize=8, ncol=len(impls), loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
fig.tight_layout()

print(f"{'spec':<44}" + "".join(f"{i[:22]:>24}" for i in impls))
for s in specs:
    cells = []
    for impl in impls:
        r = next((r for r in attn if r["spec"] == s and r["impl"] == impl), None)
        cells.append("" if r is None else (f"{r['median_ms']:.1f} ms" if r["status"] == "ok" else r["status"]))
    print(f"{labels[s]:<44}" + "".join(f"{c:>24}" for c in cells))'''),
        md("## Block-mask build time\n\n"
           "`create_block_mask` evaluates the mask_mod tile by tile. The first call traces and compiles; later "
           "calls with the same shapes reuse the compiled builder (a BlockMask is usually built once per "
           "batch shape, or inside the jitted step)."),
        code('''\
build = [r for r in records if r["kind"] == "build" and r["status"] == "ok"]
fig, ax = plt.subplots(figsize=(8, 4.5))
mask_colors = {m: f"C{i}" for i, m in enumerate(sorted({r["mask"] for r in build}))}
for side, marker, name in (("jax", "o", "flexjax"), ("torch", "s", "torch")):
    for mask, color in mask_colors.items():
        rs = sorted((r for r in build if r["side"] == side and r["mask"] == mask), key=lambda r: r["S"])
        if not rs:
            continue
        S = [r["S"] for r in rs]
        ax.plot(S, [r["median_ms"] for r in rs], marker=marker, color=color, linestyle="-" if side == "jax" else "--",
                label=f"{name} {mask} (cached)")
        ax.plot(S, [r["first_ms"] for r in rs], marker="x", color=color, linestyle=":", linewidth=0.8,
                label=f"{name} {mask} (first call)")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("sequence length")
ax.set_ylabel("ms")
ax.set_title("create_block_mask time (block 128)")
ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
ax.grid(alpha=0.3)
fig.tight_layout()

for r in [r for r in records if r["kind"] == "memory"]:
    print(f"memory: {r.get('label') or r['spec']}: peak RSS {r.get('peak_rss_mib', float('nan')):.0f} MiB "
          f"(goal {r.get('goal_mib')} MiB) -> {r['status']}")'''),
    ]


def training_features():
    return [
        md("# Training features: sinks, dropout, max scores, forward-mode AD\n\n"
           "Four arguments of `flex_attention` that training code asks for, all on the same block-sparse "
           "kernels: learnable attention **sinks** (logits that join the softmax denominator and add no "
           "value), fused **dropout** on the probabilities, the per-row **max score** as an auxiliary "
           "output, and **forward-mode AD** (`jax.jvp`) next to the usual `jax.grad`."),
        code(setup("masks", timing=False)),
        md("## Sinks learned on a toy task\n\n"
           "Each query should copy the value of the *previous occurrence of its own token* within the last "
           "16 positions, and output 0 when there is none (about half the rows). Queries and keys are the "
           "token embeddings times a learned per-head temperature. Without sinks, a softmax row must put its "
           "weight somewhere, so the rows with no match cannot output 0. A learnable sink per head gives them "
           "somewhere to put it. The same model is trained with and without sinks, and every step also "
           "records the largest attention logit through `return_aux=AuxRequest(max_scores=True)`."),
        code('''\
VOCAB, DIM, HEADS, WINDOW = 24, 32, 2, 16
SEQ, BATCH, STEPS = (64, 8, 80) if SMALL else (128, 16, 300)
embed = jax.random.normal(jax.random.key(0), (VOCAB, DIM)) / np.sqrt(DIM)


def batch(key):
    tokens = jax.random.randint(key, (BATCH, SEQ), 0, VOCAB)
    same = tokens[:, :, None] == tokens[:, None, :]
    offset = jnp.arange(SEQ)[:, None] - jnp.arange(SEQ)[None, :]
    match = same & (offset > 0) & (offset <= WINDOW)
    last = jnp.where(match, jnp.arange(SEQ)[None, None, :], -1).max(-1)      # previous occurrence or -1
    source = jnp.take_along_axis(tokens, jnp.maximum(last, 0), 1)
    target = jnp.where((last >= 0)[..., None], embed[source], 0.0)
    return tokens, target


def previous_window(b, h, q_idx, kv_idx):
    return (q_idx > kv_idx) & (q_idx - kv_idx <= WINDOW)


block_mask = flexjax.create_block_mask(previous_window, None, None, SEQ, SEQ, block_size=32)


def forward(params, tokens, use_sinks):
    x = jnp.repeat(embed[tokens][:, :, None, :], HEADS, axis=2)            # (B, S, H, DIM)
    q = x * params["temperature"][None, None, :, None]
    out, aux = flexjax.flex_attention(q, x, x, block_mask=block_mask, scale=1.0,
                                      sinks=params["sinks"] if use_sinks else None,
                                      return_aux=flexjax.AuxRequest(max_scores=True))
    return out.mean(2), aux.max_scores


def loss_fn(params, tokens, target, use_sinks):
    pred, max_scores = forward(params, tokens, use_sinks)
    return jnp.mean(jnp.sum((pred - target) ** 2, -1)), jnp.max(max_scores)


def train(use_sinks, lr=3.0):
    params = {"temperature": jnp.array([1.0, 2.0]), "sinks": jnp.zeros((HEADS,))}
    step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=3)
    losses, max_logits = [], []
    for i in range(STEPS):
        tokens, target = batch(jax.random.key(100 + i))
        (loss, max_logit), grads = step(params, tokens, target, use_sinks)
        params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
        losses.append(float(loss))
        max_logits.append(float(max_logit))
    return params, losses, max_logits


with_sinks = train(True)
without = train(False)
print(f"final loss with sinks {with_sinks[1][-1]:.4f}, without {without[1][-1]:.4f}")
print("learned sinks per head:", np.round(np.asarray(with_sinks[0]["sinks"]), 2))'''),
        code('''\
fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
axes[0].plot(with_sinks[1], label="with sinks")
axes[0].plot(without[1], label="without")
axes[0].set(xlabel="step", ylabel="loss", yscale="log", title="training loss")
axes[0].legend()
axes[1].plot(with_sinks[2], label="with sinks")
axes[1].plot(without[2], label="without")
axes[1].set(xlabel="step", ylabel="max logit", title="largest attention logit (AuxRequest(max_scores=True))")
axes[1].legend()
plt.tight_layout()'''),
        md("## Dropout\n\n"
           "The keep mask is a hash of `(key, b, h, q_idx, kv_idx)`: the same on every backend and tile "
           "size, regenerated in the backward, never stored. `flexjax.dropout_mask` shows it densely. "
           "Kept probabilities are scaled by `1/(1 - rate)`, so averaging the output over many keys "
           "approaches the output without dropout."),
        code('''\
S, H, D = (128, 2, 16) if SMALL else (256, 4, 32)
q, k, v = (jax.random.normal(jax.random.key(i), (1, S, H, D)) for i in range(3))
bm = flexjax.create_block_mask(masks.causal, None, None, S, S, block_size=64)
rate = 0.3
keep = flexjax.dropout_mask(jax.random.key(42), rate, 1, H, S, S)
print("kept fraction:", float(keep.mean()), "(expected", 1 - rate, ")")
plain = flexjax.flex_attention(q, k, v, block_mask=bm)
run = jax.jit(lambda key: flexjax.flex_attention(q, k, v, block_mask=bm, dropout_rate=rate, dropout_rng=key))
counts = [1, 4, 16, 64] if SMALL else [1, 4, 16, 64, 256]
errors, total, n = [], 0.0, 0
for i in range(counts[-1]):
    total = total + run(jax.random.key(1000 + i))
    n += 1
    if n in counts:
        errors.append(float(jnp.abs(total / n - plain).mean()))
fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
axes[0].imshow(np.asarray(keep[0, 0, :64, :64]), cmap="gray")
axes[0].set_title("keep mask, head 0 (64x64 corner)")
axes[1].loglog(counts, errors, "o-")
axes[1].set(xlabel="keys averaged", ylabel="mean |avg - no dropout|", title="dropout is unbiased")
plt.tight_layout()'''),
        md("## Forward-mode AD\n\n"
           "`jax.jvp` through `flex_attention` runs a blockwise tangent pass with the same tiles, while "
           "`jax.grad` keeps running the hand-written backward. Here a JVP is checked against a central "
           "finite difference."),
        code('''\
table = 0.1 * jax.random.normal(jax.random.key(5), (H, 2 * S))


def attend(q, table):
    return flexjax.flex_attention(q, k, v, lambda s, b, h, qi, ki: s + table[h, ki - qi + S], bm)


dq, dt = jax.random.normal(jax.random.key(6), q.shape), jax.random.normal(jax.random.key(7), table.shape)
_, tangent = jax.jvp(attend, (q, table), (dq, dt))
eps = 1e-2
fd = (attend(q + eps * dq, table + eps * dt) - attend(q - eps * dq, table - eps * dt)) / (2 * eps)
print("max |jvp - finite difference|:", float(jnp.abs(tangent - fd).max()))
print("max |jvp|:", float(jnp.abs(tangent).max()))'''),
    ]


def decoding():
    return [
        md("# Decoding with a paged KV cache\n\n"
           "A decode step is `flex_attention` with one query per sequence. Three pieces make a serving loop: "
           "a block mask built once for the whole cache and sliced per step (`flexjax.paged.decode_block_mask`: "
           "the rows the positions fall in, the mask_mod's `q_idx` shifted to them), traced positions so one "
           "jitted step serves every length, and paged K/V (`flexjax.paged`): pools of pages and a page table, "
           "with the mask and mods in logical positions, pages assigned on demand as the sequences grow "
           "(`paged.reserve`, inside the jitted step) and given back when one is done (`paged.release`).\n\n"
           "The model below is tiny and untrained (random weights): it shows the mechanics, and checks each "
           "step against attention over the gathered contiguous cache."),
        code(setup("masks, paged", timing=True)),
        md("## A tiny model and its paged cache"),
        code('''\
VOCAB = sorted(set("abcdefghijklmnopqrstuvwxyz .,"))
V, D_MODEL, HQ, HKV, D = len(VOCAB), 64, 4, 2, 16
PAGE, MAX_PAGES, NUM_PAGES = 16, 8, 20
L_MAX = PAGE * MAX_PAGES
keys = jax.random.split(jax.random.key(0), 5)
params = {
    "embed": jax.random.normal(keys[0], (V, D_MODEL)) * 0.5,
    "wq": jax.random.normal(keys[1], (D_MODEL, HQ * D)) / np.sqrt(D_MODEL),
    "wkv": jax.random.normal(keys[2], (D_MODEL, 2 * HKV * D)) / np.sqrt(D_MODEL),
    "out": jax.random.normal(keys[3], (HQ * D, V)) / np.sqrt(HQ * D),
}
prompts = ["the cat sat", "a dog ran by the"]
B = len(prompts)
k_pages, v_pages = paged.allocate(NUM_PAGES, PAGE, HKV, D)
lengths = np.array([len(p) for p in prompts])
# No page assigned yet (-1 everywhere), every page of the pool free: reserve assigns them on demand.
table = jnp.full((B, MAX_PAGES), -1, jnp.int32)
free = jnp.ones((NUM_PAGES,), bool)
block_mask = flexjax.create_block_mask(masks.causal, None, None, L_MAX, L_MAX, block_size=PAGE)
block_mask'''),
        code('''\
def qkv(tokens):
    x = params["embed"][tokens]                                   # (B, T, D_MODEL)
    q = (x @ params["wq"]).reshape(*tokens.shape, HQ, D)
    k, v = jnp.split((x @ params["wkv"]).reshape(*tokens.shape, 2 * HKV, D), 2, axis=2)
    return q, k, v


@jax.jit
def step(k_pages, v_pages, table, free, tokens, pos):
    """One token per sequence at positions ``pos`` (traced): a page for it where it starts a new one,
    its K/V written, attention, the next token."""
    table, free, ok = paged.reserve(table, free, pos + 1, PAGE)  # ok: False if the pool ran out
    q, k, v = qkv(tokens[:, None])
    k_pages, v_pages = paged.write(k_pages, v_pages, table, pos, k, v)
    bm = paged.decode_block_mask(block_mask, pos)
    out = paged.flex_attention(q, k_pages, v_pages, table, pos + 1, block_mask=bm)
    logits = out.reshape(B, HQ * D) @ params["out"]
    return k_pages, v_pages, table, free, ok, jnp.argmax(logits, -1), out


# Prefill token by token (a chunked prefill would call the same functions with q_len > 1).
text = [list(p) for p in prompts]
pos = jnp.zeros((B,), jnp.int32)
tokens = jnp.array([VOCAB.index(p[0]) for p in prompts])
n_steps = int(lengths.max()) + 40
for t in range(n_steps):
    k_pages, v_pages, table, free, ok, nxt, out = step(k_pages, v_pages, table, free, tokens, pos)
    assert bool(ok), "the page pool ran out"
    pos = pos + 1
    # Inside its prompt a sequence is fed its own next character; past it, the model's choice.
    tokens = jnp.array([VOCAB.index(prompts[b][t + 1]) if t + 1 < lengths[b] else int(nxt[b]) for b in range(B)])
    for b in range(B):
        if t + 1 >= lengths[b] and len(text[b]) < lengths[b] + 40:
            text[b].append(VOCAB[int(nxt[b])])
for b in range(B):
    print(repr("".join(text[b])))
print("compilations of step:", step._cache_size())
print("page table (pages assigned as the sequences grew):\\n", np.asarray(table))
print("free pages:", int(free.sum()), "of", NUM_PAGES)'''),
        md("Attention over the pages at the last position equals `flex_attention` on the contiguous cache "
           "gathered through the page table:"),
        code('''\
q = jax.random.normal(jax.random.key(7), (B, 1, HQ, D))
k_log, v_log = paged.gather(k_pages, table), paged.gather(v_pages, table)
last = pos - 1
ref = flexjax.flex_attention(q, k_log, v_log, backend="reference",
                             block_mask=flexjax.create_block_mask(masks.causal_with_offset(last), B, None, 1, L_MAX))
got = paged.flex_attention(q, k_pages, v_pages, table, last + 1, block_mask=paged.decode_block_mask(block_mask, last))
print("max |paged - contiguous reference|:", float(jnp.abs(got - ref).max()))'''),
        md("When a sequence is done, its pages go back to the pool for the next one (`paged.release`, "
           "jit-able too):"),
        code('''\
table, free = paged.release(table, free, jnp.array([True, False]))  # sequence 0 is done
print(np.asarray(table))
print("free pages:", int(free.sum()), "of", NUM_PAGES)'''),
        md("## Step time against cache length\n\n"
           "One decode step (B=4, Hq=16, Hkv=4, D=64, float32, causal, the query at the end of the cache): "
           "flex decoding on a contiguous cache, on a paged cache, and `jax.nn.dot_product_attention` with a "
           "dense mask over the whole cache. The flex steps read only the keys they need, through the block "
           "mask's tile lists. Timings are medians of 3 runs on this machine (a shared 2-core CPU when "
           "generated: noisy)."),
        code('''\
Bt, Hq, Hkv, Dh, ps = 4, 16, 4, 64, 256
lengths_t = [1024, 4096] if SMALL else [1024, 4096, 16384, 32768]


def median_ms(f, *args, n=3):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


rows = []
for L in lengths_t:
    kk = jax.random.split(jax.random.key(L), 3)
    q = jax.random.normal(kk[0], (Bt, 1, Hq, Dh))
    k = jax.random.normal(kk[1], (Bt, L, Hkv, Dh))
    v = jax.random.normal(kk[2], (Bt, L, Hkv, Dh))
    p = jnp.full((Bt,), L - 1, jnp.int32)
    bm = flexjax.create_block_mask(masks.causal, None, None, L, L)
    tab = jnp.arange(Bt * L // ps, dtype=jnp.int32).reshape(Bt, L // ps)
    kp, vp = k.reshape(-1, ps, Hkv, Dh), v.reshape(-1, ps, Hkv, Dh)
    contiguous = jax.jit(lambda q, k, v, p: flexjax.flex_attention(
        q, k, v, block_mask=paged.decode_block_mask(bm, p)))
    paged_step = jax.jit(lambda q, kp, vp, tab, p: paged.flex_attention(
        q, kp, vp, tab, p + 1, block_mask=paged.decode_block_mask(bm, p)))
    dense = jax.jit(lambda q, k, v, p: jax.nn.dot_product_attention(
        q, k, v, mask=(jnp.arange(L)[None, :] <= p[:, None])[:, None, None, :]))
    rows.append((L, median_ms(contiguous, q, k, v, p), median_ms(paged_step, q, kp, vp, tab, p),
                 median_ms(dense, q, k, v, p)))
    print("L={:6d}  contiguous {:7.2f} ms  paged {:7.2f} ms  dense {:7.2f} ms".format(*rows[-1]))

Ls = [r[0] for r in rows]
plt.figure(figsize=(6, 4))
for i, label in enumerate(["flex, contiguous cache", "flex, paged cache", "jax.nn.dot_product_attention, dense mask"]):
    plt.plot(Ls, [r[i + 1] for r in rows], marker="o", label=label)
plt.xscale("log", base=2)
plt.yscale("log")
plt.xlabel("cache length")
plt.ylabel("step time (ms)")
plt.legend()
plt.title("one decode step")
plt.show()'''),
        md("## A mixed batch: continuous batching\n\n"
           "A server's step mixes sequences that prefill a chunk of their prompt with sequences that decode one "
           "token. `paged.flex_attention_ragged` takes them all in one call: the new tokens packed `(T, Hq, D)`, "
           "`cu_q_lens` marking where each sequence's start, the mods in logical positions. Here a batch of "
           "prefill chunks and decode steps (the shapes of `benchmarks/bench_serving.py`, smaller) in one ragged "
           "call, against the same batch as two calls (the chunks padded to the longest, then the decode steps) "
           "and against one call padding every sequence to the longest chunk. All three are jitted with their "
           "block masks built inside; timings are medians of 3 on this machine (a shared 2-core CPU when "
           "generated). The ragged call's output equals the separate calls'."),
        code('''\
import sys

sys.path.insert(0, "..")  # the repository root, for benchmarks/
from benchmarks import bench_serving as bs  # noqa: E402

n_pre, n_dec = (4, 12) if SMALL else (8, 56)
sizes = (dict(chunk=(64, 256), prefix=(0, 512), cache=(512, 4096)) if SMALL
         else dict(chunk=(128, 512), prefix=(0, 1024), cache=(1024, 8192)))
q_lens, kv_lens = bs.batch(n_pre, n_dec, **sizes)
qs, kps, vps, tab = bs.setup(q_lens, kv_lens, Hq=16, Hkv=4, D=128, page_size=128, dtype=jnp.float32)
calls, check = bs.calls(qs, kps, vps, tab, q_lens, kv_lens, n_pre)
print(f"{n_pre} chunks ({int(q_lens[:n_pre].sum())} tokens) + {n_dec} decode steps, caches up to "
      f"{int(kv_lens.max())} tokens; max |ragged - separate| = {check():.1e}")
ms = bs.timed(calls, runs=3, flush=False)
tokens = int(q_lens.sum())
for name, t in ms.items():
    print(f"{name:9s} {t:8.1f} ms  {tokens / t * 1e3:8.0f} new tokens/s")
plt.figure(figsize=(6, 3.5))
plt.bar(list(ms), [tokens / t * 1e3 for t in ms.values()], color=["C0", "C1", "C2"])
plt.ylabel("new tokens / s")
plt.title("one step of a mixed prefill + decode batch")
plt.show()'''),
    ]


def gpt_end_to_end():
    return [
        md("# A small GPT, end to end\n\n"
           "A byte-level GPT in `flax.nnx` + `optax`, trained on text that ships with Python, then served from a "
           "paged KV cache. Every attention layer is `flexjax.flax.FlexMultiHeadAttention`, and the model uses:\n\n"
           "- **packed documents**: paragraphs of varying length one after another in each training row, kept "
           "apart by a document `mask_mod` composed with causal;\n"
           "- **sliding-window and global layers**, alternating (two BlockMasks a step);\n"
           "- a **score_mod**: soft-capped scores (Gemma 2) plus ALiBi, the model's only position signal;\n"
           "- **attention sinks**, a learnable logit per head (`num_sinks=1`, gpt-oss);\n"
           "- **bfloat16** compute (float32 parameters, optimizer state and loss).\n\n"
           "Then it generates through `FlexMultiHeadAttention`'s **paged decode cache** (`flexjax.paged`: a page "
           "pool, a page table and per-sequence lengths), checks the logits against the same weights on "
           "`jax.nn.dot_product_attention`, and times both.\n\n"
           "The model and its helpers live in [`examples/gpt.py`](../examples/gpt.py) (`python examples/gpt.py` "
           "runs the same steps from the command line); this notebook calls them and draws the results."),
        code(setup("", timing=True)),
        code('''\
import inspect
import pathlib
import sys

from flax import nnx

sys.path.insert(0, str(pathlib.Path(flexjax.__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402'''),
        md("## The text, packed\n\n"
           "The text is CPython's own documentation topics, `pydoc_data.topics` (what `help(\"if\")` prints), read "
           "from the installed standard library: nothing is downloaded. Its paragraphs are the documents; each "
           "starts with a BOS byte (0). A training row is a random window of the stream, so it packs whatever "
           "documents fall in it. The **unigram baseline** is the entropy of the training text's byte "
           "distribution: the loss of the best model that ignores the context."),
        code('''\
docs = gpt.documents()
train_set, held_out = gpt.split(docs)
unigram = train_set.unigram_entropy()
lengths = np.array([len(d) for d in docs])
print(f"{len(docs)} documents, {lengths.sum()} bytes; median {np.median(lengths):.0f} bytes, longest {lengths.max()}")
print(f"unigram baseline: {unigram:.3f} nats per byte")
print(repr(docs[123][:200]))'''),
        md("One packed row's document ids, and the two BlockMasks built from them: causal within each document, "
           "and within a window of 64 for the sliding-window layers. Grey tiles are skipped."),
        code('''\
cfg = gpt.Config()
sample = train_set.batch(np.random.default_rng(0), 4, cfg.seq)
local, full = gpt.packed_block_masks(cfg, jnp.asarray(sample["doc_ids"]))
fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
axes[0].imshow(sample["doc_ids"] - sample["doc_ids"][:, :1], aspect="auto", cmap="tab20", interpolation="nearest")
axes[0].set(title="document of each token, 4 packed rows", xlabel="position", ylabel="row")
full.plot(b=0, ax=axes[1], element=False, title=f"global layers, row 0: {full[0].sparsity():.0f}% of tiles skipped")
local.plot(b=0, ax=axes[2], element=False, legend=False,
           title=f"sliding-window layers, row 0: {local[0].sparsity():.0f}% skipped")
fig.tight_layout()'''),
        md("## The model\n\n"
           "`GPT.__call__(tokens, attend)` leaves each attention layer's call to `attend(i, layer, x)`: training "
           "passes the packed BlockMasks, decoding the cache, and the comparison below "
           "`jax.nn.dot_product_attention`. The score_mod and a block:"),
        code('''\
print(inspect.getsource(gpt.score_mod))
print(inspect.getsource(gpt.Block))'''),
        md("## Training\n\n"
           "AdamW (optax) with warmup and cosine decay, gradient clipping; one `nnx.jit` step. The default size "
           "(0.8 M parameters, batch 16 x 256 bytes, 300 steps) trains in under 3 minutes on 2 CPU cores; "
           "`FLEXJAX_NOTEBOOK_SMALL=1` (the test suite) takes 40 steps."),
        code('''\
STEPS = 40 if SMALL else 300
model = gpt.GPT(cfg, rngs=nnx.Rngs(0))
print(f"{sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) / 1e6:.2f} M parameters")
t0 = time.perf_counter()
losses = gpt.train(model, train_set, steps=STEPS, batch_size=16, lr=3e-3, log_every=50)
seconds = time.perf_counter() - t0
final = float(np.mean(losses[-10:]))
val = float(gpt.eval_loss(model, held_out.batch(np.random.default_rng(1), 16, cfg.seq)))
print(f"{STEPS} steps in {seconds:.0f} s (compile included): loss {final:.3f}, held out {val:.3f}, "
      f"unigram {unigram:.3f}")
assert final < unigram, "the model did not beat the unigram baseline"'''),
        code('''\
fig, ax = plt.subplots(figsize=(7, 4))
ax.plot(losses, label="training loss")
ax.axhline(unigram, color="C3", linestyle="--", label=f"unigram baseline ({unigram:.2f})")
ax.plot([STEPS - 1], [val], "o", color="C2", label=f"held out ({val:.2f})")
ax.set(xlabel="step", ylabel="cross-entropy (nats per byte)", ylim=(0, 6), title="training a byte-level GPT")
ax.legend()
fig.tight_layout()'''),
        md("## Generation through the paged cache\n\n"
           "`gpt.generate` gives every layer a paged cache (`init_cache(batch, max_length, page_size=32)`), "
           "prefills the prompts (the first 16 bytes of four held-out documents) in one call and samples one "
           "byte a step. It then feeds the same bytes to the same weights on `jax.nn.dot_product_attention` "
           "over contiguous caches: that function takes no score_mod, so the soft-cap and ALiBi go in as a bias "
           "computed from an explicit q·kᵀ, and the sink as an extra zero key. The logits must agree to "
           "bfloat16's precision."),
        code('''\
prompts = held_out.prompts(4, 16)
out = gpt.generate(model, prompts, 40 if SMALL else 120)
for row in out["tokens"]:
    print(repr(gpt.text(row)))
err, agree = gpt.logits_agree(out["flex_logits"], out["jax_nn_logits"], cfg.dtype)
print(f"max |logits(flexjax paged) - logits(jax.nn)| = {err:.3g}, largest logit "
      f"{float(jnp.abs(out['jax_nn_logits']).max()):.1f}")
print(f"decode, batch 4: flexjax {out['flex_tokens_per_s']:.0f} tokens/s, jax.nn {out['jax_nn_tokens_per_s']:.0f} "
      "tokens/s")
assert agree'''),
        md("## Decode speed against the cache's length\n\n"
           "One decode step (batch 4) near the end of caches of growing length. `jax.nn.dot_product_attention` "
           "reads every key and masks them; flexjax's sliding-window layers read the tiles inside the window and "
           "the global ones the tiles below the length. At a short context the fixed costs of flexjax's step "
           "(building each layer's block mask, reserving pages) dominate. Medians of a few steps on a shared "
           "2-core CPU when generated: noisy."),
        code('''\
rows = gpt.decode_speed(model, 4, [256, 1024] if SMALL else [256, 1024, 4096])
for r in rows:
    print(f"cache {r['length']:5d}: flexjax paged {r['flex_tokens_per_s']:6.0f} tokens/s, "
          f"jax.nn {r['jax_nn_tokens_per_s']:6.0f} tokens/s")
fig, ax = plt.subplots(figsize=(6, 4))
for k, label in (("flex_tokens_per_s", "flexjax, paged cache"), ("jax_nn_tokens_per_s", "jax.nn, contiguous cache")):
    ax.plot([r["length"] for r in rows], [r[k] for r in rows], "o-", label=label)
ax.set(xscale="log", yscale="log", xlabel="cache length", ylabel="tokens / s", title="decode step, batch 4")
ax.legend()
fig.tight_layout()'''),
    ]


def sparse_notebook():
    return [
        md("# Data-chosen sparsity: MoBA and NSA block selection\n\n"
           "A mask_mod fixes which pairs attend before the data is seen. MoBA "
           "([arXiv 2502.13189](https://arxiv.org/abs/2502.13189)) and NSA's selection branch "
           "([arXiv 2502.11089](https://arxiv.org/abs/2502.11089)) let the data choose: a cheap gate scores "
           "every (query block, key block) pair from pooled queries and keys, and each query block attends "
           "only to its `k` best key blocks. `flexjax.sparse` makes that choice a `BlockMask`, inside `jax.jit`:\n\n"
           "- `sparse.moba_scores(q, k, block_size=...)` / `sparse.nsa_scores(...)`: the gate, "
           "`(B, H, num_q_blocks, num_kv_blocks)`;\n"
           "- `sparse.topk_block_mask(scores, k, block_size=..., mask_mod=...)`: the BlockMask of the `k` best "
           "blocks per row;\n"
           "- `sparse.moba_block_mask(q, k, k_blocks)`: both, for causal MoBA.\n\n"
           "Below: queries and keys built so that each head looks for something different, the blocks each "
           "head chooses against the causal mask, and the attention over them under `jit`. "
           "`flexjax.flax.FlexMultiHeadAttention(sparse=SparseAttention(...))` does the same inside a layer."),
        code(setup("create_block_mask, flex_attention, masks, sparse", timing=True)),
        md("## Queries and keys with structure\n\n"
           "Each kv block gets a direction of its own (its *topic*), added to every key in it. The four query "
           "heads (two per kv head, GQA) look for different topics:\n\n"
           "- head 0: the topic of the block 3 blocks back (a fixed look-back);\n"
           "- head 1: the topics of the first two blocks (a global *sink*);\n"
           "- head 2: the topic of the block halfway back (`i // 2`);\n"
           "- head 3: nothing (noise only): its choice is arbitrary, apart from its own block."),
        code('''\
B, S, HQ, HKV, D = 1, (512 if SMALL else 1024), 4, 2, 32
BLOCK = 32 if SMALL else 64
NB = S // BLOCK                                      # 16 blocks
TOP_K = NB // 4                                     # a quarter of the kv blocks per query block
rng = np.random.default_rng(0)
topic = rng.normal(size=(HKV, NB, D))
topic /= np.linalg.norm(topic, axis=-1, keepdims=True)
block_of = np.arange(S) // BLOCK                     # each position's block
k = 0.5 * rng.normal(size=(B, S, HKV, D)) + 3.0 * np.swapaxes(topic[:, block_of], 0, 1)[None]
wanted = np.zeros((B, S, HQ, D))
wanted[0, :, 0] = topic[0, np.maximum(block_of - 3, 0)]            # kv head 0
wanted[0, :, 1] = topic[0, 0] + topic[0, 1]
wanted[0, :, 2] = topic[1, block_of // 2]                            # kv head 1
q = jnp.asarray(0.5 * rng.normal(size=(B, S, HQ, D)) + 3.0 * wanted, jnp.float32)
k = jnp.asarray(k, jnp.float32)
v = jnp.asarray(rng.normal(size=(B, S, HKV, D)), jnp.float32)
print(f"{S} positions in {NB} blocks of {BLOCK}; each query block keeps {TOP_K} kv blocks")'''),
        md("## The blocks MoBA chooses\n\n"
           "`moba_scores` is MoBA's gate per block pair: the block's mean query against each block's mean key. "
           "Future blocks get `-inf` (never chosen) and the query block's own block `+inf` (always chosen); "
           "`moba_block_mask` keeps the `TOP_K` best of each row. Each head's choice, against the causal mask "
           "(which reads every earlier block), with the gate's scores below:"),
        code('''\
scores = sparse.moba_scores(q, k, block_size=BLOCK)               # (B, HQ, NB, NB)
moba = sparse.moba_block_mask(q, k, TOP_K, block_size=BLOCK)
causal = create_block_mask(masks.causal, None, None, S, S, block_size=BLOCK)
titles = ["head 0: 3 blocks back", "head 1: the first two blocks", "head 2: halfway back", "head 3: noise"]
fig, axes = plt.subplots(2, HQ + 1, figsize=(3.4 * (HQ + 1), 7))
causal.plot(ax=axes[0, 0], element=False, legend=False,
            title=f"causal\\n{causal.sparsity():.0f}% of tiles skipped")
axes[1, 0].axis("off")
for h in range(HQ):
    moba.plot(h=h, ax=axes[0, h + 1], element=False, legend=False, title=f"MoBA top {TOP_K}\\n{titles[h]}")
    s = np.asarray(scores[0, h])
    axes[1, h + 1].imshow(np.where(np.isfinite(s), s, np.nan), cmap="viridis", interpolation="nearest")
    axes[1, h + 1].set_title(f"moba_scores, head {h}\\n(blank: the future, and +inf on the diagonal)", fontsize=9)
    axes[1, h + 1].set_xlabel("kv block")
    axes[1, h + 1].set_ylabel("q block")
fig.tight_layout()
print(f"tiles skipped: causal {causal.sparsity():.1f}%, MoBA top {TOP_K} {moba.sparsity():.1f}% "
      "(blue: full tiles, orange: partial, on the diagonal)")'''),
        md("Head 0 keeps the diagonal and the block 3 back, head 1 the first two blocks, head 2 the block "
           "halfway back; head 3's choice beyond its own block is whatever the noise favours. A check of that "
           "reading, on the mask itself:"),
        code('''\
chosen = np.asarray(moba.to_dense())[0]                           # (HQ, NB, NB): 1 where a tile is computed
rows = np.arange(3, NB)
assert chosen[0, rows, rows - 3].all() and chosen[0, rows, rows].all()
assert chosen[1, 2:, 0].all() and chosen[1, 2:, 1].all()
assert chosen[2, rows, rows // 2].all()
print(f"most kv blocks in a query block's row, by head: {chosen.sum(-1).max(-1).tolist()} (TOP_K = {TOP_K})")'''),
        md("## NSA's selection: GQA groups choose together\n\n"
           "`nsa_scores` compresses the keys (means of `compress_size` keys every `stride`), takes each query's "
           "softmax over the compressed keys, and sums it onto the blocks, over the block's queries and over "
           "the heads of each GQA group: heads 0 and 1 (kv head 0) choose the same blocks, a compromise between "
           "what each wants; so do heads 2 and 3. `topk_block_mask` with a causal mask_mod attends inside them."),
        code('''\
nsa_scores = sparse.nsa_scores(q, k, block_size=BLOCK)          # compress_size BLOCK // 2, stride BLOCK // 4
nsa = sparse.topk_block_mask(nsa_scores, TOP_K, block_size=BLOCK, mask_mod=masks.causal, seq_lengths=(S, S))
fig, axes = plt.subplots(1, HQ, figsize=(3.4 * HQ, 3.8))
for h in range(HQ):
    nsa.plot(h=h, ax=axes[h], element=False, legend=False, title=f"NSA selection, head {h}\\n(kv head {h // 2})")
fig.tight_layout()
d = np.asarray(nsa.to_dense())[0]
assert (d[0] == d[1]).all() and (d[2] == d[3]).all()'''),
        md("## Attention over the chosen blocks, under `jit`\n\n"
           "The whole step, gate and choice included, in one jitted function: one compile serves every `q`, `k` "
           "of these shapes. The choice is not differentiated (`topk_block_mask` stops the gradient of the "
           "scores, as both papers do); `jax.grad` reaches `q`, `k` and `v` through the attention over the "
           "chosen blocks. Checked against the dense `reference` backend over the same mask, and timed "
           "against causal attention."),
        code('''\
traces = []


@jax.jit
def moba_attention(q, k, v):
    traces.append(1)
    return flex_attention(q, k, v, block_mask=sparse.moba_block_mask(q, k, TOP_K, block_size=BLOCK))


@jax.jit
def causal_attention(q, k, v):
    return flex_attention(q, k, v, block_mask=causal)


out = moba_attention(q, k, v)
ref = flex_attention(q, k, v, block_mask=moba, backend="reference")   # dense, over the same mask
err = float(jnp.abs(out - ref).max())
print(f"max |jit - reference| = {err:.1e}")
assert err < 1e-4
moba_attention(q + 1.0, k, v)                                       # other values, the same shapes
assert len(traces) == 1, "compiled again"


def median_ms(f, *args, n=5):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


per_row = {"causal": float(causal.to_dense().sum()) / NB, "MoBA": float(moba.to_dense().sum()) / (HQ * NB)}
t = {"causal": median_ms(causal_attention, q, k, v), "MoBA": median_ms(moba_attention, q, k, v)}
for name in t:
    print(f"{name:>6}: {per_row[name]:.2f} kv blocks per query block, {t[name]:.1f} ms a call")
print("(forward only, MoBA's gate and choice included; medians of 5 calls on a shared CPU when generated: noisy)")'''),
        md("## In a Flax layer\n\n"
           "`flexjax.flax.FlexMultiHeadAttention(..., sparse=SparseAttention(\"moba\", block_size, top_k))` "
           "chooses the blocks from its own projected queries and keys at every call (causal, composed with "
           "its mask_mod; its score_mod and sinks apply), and `SparseAttention(\"nsa\", ...)` adds NSA's "
           "compressed and sliding-window branches under a learned gate. `examples/gpt_sparse.py` trains "
           "`examples/gpt.py`'s model dense and with MoBA at a quarter of the blocks, and prints both losses "
           "and step times."),
        code('''\
from flax import nnx

from flexjax.flax import FlexMultiHeadAttention, SparseAttention

layer = FlexMultiHeadAttention(HQ, 64, num_kv_heads=HKV, sparse=SparseAttention("moba", BLOCK, TOP_K),
                               rngs=nnx.Rngs(0))
x = jax.random.normal(jax.random.key(1), (2, S, 64))
y = nnx.jit(lambda m, x: m(x))(layer, x)
print(y.shape, layer.sparse)'''),
    ]


NOTEBOOKS = {
    "01_quickstart.ipynb": quickstart,
    "02_mods_gallery.ipynb": mods_gallery,
    "03_training_with_learned_bias.ipynb": training,
    "04_performance.ipynb": performance,
    "05_decoding.ipynb": decoding,
    "06_training_features.ipynb": training_features,
    "07_gpt_end_to_end.ipynb": gpt_end_to_end,
    "08_sparse.ipynb": sparse_notebook,
}


def build(name: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = NOTEBOOKS[name]()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def execute(nb: nbformat.NotebookNode, timeout: int = 600) -> nbformat.NotebookNode:
    """Runs ``nb`` top to bottom in notebooks/ with the current interpreter's python3 kernel."""
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": HERE}}).execute()
    return nb


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("only", nargs="*", help="substrings of the notebook names to build")
    p.add_argument("--no-run", action="store_true", help="write the notebooks without executing them")
    args = p.parse_args(argv)
    for name in NOTEBOOKS:
        if args.only and not any(s in name for s in args.only):
            continue
        nb = build(name)
        if not args.no_run:
            t0 = time.perf_counter()
            execute(nb)
            print(f"{name}: executed in {time.perf_counter() - t0:.1f} s", flush=True)
        nbformat.write(nb, os.path.join(HERE, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
