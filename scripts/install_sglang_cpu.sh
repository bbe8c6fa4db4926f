#!/usr/bin/env bash
# Installs SGLang for CPU serving into the CURRENT Python environment.
#
# Why not `pip install sglang`: its wheel requires CUDA-only packages (flashinfer, sglang-kernel,
# deep-gemm, cuda-python, ...) and torch==2.14.1, which pulls several GB of CUDA wheels and
# replaces the CPU torch. We install the sglang wheel without dependencies and then exactly
# the pure-Python dependencies that `sglang.srt` imports on the CPU serving path, under
# constraints.txt (torch==2.13.0). The CUDA-only pieces it still imports (torchvision,
# sgl_kernel) are covered by sgl_pic/binding/cpu_stubs, which our launcher puts on
# sys.path only when serving on the CPU.
#
# Usage: scripts/install_sglang_cpu.sh        (PYTHON=... to choose the interpreter)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python}"
pip=("$py" -m pip install --disable-pip-version-check -q -c "$here/constraints.txt")

"${pip[@]}" --no-deps "sglang==0.5.23"
# compressed-tensors is imported by sglang's quantization registry; its declared deps would
# pull a newer torch, so it too comes without them.
"${pip[@]}" --no-deps "compressed-tensors==0.18.0"
"${pip[@]}" \
    aiohttp anthropic blobfile build distro easydict einops fastapi gguf interegular \
    ipython llguidance msgspec ninja numba numpy openai openai-harmony orjson \
    outlines packaging partial_json_parser pillow "prometheus-client>=0.20.0" psutil \
    pybase64 pydantic python-dateutil python-multipart "pyzmq>=25.1.2" regex requests \
    scipy sentencepiece setproctitle soundfile tiktoken tqdm "uvicorn>=0.51" uvloop \
    watchfiles xgrammar xxhash zstandard datasets modelscope "mistral_common>=1.11.5" \
    torch_memory_saver loguru
"$py" -c "import sglang; print('sglang', sglang.__version__)"
