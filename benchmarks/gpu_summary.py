"""Summary of a gpu_check.sh run: the goals (measured, met or not), test counts and the timings as tables.

    python benchmarks/gpu_summary.py OUT_DIR

Reads what the steps wrote under OUT_DIR (smoke.jsonl, gpu_tests.jsonl, timing.jsonl,
sparsity.jsonl, sweep.jsonl, the late backends' timing.<backend>.jsonl and
sparsity.<backend>.jsonl, steps.jsonl), as far as they got: a run that was cut still gets a
summary, with the goals it did not reach "not measured". Writes OUT_DIR/summary.json and
prints the same as text. Standard library only, so it runs whatever state JAX is in.

``backends`` (first in the text): those the smoke test of step 0 kept, those run late (each in
processes of its own after the others' figures), and each dropped one with the reason: how its
smoke process ended (gpu_check.sh's words in steps.jsonl) and what it had written
(benchmarks/gpu_smoke.py's line: its error, or the hang FLEXJAX_GPU_INJECT_HANG injected);
then each test or timing process that was cut or failed.

The goals (issue 29), each judged only on the shape it names, against cuDNN:
- causal forward >= 1.0x cuDNN, causal backward >= 0.9x cuDNN: bfloat16, D=128, S=8192 (issue 44)
  (``timing``: ``vs_cudnn`` = cuDNN ms / kernel ms);
- a sliding window of 1024 at S=32768 >= 5x faster than cuDNN given the dense mask, in the
  forward and in the backward (``sparsity``: ``vs_cudnn_dense_mask``).
A goal is "met" when the better kernel backend reaches it (each backend's ratio is listed),
"not met" when none does, and "not measured" when its measurement is missing, or was taken
on another shape or against another baseline (a CPU rehearsal's XLA): those ratios are
listed as ``stand_in``, for the record only.
"""

from __future__ import annotations

import glob
import json
import os
import sys

GOALS = (
    {"goal": "causal forward >= 1.0x cuDNN (bfloat16, D=128, S=8192)", "section": "timing", "variant": "causal",
     "passes": ("fwd",), "S": 8192, "window": None, "ratio": "vs_cudnn", "threshold": 1.0},
    {"goal": "causal backward >= 0.9x cuDNN (bfloat16, D=128, S=8192)", "section": "timing", "variant": "causal",
     "passes": ("bwd",), "S": 8192, "window": None, "ratio": "vs_cudnn", "threshold": 0.9},
    {"goal": "sliding window 1024 at S=32768 >= 5x faster than cuDNN with the dense mask (forward and backward)",
     "section": "sparsity", "variant": "sliding_window", "passes": ("fwd", "bwd"), "S": 32768, "window": 1024,
     "ratio": "vs_cudnn_dense_mask", "threshold": 5.0},
)
# Every kernel backend gpu_bench.py times (its KERNELS): a goal is met by the best of them.
KERNELS = ("mosaic_gpu", "triton", "pallas")


def read_jsonl(path: str) -> list[dict]:
    """The file's JSON lines; a missing file is empty and a torn last line (a cut run) is dropped."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as fh:
        for line in fh:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return records


def read_section(out_dir: str, section: str) -> list[dict]:
    """``section``.jsonl, then the late backends' ``section``.<backend>.jsonl (their own processes)."""
    late = sorted(glob.glob(os.path.join(out_dir, f"{section}.*.jsonl")))
    return [r for path in [os.path.join(out_dir, f"{section}.jsonl"), *late] for r in read_jsonl(path)]


