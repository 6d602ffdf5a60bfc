"""A small GPT in flax.nnx + optax on flexjax: trained on text that ships with Python, then served
from a paged KV cache.

    python examples/gpt.py                    # the default size: trains in under 3 minutes on 2 CPU cores
    python examples/gpt.py --steps 100 --layers 2 --d-model 64    # smaller and faster
    python examples/gpt.py --help

Each feature in a few lines:
- byte-level tokens (UTF-8, 256 of them; byte 0, which the text never holds, starts each document);
- packed rows: documents of varying length one after another in each training row, kept apart by
  a document mask_mod composed with causal (``and_masks(causal, document(doc_ids))``);
- layers alternating a sliding window (even layers) and global attention: two BlockMasks a step;
- one score_mod: soft-capped scores (Gemma 2) plus ALiBi, the model's only position signal;
- attention sinks, a learnable logit per head (``FlexMultiHeadAttention(num_sinks=1)``, gpt-oss);
- bfloat16 compute (float32 parameters, optimizer state and loss);
- generation through ``FlexMultiHeadAttention``'s paged decode cache (``flexjax.paged``), its logits
  checked against, and its speed timed against, the same weights on ``jax.nn.dot_product_attention``
  over a contiguous cache.

The text is CPython's own: the topics of its documentation that the standard library ships as
``pydoc_data.topics`` (what ``help("if")`` prints; the Python Software Foundation's documentation,
under its license), read from the installed interpreter, so nothing is downloaded. Its paragraphs
are the documents. Python 3.11's is 2,608 paragraphs, 461 kB; other versions differ a little, and so
do the numbers. The loss is compared with the unigram baseline: the entropy of the training text's
byte distribution, the best loss of a model that ignores the context.

``notebooks/07_gpt_end_to_end.ipynb`` runs the same functions with plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import flexjax
from flexjax import masks, mods
from flexjax.flax import FlexMultiHeadAttention

BOS = 0  # starts every document: the NUL byte, never in the text


# -- data --------------------------------------------------------------------------------------

def documents() -> list[bytes]:
    """The paragraphs of CPython's ``pydoc_data.topics``, UTF-8, in a fixed order."""
    from pydoc_data.topics import topics

    return [p.strip("\n").encode() for name in sorted(topics) for p in topics[name].split("\n\n") if p.strip()]


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Documents one after another: ``tokens`` int32 (N,), each document as BOS and its bytes, and
    ``doc_ids`` int32 (N,), each token's document."""

    tokens: np.ndarray
    doc_ids: np.ndarray

    @classmethod
    def pack(cls, docs: list[bytes]) -> Corpus:
        tokens = np.concatenate([np.frombuffer(bytes([BOS]) + d, np.uint8) for d in docs]).astype(np.int32)
        doc_ids = np.repeat(np.arange(len(docs), dtype=np.int32), [len(d) + 1 for d in docs])
        return cls(tokens, doc_ids)

    def unigram_entropy(self) -> float:
        """Entropy (nats) of the text's byte distribution (BOS left out: it is never a target)."""
        counts = np.bincount(self.tokens[self.tokens != BOS], minlength=256)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())

    def batch(self, rng: np.random.Generator, batch_size: int, seq: int) -> dict[str, np.ndarray]:
        """``batch_size`` rows of ``seq`` tokens from random offsets: whatever documents (and parts of
        documents) fall in a row are packed in it. ``weights`` drops the targets that start another
        document (predicted across a document boundary, which the mask hides)."""
        starts = rng.integers(0, len(self.tokens) - seq - 1, batch_size)
        idx = starts[:, None] + np.arange(seq + 1)
        t, d = self.tokens[idx], self.doc_ids[idx]
        return {"tokens": t[:, :-1], "targets": t[:, 1:], "doc_ids": d[:, :-1],
                "weights": (d[:, 1:] == d[:, :-1]).astype(np.float32)}

    def prompts(self, n: int, length: int) -> np.ndarray:
        """The first ``length`` tokens (BOS included) of the first ``n`` documents that long, (n, length)."""
        starts = np.flatnonzero(self.tokens == BOS)
        ends = np.append(starts[1:], len(self.tokens))
        return np.stack([self.tokens[a:a + length] for a, b in zip(starts, ends) if b - a >= length][:n])


