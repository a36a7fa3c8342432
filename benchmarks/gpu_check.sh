#!/usr/bin/env bash
# The device check for a lent GPU (H200, CUDA 13 driver, cupy-cuda13x, torch; no network).
# Runs the GPU tests, the framework bindings' GPU check (benchmarks/gpu_frameworks.py), then
# benchmarks/gpu_bench.py (forward, genomics terms, backward) and the statistics' check and
# timings (benchmarks/bench_stats.py --backend cupy), in under 10 minutes; writes gpu.txt, the
# test log gpu_tests.txt, gpu_frameworks.txt, gpu_bench.json, gpu_bench.md, gpu_genomics.md,
# gpu_backward.md and gpu_stats.md into $OUT if set, else ./bench-out.
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

# 1. the GPU tests (the emulated matrices on real CuPy arrays, and `tune --quick`), at most 5
#    minutes in all, as file:seconds. The first files settle the most (fragment layouts, the
#    SIMT engine); the log is appended file by file, so a timeout still leaves the earlier
#    results. (The device tool returns at most 8 files from $OUT; this script leaves 8.)
: > "$out/gpu_tests.txt"
for entry in test_tensor_core:30 test_semantics:30 test_cuda_engine:60 test_mma_engine:80 \
             test_softmax_kernels:40 test_tuning:60 test_stats_cuda:45; do
  t=${entry%%:*}
  echo "== tests/$t.py" >> "$out/gpu_tests.txt"
  timeout "${entry##*:}" python -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rfE \
    "tests/$t.py" > "$out/current.txt" 2>&1
  status=$?
  cat "$out/current.txt" >> "$out/gpu_tests.txt"
  echo "$t: exit $status ($(tail -n 1 "$out/current.txt"))"
done
rm -f "$out/current.txt"

# 1b. the framework bindings on the GPU, at most 75 s: cuonline.torch on CUDA tensors on a side
#     stream with work queued before the call, cuonline.jax (where jaxlib sees the GPU) under
#     jit, grad and vmap on XLA's stream and with layout="blhd", each against the NumPy engine
#     on host copies; the CUDA limits raised before anything runs; packed batches (or their
#     refusal when traced) (gpu_frameworks.txt, rewritten after every check)
timeout 75 python benchmarks/gpu_frameworks.py --out "$out" 2>&1 | tail -n 60

# 2. the benchmark, at most 130 s; gpu_bench.md/json are rewritten after every case
timeout 130 python benchmarks/gpu_bench.py --out "$out" ${GPU_BENCH_ARGS:-} 2>&1 | tail -n 60
cat "$out/gpu_bench.md"
# 3. the genomics terms beside their dense bias, and the backward, at most 40 s each
#    (gpu_genomics.md, gpu_backward.md: 7 files in $OUT in all, with gpu_frameworks.txt)
timeout 40 python benchmarks/gpu_bench.py --out "$out" --section genomics --repeat 3 2>&1 | tail -n 12
timeout 40 python benchmarks/gpu_bench.py --out "$out" --section backward --repeat 3 --quick \
  2>&1 | tail -n 30
# 4. the statistics (attention_stats, issue 21), at most 45 s: every statistic against the NumPy
#    engine on host copies, then the kernels beside attention and the dense CuPy computation,
#    and the memory at 32768 keys (gpu_stats.md: the 8th file in $OUT)
timeout 45 python benchmarks/bench_stats.py --backend cupy --sizes 1024 4096 8192 --repeat 3 \
  --out "$out" 2>&1 | tail -n 12
# 5. packed variable-length batches (issue 20), at most 60 s: forward and backward of both
#    families against the NumPy engine, then packed / padded / loop figures on ESM-2-like
#    lengths; its report is appended to gpu_bench.md (the device tool returns 8 files)
timeout 60 python benchmarks/gpu_varlen.py --out "$out" 2>&1 | tail -n 30
cat "$out/gpu_varlen.md" >> "$out/gpu_bench.md" 2>/dev/null && rm -f "$out/gpu_varlen.md"
