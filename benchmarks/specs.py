"""Named benchmark shapes, their suites, and the shared measurement rules (one place).

Both sides (JAX in ``bench_cpu.py``, PyTorch in ``torch_baseline.py``) read the same
specs, count the same unmasked (q, kv) pairs and time the same way, so their numbers
line up in one table.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

# Only unmasked pairs count: 2 matmuls (QK^T, PV) of 2 flops per multiply-add.
FWD_FLOPS_PER_PAIR_PER_DIM = 4
# Backward = 2.5x forward (5 matmuls vs 2), so forward + backward = 3.5x forward.
FWD_BWD_FACTOR = 3.5


@dataclasses.dataclass(frozen=True)
class Spec:
    """One attention benchmark shape.

    Attributes:
      name: unique id, used on the command line and in the JSON.
      S: sequence length (queries and keys).
      mask: mask family: "causal", "sliding_window" (causal, ``window`` keys back),
        "causal_documents" (``docs`` equal documents, causal inside each) or "full".
      mode: "fwd" or "fwd+bwd".
      B, H, D: batch, heads, head dim.
      dtype: "float32" (CPU) or "bfloat16".
      window: keys before each query for "sliding_window".
      docs: number of equal documents for "causal_documents".
      score_mod: None or "alibi".
      label: a human description for tables.
    """

    name: str
    S: int
    mask: str
    mode: str = "fwd"
    B: int = 1
    H: int = 8
    D: int = 64
    dtype: str = "float32"
    window: int = 0
    docs: int = 0
    score_mod: str | None = None
    label: str = ""

    @property
    def pairs(self) -> int:
        """Unmasked (q, kv) pairs per (batch, head)."""
        return unmasked_pairs(self.mask, self.S, window=self.window, docs=self.docs)

    @property
    def flops(self) -> float:
        """Effective flops of one call: unmasked pairs only; fwd+bwd = 3.5x fwd."""
        fwd = FWD_FLOPS_PER_PAIR_PER_DIM * self.pairs * self.D * self.H * self.B
        return fwd * (FWD_BWD_FACTOR if self.mode == "fwd+bwd" else 1.0)

    def describe(self) -> dict:
        return dataclasses.asdict(self) | {"pairs": self.pairs, "density": self.pairs / self.S**2}


@dataclasses.dataclass(frozen=True)
class BuildSpec:
    """Time to build a BlockMask (first call, with tracing/compilation; then cached)."""

    name: str
    S: int
    mask: str
    window: int = 0
    docs: int = 0
    block: int = 128


@dataclasses.dataclass(frozen=True)
class MemorySpec(Spec):
    """An attention shape run once by flexjax in a fresh process to read its peak RSS.

    Attributes:
      goal_mib: the peak resident memory the run should stay under.
    """

    mode: str = "fwd+bwd"
    goal_mib: int = 2048


def unmasked_pairs(mask: str, S: int, *, window: int = 0, docs: int = 0) -> int:
    """Exact count of attending (q, kv) pairs of a mask family at length S (O(1) or O(docs))."""
    if mask == "full":
        return S * S
    if mask == "causal":
        return S * (S + 1) // 2
    if mask == "sliding_window":
        # Row q sees min(q, window) + 1 keys.
        w = min(window, S)
        return w * (w + 1) // 2 + (S - w) * (w + 1)
    if mask == "causal_documents":
        return sum(n * (n + 1) // 2 for n in document_lengths(S, docs))
    raise ValueError(f"unknown mask family {mask!r}")


def document_lengths(S: int, docs: int) -> list[int]:
    """``docs`` equal-as-possible document lengths that sum to S."""
    if docs < 1:
        raise ValueError(f"docs must be >= 1, got {docs}")
    return [S // docs + (1 if i < S % docs else 0) for i in range(docs)]


def document_ids(S: int, docs: int):
    """int32 (S,) segment ids of ``docs`` equal documents."""
    import numpy as np

    return np.repeat(np.arange(docs, dtype=np.int32), document_lengths(S, docs))


def _label(mask: str, S: int, mode: str, window=0, docs=0, score_mod=None) -> str:
    what = {"causal": "causal", "full": "full",
            "sliding_window": f"sliding window {window}",
            "causal_documents": f"{docs} documents (causal in each)"}[mask]
    if score_mod:
        what += f" + {score_mod}"
    return f"{mode} {what}, S={S}"


def _spec(mask: str, S: int, mode: str = "fwd", *, window=0, docs=0, score_mod=None) -> Spec:
    tag = {"causal": "causal", "full": "full", "sliding_window": f"sw{window}",
           "causal_documents": f"docs{docs}"}[mask]
    if score_mod:
        tag += f"_{score_mod}"
    name = f"{tag}_{mode.replace('+', '')}_S{S}"
    return Spec(name=name, S=S, mask=mask, mode=mode, window=window, docs=docs, score_mod=score_mod,
                label=_label(mask, S, mode, window, docs, score_mod))


def _build(mask: str, S: int, *, window=0, docs=0) -> BuildSpec:
    tag = {"causal": "causal", "sliding_window": f"sw{window}", "causal_documents": f"docs{docs}"}[mask]
    return BuildSpec(name=f"build_{tag}_S{S}", S=S, mask=mask, window=window, docs=docs)


# Required CPU specs (float32, B=1, H=8, D=64): causal fwd S=4096; sliding window 256 at
# S=8192; 4 causal documents at S=8192; causal fwd+bwd S=4096. The other lengths make
# the curves of notebooks/04_performance.ipynb.
SUITES: dict[str, dict[str, list]] = {
    # Small enough for CI: the JAX side finishes in well under a minute on 2 cores.
    "ci": {
        "attention": [
            _spec("causal", 512), _spec("causal", 1024), _spec("causal", 2048),
            _spec("sliding_window", 2048, window=128),
            _spec("causal_documents", 2048, docs=4),
            _spec("causal", 1024, "fwd+bwd"),
        ],
        "build": [_build("causal", S) for S in (1024, 2048, 4096)]
        + [_build("sliding_window", 4096, window=128)],
        "memory": [MemorySpec(name="memory_causal_fwdbwd_S4096", S=4096, mask="causal",
                              label="fwd+bwd causal, S=4096")],
    },
    "full": {
        "attention": [
            *(_spec("causal", S) for S in (1024, 2048, 4096, 8192)),
            *(_spec("sliding_window", S, window=256) for S in (2048, 4096, 8192)),
            *(_spec("causal_documents", S, docs=4) for S in (4096, 8192)),
            _spec("causal", 4096, score_mod="alibi"),
            *(_spec("causal", S, "fwd+bwd") for S in (1024, 2048, 4096)),
            # Issue 15: training cost should follow the unmasked work (torch has no CPU flex backward).
            _spec("sliding_window", 8192, "fwd+bwd", window=256),
            _spec("causal_documents", 8192, "fwd+bwd", docs=4),
        ],
        "build": [_build(m, S, **kw) for S in (1024, 4096, 16384, 32768)
                  for m, kw in (("causal", {}), ("sliding_window", {"window": 256}),
                                ("causal_documents", {"docs": 4}))],
        "memory": [MemorySpec(name="memory_causal_fwdbwd_S32768", S=32768, mask="causal",
                              label="fwd+bwd causal, S=32768 (goal: peak RSS < 2 GiB)")],
    },
}


def suite(name: str) -> dict[str, list]:
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; choose one of {sorted(SUITES)}")
    return SUITES[name]


def find(name: str):
    """The spec called ``name`` in any suite."""
    for s in SUITES.values():
        for specs in s.values():
            for spec in specs:
                if spec.name == name:
                    return spec
    raise KeyError(f"no spec named {name!r}")


# Measurement rules shared by both sides: warm up, then time at least ``min_runs`` calls
# and at least ``min_time`` seconds (at most ``max_runs``), and report the median.
WARMUP = 1
MIN_RUNS = 3
MAX_RUNS = 15
MIN_TIME_S = 1.0
# Per-suite overrides: the CI suite trades a little precision for staying under a minute.
SUITE_TIMING = {"ci": {"min_time": 0.3}, "full": {}}


_timing: dict = {}


def use_suite_timing(suite_name: str) -> None:
    """Makes ``measure`` use the timing overrides of ``suite_name``."""
    _timing.clear()
    _timing.update(SUITE_TIMING.get(suite_name, {}))


def measure(call: Callable[[], object], sync: Callable[[object], object], *, warmup: int | None = None,
            min_runs: int | None = None, max_runs: int | None = None, min_time: float | None = None) -> dict:
    """Median/min milliseconds of ``sync(call())`` after warm-up (rules above, or the suite's)."""
    warmup = _timing.get("warmup", WARMUP) if warmup is None else warmup
    min_runs = _timing.get("min_runs", MIN_RUNS) if min_runs is None else min_runs
    max_runs = _timing.get("max_runs", MAX_RUNS) if max_runs is None else max_runs
    min_time = _timing.get("min_time", MIN_TIME_S) if min_time is None else min_time
    for _ in range(warmup):
        sync(call())
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_runs or (time.perf_counter() - start < min_time and len(times) < max_runs):
        t0 = time.perf_counter()
        sync(call())
        times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "runs": len(times)}