def split(docs: list[bytes], every: int = 20) -> tuple[Corpus, Corpus]:
    """(train, held-out): every ``every``-th document held out."""
    return (Corpus.pack([d for i, d in enumerate(docs) if i % every]),
            Corpus.pack([d for i, d in enumerate(docs) if not i % every]))


# -- the model ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Config:
    """The model's sizes and attention settings (the defaults: 0.8 M parameters)."""

    vocab: int = 256
    d_model: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2  # GQA
    window: int = 64  # the sliding-window layers' reach (layers 0, 2, ...); the others are global
    soft_cap: float = 20.0  # on q·k / sqrt(d) (Gemma 2 caps its attention at 50)
    seq: int = 256
    block: int = 64  # BlockMask tile: 64 lets the window's tiles be skipped at seq 256
    dtype: Any = jnp.bfloat16

    def window_of(self, layer: int) -> int | None:
        return self.window if layer % 2 == 0 else None


def score_mod(cfg: Config):
    """Soft-capped scores plus ALiBi (in that order: the cap bounds q·k, ALiBi then ranks by distance)."""
    cap, alibi = mods.soft_cap(cfg.soft_cap), mods.alibi(cfg.heads)

    def capped_alibi(score, b, h, q_idx, kv_idx):
        return alibi(cap(score, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)

    return capped_alibi


class Block(nnx.Module):
    """Pre-norm attention (``FlexMultiHeadAttention``) and MLP, residual in float32."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        d, dt = cfg.d_model, cfg.dtype
        self.attn_norm = nnx.RMSNorm(d, dtype=dt, rngs=rngs)
        self.attn = FlexMultiHeadAttention(cfg.heads, d, num_kv_heads=cfg.kv_heads, score_mod=score_mod(cfg),
                                           num_sinks=1, dtype=dt, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(d, dtype=dt, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, dtype=dt, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, dtype=dt, rngs=rngs)

    def __call__(self, x, attend):
        x = x + attend(self.attn, self.attn_norm(x))
        return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))


class GPT(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)
        self.unembed = nnx.Linear(cfg.d_model, cfg.vocab, dtype=cfg.dtype, rngs=rngs)

    def __call__(self, tokens, attend):
        """Logits (B, T, vocab), float32. ``attend(i, layer, x)`` runs block i's attention ``layer`` on
        ``x``: the masks, caches and attention function are the caller's choice."""
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            x = block(x, functools.partial(attend, i))
        return self.unembed(self.norm(x)).astype(jnp.float32)


def packed_block_masks(cfg: Config, doc_ids):
    """(sliding-window, global) BlockMasks for rows of packed documents (doc_ids (B, S)): causal within each
    document, and within the window for the first. Their tiles across documents and outside the window are
    skipped."""
    B, S = doc_ids.shape
    in_document = flexjax.and_masks(masks.causal, masks.document(doc_ids))
    local = flexjax.and_masks(in_document, masks.sliding_window(cfg.window))
    return tuple(flexjax.create_block_mask(m, B, None, S, S, block_size=cfg.block) for m in (local, in_document))


def packed_attend(cfg: Config, doc_ids):
    """``attend`` for training on rows of packed documents: two BlockMasks, built once a step."""
    local, full = packed_block_masks(cfg, doc_ids)

    def attend(i, layer, x):
        return layer(x, block_mask=local if cfg.window_of(i) else full)

    return attend


def loss_fn(model: GPT, batch) -> jax.Array:
    logits = model(batch["tokens"], packed_attend(model.cfg, batch["doc_ids"]))
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return (nll * batch["weights"]).sum() / batch["weights"].sum()


def make_optimizer(model: GPT, lr: float, steps: int) -> nnx.Optimizer:
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(100, steps // 10 + 1), steps, lr / 10)
    return nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.98)),
                         wrt=nnx.Param)


@nnx.jit
def train_step(model: GPT, optimizer: nnx.Optimizer, batch) -> jax.Array:
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def eval_loss(model: GPT, batch) -> jax.Array:
    return loss_fn(model, batch)


