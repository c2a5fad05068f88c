#!/usr/bin/env bash
# GPU check (issue 11), one prepared run of at most BUDGET_S seconds (default 470, under 8 minutes
# on an H200 with the build): build the CUDA kernels, run the CUDA tests, compute-sanitizer
# memcheck over the CUDA op tests and racecheck over a small subset, the benchmarks at the CPU
# and the realistic sizes, and write ONE summary, OUT_DIR/summary.json (every step's status and
# time, test and sanitizer counts, every benchmark figure, issue 11's goals). The CPU-only tests
# are `make test`'s job and are not rerun here.
#
#   usage: tools/gpu_check.sh [OUT_DIR]          (default gpu-check-out)
#   BUDGET_S=470   wall-clock budget; a step gets the smaller of its own limit and what is left
#   STEPS="..."    run only these steps (names below; the others are recorded as not requested)
#   DRY_RUN=1      no GPU needed: print each step's command instead of running it, then summarise
#   MAX_JOBS=16    build parallelism
#
# Fails loudly: any failed, timed-out or skipped (budget spent) step makes the exit status 1 and
# prints a FAILED line naming the steps. Logs: OUT_DIR/logs/<step>.log; benchmark JSON: OUT_DIR/bench/.
# Uses .venv/bin/python if present, else $PYTHON or python3, with the torch installed there.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-check-out}
BUDGET_S=${BUDGET_S:-470}
START=$(date +%s)
mkdir -p "$OUT/logs" "$OUT/bench"
rm -f "$OUT/steps.tsv" "$OUT/summary.json" "$OUT"/bench/*.json "$OUT/logs/tests.xml"
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi
export PYTHONUNBUFFERED=1

ALL_STEPS="build import tests memcheck racecheck bench_linear_ce_large bench_probe_large bench_importance_small
bench_importance_large bench_projection_small bench_projection_large bench_lr_large bench_train_step_large"
ALL_STEPS=$(echo $ALL_STEPS)
for s in ${STEPS:-}; do
  [[ " $ALL_STEPS " == *" $s "* ]] || { echo "FAILED: unknown step '$s' in STEPS (steps: $ALL_STEPS)"; exit 2; }
done

elapsed() { echo $(( $(date +%s) - START )); }
record() { printf '%s\t%s\t%s\t%s\t%s\n' "$@" >> "$OUT/steps.tsv"; }

# step NAME LIMIT_S CMD...: run CMD (output to logs/NAME.log) under the smaller of LIMIT_S and the
# budget left; record name, status (ok|failed|timeout|skipped|not requested), rc, seconds, log.
step() {
  local name=$1 limit=$2; shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then
    record "$name" "not requested" 0 0 ""; return 0
  fi
  local left=$(( BUDGET_S - $(elapsed) ))
  if [ "$left" -lt 15 ]; then
    record "$name" skipped -1 0 ""; echo "== $name: SKIPPED, the ${BUDGET_S} s budget is spent"; return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (at $(elapsed) s, limit ${limit} s)"
  local t0 rc status
  t0=$(date +%s)
  if [ -n "${DRY_RUN:-}" ]; then
    echo "DRY_RUN: $*" | tee "$OUT/logs/$name.log"; rc=0
  else
    timeout --kill-after=10 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
    rc=$?
    tail -n "${TAIL_LINES:-8}" "$OUT/logs/$name.log"
  fi
  status=ok
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status=timeout; elif [ "$rc" -ne 0 ]; then status=failed; fi
  record "$name" "$status" "$rc" "$(( $(date +%s) - t0 ))" "$name.log"
  [ "$status" = ok ] || { echo "== $name: ${status^^} (rc $rc; log $OUT/logs/$name.log)"; return 1; }
}

summarise() {
  "$PY" tools/gpu_summary.py "$OUT" --budget-s "$BUDGET_S" --elapsed-s "$(elapsed)"
  local rc=$?
  if [ $rc -ne 0 ]; then
    echo "FAILED: $(awk -F'\t' '$2 != "ok" && $2 != "not requested" {printf "%s (%s) ", $1, $2}' \
      "$OUT/steps.tsv" 2>/dev/null)"
    echo "see $OUT/summary.json and $OUT/logs/"
  else
    echo "gpu_check: all steps ok in $(elapsed) s; summary $OUT/summary.json"
  fi
  exit $rc
}

"$PY" - > "$OUT/machine.json" 2> "$OUT/logs/machine.log" <<'EOF'
import json, platform, subprocess
import torch
info = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "gpu_visible": torch.cuda.is_available()}
if torch.cuda.is_available():
    info["gpu"] = torch.cuda.get_device_name(0)
    info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
try:
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"]
    info["nvidia_smi"] = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
except Exception as e:
    info["nvidia_smi"] = f"unavailable: {e}"
print(json.dumps(info, indent=2))
EOF
cat "$OUT/machine.json"
if [ -z "${DRY_RUN:-}" ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  record machine failed 1 0 machine.log
  echo "FAILED: no GPU visible to $PY (torch.cuda.is_available() is False); DRY_RUN=1 checks the script without one"
  summarise
fi

# The sanitizer: on PATH, under CUDA_HOME, or in a standard toolkit location.
SANITIZER=""
for c in "$(command -v compute-sanitizer 2>/dev/null)" "${CUDA_HOME:-/nonexistent}/bin/compute-sanitizer" \
         /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer; do
  if [ -n "$c" ] && [ -x "$c" ]; then SANITIZER=$c; break; fi
done
if [ -z "$SANITIZER" ]; then  # its steps then fail, saying why
  SANITIZER="$OUT/logs/no-compute-sanitizer.sh"
  printf '#!/bin/sh\necho "compute-sanitizer not found (PATH, CUDA_HOME/bin, /usr/local/cuda*/bin)"; exit 127\n' \
    > "$SANITIZER"
  chmod +x "$SANITIZER"
