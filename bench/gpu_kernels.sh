#!/usr/bin/env bash
# One run on a lent GPU machine (H200): build the kernels, run the CUDA tests, run the
# benchmark. Everything it reports lands in $OUT (default bench/results):
#   env.txt, compile.log, tests.log, bench.log, kernels_<device>.json, sanitizer.log
# Uses the machine's own python3 and torch (no installs: that machine has no network);
# the checkout is put on PYTHONPATH. Budget: about 4 minutes, well under 8.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Kernel library cache inside the run, so every run builds from these sources.
export HOME="${TMPDIR:-/tmp}/sgl_pic_home"
mkdir -p "$HOME"

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  command -v nvcc && nvcc --version | tail -n 2
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.is_available() and torch.cuda.get_device_name(0))"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== compile_check (sm_80, sm_90)"
timeout 180 kernels/compile_check.sh build/kernels 2>&1 | tee "$OUT/compile.log"
rc_compile=${PIPESTATUS[0]}

echo "== tests/ops (the Python loader builds the kernels for this GPU on first use)"
timeout 240 python3 -m pytest tests/ops -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/tests.log"
rc_tests=${PIPESTATUS[0]}

echo "== bench/kernels.py"
timeout 240 python3 bench/kernels.py --out-dir "$OUT" 2>&1 | tee "$OUT/bench.log"
rc_bench=${PIPESTATUS[0]}

# Out-of-bounds accesses in the kernels, on a few small cases; informational (the
# sanitizer may refuse the device on some runtimes), bounded so it cannot eat the budget.
rc_sanitizer=skipped
if command -v compute-sanitizer >/dev/null 2>&1; then
  echo "== compute-sanitizer memcheck (informational)"
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 3 python3 -m pytest \
    tests/ops/test_cuda.py -q -p no:cacheprovider \
    -k "misaligned or pinned or (gather_matches_reference and float16 and not bfloat16 and 3-64) or \
(apply_rope_matches_reference and bfloat16 and 2-66)" >"$OUT/sanitizer.log" 2>&1
  rc_sanitizer=$?
  tail -n 5 "$OUT/sanitizer.log"
fi

echo "== summary: compile=$rc_compile tests=$rc_tests bench=$rc_bench sanitizer=$rc_sanitizer"
[[ $rc_compile == 0 && $rc_tests == 0 && $rc_bench == 0 ]]