def backends_summary(steps: list[dict], smoke: list[dict]) -> dict:
    """The kernel backends step 0 kept and dropped (with the reason), and the processes cut or failed later."""
    start = next((r for r in steps if r.get("step") == "smoke" and r.get("event") == "start"), {})
    end = next((r for r in steps if r.get("step") == "smoke" and r.get("event") == "end"), {})
    out = {"requested": start.get("backends", []), "kept": end.get("kept", []), "late": end.get("late", []),
           "injected_hang": next((r.get("spec") for r in steps if r.get("event") == "inject_hang"), None),
           "dropped": {}, "smoke": {}}
    for r in smoke:
        if r.get("kind") == "smoke":
            out["smoke"][r["backend"]] = {k: r[k] for k in ("outcome", "wall_s", "call_s", "error") if k in r}
        elif r.get("kind") == "injected_hang":
            out["smoke"][r["backend"]] = {"outcome": "injected hang", "error": r.get("note", "")}
    for r in steps:
        if r.get("step") == "smoke" and r.get("event") == "backend" and not r.get("kept"):
            said = out["smoke"].get(r["backend"])
            reason = r.get("reason", f"rc {r.get('rc')}")
            if said:
                reason += f"; it had written: {said['outcome']}" + (f" ({said['error'][:300]})" if said.get("error")
                                                                     else "")
            else:
                reason += "; it had written nothing"
            out["dropped"][r["backend"]] = reason
    out["inaccurate"] = {b: r.get("error", "") for b, r in out["smoke"].items() if r.get("outcome") == "inaccurate"}
    # The tests' processes one by one; the timing steps (one process each) by their end.
    out["cut_or_failed"] = [
        {k: r.get(k) for k in ("step", "backend", "shard", "rc", "timeout_s")} for r in steps
        if r.get("rc") not in (0, None) and (r.get("event") == "process" or (
            r.get("event") == "end" and r["step"].split(":")[0] in ("timing", "sparsity", "sweep")))]
    return out


def tests_summary(records: list[dict]) -> dict:
    tests = [r for r in records if r.get("kind") == "test"]
    by_backend: dict[str, dict[str, int]] = {}
    for r in tests:
        counts = by_backend.setdefault(r["backend"], {})
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    planned = sum(len(r.get("units", [])) * len(r.get("backends", [])) for r in records if r.get("kind") == "start")
    return {"ran": len(tests), "planned": planned, "passed": sum(r["outcome"] == "passed" for r in tests),
            "by_backend": by_backend,
            "not_passed": [{k: r.get(k) for k in ("case", "backend", "B", "Sq", "Skv", "outcome")}
                           | {"error": str(r.get("error", ""))[:400]} for r in tests if r["outcome"] != "passed"]}


def _env(records: list[dict]) -> dict:
    return next((r for r in records if r.get("kind") == "env"), {})


def goal_status(spec: dict, records: list[dict]) -> dict:
    """One goal: each kernel's ratio per pass, the better kernel and the verdict."""
    env = _env(records)
    times = [r for r in records if r.get("kind") == "time" and r.get("role") == "kernel"
             and r.get("variant") == spec["variant"] and r.get("pass") in spec["passes"]]
    exact = [r for r in times if r.get("S") == spec["S"] and r.get("D") == 128 and r.get("dtype") == "bfloat16"
             and spec["ratio"] in r and (spec["window"] is None or env.get("window") == spec["window"])]
    out = {"goal": spec["goal"], "threshold": spec["threshold"], "ratio": spec["ratio"]}
    ratios = {impl: {r["pass"]: r[spec["ratio"]] for r in exact if r["impl"] == impl} for impl in KERNELS}
    ratios = {impl: per for impl, per in ratios.items() if per}
    if not ratios:
        stand_in = {}
        for r in times:
            ratio = next((k for k in r if k.startswith("vs_") and k.endswith(spec["ratio"][len("vs_cudnn"):])), None)
            if ratio:
                stand_in.setdefault(r["impl"], {})[f"{r['pass']} S={r['S']} {r['dtype']} {ratio}"] = r[ratio]
        note = ("measured only at another shape or against another baseline; those ratios (stand_in) are for "
                "the record only") if stand_in else "no measurement"
        out.update(status="not measured", note=note)
        if stand_in:
            out["stand_in"] = stand_in
        return out
    # A kernel's value: its worst pass; complete when every pass the goal names was measured.
    value = {impl: min(per.values()) for impl, per in ratios.items()}
    complete = {impl for impl, per in ratios.items() if set(per) == set(spec["passes"])}
    best = max(value, key=value.get)
    out.update(ratios=ratios, best=best, value=value[best])
    reaching = [i for i in value if value[i] >= spec["threshold"]]
    if any(i in complete for i in reaching):
        best = max((i for i in reaching if i in complete), key=value.get)
        out.update(best=best, value=value[best], status="met")
    elif reaching:
        out.update(status="not measured", note=f"{', '.join(reaching)} reached it in the passes measured, not in all")
    else:
        out["status"] = "not met"
    return out


def rows(records: list[dict]) -> list[dict]:
    """A section's results, one short row each: its key, ms, TFLOP/s and ratios, or why it has none."""
    keep = ("kind", "S", "variant", "pass", "impl", "kernels", "point", "ms", "tflops", "reason")
    return [{k: r[k] for k in keep if k in r} | {k: v for k, v in r.items() if k.startswith("vs_")}
            for r in records if r.get("kind") in ("time", "skip", "refused", "n/a")]