fi

OP_TESTS="tests/test_taylor_importance.py tests/test_linear_cross_entropy.py tests/test_projection.py"
# Small and fast (17 tests), every kernel family that uses shared memory: racecheck instruments every
# shared-memory access, and did not finish the whole taylor + linear-CE files in 80 s on the first run.
RACE_TESTS="(test_matches_reference_one_tensor and (65537 or size5)) or test_conflict_correct_matches_reference"
RACE_TESTS="$RACE_TESTS or (test_coeffs_and_apply_match_reference and gdtype0)"
RACE_TESTS="$RACE_TESTS or (test_matches_reference and 1000 and dtype0)"
RACECHECK_K=${RACECHECK_K:-"cuda and ($RACE_TESTS)"}

step build 180 env ADEPT_EXT_CUDA=1 MAX_JOBS="${MAX_JOBS:-16}" "$PY" setup.py build_ext --inplace || summarise
step import 60 "$PY" -c "import adept_ext, torch
assert adept_ext.cuda_available() and torch.cuda.is_available(), 'CUDA kernels not compiled, or no GPU'
print('cuda kernels: ok; built for TORCH_CUDA_ARCH_LIST', adept_ext.compiled_cuda_arch_list(),
      'on', torch.cuda.get_device_name(), torch.cuda.get_device_capability())" || summarise
step tests 150 "$PY" -m pytest -q -rs -p no:cacheprovider -k cuda --junitxml="$OUT/logs/tests.xml" tests
# The caching allocator would hide reads past a tensor's end inside its pooled blocks.
step memcheck 200 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SANITIZER" --tool memcheck --error-exitcode 99 \
  --print-limit 50 "$PY" -m pytest -q -x -p no:cacheprovider -m "not slow" -k "cuda and not compile and not opcheck" \
  $OP_TESTS
step racecheck 90 "$SANITIZER" --tool racecheck --error-exitcode 99 --print-limit 50 \
  "$PY" -m pytest -q -x -p no:cacheprovider -m "not slow" -k "$RACECHECK_K" $OP_TESTS

# The benchmarks, the issue's goals first (so that a spent budget leaves out the least urgent).
bench() {  # bench NAME SIZE LIMIT_S
  step "bench_${1}_$2" "$3" "$PY" tools/bench.py "$1" --size "$2" --device cuda --json "$OUT/bench/${1}_$2.json"
}
bench linear_ce large 60
bench probe large 120
bench importance small 45
bench importance large 75
bench projection small 45
bench projection large 120
bench lr large 120
bench train_step large 180
summarise
