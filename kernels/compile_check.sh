#!/usr/bin/env bash
# Compiles every kernels/*.cu for sm_80 and sm_90 and links them into one shared library,
# with no GPU needed. Exits non-zero on the first compiler error or warning.
#
# Usage (from anywhere): kernels/compile_check.sh [OUT_DIR]   (default: build/kernels)
# NVCC overrides the compiler; ARCHS (space-separated, default "80 90") the targets.
set -euo pipefail

kernels_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(dirname "$kernels_dir")"
out_dir="${1:-$repo_root/build/kernels}"
nvcc="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
archs="${ARCHS:-80 90}"

if [[ ! -x "$nvcc" ]]; then
  echo "compile_check: nvcc not found (set NVCC)" >&2
  exit 2
fi
mkdir -p "$out_dir"

# Flags shared with the Python loader (sgl_pic/ops/cuda.py), one per line.
mapfile -t flags < <(grep -v '^\s*$' "$kernels_dir/nvcc.flags")
gencode=()
for arch in $archs; do
  gencode+=("-gencode=arch=compute_${arch},code=sm_${arch}")
done

echo "compile_check: $("$nvcc" --version | tail -n 1)"
echo "compile_check: targets sm_${archs// /, sm_}; flags: ${flags[*]}"

shopt -s nullglob
sources=("$kernels_dir"/*.cu)
if ((${#sources[@]} == 0)); then
  echo "compile_check: no .cu files under $kernels_dir" >&2
  exit 2
fi

# One compiler process per file, two at a time: the machine CI runs on has 2 cores.
objects=()
pids=()
for src in "${sources[@]}"; do
  obj="$out_dir/$(basename "${src%.cu}").o"
  objects+=("$obj")
  "$nvcc" "${flags[@]}" "${gencode[@]}" -I"$kernels_dir" -c "$src" -o "$obj" &
  pids+=($!)
  if ((${#pids[@]} >= 2)); then
    wait "${pids[0]}"
    pids=("${pids[@]:1}")
  fi
done
for pid in "${pids[@]}"; do wait "$pid"; done
for obj in "${objects[@]}"; do echo "compile_check: built $obj"; done

lib="$out_dir/libsgl_pic_kernels.so"
"$nvcc" -shared "${gencode[@]}" "${objects[@]}" -o "$lib"
echo "compile_check: linked $lib"

# Prove each requested architecture's machine code is in the library: cuobjdump when
# installed, else a read of the fatbin headers (magic 0xBA55ED50; entry kind 2 = cubin).
list_cubin_archs() {
  local cuobjdump
  cuobjdump="$(command -v cuobjdump || true)"
  [[ -z "$cuobjdump" && -x "$(dirname "$(readlink -f "$nvcc")")/cuobjdump" ]] &&
    cuobjdump="$(dirname "$(readlink -f "$nvcc")")/cuobjdump"
  if [[ -n "$cuobjdump" ]]; then
    "$cuobjdump" --list-elf "$1" | grep -o 'sm_[0-9]*' | sed 's/sm_//' | sort -u
    return
  fi
  python3 - "$1" <<'PY'
import struct, sys
data = open(sys.argv[1], "rb").read()
archs, i = set(), 0
while (i := data.find(struct.pack("<I", 0xBA55ED50), i)) >= 0:
    header, size = struct.unpack_from("<H", data, i + 6)[0], struct.unpack_from("<Q", data, i + 8)[0]
    p, end = i + header, i + header + size
    while p < end:
        kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, p)
        if kind == 2:
            archs.add(struct.unpack_from("<I", data, p + 28)[0])
        p += entry_header + payload
    i = end
print("\n".join(str(a) for a in sorted(archs)))
PY
}
built_archs="$(list_cubin_archs "$lib")"
for arch in $archs; do
  if ! grep -qx "$arch" <<<"$built_archs"; then
    echo "compile_check: no sm_${arch} machine code in $lib" >&2
    exit 1
  fi
done
echo "compile_check: machine code in $lib for sm_$(echo $built_archs | sed 's/ /, sm_/g')"

# The Python loader resolves these symbols through ctypes.
for sym in pic_abi_version pic_error_string pic_copy_rows pic_rope_rows; do
  if ! nm -D --defined-only "$lib" | grep -qw "$sym"; then
    echo "compile_check: $lib does not export $sym" >&2
    exit 1
  fi
done
echo "compile_check: OK"
