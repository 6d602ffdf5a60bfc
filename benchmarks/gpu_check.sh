#!/usr/bin/env bash
# GPU check of the mosaic_gpu, triton and pallas backends on one NVIDIA GPU (issues 29, 31): correctness at the
# shapes it times, then the timings, in one call of under 8 minutes (budget 450 s).
#
#   bash benchmarks/gpu_check.sh OUT_DIR
#
# Runs from the source tree (PYTHONPATH=<repo>) and installs nothing. Python: $PYTHON, else
# the project's .venv, else python3 on PATH (the GPU machine has no .venv); it must hold a
# CUDA jaxlib. Needs no pytest. The triton backend needs jax-triton (and absl-py, which it
# imports): where one is not installed, its pure-Python wheel in <repo>/.whl/ (`make wheel`,
# carried to the GPU machine) is put on PYTHONPATH as it is (zipimport), installing nothing.
#
# Steps, most important first, each with its own time limit:
#   tests     bf16, D=128, GQA 16/4, at 1999x2011 (B=2) and S=8192 (B=1): causal, ALiBi, a
#             relative bias (its table's gradient too), sliding window 1024, documents and
#             dropout, for triton and pallas, against the float32 reference: out, lse, dq,
#             dk, dv and the captured arrays' gradients (benchmarks/gpu_tests.py; shards
#             compile in parallel processes)
#   timing    B=4, H=16/4, S=8192, D=128, causal and full: the forward alone and the backward
#             alone (a jax.vjp closure), 20 back-to-back calls per synchronisation, as TFLOP/s
#             and as ratios to cuDNN (benchmarks/gpu_bench.py --section timing)
#   sparsity  sliding window 1024 and documents at S=32768 (judged, first) and 16384 against cuDNN given the
#             same dense mask, and its own window / packed form (--section sparsity)
#   sweep     triton tiles, warps and stages through kernel_options, forward and backward, at
#             the timing's causal shape (--section sweep)
#   summary   the goals (measured: met or not met; or not measured) and the tables
#             (benchmarks/gpu_summary.py, standard library only)
# Each writes under OUT_DIR as results appear, so a run that is cut short still reports:
#   env.txt          python, versions, devices, nvidia-smi
#   steps.jsonl      a line as each step starts and ends (rc, seconds since the start)
#   gpu_tests.jsonl  a line per case, shape and backend: errors and tolerances per output
#   timing.jsonl, sparsity.jsonl, sweep.jsonl   a line per measurement (or why there is none)
#   summary.json     goals, test counts, the rows of the three timing steps
#   *.log            each process's output
# Exit status: 0 all passed; 1 a case failed, a measurement is missing or a step was cut
# (the goals do not change it: summary.json states them); 2 no GPU or no usable python.
#
# Budget: FLEXJAX_GPU_BUDGET_S (default 450) from the start. Tests: FLEXJAX_GPU_TEST_SHARDS
# processes (default 4), cut at FLEXJAX_GPU_TEST_TIMEOUT_S (default 180). Then each timing step
# gets at most its cap (FLEXJAX_GPU_TIMING_S 110, FLEXJAX_GPU_SPARSITY_S 70; the sweep what is
# left) and what is left of the budget, starts only with 30 s or more, and starts no measurement
# in its last 15 s. Compiles are cached in JAX_COMPILATION_CACHE_DIR (default
# /tmp/flexjax-gpu-check-cache), so a second run on the same machine skips unchanged ones.
#
# FLEXJAX_GPU_BACKENDS (default mosaic_gpu,triton,pallas; triton,pallas in the rehearsal) picks the kernel backends (the sweep is
# triton's). FLEXJAX_GPU_TEST_ARGS / FLEXJAX_GPU_TIMING_ARGS / FLEXJAX_GPU_SPARSITY_ARGS /
# FLEXJAX_GPU_SWEEP_ARGS add arguments to a step (e.g. "--cases causal,dropout", "--lengths
# 4096"). FLEXJAX_GPU_CHECK_ALLOW_CPU=1 goes on without a GPU as a rehearsal: tiny shapes, the
# kernels in their interpreters (triton's needs Triton and torch: PYTHON=build/venv-compile/bin/python),
# XLA in cuDNN's place (`make gpu-check-rehearsal`).
set -uo pipefail