def train(model: GPT, corpus: Corpus, *, steps: int, batch_size: int, lr: float, seed: int = 0,
          log_every: int = 25, log=print) -> list[float]:
    """Trains ``model`` in place; returns the loss of every step."""
    optimizer = make_optimizer(model, lr, steps)
    rng = np.random.default_rng(seed)
    losses, t0 = [], time.perf_counter()
    for step in range(steps):
        losses.append(float(train_step(model, optimizer, corpus.batch(rng, batch_size, model.cfg.seq))))
        if log and (step % log_every == 0 or step == steps - 1):
            log(f"step {step:4d}  loss {losses[-1]:.3f}  ({time.perf_counter() - t0:.0f} s)")
    return losses


# -- generation ------------------------------------------------------------------------------------
# The decode steps are jitted functions of (graphdef, state): nnx.split once, nnx.merge inside jit.
# nnx.jit would walk the module graph at every call, about 2 ms on these CPUs: more than a step here.

def decode_attend(cfg: Config):
    """``attend`` for decoding through each layer's cache (``FlexMultiHeadAttention(decode=True)``: causal
    by absolute position; the sliding-window layers add their window)."""
    window = masks.sliding_window(cfg.window)

    def attend(i, layer, x):
        return layer(x, decode=True, mask_mod=window if cfg.window_of(i) else None)

    return attend


def init_paged_cache(model: GPT, batch: int, max_length: int, page_size: int = 32):
    for block in model.blocks:
        block.attn.init_cache(batch, max_length, model.cfg.dtype, page_size=page_size)


def split_for_decode(model: GPT):
    """(graphdef, cache, rest): the layers' caches apart from the weights, so that a step takes the cache
    donated and gives back only the cache (returning the weights would copy them every step)."""
    return nnx.split(model, nnx.Cache, ...)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def flex_step(graphdef, cache, rest, tokens):
    """Appends ``tokens`` (B, T) to every layer's paged cache (``cache``, donated: updated in place): (the
    last position's logits (B, vocab), the new cache)."""
    model = nnx.merge(graphdef, cache, rest)
    logits = model(tokens, decode_attend(model.cfg))[:, -1]
    return logits, nnx.state(model, nnx.Cache)


def jax_nn_attend(cfg: Config, caches: list, pos):
    """``attend`` on ``jax.nn.dot_product_attention`` over contiguous caches, one ``(k, v)`` pair a layer
    (B, max_length, kv_heads, head_dim), replaced in ``caches``; the tokens go at ``pos``.

    ``jax.nn.dot_product_attention`` takes no score_mod: the soft-cap and ALiBi go in as a bias,
    ``score_mod(s) - s``, from an explicit q·kᵀ; the sink as one more key (zero, with the sink's
    logit as its bias and a zero value)."""

    def attend(i, layer, x):
        B, T, _ = x.shape
        H, K, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        q = layer.query(x).reshape(B, T, H, D)
        k_cache, v_cache = (jax.lax.dynamic_update_slice(c, new(x).reshape(B, T, K, D).astype(c.dtype), (0, pos, 0, 0))
                            for c, new in zip(caches[i], (layer.key, layer.value)))
        caches[i] = (k_cache, v_cache)
        q_idx, kv_idx = pos + jnp.arange(T)[:, None], jnp.arange(k_cache.shape[1])[None, :]
        allowed = kv_idx <= q_idx
        if cfg.window_of(i):
            allowed &= kv_idx >= q_idx - cfg.window
        s = jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k_cache, H // K, axis=2),
                       preferred_element_type=jnp.float32) / math.sqrt(D)
        bias = layer.score_mod(s, 0, jnp.arange(H)[:, None, None], q_idx, kv_idx) - s
        sink = jnp.broadcast_to(layer.sinks[...][None, :, None, :], (B, H, T, 1))
        zero = jnp.zeros((B, 1, K, D), k_cache.dtype)
        out = jax.nn.dot_product_attention(
            q, jnp.concatenate([k_cache, zero], 1), jnp.concatenate([v_cache, zero], 1),
            bias=jnp.concatenate([bias, sink], -1),
            mask=jnp.concatenate([allowed, jnp.ones((T, 1), bool)], -1)[None, None])
        return layer.out(out.reshape(B, T, H * D))

    return attend


