#!/usr/bin/env bash
# One run on a lent GPU machine (one CUDA GPU, its own python3 + torch, no SGLang, no
# network): the CUDA kernels' tests, the serving path's torch-side ops on CUDA, and the
# kernels' bandwidth benchmark, all within 8 minutes. Reports land in $OUT (default
# bench/results): env.txt, build.log, tests.log, serving.log, gpu_serving_ops.json,
# bench.log, kernels_<device>.json, summary.json, and with SGLang installed also
# serve_check.log and serve_check.json.
#
#   bash bench/gpu_check.sh                 # on the GPU machine
#   bash bench/gpu_check.sh --cpu-dry-run   # anywhere: the plain-python checks on the CPU
#
# Needs torch, numpy and msgpack (sgl_pic.store imports them). pytest is optional: without
# it the CUDA unit tests are skipped and the plain-python checks (bench/kernels.py checks
# every op against the reference before timing; bench/gpu_serving_ops.py) still run.
# Missing packages are installed from wheels in $WHEELS (default .whl/, git-ignored, so
# carry it) when that directory exists; prepare it on a networked machine with e.g.
#   pip download --only-binary=:all: --python-version 3.12 \
#     --platform manylinux2014_x86_64 -d .whl msgpack numpy pytest
# Where SGLang is installed (a user's GPU machine), the last step is the one-shot serving
# check (bench/serve_check.py): the server at its defaults on this GPU, chunked requests
# against exact ones, its metrics; SERVE_ARGS passes server arguments to it (e.g.
# SERVE_ARGS="--model-path Qwen/Qwen2.5-7B-Instruct"; the embedded model by default).
# Without SGLang (the lent device image) that step is skipped and said so; nothing else
# imports SGLang. SERVE_BUDGET_S (default 900) bounds that step alone.
# Exit: 0 all passed, 1 a check failed, 3 no CUDA device.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-bench/results}"
WHEELS="${WHEELS:-.whl}"
BUDGET_S="${BUDGET_S:-470}"  # under 8 minutes, whatever the steps below take
mkdir -p "$OUT"
export OUT PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Kernel library cache inside the run, so every run builds from these sources.
export HOME="${TMPDIR:-/tmp}/sgl_pic_home"
mkdir -p "$HOME"
PY="${PYTHON:-python3}"
start=$SECONDS

# Seconds left of the budget, capped at $1: each step gets at most that.
left() {
  local rem=$((BUDGET_S - (SECONDS - start)))
  ((rem > $1)) && rem=$1
  ((rem < 1)) && rem=1
  echo "$rem"
}

have() { "$PY" -c "import $1" >/dev/null 2>&1; }

dry_run=0
[[ "${1:-}" == "--cpu-dry-run" ]] && dry_run=1

