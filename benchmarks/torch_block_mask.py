"""PyTorch's create_block_mask (compiled) on the block-mask build specs, one JSON line per spec.

Runs in its own process (torch and JAX are never imported together):

    build/venv-compile/bin/python benchmarks/torch_block_mask.py [--specs causal-64k,docs64-64k]

The masks are the same as ``bench_block_mask.py``'s: causal, and causal within 64
equal documents (ids from a captured tensor), block 128, B = H = None.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask

SPECS = {"causal-64k": ("causal", 65536, 0), "docs64-64k": ("causal_documents", 65536, 64)}


def _mask(kind: str, S: int, docs: int):
    if kind == "causal":
        return lambda b, h, q, kv: q >= kv
    ids = torch.arange(S) // (S // docs)
    return lambda b, h, q, kv: (q >= kv) & (ids[q] == ids[kv])


def run(name: str, repeats: int) -> dict:
    kind, S, docs = SPECS[name]
    mm = _mask(kind, S, docs)

    def build():
        return create_block_mask(mm, None, None, S, S, device="cpu", BLOCK_SIZE=128, _compile=True)

    t0 = time.perf_counter()
    bm = build()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        bm = build()
        times.append(time.perf_counter() - t0)
    return {"side": "torch", "impl": "torch.create_block_mask(_compile=True)", "spec": name, "S": S,
            "first_s": round(first, 3), "warm_ms": round(1e3 * statistics.median(times), 2),
            "sparsity": round(float(bm.sparsity()), 2), "torch": torch.__version__}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--specs", default=",".join(SPECS))
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    for name in args.specs.split(","):
        print(json.dumps(run(name, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
