#!/usr/bin/env bash
# Build the hf-kbit wheel with the CUDA library on a machine with nvcc (no GPU needed).
#
#   scripts/build_wheel.sh                 # SASS for sm_80/86/89/90a/120 + compute_80 PTX
#   HF_KBIT_CUDA_ARCHS=90a scripts/build_wheel.sh   # H100/H200 only (fast)
#
# The library is loaded with ctypes and uses no Python C API, so the wheel is tagged
# py3-none-<platform>: one wheel installs on every Python 3 (`pip install --no-deps`).
# Output: dist/hf_kbit-*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
mkdir -p dist
"$PYTHON" -m pip wheel . --no-deps -w dist \
  -C wheel.py-api=py3 \
  -C build-dir=build/wheel \
  -C cmake.define.CMAKE_CUDA_FLAGS="--threads=0" \
  "$@"
ls -l dist/hf_kbit-*.whl
# The wheel must carry the library when a CUDA toolkit was found.
if command -v nvcc >/dev/null 2>&1 && [ "${HF_KBIT_BUILD_CUDA:-1}" != "0" ]; then
  newest=$(ls -t dist/hf_kbit-*.whl | head -1)
  listing=$("$PYTHON" -m zipfile -l "$newest")
  grep -q "hf_kbit/libhf_kbit_cuda.so" <<<"$listing" \
    || { echo "error: $newest lacks hf_kbit/libhf_kbit_cuda.so" >&2; exit 1; }
  echo "ok: $newest carries hf_kbit/libhf_kbit_cuda.so"
fi
