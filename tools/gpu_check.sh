#!/usr/bin/env bash
# GPU check: build with CUDA kernels, run the test suite (CUDA variants included) and the
# benchmarks on the GPU, and write everything under OUT_DIR. Uses the Python it finds
# (.venv if present, else $PYTHON or python3) with the torch already installed there:
# a GPU machine may have its own torch and no package registry.
#   usage: tools/gpu_check.sh [OUT_DIR]     (about 2-4 minutes on an H200)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-check-out}
mkdir -p "$OUT"
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi

{
  date -u
  nvidia-smi || true
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available() and torch.cuda.get_device_name())"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

echo "== build (ADEPT_EXT_CUDA=1)"
if ! ADEPT_EXT_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi
"$PY" -c "import adept_ext, torch; assert adept_ext.cuda_available() and torch.cuda.is_available(); print('cuda kernels: ok')" || exit 1

status=0
echo "== tests"
if "$PY" -c "import pytest" 2>/dev/null; then
  "$PY" -m pytest -q -rs tests 2>&1 | tee "$OUT/tests.txt" | tail -15
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
  echo "pytest is not installed for $PY: tests skipped" | tee "$OUT/tests.txt"; status=1
fi

echo "== benchmarks (cuda)"
"$PY" tools/bench.py all --device cuda --json "$OUT/bench_cuda.json" 2>&1 | tee "$OUT/bench_cuda.txt" || status=1
exit $status
