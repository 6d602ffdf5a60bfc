"""examples/gpt.py's small GPT trained twice, dense and with MoBA sparse attention at 1/4 of the blocks.

    python examples/gpt_sparse.py             # the default size: about 2-3 minutes on 2 CPU cores
    python examples/gpt_sparse.py --quick     # a few steps at a toy size (the test's)
    python examples/gpt_sparse.py --help

The same model (``gpt.GPT``: byte-level, soft-capped ALiBi scores, attention sinks, GQA, bfloat16
compute), from the same seed, on the same batches of CPython's documentation topics, twice:

- dense: each layer's ``FlexMultiHeadAttention`` attends causally to every earlier position;
- sparse: the same layers with ``sparse=SparseAttention("moba", block_size, top_k)``, each block of
  queries attending to its ``top_k = num_blocks // 4`` kv blocks chosen by MoBA's gate (its own block
  always among them; the score_mod and sinks as in the dense model). MoBA adds no parameters, so the
  two models start from the same weights.

The two training steps run alternately, one of each per batch, so that both see the same machine
load; the script prints both final losses (training, the mean of the last 10 steps, and held out),
the median time of a training step of each after the first two (which compile) and their ratio.

By default the attention runs causally over the whole training row, across the packed documents
(the targets that start another document still do not count), so that the dense model reads every
earlier block and the sparse one chooses among them; ``--document-mask`` keeps each document to
itself, as ``examples/gpt.py`` does (both models; the sparse layers then never choose a block the
mask leaves empty). ``--window N`` gives the even layers gpt.py's sliding window of N, in both models
(those layers stay dense: only the global layers are made sparse).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpt  # noqa: E402  (examples/gpt.py: the model, the data and the optimizer)

import flexjax  # noqa: E402
from flexjax import masks  # noqa: E402
from flexjax.flax import SparseAttention  # noqa: E402


def sparsify(model: gpt.GPT, sparse: SparseAttention) -> gpt.GPT:
    """Switches ``model``'s global layers (those without a sliding window) to ``sparse`` in place. MoBA has
    no parameters of its own, so the weights stay as they are."""
    for i, block in enumerate(model.blocks):
        if not model.cfg.window_of(i):
            block.attn.sparse = sparse
    return model


def make_attend(cfg: gpt.Config, doc_ids, document_mask: bool):
    """``attend`` for a training row: the global layers get the row's mask_mod (causal; within each document
    with ``document_mask``): a dense layer builds its BlockMask from it, a sparse one chooses its blocks under
    it (and adds causal itself). The sliding-window layers get one BlockMask a step, as in gpt.py."""
    B, S = doc_ids.shape
    row = flexjax.and_masks(masks.causal, masks.document(doc_ids)) if document_mask else masks.causal
    local = None
    if cfg.window:
        local = flexjax.create_block_mask(flexjax.and_masks(row, masks.sliding_window(cfg.window)), B, None, S, S,
                                          block_size=cfg.block)

    def attend(i, layer, x):
        if cfg.window_of(i):
            return layer(x, block_mask=local)
        if layer.sparse is None:  # (a dense layer would build its mask at the default block of 128)
            return layer(x, block_mask=flexjax.create_block_mask(row, B if document_mask else None, None, S, S,
                                                                 block_size=cfg.block))
        return layer(x, mask_mod=row)

    return attend


def loss_fn(model: gpt.GPT, batch, document_mask: bool) -> jax.Array:
    logits = model(batch["tokens"], make_attend(model.cfg, batch["doc_ids"], document_mask))
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return (nll * batch["weights"]).sum() / batch["weights"].sum()


@nnx.jit(static_argnums=3)
def train_step(model: gpt.GPT, optimizer: nnx.Optimizer, batch, document_mask: bool) -> jax.Array:
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch, document_mask)
    optimizer.update(model, grads)
    return loss


@nnx.jit(static_argnums=2)
def eval_loss(model: gpt.GPT, batch, document_mask: bool) -> jax.Array:
    return loss_fn(model, batch, document_mask)


def blocks_read(n: int, top_k: int | None) -> float:
    """kv blocks per query block, on average over the n query blocks of a causal row: every block up to its
    own (dense), or at most ``top_k`` of them (MoBA)."""
    i = np.arange(n) + 1
    return float(np.mean(i if top_k is None else np.minimum(i, top_k)))


def train_both(models: dict, corpus: gpt.Corpus, *, steps: int, batch_size: int, lr: float, document_mask: bool,
               seed: int = 0, log_every: int = 25, log=print) -> dict:
    """Trains each model of ``models`` (name -> GPT) in place on the same batches, one step of each per batch
    in turn: {name: {"losses": [...], "seconds": [...]}} (each step's loss and wall time)."""
    optimizers = {name: gpt.make_optimizer(m, lr, steps) for name, m in models.items()}
    out = {name: {"losses": [], "seconds": []} for name in models}
    rng, t_start = np.random.default_rng(seed), time.perf_counter()
    for step in range(steps):
        batch = corpus.batch(rng, batch_size, next(iter(models.values())).cfg.seq)
        for name, model in models.items():
            t0 = time.perf_counter()
            loss = float(train_step(model, optimizers[name], batch, document_mask))  # (float: waits for the step)
            out[name]["seconds"].append(time.perf_counter() - t0)
            out[name]["losses"].append(loss)
        if log and (step % log_every == 0 or step == steps - 1):
            log(f"step {step:4d}  " + "  ".join(f"{name} loss {r['losses'][-1]:.3f}" for name, r in out.items())
                + f"  ({time.perf_counter() - t_start:.0f} s)")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--block", type=int, default=64, help="the BlockMask tile, and MoBA's block")
    p.add_argument("--top-k", type=int, default=None, help="kv blocks per query block (default: 1/4 of the blocks)")
    p.add_argument("--d-model", type=int, default=gpt.Config.d_model)
    p.add_argument("--layers", type=int, default=gpt.Config.layers)
    p.add_argument("--heads", type=int, default=gpt.Config.heads)
    p.add_argument("--kv-heads", type=int, default=gpt.Config.kv_heads)
    p.add_argument("--window", type=int, default=0, help="sliding window of the even layers (0: every layer global)")
    p.add_argument("--document-mask", action="store_true", help="attend within each packed document only")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--quick", action="store_true",
                   help="a toy size for a smoke test: 6 steps of 4 x 128 tokens, blocks of 16, 2 layers of width 32")
    p.add_argument("--check", action="store_true", help="exit 1 unless both losses are finite")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.seq, args.block = 6, 4, 128, 16
        args.d_model, args.layers, args.heads, args.kv_heads = 32, 2, 2, 1

    cfg = gpt.Config(d_model=args.d_model, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                     window=args.window, seq=args.seq, block=args.block, dtype=jnp.dtype(args.dtype))
    n = -(-cfg.seq // cfg.block)
    top_k = args.top_k or max(1, n // 4)
    sparse = SparseAttention("moba", block_size=cfg.block, top_k=top_k)
    train_set, held_out = gpt.split(gpt.documents())
    print(f"jax {jax.__version__} on {jax.default_backend()}, {jax.device_count()} device(s); {cfg}")
    print(f"{sparse}: {top_k} of {n} kv blocks per query block; {args.steps} steps of {args.batch} x {cfg.seq} "
          f"tokens; attention {'within each document' if args.document_mask else 'across the packed documents'}")
    models = {"dense": gpt.GPT(cfg, rngs=nnx.Rngs(0)), "sparse": sparsify(gpt.GPT(cfg, rngs=nnx.Rngs(0)), sparse)}
    params = sum(x.size for x in jax.tree.leaves(nnx.state(models["dense"], nnx.Param)))
    print(f"model: {params / 1e6:.2f} M parameters (the same weights in both)")

    runs = train_both(models, train_set, steps=args.steps, batch_size=args.batch, lr=args.lr,
                      document_mask=args.document_mask, log_every=max(1, args.steps // 6))
    val_batch = held_out.batch(np.random.default_rng(1), args.batch, cfg.seq)
    result = {}
    for name, model in models.items():
        losses, seconds = runs[name]["losses"], runs[name]["seconds"]
        result[name] = {"train": float(np.mean(losses[-10:])),
                        "held_out": float(eval_loss(model, val_batch, args.document_mask)),
                        "ms": 1e3 * float(np.median(seconds[2:] if len(seconds) > 2 else seconds))}
    timed = max(0, args.steps - 2)
    most = "at most " if args.document_mask else ""  # (the document mask empties some blocks)
    for name, what in (("dense", f"causal, {most}{blocks_read(n, None):.2f} kv blocks per query block on average"),
                       ("sparse", f"MoBA top {top_k} of {n}, {most}{blocks_read(n, top_k):.2f} kv blocks per query "
                                  f"block")):
        r = result[name]
        print(f"{name:6s} ({what}): train loss {r['train']:.3f} (mean of the last 10 steps), held out "
              f"{r['held_out']:.3f}; {r['ms']:.1f} ms per training step (median of {timed} steps after compile)")
    ratio = result["sparse"]["ms"] / result["dense"]["ms"]
    print(f"sparse / dense time per training step: {ratio:.2f} ({1 / ratio:.2f}x the dense speed; the two "
          f"alternating on the same batches)")
    if args.check and not all(np.isfinite([r["train"], r["held_out"]]).all() for r in result.values()):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
