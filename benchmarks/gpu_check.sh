#!/usr/bin/env bash
# The device check for a lent GPU (H200, CUDA 13 driver, cupy-cuda13x, torch; no network).
# Runs the GPU tests, then benchmarks/gpu_bench.py, in under 8 minutes; writes the test log,
# gpu_bench.json and gpu_bench.md into $OUT if set, else ./bench-out.
#
#   bash benchmarks/gpu_check.sh            # from the repository root, no install needed
#   GPU_BENCH_ARGS=--quick bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench-out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$out/gpu.txt"
python -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)" \
  2>&1 | tee -a "$out/gpu.txt"

# 1. the GPU tests (the emulated matrix on real CuPy arrays), at most 3 minutes
timeout 180 python -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests \
  > "$out/gpu_tests.txt" 2>&1
echo "gpu tests: exit $? ($(tail -n 1 "$out/gpu_tests.txt"))"

# 2. the benchmark, at most 4.5 minutes
timeout 270 python benchmarks/gpu_bench.py --out "$out" ${GPU_BENCH_ARGS:-} 2>&1 | tail -n 60
