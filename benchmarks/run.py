"""Benchmark runner: the JAX and PyTorch sides in separate processes, alternating per spec.

    python -m benchmarks.run --suite ci|full [--torch] [--out DIR]

Each side is a worker process (``bench_cpu.py --worker``, ``torch_baseline.py
--worker``), started fresh for every spec, so the two thread pools never run together,
no spec inherits another's state, and machine noise falls on both alike; the side that
goes first swaps every spec. Memory specs run in a fresh process each (peak RSS). Writes
``DIR/results.jsonl`` and ``DIR/results.md`` and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time

if __package__ in (None, ""):  # run as a script: `python benchmarks/run.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import specs as S
from benchmarks.report import fmt, render_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = S.PREFIX


class Worker:
    """A benchmark worker process speaking the ``@@bench {json}`` line protocol."""

    def __init__(self, side: str, module: str, suite: str, log_path: str):
        self.side = side
        self.log = open(log_path, "a")
        cmd = [sys.executable, "-m", module, "--worker", "--suite", suite]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=_child_env(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1)
        hello = self._read_until(lambda r: r.get("kind") == "machine")
        self.info = next((r for r in hello if r.get("kind") == "machine"), {})

    def _read_until(self, stop) -> list[dict]:
        records = []
        for line in self.proc.stdout:
            if not line.startswith(PREFIX):
                continue
            rec = json.loads(line[len(PREFIX):])
            if stop(rec):
                if rec.get("kind") != "done":
                    records.append(rec)
                return records
            records.append(rec)
        code = self.proc.wait()
        records.append({"kind": "error", "side": self.side, "status": "error",
                        "note": f"{self.side} worker exited with code {code}; see {self.log.name}"})
        return records

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, name: str) -> list[dict]:
        if not self.alive:
            return [{"kind": "error", "side": self.side, "spec": name, "status": "error",
                     "note": f"{self.side} worker is not running; see {self.log.name}"}]
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        return self._read_until(lambda r: r.get("kind") == "done")

    def close(self) -> None:
        if self.alive:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def _child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # Simulated multi-device CPU (the test suite's setting) is not what users run.
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def run_memory(spec, log_path: str, timeout: float = 900) -> dict:
    """One memory spec in a fresh process; its record (or an error record)."""
    cmd = [sys.executable, "-m", "benchmarks.bench_cpu", "--memory", spec.name]
    with open(log_path, "a") as log:
        try:
            r = subprocess.run(cmd, cwd=ROOT, env=_child_env(), stdout=subprocess.PIPE, stderr=log, text=True,
                               timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"kind": "memory", "spec": spec.name, "S": spec.S, "status": "error",
                    "note": f"timed out after {timeout:.0f} s"}
    for line in r.stdout.splitlines():
        if line.startswith(PREFIX):
            return json.loads(line[len(PREFIX):])
    return {"kind": "memory", "spec": spec.name, "S": spec.S, "status": "error",
            "note": f"exit code {r.returncode}; see {log_path}"}


def machine_info(command: str) -> dict:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            mem_gib = int(next(line.split()[1] for line in f if line.startswith("MemTotal"))) / 2**20
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        commit = commit + ("+dirty" if dirty else "")
    except OSError:
        commit = "unknown"
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"kind": "machine", "side": "runner", "cpu": cpu, "cpu_count": os.cpu_count(), "cpus_usable": affinity,
            "mem_gib": round(mem_gib, 1) if mem_gib else None, "platform": platform.platform(),
            "python": platform.python_version(), "load_avg_start": os.getloadavg(), "command": command,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "git": commit}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=sorted(S.SUITES), default="ci")
    p.add_argument("--torch", action="store_true", help="also run the PyTorch baselines (own process)")
    p.add_argument("--out", default="bench_results", help="directory for results.jsonl and results.md")
    p.add_argument("--only", default=None,
                   help="run only specs whose name contains one of these comma-separated texts")
    p.add_argument("--no-memory", action="store_true", help="skip the memory specs")
    args = p.parse_args(argv)
    command = "python -m benchmarks.run " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))

    os.makedirs(args.out, exist_ok=True)
    suite = S.suite(args.suite)
    names = [s.name for kind in ("attention", "build") for s in suite[kind]]
    memory = [] if args.no_memory else list(suite["memory"])
    if args.only:
        wanted = [w for w in args.only.split(",") if w]
        names = [n for n in names if any(w in n for w in wanted)]
        memory = [m for m in memory if any(w in m.name for w in wanted)]

    t_start = time.perf_counter()
    records = [machine_info(command)]
    def start_workers() -> list[Worker]:
        ws = [Worker("jax", "benchmarks.bench_cpu", args.suite, os.path.join(args.out, "worker_jax.log"))]
        if args.torch:
            ws.append(Worker("torch", "benchmarks.torch_baseline", args.suite,
                             os.path.join(args.out, "worker_torch.log")))
        return ws

    total = len(names) + len(memory)
    for i, name in enumerate(names):
        # Fresh workers for every spec: in one long-lived JAX process, later specs ran up
        # to 1.5x slower than alone (e.g. 4 documents at S=4096: 55 vs 38 ms), after the
        # dense baselines of earlier specs had run there.
        workers = start_workers()
        if i == 0:
            records += [w.info for w in workers if w.info]
        try:
            # The side that goes first alternates, so slow drifts in machine load hit both alike.
            order = workers if i % 2 == 0 else workers[::-1]
            parts = []
            for w in order:
                t0 = time.perf_counter()
                recs = [r | {"suite": args.suite} for r in w.run(name)]
                records += recs
                flex = next((r for r in recs if r.get("impl") in ("flexjax", "flexjax.create_block_mask")
                             and r.get("status") == "ok"), None)
                extra = f", flexjax {flex['median_ms']:.1f} ms" if flex else ""
                bad = sum(r.get("status") == "error" for r in recs)
                parts.append(f"{w.side} {time.perf_counter() - t0:.1f}s{extra}" + (f" ({bad} errors)" if bad else ""))
            print(f"[{i + 1}/{total}] {name:<28} " + " | ".join(parts), flush=True)
        finally:
            for w in workers:
                w.close()
    for j, spec in enumerate(memory, len(names) + 1):
        t0 = time.perf_counter()
        rec = run_memory(spec, os.path.join(args.out, "memory.log")) | {"suite": args.suite}
        records.append(rec)
        print(f"[{j}/{total}] {spec.name:<28} fresh process {time.perf_counter() - t0:.1f}s, "
              f"peak RSS {fmt(rec.get('peak_rss_mib'), '{:.0f}')} MiB", flush=True)

    records[0]["wall_s"] = round(time.perf_counter() - t_start, 1)
    with open(os.path.join(args.out, "results.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    md = render_markdown(records, command)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md)
    print()
    print(md)
    print(f"wrote {args.out}/results.jsonl and {args.out}/results.md in {records[0]['wall_s']:.0f} s")
    return 1 if any(r.get("status") in ("error", "wrong") for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