{
  date -u
  command -v nvidia-smi >/dev/null && nvidia-smi \
    --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  command -v nvcc >/dev/null && nvcc --version | tail -n 2
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', \
torch.__version__, '| cuda', torch.version.cuda, '|', torch.cuda.is_available() and \
torch.cuda.get_device_name(0))"
  for mod in numpy msgpack pytest hypothesis sglang; do
    have "$mod" && echo "module $mod: present" || echo "module $mod: missing"
  done
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

missing=()
for mod in numpy msgpack pytest; do have "$mod" || missing+=("$mod"); done
if ((${#missing[@]})) && [[ -d "$WHEELS" ]]; then
  echo "== installing ${missing[*]} from $WHEELS (no index)"
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" "${missing[@]}" 2>&1 | tail -n 3
fi
for mod in numpy msgpack; do
  if ! have "$mod"; then
    echo "gpu_check: python module '$mod' is missing (sgl_pic.store needs it); carry" \
      "wheels in $WHEELS (see the header of this script)" >&2
    exit 1
  fi
done

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  if ((dry_run)); then
    echo "gpu_check: no CUDA device; --cpu-dry-run: running the plain-python checks on the CPU"
    timeout "$(left 300)" "$PY" bench/gpu_serving_ops.py --cpu-dry-run --out-dir "$OUT" \
      >"$OUT/serving.log" 2>&1
    rc=$?
    grep -E '^[a-z_]+ +(OK|FAIL)' "$OUT/serving.log"
    timeout "$(left 300)" "$PY" bench/kernels.py --out-dir "$OUT" >"$OUT/bench.log" 2>&1
    rc_bench=$?
    grep -E '^correctness' "$OUT/bench.log"
    echo "gpu_check: dry run serving=$rc bench=$rc_bench"
    [[ $rc == 0 && $rc_bench == 0 ]]
    exit $?
  fi
  echo "gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing to check." \
    "Use --cpu-dry-run to exercise the script on the CPU." >&2
  exit 3
fi

echo "== kernels: build for this GPU through the Python loader"
timeout "$(left 240)" "$PY" -c "
import sys, torch, sgl_pic.ops.cuda as c
s = c.prepare(torch.device('cuda'))
print(s)
sys.exit(0 if s.available else 1)" 2>&1 | tee "$OUT/build.log"
rc_build=${PIPESTATUS[0]}

rc_tests=skipped
if have pytest; then
  echo "== pytest: CUDA tests of the kernels, the pool ops and the layer feed"
  # --confcutdir keeps the repository's top-level conftest (which needs transformers) out.
  timeout "$(left 150)" "$PY" -m pytest -q -rs -p no:cacheprovider --confcutdir=tests/ops \
    tests/ops/test_cuda.py tests/ops/test_pool.py 2>&1 | tee "$OUT/tests.log"
  rc_ops=${PIPESTATUS[0]}
  timeout "$(left 90)" "$PY" -m pytest -q -rs -p no:cacheprovider \
    --confcutdir=tests/integration tests/engine/test_layer_feed.py 2>&1 |
    tee -a "$OUT/tests.log"
  rc_feed=${PIPESTATUS[0]}
  rc_tests=$((rc_ops || rc_feed))
else
  echo "== pytest not installed: CUDA unit tests skipped (plain-python checks follow)"
fi

echo "== bench/gpu_serving_ops.py"
timeout "$(left 90)" "$PY" bench/gpu_serving_ops.py --out-dir "$OUT" >"$OUT/serving.log" 2>&1
rc_serving=$?
grep -E '^[a-z_]+ +(OK|FAIL)|Error' "$OUT/serving.log"

echo "== bench/kernels.py (correctness, then bandwidth)"
timeout "$(left 150)" "$PY" bench/kernels.py --out-dir "$OUT" --max-tokens 256000 \
  >"$OUT/bench.log" 2>&1
rc_bench=$?
tail -n 30 "$OUT/bench.log"

rc_serve=skipped
if have sglang; then
  echo "== bench/serve_check.py: the server at its defaults on this GPU"
  # Its own budget: a server start (weights, graph capture) outlasts the ops budget.
  # shellcheck disable=SC2086  # SERVE_ARGS is a list of server arguments
  timeout "${SERVE_BUDGET_S:-900}" "$PY" bench/serve_check.py --out-dir "$OUT" -- \
    ${SERVE_ARGS:-} \
    2>&1 | tee "$OUT/serve_check.log" | grep -E '^[a-z]+ +(OK|FAIL)|Error|launching'
  rc_serve=${PIPESTATUS[0]}
else
  echo "== serving check skipped: SGLang is not installed here (bench/serve_check.py needs it)"
fi

elapsed=$((SECONDS - start))
cat >"$OUT/summary.json" <<EOF
{"build": "$rc_build", "tests": "$rc_tests", "serving": "$rc_serving", "bench": "$rc_bench",
 "serve_check": "$rc_serve", "seconds": $elapsed}
EOF
echo "== summary: build=$rc_build tests=$rc_tests serving=$rc_serving bench=$rc_bench" \
  "serve_check=$rc_serve (${elapsed} s)"
[[ $rc_build == 0 && ($rc_tests == 0 || $rc_tests == skipped) && $rc_serving == 0 && \
  $rc_bench == 0 && ($rc_serve == 0 || $rc_serve == skipped) ]] || exit 1