def dense_bytes(spec, arrays: int) -> int:
    """Bytes of ``arrays`` dense (B, H, S, S) float32 score-sized arrays."""
    return arrays * spec.B * spec.H * spec.S * spec.S * 4


# -- the worker protocol both sides speak with benchmarks.run ------------------------------

#: Lines of a worker's stdout that carry a JSON record start with this.
PREFIX = "@@bench "


def emit(rec: dict, stream=None) -> None:
    """Writes one record for benchmarks.run to read."""
    stream = stream or sys.stdout
    stream.write(PREFIX + json.dumps(rec) + "\n")
    stream.flush()


def error_record(side: str, name: str, e: Exception) -> dict:
    """A failing spec is a result too (the others still run)."""
    return {"kind": "error", "side": side, "spec": name, "status": "error", "note": f"{type(e).__name__}: {e}"[:500]}


def serve(run_spec: Callable[[str], list], machine_info: Callable[[], dict]) -> None:
    """Worker loop: reads spec names from stdin, one a line; answers each with its
    records, then a "done" record."""
    emit(machine_info())
    for line in sys.stdin:
        name = line.strip()
        if not name:
            continue
        for rec in run_spec(name):
            emit(rec)
        emit({"kind": "done", "spec": name})


def arg_parser(doc: str, *, memory: bool = False):
    """The command line both sides take (and benchmarks.run passes to workers)."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="full", help="ci or full (default full)")
    p.add_argument("--spec", action="append", help="run only these spec names (repeatable)")
    p.add_argument("--out", help="append JSON lines to this file")
    p.add_argument("--worker", action="store_true", help="serve spec names from stdin (for benchmarks.run)")
    if memory:
        p.add_argument("--memory", metavar="NAME", help="run one memory spec in this process and print its record")
    return p


def run_standalone(args, run_spec: Callable[[str], list], machine_info: Callable[[], dict]) -> int:
    """One side run on its own: the named specs (default: the suite's), a markdown table
    on stdout and, with ``args.out``, JSON lines appended to that file."""
    names = args.spec or [s.name for kind in ("attention", "build") for s in suite(args.suite)[kind]]
    records = [machine_info()]
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name}", file=sys.stderr, flush=True)
        records += run_spec(name)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    from benchmarks.report import render_markdown

    print(render_markdown(records, command=" ".join([os.path.basename(sys.executable), *sys.argv])))
    return 0