def init_contiguous_caches(model: GPT, batch: int, max_length: int) -> list:
    a = model.blocks[0].attn
    shape = (batch, max_length, a.num_kv_heads, a.head_dim)
    return [(jnp.zeros(shape, model.cfg.dtype), jnp.zeros(shape, model.cfg.dtype)) for _ in model.blocks]


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def jax_nn_step(graphdef, cache, rest, caches: list, tokens, pos):
    """``flex_step`` on ``jax.nn.dot_product_attention``: (logits (B, vocab), caches); the contiguous caches
    donated, as ``flex_step``'s. (``graphdef, cache, rest`` are ``split_for_decode``'s; the paged cache is
    not read.)"""
    model = nnx.merge(graphdef, cache, rest)
    caches = list(caches)
    logits = model(tokens, jax_nn_attend(model.cfg, caches, pos))[:, -1]
    return logits, caches


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t0


def _rate(batch: int, times: list) -> float:
    """tokens/s of the median step after the first two (the first compiles, the second may): the machine is
    shared, and one slow step must not decide."""
    return batch / float(np.median(times[2:]))


def generate(model: GPT, prompts: np.ndarray, new_tokens: int, *, temperature: float = 0.8, seed: int = 0,
             page_size: int = 32) -> dict[str, Any]:
    """Samples ``new_tokens`` after ``prompts`` (B, P) through the paged caches, feeding each step's tokens
    through the ``jax.nn.dot_product_attention`` path too, right after (the two paths' steps alternate, so
    that both see the same machine): the tokens (B, P + new_tokens), both paths' logits (B, new_tokens,
    vocab) and their speeds (tokens/s of the median one-token step)."""
    B, P = prompts.shape
    init_paged_cache(model, B, P + new_tokens, page_size)
    graphdef, cache, rest = split_for_decode(model)
    caches = init_contiguous_caches(model, B, P + new_tokens)
    key = jax.random.key(seed)
    tokens, flex_logits, ref_logits, t_flex, t_ref, pos = [jnp.asarray(prompts)], [], [], [], [], 0
    for _ in range(new_tokens):
        (logits, cache), seconds = _timed(flex_step, graphdef, cache, rest, tokens[-1])
        flex_logits.append(logits)
        t_flex.append(seconds)
        (logits, caches), seconds = _timed(jax_nn_step, graphdef, cache, rest, caches, tokens[-1], jnp.int32(pos))
        ref_logits.append(logits)
        t_ref.append(seconds)
        pos += tokens[-1].shape[1]
        key, sub = jax.random.split(key)
        # (Sampled before the next step's clock starts: a dispatch still running would count as that step's.)
        tokens.append(jax.block_until_ready(jax.random.categorical(sub, flex_logits[-1] / temperature)[:, None]))
    nnx.update(model, cache)
    return {"tokens": np.asarray(jnp.concatenate(tokens, axis=1)), "flex_logits": jnp.stack(flex_logits, 1),
            "jax_nn_logits": jnp.stack(ref_logits, 1), "flex_tokens_per_s": _rate(B, t_flex),
            "jax_nn_tokens_per_s": _rate(B, t_ref)}


def decode_speed(model: GPT, batch: int, lengths, *, steps: int = 12, page_size: int = 64) -> list[dict]:
    """tokens/s of one-token decode steps near the end of caches of each length in ``lengths``, flexjax's
    paged cache against ``jax.nn.dot_product_attention``'s contiguous one (the two alternating, median
    step; random tokens prefill the cache, weights as they are)."""
    rows = []
    for length in lengths:
        prompts = jnp.asarray(np.random.default_rng(length).integers(1, 256, (batch, length - steps - 1)), jnp.int32)
        init_paged_cache(model, batch, length, page_size)
        graphdef, cache, rest = split_for_decode(model)
        _, cache = flex_step(graphdef, cache, rest, prompts)
        caches = init_contiguous_caches(model, batch, length)
        one, t_flex, t_ref = prompts[:, :1], [], []
        for i in range(steps):
            (_, cache), seconds = _timed(flex_step, graphdef, cache, rest, one)
            t_flex.append(seconds)
            (_, caches), seconds = _timed(jax_nn_step, graphdef, cache, rest, caches, one,
                                          jnp.int32(length - steps + i))
            t_ref.append(seconds)
        nnx.update(model, cache)
        rows.append({"length": length, "flex_tokens_per_s": _rate(batch, t_flex),
                     "jax_nn_tokens_per_s": _rate(batch, t_ref)})
    return rows