OUT="${1:?usage: benchmarks/gpu_check.sh OUT_DIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT" || exit 2
# Nothing of an earlier run in OUT_DIR may reach this run's summary.
rm -f "$OUT"/{steps,gpu_tests,timing,sparsity,sweep}.jsonl "$OUT"/{gpu_tests.*,timing,sparsity,sweep,summary}.log \
  "$OUT/error.txt" "$OUT/summary.json"
BUDGET="${FLEXJAX_GPU_BUDGET_S:-450}"
TEST_TIMEOUT="${FLEXJAX_GPU_TEST_TIMEOUT_S:-180}"
# mosaic_gpu on a GPU; its interpreter is left out of the CPU rehearsal (minutes per case on 2
# cores, and the rehearsal's head dim 32 is one it refuses): tests/test_mosaic_gpu.py runs it there.
if [[ -n "${FLEXJAX_GPU_CHECK_ALLOW_CPU:-}" ]]; then
  BACKENDS="${FLEXJAX_GPU_BACKENDS:-triton,pallas}"
else
  BACKENDS="${FLEXJAX_GPU_BACKENDS:-mosaic_gpu,triton,pallas}"
fi
MIN_STEP_S=30    # a timing step starts only with this much of the budget left
MARGIN_S=15      # and starts no measurement in its last MARGIN_S seconds
SUMMARY_S=15     # kept for the summary at the end (it reads JSON lines: about a second)

if [[ -n "${PYTHON:-}" ]]; then
  PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
  PY=.venv/bin/python
else
  PY="$(command -v python3 || command -v python || true)"
fi
if [[ -z "$PY" ]] || ! command -v "$PY" > /dev/null; then
  echo "gpu_check: no python: set PYTHON, create .venv or put python3 on PATH" | tee "$OUT/error.txt"
  exit 2