def summarize(out_dir: str) -> dict:
    tests = read_jsonl(os.path.join(out_dir, "gpu_tests.jsonl"))
    sections = {s: read_section(out_dir, s) for s in ("timing", "sparsity", "sweep")}
    step_lines = read_jsonl(os.path.join(out_dir, "steps.jsonl"))
    steps = {}
    for r in step_lines:
        if r.get("event") in ("end", "skipped"):
            steps[r["step"]] = {k: r[k] for k in ("event", "rc", "t_s", "reason") if k in r}
    env = _env(sections["timing"]) or _env(sections["sparsity"]) or _env(sections["sweep"])
    return {"backends": backends_summary(step_lines, read_jsonl(os.path.join(out_dir, "smoke.jsonl"))),
            "goals": [goal_status(g, sections[g["section"]]) for g in GOALS],
            "tests": tests_summary(tests),
            "device": env.get("device"), "jax": env.get("jax"), "baseline": env.get("baseline"),
            "flops": env.get("flops"), "steps": steps,
            **{s: {"env": _env(recs), "rows": rows(recs)} for s, recs in sections.items()}}


def _ratio_text(r: dict) -> str:
    return "".join(f" {k[3:]} x{v:.2f}" for k, v in r.items() if k.startswith("vs_"))


def backends_text(b: dict) -> list[str]:
    lines = [f"== backends (step 0's smoke test): kept {', '.join(b['kept']) or 'none'}"
             + (f"; late, in processes of their own: {', '.join(b['late'])}" if b["late"] else "")
             + (f"; FLEXJAX_GPU_INJECT_HANG={b['injected_hang']}" if b["injected_hang"] else "")]
    lines += [f"  dropped {name}: {reason}" for name, reason in b["dropped"].items()]
    lines += [f"  inaccurate {name} (kept): {error[:300]}" for name, error in b["inaccurate"].items()]
    lines += [f"  cut or failed: {' '.join(str(p[k]) for k in ('step', 'backend', 'shard') if p.get(k))} rc {p['rc']}"
              + (f" (timed out after {p['timeout_s']} s)" if p["rc"] in (124, 137) and p.get("timeout_s")
                 else " (timed out)" if p["rc"] in (124, 137) else "") for p in b["cut_or_failed"]]
    return lines


def text(summary: dict) -> str:
    lines = backends_text(summary["backends"]) + ["== goals"]
    for g in summary["goals"]:
        detail = ", ".join(f"{impl} " + "/".join(f"{p} {v:.2f}" for p, v in per.items())
                           for impl, per in g.get("ratios", {}).items())
        lines.append(f"{g['status']:12s} {g['goal']}" + (f": {detail}" if detail else "")
                     + (f"; {g['note']}" if g.get("note") else ""))
    t = summary["tests"]
    lines.append(f"== tests: {t['passed']}/{t['ran']} passed ({t['planned']} planned) "
                 + ", ".join(f"{b}: {c}" for b, c in t["by_backend"].items()))
    lines += [f"  {r['outcome']} {r['case']} [{r['backend']}] B={r['B']} Sq={r['Sq']} Skv={r['Skv']}: "
              f"{r['error'][:200]}" for r in t["not_passed"]]
    for section in ("timing", "sparsity", "sweep"):
        recs = summary[section]["rows"]
        if not recs:
            lines.append(f"== {section}: no results")
            continue
        lines.append(f"== {section}: ms per call, effective TFLOP/s, <baseline> x<baseline ms / ms>")
        for r in recs:
            what = f"S={r.get('S', '?'):<6} {r.get('variant', ''):15s} {r.get('pass', ''):4s} {r.get('impl', '')}"
            if "point" in r:
                what += f" {r.get('kernels', '')} {r['point']}"
            if r["kind"] == "time":
                lines.append(f"  {what}: {r['ms']:.4g} ms {r['tflops']:.4g} TFLOP/s{_ratio_text(r)}")
            else:
                lines.append(f"  {what}: {r['kind']} ({str(r.get('reason', ''))[:160]})")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print("usage: python benchmarks/gpu_summary.py OUT_DIR (a gpu_check.sh output directory)", file=sys.stderr)
        return 2
    summary = summarize(argv[0])
    with open(os.path.join(argv[0], "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    print(text(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