def logits_agree(a, b, dtype) -> tuple[float, bool]:
    """(max |a - b|, within the dtype's tolerance): bfloat16 keeps 8 bits, so 2**-5 of the logits' scale."""
    err = float(jnp.abs(a - b).max())
    tol = (2.0 ** -5 if dtype == jnp.bfloat16 else 1e-4) * max(1.0, float(jnp.abs(b).max()))
    return err, err <= tol


def text(tokens) -> str:
    return bytes(int(t) for t in tokens if t != BOS).decode("utf-8", errors="replace")


# -- the script ------------------------------------------------------------------------------------

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=Config.seq)
    p.add_argument("--d-model", type=int, default=Config.d_model)
    p.add_argument("--layers", type=int, default=Config.layers)
    p.add_argument("--heads", type=int, default=Config.heads)
    p.add_argument("--kv-heads", type=int, default=Config.kv_heads)
    p.add_argument("--window", type=int, default=Config.window)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--new-tokens", type=int, default=100, help="tokens generated per prompt")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--speed-lengths", type=int, nargs="*", default=[256, 1024, 4096],
                   help="cache lengths at which to time one decode step of both paths (none: skip)")
    p.add_argument("--check", action="store_true",
                   help="exit 1 unless the final loss beats the unigram baseline and the two decode paths agree")
    args = p.parse_args(argv)

    cfg = Config(d_model=args.d_model, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                 window=args.window, seq=args.seq, dtype=jnp.dtype(args.dtype))
    docs = documents()
    train_set, held_out = split(docs)
    unigram = train_set.unigram_entropy()
    print(f"jax {jax.__version__} on {jax.default_backend()}, {jax.device_count()} device(s); {cfg}")
    print(f"text: {len(docs)} paragraphs of pydoc_data.topics, {len(train_set.tokens)} training tokens; "
          f"unigram baseline {unigram:.3f} nats")
    model = GPT(cfg, rngs=nnx.Rngs(0))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"model: {params / 1e6:.2f} M parameters")

    t0 = time.perf_counter()
    losses = train(model, train_set, steps=args.steps, batch_size=args.batch, lr=args.lr)
    seconds = time.perf_counter() - t0
    final = float(np.mean(losses[-10:]))
    val = float(eval_loss(model, held_out.batch(np.random.default_rng(1), args.batch, cfg.seq)))
    print(f"trained {args.steps} steps in {seconds:.1f} s (compile included): loss {final:.3f} (mean of the last "
          f"10 steps), held out {val:.3f}, unigram {unigram:.3f} nats: "
          f"{'below' if final < unigram else 'NOT below'} the unigram baseline")

    prompts = held_out.prompts(args.prompts, 16)
    out = generate(model, prompts, args.new_tokens)
    err, agree = logits_agree(out["flex_logits"], out["jax_nn_logits"], cfg.dtype)
    for row in out["tokens"]:
        print(repr(text(row)))
    print(f"decode, batch {args.prompts}, {prompts.shape[1] + args.new_tokens} cached tokens: flexjax paged cache "
          f"{out['flex_tokens_per_s']:.0f} tokens/s, "
          f"jax.nn.dot_product_attention (contiguous cache) {out['jax_nn_tokens_per_s']:.0f} tokens/s "
          f"({out['flex_tokens_per_s'] / out['jax_nn_tokens_per_s']:.2f}x; median steps, alternating); "
          f"max |logits difference| {err:.3g} ({'within' if agree else 'NOT within'} {args.dtype} tolerance)")
    for row in decode_speed(model, args.prompts, args.speed_lengths):
        print(f"decode at cache length {row['length']:5d}: flexjax paged {row['flex_tokens_per_s']:6.0f} tokens/s, "
              f"jax.nn.dot_product_attention {row['jax_nn_tokens_per_s']:6.0f} tokens/s "
              f"({row['flex_tokens_per_s'] / row['jax_nn_tokens_per_s']:.2f}x)")
    if args.check and not (final < unigram and agree):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
