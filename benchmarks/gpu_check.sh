#!/usr/bin/env bash
# GPU check of the mosaic_gpu, triton and pallas backends on one NVIDIA GPU (issues 29, 31, 44): correctness
# at the shapes it times, then the timings, in one call of under 8 minutes on an H100 (budget 480 s, every
# step's cap included: see Budget).
#
#   bash benchmarks/gpu_check.sh OUT_DIR
#   bash benchmarks/gpu_check.sh --slots-for-mib MEMORY_MIB   # the test processes rule below, printed
#
# Runs from the source tree (PYTHONPATH=<repo>) and installs nothing. Python: $PYTHON, else
# the project's .venv, else python3 on PATH (the GPU machine has no .venv); it must hold a
# CUDA jaxlib. Needs no pytest. The triton backend needs jax-triton (and absl-py, which it
# imports): where one is not installed, its pure-Python wheel in <repo>/.whl/ (`make wheel`,
# carried to the GPU machine) is put on PYTHONPATH as it is (zipimport), installing nothing.
#
# Steps, most important first, each with its own time limit (its cap, seconds, default):
#   env       25   python, versions, devices, nvidia-smi; no GPU: exit 2 (or a rehearsal, below)
#   smoke     45   step 0: each kernel backend in a process of its own, all at once: a tiny causal
#                  forward and backward (B=1, S=256, 2/1 heads, D=128, bfloat16) against the reference
#                  (benchmarks/gpu_smoke.py). A backend whose process fails (an error, a refusal, a
#                  NaN) or does not end within the cap is dropped from every later step, with the
#                  reason (steps.jsonl, smoke.jsonl, summary.json); one that is merely inaccurate is
#                  kept and flagged (the tests step says where)
#   tests    115   bf16, D=128, GQA 16/4, at 1999x2011 (B=2) and S=8192 (B=1): causal, ALiBi, a
#                  relative bias (its table's gradient too), sliding window 1024, documents and
#                  dropout, against the float32 reference: out, lse, dq, dk, dv and the captured
#                  arrays' gradients (benchmarks/gpu_tests.py), for the kept backends but the late
#                  ones; each backend in processes of its own (a backend that hangs loses only its
#                  own remaining cases), no more at once than the GPU's memory holds (below)
#   timing    80   B=4, H=16/4, S=8192, D=128, causal and full: the forward alone and the backward
#                  alone (a jax.vjp closure), 20 back-to-back calls per synchronisation, as TFLOP/s
#                  and as ratios to cuDNN (benchmarks/gpu_bench.py --section timing): cuDNN and the
#                  kept backends but the late ones
#   sparsity  60   sliding window 1024 and documents at S=32768 (judged, first) and 16384 against cuDNN
#                  given the same dense mask, and its own window / packed form (--section sparsity)
#   late     110   per late backend (FLEXJAX_GPU_LATE_BACKENDS, default mosaic_gpu, whose kernels have
#                  never run on a GPU), in processes of their own after the others' figures are on
#                  disk, so that a hang there loses none of them: its tests (35, step tests:<name>;
#                  70 in a rehearsal, where pallas' interpreter took 35-40 s on 2 cores),
#                  timing (40, timing:<name>) and sparsity (35, sparsity:<name>), the ratios against
#                  the cuDNN timings of the steps above (--baselines-from)
#   sweep     30   triton tiles, warps and stages through kernel_options, forward and backward, at
#                  the timing's causal shape (--section sweep), where triton is kept
#   summary   10   the backends kept and dropped, the goals (measured: met or not met; or not
#                  measured), and the tables (benchmarks/gpu_summary.py, standard library only)
# Each writes under OUT_DIR as results appear, so a run that is cut short still reports:
#   env.txt          python, versions, devices, nvidia-smi
#   steps.jsonl      a line as each step starts and ends (rc, seconds since the start); the smoke
#                    step's verdict per backend ("event": "backend": kept, or the reason it is
#                    dropped); the tests' processes' ends ("event": "process")
#   smoke.jsonl      a line per backend: its smoke test's outcome, errors and seconds
#   gpu_tests.jsonl  a line per case, shape and backend: errors and tolerances per output
#   timing.jsonl, sparsity.jsonl, sweep.jsonl   a line per measurement (or why there is none);
#   timing.<name>.jsonl, sparsity.<name>.jsonl  the same for a late backend
#   summary.json     backends, goals, test counts, the rows of the timing steps
#   *.log            each process's output
# Exit status: 0 all passed; 1 a backend was dropped (one FLEXJAX_GPU_INJECT_HANG asks to hang
# excepted: see below), a case failed, a measurement is missing or a step was cut (the goals do
# not change it: summary.json states them); 2 no GPU or no usable python.
#
# Budget: FLEXJAX_GPU_BUDGET_S (default 480, 8 minutes) from the start. The caps above add up to
# 475 s with one late backend (25 + 45 + 115 + 80 + 60 + 110 + 30 + 10; the 5 s left are the
# shell's own), so every step gets its whole cap even when each before it ran into its own: a
# backend that hangs costs the caps of the steps it is in, never another step's time. Caps:
# FLEXJAX_GPU_ENV_S, FLEXJAX_GPU_SMOKE_S (45; 30 in a rehearsal, whose injected hang waits it out),
# FLEXJAX_GPU_TEST_TIMEOUT_S, FLEXJAX_GPU_TIMING_S, FLEXJAX_GPU_SPARSITY_S, FLEXJAX_GPU_LATE_TEST_S (35; 70 in a rehearsal),
# FLEXJAX_GPU_LATE_TIMING_S, FLEXJAX_GPU_LATE_SPARSITY_S, FLEXJAX_GPU_SWEEP_S. A step gets at most
# its cap and what is left of the budget (less the summary's), starts only with 20 s (or its cap,
# if smaller) left, and a timing step starts no measurement in its last 10 s. Each process is sent
# SIGTERM 3 s before its limit and SIGKILL at it (a kernel stuck in the driver may ignore the
# first). Compiles are cached in JAX_COMPILATION_CACHE_DIR (default /tmp/flexjax-gpu-check-cache),
# so a second run on the same machine skips unchanged ones.
#
# Test processes at once (the slots): each holds a dense float32 reference of 18-29 GiB at S=8192,
# so slots = floor((memory.total GiB - 8) / 30), at least 1 and at most 4, with memory.total the
# first GPU's from `nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits` (MiB): an
# H100 80 GB (79 GiB) 2, an H200 (140 GiB) 4, a 40 GB card 1. Without nvidia-smi (the CPU
# rehearsal; 2 cores) 2; FLEXJAX_GPU_TEST_SHARDS sets it. The tests step splits the slots among
# its backends (each gets max(1, slots / backends) processes, every n-th case each); jobs beyond
# the slots wait for one, each wave getting an equal share of the cap. A late backend's tests get
# all the slots.
#
# FLEXJAX_GPU_BACKENDS (default mosaic_gpu,triton,pallas; triton,pallas in the rehearsal) picks the
# kernel backends (the sweep is triton's); FLEXJAX_GPU_LATE_BACKENDS (default mosaic_gpu) those of
# them run late, in that order. FLEXJAX_GPU_TEST_ARGS / FLEXJAX_GPU_TIMING_ARGS /
# FLEXJAX_GPU_SPARSITY_ARGS / FLEXJAX_GPU_SWEEP_ARGS add arguments to a step, late or not (e.g.
# "--cases causal,dropout", "--lengths 4096"). FLEXJAX_GPU_CHECK_ALLOW_CPU=1 goes on without a GPU
# as a rehearsal: tiny shapes, the kernels in their interpreters (triton's needs Triton and torch:
# PYTHON=build/venv-compile/bin/python), XLA in cuDNN's place; mosaic_gpu refuses the rehearsal's
# head dim 32, so its smoke test drops it there.
#
# Test hook: FLEXJAX_GPU_INJECT_HANG=name[@step],... (honoured on a GPU too, and said at the
# start) makes the named backends' processes sleep forever where they would first call that
# backend (benchmarks/gpu_smoke.py): name alone in every step, so its smoke test times out and
# drops it; name@step (smoke, tests, timing, sparsity, sweep) in that step only. A backend
# dropped at the smoke test because it was asked to hang does not fail the run; one asked to hang
# there that was not dropped does. `make gpu-check-rehearsal` runs the rehearsal with
# FLEXJAX_GPU_BACKENDS=mosaic_gpu,triton,pallas, FLEXJAX_GPU_INJECT_HANG=mosaic_gpu and
# FLEXJAX_GPU_LATE_BACKENDS=mosaic_gpu,pallas (pallas takes the late path's processes there in
# mosaic_gpu's stead): the summary shows mosaic_gpu dropped, with the reason, and the others' figures.
set -uo pipefail