fi
PY="$(command -v "$PY")"
[[ $PY == /* ]] || PY="$ROOT/$PY"  # absolute, without resolving the venv's symlink

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# The pure-Python wheels of `make wheel`, each only where its module does not import: absl-py
# first, which jax-triton imports.
for pair in absl:absl_py jax_triton:jax_triton; do
  if ! "$PY" -c "import ${pair%%:*}" > /dev/null 2>&1; then
    for whl in "$ROOT"/.whl/"${pair#*:}"-*-py3-none-any.whl; do
      [[ -f $whl ]] && export PYTHONPATH="$whl:$PYTHONPATH"
    done
  fi
done
export PYTHONUNBUFFERED=1
# Let XLA take GPU memory as it needs it: the test shards (each with a dense float32 reference
# of up to ~30 GiB at S=8192), the dense cuDNN baselines and the kernels share the device
# without a 75% preallocation each.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR-/tmp/flexjax-gpu-check-cache}"

step() {  # step NAME start|end|skipped [RC]
  printf '{"step": "%s", "event": "%s", "rc": %s, "t_s": %d}\n' "$1" "$2" "${3:-null}" "$SECONDS" \
    >> "$OUT/steps.jsonl"
}

step env start
# One interpreter start both describes the machine and asks whether JAX sees a GPU.
"$PY" - > "$OUT/env.txt" 2>&1 <<'EOF'
import importlib.metadata, platform, sys
print("python", sys.executable, platform.python_version())
try:
    import jax
    print("jax", jax.__version__, jax.__file__)
except Exception as e:
    print("jax -", type(e).__name__, e)
for name in ("jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "numpy", "triton", "jax-triton", "absl-py", "torch",
             "pytest"):
    try:
        print(name, importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        print(name, "-")
try:
    import jax_triton
    print("jax_triton importable", jax_triton.__file__)
except Exception as e:
    print("jax_triton not importable:", type(e).__name__, str(e)[:200])
try:
    print("backend", jax.default_backend())
    print("devices", jax.devices())
except Exception as e:
    print("backend none", type(e).__name__, e)
    sys.exit(3)
sys.exit(0 if jax.default_backend() == "gpu" else 3)
EOF
gpu=$?
{ command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } \
  >> "$OUT/env.txt" 2>&1
step env end "$gpu"
REHEARSAL=""
if [[ $gpu -ne 0 ]]; then
  if [[ -z "${FLEXJAX_GPU_CHECK_ALLOW_CPU:-}" ]]; then
    jax="$(grep -m1 '^jax ' "$OUT/env.txt" | cut -d' ' -f2)"
    backend="$(grep -m1 '^backend ' "$OUT/env.txt" | cut -d' ' -f2)"
    echo "gpu_check: no GPU visible to JAX (python $PY, jax ${jax:-?}, backend ${backend:-?}); see $OUT/env.txt" \
      | tee "$OUT/error.txt"
    exit 2
  fi
  REHEARSAL=--rehearsal
  echo "gpu_check: REHEARSAL without a GPU: tiny shapes, interpreters, XLA in cuDNN's place; no figure below is a GPU's"
fi
SHARDS="${FLEXJAX_GPU_TEST_SHARDS:-$([[ -n $REHEARSAL ]] && echo 2 || echo 4)}"  # 2 cores rehearse
cat "$OUT/env.txt"

status=0
step tests start
pids=()
for ((i = 0; i < SHARDS; i++)); do
  # The platform allocator frees what a shard no longer uses (XLA's default pool keeps its peak
  # until the process ends): only the shards' simultaneous dense references must fit together.
  # shellcheck disable=SC2086  # the extra arguments are meant to split
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout "$TEST_TIMEOUT" "$PY" benchmarks/gpu_tests.py --shard "$i/$SHARDS" \
    --out "$OUT/gpu_tests.jsonl" --backends "$BACKENDS" $REHEARSAL ${FLEXJAX_GPU_TEST_ARGS:-} \
    > "$OUT/gpu_tests.$i.log" 2>&1 &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do
  wait "$pid" || rc=$?
done
step tests end "$rc"
[[ $rc -eq 0 ]] || status=1
passed=$(grep -c '"outcome": "passed"' "$OUT/gpu_tests.jsonl" 2> /dev/null)
ran=$(grep -c '"kind": "test"' "$OUT/gpu_tests.jsonl" 2> /dev/null)
echo "gpu_check: tests ${passed:-0}/${ran:-0} passed, rc $rc, ${SECONDS} s (details: $OUT/gpu_tests.jsonl)"
grep '"kind": "test"' "$OUT/gpu_tests.jsonl" 2> /dev/null | grep -v '"outcome": "passed"' | cut -c1-400

bench() {  # bench SECTION CAP_S EXTRA_ARGS: one gpu_bench.py section within its cap and the budget
  local section=$1 cap=$2 extra=$3 left limit rc timed
  left=$((BUDGET - SUMMARY_S - SECONDS))
  limit=$((cap < left ? cap : left))
  if ((limit < MIN_STEP_S)); then
    echo "gpu_check: $section skipped, ${left} s of the ${BUDGET} s budget left" | tee -a "$OUT/error.txt"
    step "$section" skipped
    status=1
    return
  fi
  step "$section" start
  # shellcheck disable=SC2086
  timeout "$limit" "$PY" benchmarks/gpu_bench.py --section "$section" --out "$OUT/$section.jsonl" \
    --deadline-at $(($(date +%s) + limit - MARGIN_S)) $REHEARSAL $extra > "$OUT/$section.log" 2>&1
  rc=$?
  step "$section" end "$rc"
  [[ $rc -eq 0 ]] || status=1
  timed=$(grep -c '"kind": "time"' "$OUT/$section.jsonl" 2> /dev/null)
  echo "gpu_check: $section ${timed:-0} timings, rc $rc, ${SECONDS} s (details: $OUT/$section.jsonl)"
}

bench timing "${FLEXJAX_GPU_TIMING_S:-110}" "--impls $BACKENDS ${FLEXJAX_GPU_TIMING_ARGS:-}"
bench sparsity "${FLEXJAX_GPU_SPARSITY_S:-70}" "--impls $BACKENDS ${FLEXJAX_GPU_SPARSITY_ARGS:-}"
if [[ ,$BACKENDS, == *,triton,* ]]; then
  bench sweep "$BUDGET" "${FLEXJAX_GPU_SWEEP_ARGS:-}"
else
  echo "gpu_check: sweep not run: it sweeps triton, which FLEXJAX_GPU_BACKENDS=$BACKENDS leaves out"
  step sweep skipped 0
fi

step summary start
timeout "$SUMMARY_S" "$PY" benchmarks/gpu_summary.py "$OUT" > "$OUT/summary.log" 2>&1
rc=$?
step summary end "$rc"
[[ $rc -eq 0 ]] || status=1
cat "$OUT/summary.log"
echo "gpu_check: exit $status after ${SECONDS} s (budget ${BUDGET} s)"
exit $status
