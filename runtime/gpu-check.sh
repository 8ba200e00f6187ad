#!/usr/bin/env bash
# The checks that need a GPU, in one command (CI has none; run it on a machine with one, e.g. the
# device machine, from the repository root): build the native layer with its CUDA kernels, run the
# tests that skip without a GPU, time the GPU paths, and run the CUDA copy under compute-sanitizer
# (the slowest, last). Each step is bounded so the whole fits a 10-minute call with room to spare.
# Logs and the benchmark's JSON go to $OUT (default ./gpu-check-out). Uses the python3 that holds
# torch and Triton there (PYTHON overrides); needs nvcc, cmake, nanobind, pytest and hypothesis.
set -uo pipefail
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu-check-out}
BUILD=${BUILD:-/tmp/ucm-native-gpu}
ARCH=${UCM_CUDA_ARCHITECTURES:-90a}
export PATH="$PATH:/usr/local/cuda/bin"  # nvcc and compute-sanitizer where CUDA installs them
mkdir -p "$OUT"
status=0
step() { echo "== $* ($(date +%T))"; }

step "machine"
nvidia-smi -L
"$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

step "build runtime/native with CUDA for sm_$ARCH"
cmake -S runtime/native -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DUCM_CUDA=ON \
  -DUCM_CUDA_ARCHITECTURES="$ARCH" -DPython_EXECUTABLE="$(command -v "$PYTHON")" \
  -Dnanobind_DIR="$("$PYTHON" -c 'import nanobind; print(nanobind.cmake_dir())')" >"$OUT/build.log" 2>&1 &&
  cmake --build "$BUILD" >>"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
export PYTHONPATH="$BUILD:$PWD:$PWD/testing"  # testing/: pytest loads ucm_testing.ci_report (pyproject)

step "tests that need a GPU (and the native kernels' CPU tests beside them)"
timeout 240 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/runtime/test_native.py \
  tests/connector/test_layout.py tests/sparse/test_kernel.py tests/sparse/test_triton.py 2>&1 |
  tee "$OUT/tests.log" | tail -25 || status=1

step "benchmarks/gpu_paths.py"
timeout 150 "$PYTHON" benchmarks/gpu_paths.py --json "$OUT/gpu_paths.json" 2>&1 | tee "$OUT/gpu_paths.log" || status=1

step "the CUDA copy under compute-sanitizer memcheck"
timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$PYTHON" -m pytest -q -p no:cacheprovider \
  -k "cuda or gpu" tests/runtime/test_native.py tests/connector/test_layout.py 2>&1 | tee "$OUT/sanitizer.log" | tail -8 ||
  status=1

step "done: status $status"
exit $status
