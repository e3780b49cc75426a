#!/usr/bin/env bash
# One call on the GPU machine: the gpu tests, the kernel tests on CUDA and on the host CPU
# (at 1, 2 and all threads), and the kernel benchmarks; logs and JSON into $OUT.
#   bash bench/gpu_session.sh [quick]
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, platform; print(torch.__version__, triton.__version__, torch.get_num_threads())" | tee -a "$OUT/gpu.txt"
grep -m1 "model name" /proc/cpuinfo | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gpu.py -x 2>&1 | tee "$OUT/test_gpu.log" | tail -15
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_invariant_kernels.py 2>&1 | tee "$OUT/test_kernels.log" | tail -8
if [ "${1:-}" != "quick" ]; then
  python3 bench/kernels.py --sweep --out "$OUT/kernels_cuda.json" 2>&1 | tee "$OUT/bench_cuda.log" | tail -80
  python3 bench/kernels.py --device cpu --out "$OUT/kernels_xeon.json" 2>&1 | tee "$OUT/bench_xeon.log" | tail -10
fi
