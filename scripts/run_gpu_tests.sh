#!/usr/bin/env bash
# The GPU test suite, on the GPU machine, in one command:
#
#   scripts/run_gpu_tests.sh [path/to/hf_kbit-*.whl]
#
# Installs the wheel (default: the newest dist/hf_kbit-*.whl, built by scripts/build_wheel.sh)
# with --no-deps into a private directory and runs `pytest -m gpu tests/gpu` against that
# installed package, then a representative subset under compute-sanitizer memcheck.
# Without a wheel it builds the library from csrc/ for this GPU only and uses the source tree.
# Exit status: non-zero if any test or the sanitizer fails.
#
# GPU_TESTS: the test files of tests/gpu to run (space-separated, default all); GPU_MEMCHECK=0 skips the
# sanitizer pass. On an H100 the whole run takes about 10 minutes (the tests about 7.5, test_moe_gpu.py 2.5 of
# them), so where one command may run at most 10 minutes, split it, e.g.
#   GPU_TESTS="test_moe_gpu.py test_offsets_gpu.py test_rotation_kernels.py" GPU_MEMCHECK=0 scripts/run_gpu_tests.sh
#   GPU_TESTS="$(cd tests/gpu && ls test_*.py | grep -v -e moe_gpu -e offsets_gpu -e rotation_kernels)" scripts/run_gpu_tests.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
PYTHON="${PYTHON:-python3}"
WHEEL="${1:-$(ls -t dist/hf_kbit-*.whl 2>/dev/null | head -1 || true)}"
TARGETS=()
for f in ${GPU_TESTS:-}; do
  [ -f "$ROOT/tests/gpu/$f" ] || { echo "GPU_TESTS: no file tests/gpu/$f" >&2; exit 2; }
  TARGETS+=("$ROOT/tests/gpu/$f")
done
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=("$ROOT/tests/gpu")

SITE="$(mktemp -d)"

if [ -n "$WHEEL" ]; then
  echo "== installing $WHEEL (--no-deps) into $SITE"
  "$PYTHON" -m pip install -q --no-deps --no-index --no-compile --target "$SITE" "$WHEEL"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  RUN_DIR="$SITE"  # not the repo root, so `import hf_kbit` finds the installed package
else
  cc=$("$PYTHON" -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())')
  arch="$cc"; [ "$cc" = "90" ] && arch="90a"
  echo "== no wheel: building csrc/ for sm_$arch"
  HF_KBIT_CUDA_ARCHS="${HF_KBIT_CUDA_ARCHS:-$arch}" cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build build/gpu -j "$(nproc)"
  export HF_KBIT_LIBRARY="$ROOT/build/gpu/csrc/libhf_kbit_cuda.so"
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  RUN_DIR="$ROOT"
fi

cd "$RUN_DIR"
"$PYTHON" -c 'import hf_kbit, torch; from hf_kbit import _lib; _lib.load(); print("hf_kbit from", hf_kbit.__file__, "| library", _lib.library_path(), "| torch", torch.__version__, "|", torch.cuda.get_device_name())'

echo "== pytest -m gpu ${GPU_TESTS:-tests/gpu}"
"$PYTHON" -m pytest -m gpu -q -p no:cacheprovider "${TARGETS[@]}"

if [ "${GPU_MEMCHECK:-1}" = "0" ]; then
  echo "== memcheck skipped (GPU_MEMCHECK=0)"
elif command -v compute-sanitizer >/dev/null 2>&1; then
  echo "== compute-sanitizer memcheck (representative set)"
  rc=0
  compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
    "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider "${TARGETS[@]}" \
    -k "smoke or (mm_matches and bf16 and N257K515 and (M1 or M5)) or (each_kernel_path and gemm and N257K515 and (M17 or M65)) or (gemv_plan_modes and bf16 and (N4100K2040M3 or N5120K2048M16 or N14336K4096M16 or N40K16400M16 or N1000K16400M16 or N1024K4096M13 or N42240K384M1)) or gemm_offset or (dequantize_bit_exact and 257x515 and bf16) or (quantize_bit_exact and 33x257 and bf16) or (gemm_matches_reference and N257K515 and (M17 or M255)) or (grouped_mm_matches_reference and k3-fp16 and S512 and E5N257K515) or (rotated_gemv_every_plan_mode and staged and (N4100K2048M3 or N1024K4096M13)) or (softmax_topk_on_cuda and T7 and 60-4) or (grouped_mm_on_cuda_equals_reference and k4-bf16 and E5N257K515 and (S5 or S64 or S300)) or (per_row_mode_with_many_experts and S300) or (silu_glu_on_cuda and bfloat16) or (experts_combine_on_cuda and bfloat16 and same) or (expert_offsets_on_cuda and E128 and int64) or (sigmoid_group_topk_on_cuda and T7 and renormalized) or (topk_softmax_on_cuda and T7 and bfloat16) or (offsets_gemv_matches_reference and N4100K2000 and (M1 or M16)) or (offsets_gemm_matches_reference and N4100K2000 and (M17 or M512)) or (dequantize_records_bit_exact and N100K200) or (prologue_gemv_on_records_matches_reference and N4100K2000 and (k4-bf16 or k3-fp16) and (M1 or M16)) or (prologue_gemv_on_records_every_plan_mode and k4-bf16 and add_rmsnorm) or (glu_epilogue_matches_reference and k4-bf16 and (M1 or M5)) or glu_epilogue_rounds or (offsets and graph_replay)" || rc=$?
  if [ "$rc" = 5 ]; then  # pytest: nothing selected
    echo "== memcheck: no test of the representative set in GPU_TESTS"
  elif [ "$rc" != 0 ]; then
    exit "$rc"
  fi
else
  echo "compute-sanitizer not found: memcheck skipped" >&2
  exit 3
fi
