#!/usr/bin/env bash
# GPU check for the pallas backend, for whenever an NVIDIA GPU is at hand (< 8 minutes).
#
#   benchmarks/gpu_check.sh OUT_DIR
#
# Installs nothing from the network: it uses the project's .venv (or $PYTHON), which must
# already hold a CUDA jaxlib. Runs the gpu-marked tests (compiled Triton kernels against
# the reference), then times pallas against cuDNN and the xla backend; everything lands
# in OUT_DIR (gpu_tests.xml, gpu_tests.log, bench.json, bench.log, env.txt).
set -uo pipefail

OUT="${1:?usage: benchmarks/gpu_check.sh OUT_DIR}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Let XLA take GPU memory as it needs it, so the dense cuDNN baselines and the kernels
# share the device without a 75% preallocation.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  "$PY" -c 'import jax; print("jax", jax.__version__, jax.devices())' 2>&1
} > "$OUT/env.txt"
cat "$OUT/env.txt"

if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")'; then
  echo "no GPU visible to JAX; see $OUT/env.txt" | tee "$OUT/error.txt"
  exit 2
fi

status=0
# Tests: about a minute of compiles on one GPU; the budget leaves room for the benchmark.
timeout 150 "$PY" -m pytest -q -m gpu tests/test_pallas.py --junitxml="$OUT/gpu_tests.xml" \
  -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" || status=1
# Benchmark: stops starting new measurements after 270 s, and is killed at 300 s.
timeout 300 "$PY" benchmarks/gpu_bench.py --out "$OUT/bench.json" --deadline-s 270 2>&1 \
  | tee "$OUT/bench.log" || status=1
exit $status
