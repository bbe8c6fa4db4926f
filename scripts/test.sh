#!/usr/bin/env bash
# Installs everything on a fresh machine (CPU, package registries only) and runs the tests.
#   bash scripts/test.sh            # everything but the slow group
#   bash scripts/test.sh --all      # the slow group too
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1

bash scripts/install.sh

echo "== kernels: nvcc compile check (sm_80, sm_90)"
if command -v nvcc >/dev/null 2>&1; then
    bash kernels/compile_check.sh
else
    echo "nvcc not found: the CUDA compile check needs it" >&2
    exit 1
fi

echo "== lint"
python -m ruff check .

echo "== tests"
marker=(-m "not slow")
[[ "${1:-}" == "--all" ]] && marker=()
# The SGLang end-to-end tests must run here, never skip: install.sh installed SGLang.
SGL_PIC_REQUIRE_SGLANG=1 python -m pytest tests -q "${marker[@]}"
