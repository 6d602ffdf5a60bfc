#!/usr/bin/env bash
# GPU check for the pallas and triton backends on one NVIDIA GPU, in under 6 minutes (two fit in a lease).
#
#   bash benchmarks/gpu_check.sh OUT_DIR
#
# Runs from the source tree (PYTHONPATH=<repo>) and installs nothing. Python: $PYTHON, else
# the project's .venv, else python3 on PATH (the GPU machine has no .venv); it must hold a
# CUDA jaxlib. Needs no pytest. The triton backend needs jax-triton: where it is not installed, a
# pure-Python wheel of it in <repo>/.whl/ (jax_triton-*.whl, e.g. carried to the GPU machine) is put
# on PYTHONPATH as it is (zipimport), installing nothing. Every step writes under OUT_DIR as results appear, so a run
# that is cut short still reports:
#   env.txt          python, versions, devices, nvidia-smi
#   steps.jsonl      a line as each step starts and ends (rc, seconds since the start)
#   gpu_tests.jsonl  a line per catalog case and backend (pallas, triton): compiled kernels
#                    (bf16, fwd + bwd) against the reference (benchmarks/gpu_tests.py; shards
#                    run in parallel)
#   bench.jsonl      a line per timing: pallas, triton vs cuDNN vs xla (benchmarks/gpu_bench.py)
#   bench.json       the timings as rows, written when the benchmark finishes
#   *.log            each process's output
# Exit status: 0 all passed; 1 a case failed or a step was cut; 2 no GPU or no usable python.
#
# Budget: FLEXJAX_GPU_BUDGET_S (default 330) from the start. Tests: FLEXJAX_GPU_TEST_SHARDS
# processes (default 4), cut at FLEXJAX_GPU_TEST_TIMEOUT_S (default 150). The benchmark then
# starts no measurement later than 30 s before the budget ends, and is cut at its end.
# Compiles are cached in JAX_COMPILATION_CACHE_DIR (default /tmp/flexjax-gpu-check-cache),
# so a second run on the same machine skips the compiles of unchanged kernels.
#
# FLEXJAX_GPU_TEST_ARGS / FLEXJAX_GPU_BENCH_ARGS add arguments to the two steps (e.g.
# "--cases causal,padding", "--lengths 4096"); FLEXJAX_GPU_CHECK_ALLOW_CPU=1 goes on without
# a GPU, to rehearse the script on CPU with "--interpret" and a small "--shape".
set -uo pipefail

OUT="${1:?usage: benchmarks/gpu_check.sh OUT_DIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT" || exit 2
rm -f "$OUT/steps.jsonl" "$OUT/gpu_tests.jsonl" "$OUT/error.txt"  # the test lines are appended
BUDGET="${FLEXJAX_GPU_BUDGET_S:-330}"
SHARDS="${FLEXJAX_GPU_TEST_SHARDS:-4}"
TEST_TIMEOUT="${FLEXJAX_GPU_TEST_TIMEOUT_S:-150}"

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
if ! "$PY" -c "import jax_triton" > /dev/null 2>&1; then
  for whl in "$ROOT"/.whl/jax_triton-*-py3-none-any.whl; do
    [[ -f $whl ]] && export PYTHONPATH="$whl:$PYTHONPATH"
  done
fi
export PYTHONUNBUFFERED=1
# Let XLA take GPU memory as it needs it: the test shards, the dense cuDNN baselines and the
# kernels share the device without a 75% preallocation each.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR-/tmp/flexjax-gpu-check-cache}"

step() {  # step NAME start|end [RC]
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
for name in ("jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "numpy", "triton", "jax-triton", "torch", "pytest"):
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
if [[ $gpu -ne 0 && -z "${FLEXJAX_GPU_CHECK_ALLOW_CPU:-}" ]]; then
  jax="$(grep -m1 '^jax ' "$OUT/env.txt" | cut -d' ' -f2)"
  backend="$(grep -m1 '^backend ' "$OUT/env.txt" | cut -d' ' -f2)"
  echo "gpu_check: no GPU visible to JAX (python $PY, jax ${jax:-?}, backend ${backend:-?}); see $OUT/env.txt" \
    | tee "$OUT/error.txt"
  exit 2
fi
cat "$OUT/env.txt"

status=0
step tests start
pids=()
for ((i = 0; i < SHARDS; i++)); do
  # shellcheck disable=SC2086  # the extra arguments are meant to split
  timeout "$TEST_TIMEOUT" "$PY" benchmarks/gpu_tests.py --shard "$i/$SHARDS" --out "$OUT/gpu_tests.jsonl" \
    ${FLEXJAX_GPU_TEST_ARGS:-} > "$OUT/gpu_tests.$i.log" 2>&1 &
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

left=$((BUDGET - SECONDS))
if ((left < 60)); then
  echo "gpu_check: benchmark skipped, ${left} s of the ${BUDGET} s budget left" | tee -a "$OUT/error.txt"
  step bench skipped
  exit 1
fi
step bench start
# shellcheck disable=SC2086
timeout "$left" "$PY" benchmarks/gpu_bench.py --out "$OUT/bench.jsonl" --summary "$OUT/bench.json" \
  --deadline-s $((left - 30)) ${FLEXJAX_GPU_BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
rc=$?
step bench end "$rc"
[[ $rc -eq 0 ]] || status=1
timed=$(grep -c '"kind": "time"' "$OUT/bench.jsonl" 2> /dev/null)
echo "gpu_check: benchmark ${timed:-0} timings, rc $rc, ${SECONDS} s (details: $OUT/bench.jsonl)"
sed -n '/^== ms /,$p' "$OUT/bench.log"
exit $status