SHARD_GIB=30        # one test process's peak at S=8192: a dense float32 reference of 18-29 GiB
SHARD_MARGIN_GIB=8  # CUDA contexts (~0.5 GiB a process), the kernels' buffers, fragmentation
MAX_SLOTS=4
test_slots() {  # test_slots MEMORY_MIB: the test processes a GPU of that memory runs at once
  local n=$((($1 / 1024 - SHARD_MARGIN_GIB) / SHARD_GIB))
  ((n < 1)) && n=1
  ((n > MAX_SLOTS)) && n=$MAX_SLOTS
  echo "$n"
}
if [[ ${1:-} == --slots-for-mib ]]; then
  [[ ${2:-} =~ ^[0-9]+$ ]] || { echo "usage: benchmarks/gpu_check.sh --slots-for-mib MEMORY_MIB" >&2; exit 2; }
  test_slots "$2"
  exit 0
fi

OUT="${1:?usage: benchmarks/gpu_check.sh OUT_DIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT" || exit 2
# Nothing of an earlier run in OUT_DIR may reach this run's summary.
rm -f "$OUT"/{steps,smoke,gpu_tests,timing,sparsity,sweep}.jsonl "$OUT"/{timing,sparsity}.*.jsonl "$OUT"/*.log \
  "$OUT/error.txt" "$OUT/summary.json"
RCS="$(mktemp -d)"  # each background process's exit status, one file each
trap 'rm -rf "$RCS"' EXIT
REHEARSING="${FLEXJAX_GPU_CHECK_ALLOW_CPU:-}"
BUDGET="${FLEXJAX_GPU_BUDGET_S:-480}"
ENV_S="${FLEXJAX_GPU_ENV_S:-25}"
SMOKE_S="${FLEXJAX_GPU_SMOKE_S:-$([[ -n $REHEARSING ]] && echo 30 || echo 45)}"
TEST_TIMEOUT="${FLEXJAX_GPU_TEST_TIMEOUT_S:-115}"
TIMING_S="${FLEXJAX_GPU_TIMING_S:-80}"
SPARSITY_S="${FLEXJAX_GPU_SPARSITY_S:-60}"
LATE_TEST_S="${FLEXJAX_GPU_LATE_TEST_S:-$([[ -n $REHEARSING ]] && echo 70 || echo 35)}"
LATE_TIMING_S="${FLEXJAX_GPU_LATE_TIMING_S:-40}"
LATE_SPARSITY_S="${FLEXJAX_GPU_LATE_SPARSITY_S:-35}"
SWEEP_S="${FLEXJAX_GPU_SWEEP_S:-30}"
SUMMARY_S=10   # kept for the summary at the end (it reads JSON lines: about a second)
MIN_STEP_S=20  # a step starts only with this much of the budget left (or its cap, if smaller)
MARGIN_S=10    # a timing step starts no measurement in its last MARGIN_S seconds
KILL_S=3       # SIGTERM this long before a process's limit, SIGKILL at it
# mosaic_gpu on a GPU; in the CPU rehearsal its interpreter takes minutes a case on 2 cores and it
# refuses the rehearsal's head dim 32 (tests/test_mosaic_gpu.py runs it there).
if [[ -n $REHEARSING ]]; then
  BACKENDS="${FLEXJAX_GPU_BACKENDS:-triton,pallas}"
else
  BACKENDS="${FLEXJAX_GPU_BACKENDS:-mosaic_gpu,triton,pallas}"
fi
LATE="${FLEXJAX_GPU_LATE_BACKENDS-mosaic_gpu}"
INJECT="${FLEXJAX_GPU_INJECT_HANG:-}"
for value in "$BUDGET" "$ENV_S" "$SMOKE_S" "$TEST_TIMEOUT" "$TIMING_S" "$SPARSITY_S" "$LATE_TEST_S" "$LATE_TIMING_S" \
  "$LATE_SPARSITY_S" "$SWEEP_S" "${FLEXJAX_GPU_TEST_SHARDS:-1}"; do
  [[ $value =~ ^[1-9][0-9]*$ ]] || { echo "gpu_check: a cap, budget or shard count is not a positive integer: '$value'" \
    | tee "$OUT/error.txt"; exit 2; }
done
for value in "$BACKENDS" "$LATE" "$INJECT"; do
  [[ $value =~ ^[A-Za-z0-9_,@]*$ ]] || { echo "gpu_check: backend lists take names, ',' and '@': '$value'" \
    | tee "$OUT/error.txt"; exit 2; }
done

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

step() {  # step NAME EVENT [RC] [EXTRA]: EXTRA is more JSON members, ', "key": value...'
  printf '{"step": "%s", "event": "%s", "rc": %s, "t_s": %d%s}\n' "$1" "$2" "${3:-null}" "$SECONDS" "${4:-}" \
    >> "$OUT/steps.jsonl"
}
json_list() {  # json_list A B...: "A", "B"...
  local out="" x
  for x in "$@"; do out+="${out:+, }\"$x\""; done
  printf '%s' "$out"
}
limit_for() {  # limit_for CAP: the seconds a step may take now, its cap within what is left of the budget
  local left=$((BUDGET - SUMMARY_S - SECONDS))
  echo $(($1 < left ? $1 : left))
}
skip_if_late() {  # skip_if_late NAME CAP LIMIT: too little of the budget left for the step: say so, fail the run
  local need=$((MIN_STEP_S < $2 ? MIN_STEP_S : $2))
  (($3 < need)) || return 1
  echo "gpu_check: $1 skipped, $3 s of the ${BUDGET} s budget left" | tee -a "$OUT/error.txt"
  step "$1" skipped
  status=1
}
run_limited() {  # run_limited SECONDS COMMAND...: SIGTERM KILL_S before SECONDS, SIGKILL at it
  local term=$(($1 > KILL_S + 1 ? $1 - KILL_S : 1))
  shift
  timeout -k "$KILL_S" "$term" "$@"
}
timed_out() { [[ $1 -eq 124 || $1 -eq 137 ]]; }
injected_for() {  # injected_for NAME STEP: whether FLEXJAX_GPU_INJECT_HANG asks NAME to hang in STEP
  local entry entries
  IFS=, read -ra entries <<< "$INJECT"
  for entry in "${entries[@]}"; do
    [[ $entry == "$1" || $entry == "$1@$2" ]] && return 0
  done
  return 1
}

step env start
# One interpreter start both describes the machine and asks whether JAX sees a GPU.
run_limited "$ENV_S" "$PY" - > "$OUT/env.txt" 2>&1 <<'EOF'
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
MEM_MIB=""
if command -v nvidia-smi > /dev/null; then
  timeout 10 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$OUT/env.txt" 2>&1
  MEM_MIB="$(timeout 10 nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2> /dev/null \
    | head -n 1 | tr -dc '0-9')"
fi
step env end "$gpu"
if timed_out "$gpu"; then
  echo "gpu_check: the environment probe ($PY) did not end within ${ENV_S} s; see $OUT/env.txt" | tee "$OUT/error.txt"
  exit 2
fi
REHEARSAL=""
if [[ $gpu -ne 0 ]]; then
  if [[ -z $REHEARSING ]]; then
    jax="$(grep -m1 '^jax ' "$OUT/env.txt" | cut -d' ' -f2)"
    backend="$(grep -m1 '^backend ' "$OUT/env.txt" | cut -d' ' -f2)"
    echo "gpu_check: no GPU visible to JAX (python $PY, jax ${jax:-?}, backend ${backend:-?}); see $OUT/env.txt" \
      | tee "$OUT/error.txt"
    exit 2
  fi
  REHEARSAL=--rehearsal
  echo "gpu_check: REHEARSAL without a GPU: tiny shapes, interpreters, XLA in cuDNN's place; no figure below is a GPU's"
fi
if [[ -n ${FLEXJAX_GPU_TEST_SHARDS:-} ]]; then
  SLOTS=$FLEXJAX_GPU_TEST_SHARDS SLOTS_FROM="FLEXJAX_GPU_TEST_SHARDS"
elif [[ -n $MEM_MIB ]]; then
  SLOTS=$(test_slots "$MEM_MIB")
  SLOTS_FROM="nvidia-smi memory.total $MEM_MIB MiB: (GiB - $SHARD_MARGIN_GIB) / $SHARD_GIB, 1 to $MAX_SLOTS"
else
  SLOTS=2 SLOTS_FROM="no nvidia-smi: the default"
fi
cat "$OUT/env.txt"
echo "gpu_check: test processes at once: $SLOTS ($SLOTS_FROM)"
if [[ -n $INJECT ]]; then
  export FLEXJAX_GPU_INJECT_HANG="$INJECT"
  echo "gpu_check: FLEXJAX_GPU_INJECT_HANG=$INJECT: a test hook; those backends' processes sleep until killed"
  step env inject_hang "" ", \"spec\": \"$INJECT\""
fi

status=0
# Step 0: each backend's smoke test, in its own process, all at once.
IFS=, read -ra REQUESTED <<< "$BACKENDS"
limit=$(limit_for "$SMOKE_S")
step smoke start "" ", \"backends\": [$(json_list "${REQUESTED[@]}")], \"timeout_s\": $limit"
for b in "${REQUESTED[@]}"; do
  # shellcheck disable=SC2086  # $REHEARSAL is empty or one flag
  (run_limited "$limit" "$PY" benchmarks/gpu_smoke.py --backend "$b" --out "$OUT/smoke.jsonl" $REHEARSAL \
    > "$OUT/smoke.$b.log" 2>&1; echo $? > "$RCS/smoke.$b") &
done
wait
KEPT=() DROPPED=()
for b in "${REQUESTED[@]}"; do
  rc=$(cat "$RCS/smoke.$b" 2> /dev/null || echo 1)
  if [[ $rc -eq 0 ]]; then
    KEPT+=("$b")
    step smoke backend "$rc" ", \"backend\": \"$b\", \"kept\": true"
    echo "gpu_check: $(grep -m1 "^smoke $b:" "$OUT/smoke.$b.log" | cut -c1-300)"
    continue
  fi
  DROPPED+=("$b")
  if timed_out "$rc"; then
    reason="its smoke test did not end within ${limit} s (killed, rc $rc)"
  else
    reason="its smoke test failed (exit status $rc)"
  fi
  step smoke backend "$rc" ", \"backend\": \"$b\", \"kept\": false, \"reason\": \"$reason\""
  echo "gpu_check: $b DROPPED from every later step: $reason; its log ends: $(tail -n 1 "$OUT/smoke.$b.log" | cut -c1-300)"
  if injected_for "$b" smoke; then
    echo "gpu_check: ($b was asked to hang by FLEXJAX_GPU_INJECT_HANG: its drop does not fail the run)"
  else
    status=1
  fi
done
MAIN=() LATE_KEPT=()
IFS=, read -ra late_names <<< "$LATE"
for b in "${KEPT[@]}"; do
  [[ ,$LATE, == *,$b,* ]] || MAIN+=("$b")
done
for b in "${late_names[@]}"; do
  [[ " ${KEPT[*]} " == *" $b "* ]] && LATE_KEPT+=("$b")
done
step smoke end "$((${#DROPPED[@]} > 0))" ", \"kept\": [$(json_list "${KEPT[@]}")], \"dropped\": [$(json_list \
  "${DROPPED[@]}")], \"main\": [$(json_list "${MAIN[@]}")], \"late\": [$(json_list "${LATE_KEPT[@]}")]"
echo "gpu_check: smoke: kept ${KEPT[*]:-none}; dropped ${DROPPED[*]:-none}; late ${LATE_KEPT[*]:-none}; ${SECONDS} s"

run_tests() {  # run_tests STEP CAP BACKEND...: each backend in processes of its own, SLOTS at a time
  local name=$1 cap=$2 limit procs=() job b i k waves per t deadline rc=0 r passed ran mine
  shift 2
  if (($# == 0)); then
    step "$name" skipped 0 ', "reason": "no backend left"'
    return
  fi
  limit=$(limit_for "$cap")
  if skip_if_late "$name" "$cap" "$limit"; then
    return
  fi
  k=$((SLOTS / $# > 1 ? SLOTS / $# : 1))
  for b in "$@"; do
    for ((i = 0; i < k; i++)); do procs+=("$b:$i/$k"); done
  done
  waves=$(((${#procs[@]} + SLOTS - 1) / SLOTS))
  per=$((limit / waves))
  deadline=$((SECONDS + limit))
  step "$name" start "" ", \"backends\": [$(json_list "$@")], \"processes\": ${#procs[@]}, \"slots\": $SLOTS, \
\"slots_from\": \"$SLOTS_FROM\", \"timeout_s\": $limit"
  for job in "${procs[@]}"; do
    while (($(jobs -rp | wc -l) >= SLOTS)); do wait -n; done
    b=${job%%:*} i=${job#*:}
    t=$((deadline - SECONDS < per ? deadline - SECONDS : per))
    echo "$t" > "$RCS/$name.$b.${i%/*}.limit"
    if ((t < 5)); then  # the step's time is spent: counted as cut, not started
      echo 124 > "$RCS/$name.$b.${i%/*}"
      continue
    fi
    # The platform allocator frees what a process no longer uses (XLA's default pool keeps its peak
    # until the process ends): only the processes' simultaneous dense references must fit together.
    # shellcheck disable=SC2086  # the extra arguments are meant to split
    (XLA_PYTHON_CLIENT_ALLOCATOR=platform run_limited "$t" "$PY" benchmarks/gpu_tests.py --shard "$i" \
      --out "$OUT/gpu_tests.jsonl" --backends "$b" $REHEARSAL ${FLEXJAX_GPU_TEST_ARGS:-} \
      > "$OUT/gpu_tests.$b.${i%/*}.log" 2>&1; echo $? > "$RCS/$name.$b.${i%/*}") &
  done
  wait
  for job in "${procs[@]}"; do
    b=${job%%:*} i=${job#*:}
    r=$(cat "$RCS/$name.$b.${i%/*}" 2> /dev/null || echo 1)
    step "$name" process "$r" ", \"backend\": \"$b\", \"shard\": \"$i\", \"timeout_s\": $(cat "$RCS/$name.$b.${i%/*}.limit")"
    [[ $r -eq 0 ]] || rc=$r
    if timed_out "$r"; then
      echo "gpu_check: $name: $b's process $i cut at its limit (rc $r); its log ends:"
      tail -n 2 "$OUT/gpu_tests.$b.${i%/*}.log" 2> /dev/null | cut -c1-300
    fi
  done
  step "$name" end "$rc"
  [[ $rc -eq 0 ]] || status=1
  mine="$(printf -- '"backend": "%s"\n' "$@")"  # this step's backends' lines
  ran=$(grep '"kind": "test"' "$OUT/gpu_tests.jsonl" 2> /dev/null | grep -cF "$mine")
  passed=$(grep '"kind": "test"' "$OUT/gpu_tests.jsonl" 2> /dev/null | grep -F "$mine" | grep -c '"outcome": "passed"')
  echo "gpu_check: $name ${passed:-0}/${ran:-0} passed, rc $rc, ${SECONDS} s (details: $OUT/gpu_tests.jsonl)"
  grep '"kind": "test"' "$OUT/gpu_tests.jsonl" 2> /dev/null | grep -F "$mine" | grep -v '"outcome": "passed"' \
    | cut -c1-400
}

bench() {  # bench SECTION STEP CAP FILE [LATE_BACKEND]: one gpu_bench.py process within its cap and the budget
  local section=$1 name=$2 cap=$3 file=$4 late=${5:-} limit rc timed impls=() extra
  if [[ $section != sweep && -n $late ]]; then
    impls=(--impls "$late" --baselines-from "$OUT/$section.jsonl")
  elif [[ $section != sweep ]]; then
    impls=(--impls "$(IFS=,; echo "${MAIN[*]}")")
  fi
  case $section in
    timing) extra="${FLEXJAX_GPU_TIMING_ARGS:-}" ;;
    sparsity) extra="${FLEXJAX_GPU_SPARSITY_ARGS:-}" ;;
    *) extra="${FLEXJAX_GPU_SWEEP_ARGS:-}" ;;
  esac
  limit=$(limit_for "$cap")
  if skip_if_late "$name" "$cap" "$limit"; then
    return
  fi
  step "$name" start "" ", \"timeout_s\": $limit"
  # shellcheck disable=SC2086
  run_limited "$limit" "$PY" benchmarks/gpu_bench.py --section "$section" --out "$OUT/$file.jsonl" "${impls[@]}" \
    --deadline-at $(($(date +%s) + limit - MARGIN_S)) $REHEARSAL $extra > "$OUT/$file.log" 2>&1
  rc=$?
  step "$name" end "$rc" ", \"timeout_s\": $limit${late:+, \"backend\": \"$late\"}"
  [[ $rc -eq 0 ]] || status=1
  timed=$(grep -c '"kind": "time"' "$OUT/$file.jsonl" 2> /dev/null)
  echo "gpu_check: $name ${timed:-0} timings, rc $rc$(timed_out "$rc" && echo " (cut at $limit s)"), ${SECONDS} s \
(details: $OUT/$file.jsonl)"
}

run_tests tests "$TEST_TIMEOUT" "${MAIN[@]}"
# cuDNN's timings even where no kernel backend is left here: the late ones' ratios are against them.
bench timing timing "$TIMING_S" timing
bench sparsity sparsity "$SPARSITY_S" sparsity
for b in "${late_names[@]}"; do
  if [[ " ${LATE_KEPT[*]} " != *" $b "* ]]; then
    [[ ,$BACKENDS, == *,$b,* ]] && step "late:$b" skipped 0 ', "reason": "dropped at the smoke test"'
    continue
  fi
  run_tests "tests:$b" "$LATE_TEST_S" "$b"
  bench timing "timing:$b" "$LATE_TIMING_S" "timing.$b" "$b"
  bench sparsity "sparsity:$b" "$LATE_SPARSITY_S" "sparsity.$b" "$b"
done
if [[ " ${KEPT[*]} " == *" triton "* ]]; then
  bench sweep sweep "$SWEEP_S" sweep
else
  echo "gpu_check: sweep not run: it sweeps triton, which is not among the backends kept (${KEPT[*]:-none})"
  step sweep skipped 0 ', "reason": "triton not kept"'
fi

step summary start
timeout "$SUMMARY_S" "$PY" benchmarks/gpu_summary.py "$OUT" > "$OUT/summary.log" 2>&1
rc=$?
step summary end "$rc"
[[ $rc -eq 0 ]] || status=1
cat "$OUT/summary.log"
for b in "${REQUESTED[@]}"; do  # the test hook's own check: each backend asked to hang is shown dropped
  injected_for "$b" smoke || continue
  if ! "$PY" -c 'import json, sys; d = json.load(open(sys.argv[1]))["backends"]["dropped"]; sys.exit(not d.get(sys.argv[2]))' \
    "$OUT/summary.json" "$b" 2> /dev/null; then
    echo "gpu_check: FLEXJAX_GPU_INJECT_HANG asked $b to hang at its smoke test, yet summary.json does not show it dropped" \
      | tee -a "$OUT/error.txt"
    status=1
  fi
done
echo "gpu_check: exit $status after ${SECONDS} s (budget ${BUDGET} s)"
exit $status
