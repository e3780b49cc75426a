#!/usr/bin/env bash
# One call on the GPU machine: the gpu tests, the kernel tests on CUDA and on the host CPU
# (at 1, 2 and all threads), the kernel benchmarks, and the default run on the host's CPU;
# logs and JSON into $OUT. Steps: tests bench xeon train (default: all); SWEEP=1 adds the
# Triton tile sweep. The default run needs Ray there: run ../shared/tools/device-wheels
# here first and carry .whl.
#   bash bench/gpu_session.sh [step ...]
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
steps=${*:-tests bench xeon train}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.get_num_threads())" | tee -a "$OUT/gpu.txt"
grep -m1 "model name" /proc/cpuinfo | tee -a "$OUT/gpu.txt"
for step in $steps; do
  case $step in
    tests)
      python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gpu.py 2>&1 | tee "$OUT/test_gpu.log" | tail -4
      python3 -m pytest -q -p no:cacheprovider tests/kernels/test_invariant_kernels.py 2>&1 | tee "$OUT/test_kernels.log" | tail -4 ;;
    bench)
      python3 bench/kernels.py ${SWEEP:+--sweep} --out "$OUT/kernels_cuda.json" 2>&1 | tee "$OUT/bench_cuda.log" | tail -75 ;;
    xeon)
      python3 bench/kernels.py --device cpu --out "$OUT/kernels_xeon.json" 2>&1 | tee "$OUT/bench_xeon.log" | tail -8 ;;
    train)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH || { echo "no .whl: skipping train"; continue; }
      start=$SECONDS
      timeout 420 python3 -m reprorl.cli train 2>&1 | tee "$OUT/train_xeon.log" | tail -6
      echo "default run on the host CPU: exit ${PIPESTATUS[0]}, $((SECONDS - start)) s" | tee -a "$OUT/train_xeon.log"
      cp runs/reprorl/tiny-grpo/determinism.txt "$OUT/" 2>/dev/null
      tail -c 3000 runs/reprorl/tiny-grpo/metrics.jsonl > "$OUT/metrics_tail.jsonl" 2>/dev/null ;;
  esac
done
