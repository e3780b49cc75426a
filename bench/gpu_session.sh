#!/usr/bin/env bash
# One call on the GPU machine: the chosen steps' tests and benchmarks, every log and JSON
# packed into $OUT/session.tgz (a call brings back at most 8 files) and a summary in
# $OUT/summary.txt, both rewritten after each step. Steps (default: all):
#   tests    the gpu kernel tests, and the kernel tests on CUDA and on the host CPU
#   bench    the kernel benchmarks on CUDA (SWEEP=1 adds the Triton tile sweep, at the row counts
#            SWEEP_ROWS, e.g. "64"; SKIP_OPS=1 leaves out the single ops; KERNEL_ARGS: more arguments,
#            e.g. "--profile-tokens 64 256")
#   xeon     the kernel benchmarks on the host CPU (XEON_ARGS: more arguments, e.g. "--profile-tokens 16 256")
#   cpuplans bench/tune/cpu_plans.py on the host CPU, at its 16 threads and at 1: how the CPU linear should
#            split its work there
#   cpublocks bench/tune/cpu_blocks.py on the host CPU, at its 16 threads and at 1: which register blocks
#            the CPU linear should run there (BLOCKS: the block sets, e.g. "8,12,8,6 8,14,8,6:2")
#   engine   the GPU engine's tests, bench/rollout.py --device cuda and its --profile of decode steps
#            (ROLLOUT_ARGS: more bench arguments, e.g. "--gpu-models qwen2.5-0.5b"; NO_PROFILE=1 skips it)
#   gputrain the one-GPU training and weight-sync tests, and bench/train_step.py
#   gputests the one-GPU training tests alone
#   trainstep bench/train_step.py alone (TRAIN_STEP_ARGS: more arguments, e.g. "--profile --skip-trl";
#            TRAIN_STEP_TIMEOUT: its limit, 300 s)
#   sharded  parameters sharded at rest on one GPU: its gpu tests (tests/workers/test_units.py), then
#            bench/train_step.py without and with --shard-params (SHARDED_ARGS: their arguments, default
#            the 0.5B shape, determinism on, one timed step; SHARDED_TESTS=0 skips the tests); both
#            JSONs record the weights' digest after the last step, to compare the two runs' bits
#   offload  optimizer offload: its gpu tests (the host's AdamW against the GPU's, a rank with and
#            without it), bench/train_step.py at the 0.5B shape without and with --optimizer-offload
#            (OFFLOAD_ARGS; their weights' digests after the last step, to compare the bits), then the 7B
#            shape's full fine-tuning step with it (OFFLOAD_7B_ARGS; OFFLOAD_7B=0 skips it, OFFLOAD_SMALL=0 the rest)
#   pytest   the tests named in PYTEST_ARGS (e.g. "tests/x.py -k 'y or z'", parsed as a shell line)
# A running test file's log is copied to $OUT/live.log (TEST_TIMEOUT: each test file's limit, 480 s;
# FAULT_S: a test running longer dumps its stacks, 120 s).
#   families every model family at its real shape against transformers (tests/models/test_real_shapes.py),
#            sliding-window attention on CUDA (all of tests/kernels/test_sliding_window.py), and the rollout
#            and train-step benchmarks of the Llama-3.2-1B and Gemma-3-1B shapes beside Qwen2.5-0.5B
#            (FAMILY_BENCH=rollout or trainstep: one of the two only, and no tests unless FAMILY_TESTS=1)
#   reward   the reward model on the GPU (its gpu test)
#   example  the GPU example (examples/gpu_arithmetic.yaml): its warm start and 30 steps
#   train    the default run on the host's CPU (its fingerprints.jsonl comes back: compare it with a run here)
#   cpubits  bench/cpu_bits.py on the host CPU: the warm start step by step and op by op, into
#            $OUT/cpu_bits.json (compare it with a run here: bench/cpu_bits.py --compare; CPU_BITS_ARGS:
#            more arguments, e.g. "--steps 300"; CPU_BITS_TIMEOUT: its limit, 420 s)
#   isa      on the host CPU: the CPU kernels built for x86-64, AVX2 and AVX-512 give the same bits
#            (tests/kernels/test_cpu_isa.py), cpu_math's golden digests, and the default run's
#   vllm     after bench/vllm_gpu_wheels.sh install (vLLM comes in three calls of its own, the machine
#            kept warm between them): bench/vllm_gpu.sh (VLLM_STEPS, default "twice 1vs2 lora"; STEPS_N
#            steps a run, 2) and bench/vllm_vs_native.py --gpu
# engine, gputrain, reward and train need Ray there: run ../shared/tools/device-wheels here first
# and carry .whl.
#   bash bench/gpu_session.sh [step ...]
# PARALLEL=1 runs the steps side by side, each into $OUT/<step>, and waits for them all.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
LOGS=$(mktemp -d)
mkdir -p "$OUT"
steps=${*:-tests bench xeon engine gputrain example train}
summary() { tee -a "$LOGS/summary.txt"; }

with_ray() {  # the wheels the GPU machine lacks (Ray, math-verify...), installed once per machine
  [ -f /tmp/site/.done ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site .whl/*.whl && touch /tmp/site/.done; } || return 1
  export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH
}

if [ -n "${PARALLEL:-}" ]; then
  # The steps side by side (tests, not benchmarks: those want the GPU alone), each in its
  # own $OUT/<step>; this waits for all of them, then joins their summaries.
  [ -d .whl ] && with_ray  # once, before the steps would each try to install
  for step in $steps; do
    OUT="$OUT/$step" PARALLEL= bash "$0" "$step" > "$LOGS/$step.stdout" 2>&1 &
  done
  wait
  for step in $steps; do cat "$OUT/$step/summary.txt" 2>/dev/null || echo "[$step] no summary"; done \
    > "$OUT/summary.txt"
  cat "$OUT/summary.txt"
  exit 0
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,memory.total --format=csv | summary
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.get_num_threads())" | summary
grep -m1 "model name" /proc/cpuinfo | summary

step_pair() {  # name_a, flag_a, name_b, flag_b, args: bench/train_step.py twice, then both runs' weights' digests
  local name flag
  for name in "$1" "$3"; do
    flag=$2; [ "$name" = "$3" ] && flag=$4
    timeout ${TRAIN_STEP_TIMEOUT:-300} python3 bench/train_step.py $5 $flag --out "$OUT/train_step_$name.json" \
      > "$LOGS/bench_train_step_$name.log" 2>&1
    echo "[$name] exit $?" | summary
    grep -v "^USDT\|^STAGE\|it/s\]" "$LOGS/bench_train_step_$name.log" | tail -8 | summary
  done
  python3 -c "import json, sys; d = [json.load(open(f)) for f in sys.argv[1:]]; \
    print('weights after the last step, $1 vs $3:', *[m['on'].get('weights_sha256', '-')[:16] for m in \
    [x.get('modes', x) for x in d]])" "$OUT/train_step_$1.json" "$OUT/train_step_$3.json" 2>&1 | summary
}

run_tests() {  # name, pytest args...
  # Verbose, with the stacks of a test still running after FAULT_S (a slow compile or a hang
  # shows where it is), and SIGINT at the limit so pytest reports what it finished. The log
  # is copied to $OUT/live.log as it grows, so a call cut short still brings it back.
  local name=$1; shift
  timeout -s INT "${TEST_TIMEOUT:-480}" python3 -m pytest -v -p no:cacheprovider -o "faulthandler_timeout=${FAULT_S:-120}" \
    --durations=10 "$@" > "$LOGS/$name.log" 2>&1 &
  local pid=$!
  while kill -0 $pid 2>/dev/null; do cp "$LOGS/$name.log" "$OUT/live.log"; sleep 10; done
  wait $pid; rm -f "$OUT/live.log"  # the step's session.tgz has it
  echo "[$name] $(tail -1 "$LOGS/$name.log")" | summary
  grep -E "(FAILED|ERROR|Timeout)" "$LOGS/$name.log" | head -20 | summary
}

for step in $steps; do
  start=$SECONDS
  case $step in
    tests)
      run_tests test_gpu tests/kernels/test_gpu.py
      run_tests test_kernels tests/kernels/test_invariant_kernels.py ;;
    bench)
      python3 bench/kernels.py ${SWEEP:+--sweep} ${SWEEP_ROWS:+--sweep-rows $SWEEP_ROWS} ${SKIP_OPS:+--skip-ops} ${KERNEL_ARGS:-} --out "$LOGS/kernels_cuda.json" > "$LOGS/bench_cuda.log" 2>&1
      grep -v "^  sweep" "$LOGS/bench_cuda.log" | tail -250 | summary ;;
    cpuplans)
      python3 bench/tune/cpu_plans.py --out "$LOGS/cpu_plans_xeon.json" > "$LOGS/cpu_plans.log" 2>&1
      python3 bench/tune/cpu_plans.py --threads 1 --out "$LOGS/cpu_plans_xeon_1.json" >> "$LOGS/cpu_plans.log" 2>&1
      grep -v "^wrote" "$LOGS/cpu_plans.log" | summary ;;
    cpublocks)
      python3 bench/tune/cpu_blocks.py ${BLOCKS:+--blocks $BLOCKS} --out "$LOGS/cpu_blocks_xeon.json" > "$LOGS/cpu_blocks.log" 2>&1
      python3 bench/tune/cpu_blocks.py ${BLOCKS:+--blocks $BLOCKS} --threads 1 --out "$LOGS/cpu_blocks_xeon_1.json" >> "$LOGS/cpu_blocks.log" 2>&1
      grep -v "^wrote" "$LOGS/cpu_blocks.log" | summary ;;
    xeon)
      # 15 timings each (the 5 of 2026-12-02 gave single linears from 0.12x to 5.95x MKL in one run)
      python3 bench/kernels.py --device cpu --repeats 15 ${XEON_ARGS:-} --out "$LOGS/kernels_xeon.json" \
        > "$LOGS/bench_xeon.log" 2>&1
      grep -v "^USDT\|warn" "$LOGS/bench_xeon.log" | tail -100 | summary ;;
    engine)
      with_ray || echo "no .whl: the engine tests that need Ray skip" | summary
      run_tests test_engine_gpu tests/rollout/test_engine_gpu.py
      timeout 400 python3 bench/rollout.py --device cuda ${ROLLOUT_ARGS:-} --out "$LOGS/rollout_cuda.json" \
        > "$LOGS/bench_rollout.log" 2>&1
      tail -40 "$LOGS/bench_rollout.log" | summary
      if [ -z "${NO_PROFILE:-}" ]; then
        timeout 200 python3 bench/rollout.py --device cuda --profile --out "$LOGS/rollout_profile.json" \
          > "$LOGS/rollout_profile.log" 2>&1
        grep -v "^USDT\|^STAGE" "$LOGS/rollout_profile.log" | tail -48 | summary
      fi ;;
    gputrain)
      with_ray || { echo "no .whl: skipping gputrain" | summary; continue; }
      run_tests test_weight_sync_gpu tests/trainer/test_weight_sync_gpu.py
      run_tests test_gpu_train tests/trainer/test_gpu_train.py
      timeout 300 python3 bench/train_step.py --out "$LOGS/train_step.json" > "$LOGS/bench_train_step.log" 2>&1
      tail -30 "$LOGS/bench_train_step.log" | summary ;;
    families)
      with_ray || echo "no .whl: the train-step bench skips" | summary
      if [ -z "${FAMILY_BENCH:-}" ] || [ -n "${FAMILY_TESTS:-}" ]; then
        run_tests families_gpu tests/models/test_real_shapes.py -m gpu
        # whole: its unmarked cases run on CUDA where there is one (DEV), beside the gpu ones
        run_tests sliding_window tests/kernels/test_sliding_window.py
      fi
      if [ "${FAMILY_BENCH:-rollout}" = rollout ]; then
        timeout 330 python3 bench/rollout.py --device cuda --budget-s 280 \
          --gpu-models qwen2.5-0.5b llama3.2-1b gemma3-1b --out "$OUT/rollout_families.json" \
          > "$LOGS/bench_rollout_families.log" 2>&1
        tail -40 "$LOGS/bench_rollout_families.log" | summary
      fi
      if [ "${FAMILY_BENCH:-trainstep}" = trainstep ]; then
        for shape in llama3.2-1b gemma3-1b; do
          timeout 280 python3 bench/train_step.py --shape $shape --skip-trl ${TRAIN_STEP_ARGS:-} \
            --out "$OUT/train_step_$shape.json" > "$LOGS/bench_train_step_$shape.log" 2>&1
          grep -v "^USDT\|^STAGE\|it/s\]" "$LOGS/bench_train_step_$shape.log" | tail -14 | summary
        done
      fi ;;
    gputests)
      with_ray || { echo "no .whl: skipping gputests" | summary; continue; }
      run_tests test_gpu_train tests/trainer/test_gpu_train.py ;;
    trainstep)
      with_ray || { echo "no .whl: skipping trainstep" | summary; continue; }
      # Straight into $OUT: a call cut short (its limit, or the session's device time) still
      # brings back what the bench printed and the JSON it rewrites after each part.
      timeout ${TRAIN_STEP_TIMEOUT:-300} python3 bench/train_step.py ${TRAIN_STEP_ARGS:-} --out "$OUT/train_step.json" \
        > "$OUT/bench_train_step.log" 2>&1
      cp "$OUT/train_step.json" "$OUT/bench_train_step.log" "$LOGS/" 2>/dev/null
      grep -v "^USDT\|^STAGE\|it/s\]" "$LOGS/bench_train_step.log" | tail -120 | summary ;;
    sharded)
      with_ray || { echo "no .whl: skipping sharded" | summary; continue; }
      [ "${SHARDED_TESTS:-1}" = 0 ] || run_tests test_units_gpu tests/workers/test_units.py -m gpu
      args=${SHARDED_ARGS:-"--shape 0.5b --prompts 32 --n 8 --micro-batch 16 --gradient-checkpointing --modes on --timed-steps 1 --skip-trl"}
      step_pair whole "" sharded --shard-params "$args" ;;
    offload)
      with_ray || echo "no .whl: the rank tests skip" | summary
      free -g | summary
      [ "${OFFLOAD_SMALL:-1}" = 0 ] || {
      run_tests test_offload_gpu tests/kernels/test_optim_math.py tests/workers/test_offload.py \
        tests/workers/test_optim.py -m gpu
      args=${OFFLOAD_ARGS:-"--shape 0.5b --prompts 32 --n 8 --micro-batch 32 --mini-batch 128 --modes on --timed-steps 1 --skip-trl"}
      step_pair device "" host --optimizer-offload "$args"; }
      [ "${OFFLOAD_7B:-1}" = 0 ] && continue
      args=${OFFLOAD_7B_ARGS:-"--shape 7b --prompts 32 --n 8 --micro-batch 32 --mini-batch 64 --gradient-checkpointing --optimizer-offload --modes on --timed-steps 1 --skip-trl"}
      timeout ${OFFLOAD_7B_TIMEOUT:-540} python3 bench/train_step.py $args --out "$OUT/train_step_7b_offload.json" \
        > "$LOGS/bench_train_step_7b_offload.log" 2>&1
      echo "[7b offload] exit $?" | summary
      grep -v "^USDT\|^STAGE\|it/s\]" "$LOGS/bench_train_step_7b_offload.log" | tail -12 | summary
      free -g | summary ;;
    pytest)
      with_ray || echo "no .whl: tests that need Ray skip" | summary
      eval "args=(${PYTEST_ARGS:?PYTEST_ARGS names the tests})"  # keeps a quoted -k expression whole
      run_tests pytest_args "${args[@]}" ;;
    reward)
      with_ray || { echo "no .whl: skipping reward" | summary; continue; }
      run_tests test_reward_gpu tests/reward/test_reward_model.py -m gpu ;;
    example)
      with_ray || { echo "no .whl: skipping example" | summary; continue; }
      timeout 420 python3 -m reprorl.cli train examples/gpu_arithmetic.yaml > "$LOGS/example.log" 2>&1
      echo "GPU example: exit $?, $((SECONDS - start)) s" | summary
      grep -E "warm|val/accuracy|verdict|step 30" "$LOGS/example.log" | tail -20 | summary
      cp runs/reprorl/gpu-grpo/determinism.txt "$LOGS/example_determinism.txt" 2>/dev/null
      cp runs/reprorl/gpu-grpo/metrics.jsonl "$LOGS/example_metrics.jsonl" 2>/dev/null ;;
    train)
      with_ray || { echo "no .whl: skipping train" | summary; continue; }
      # resources.device=cpu: left to auto, the run would take the GPU
      timeout 420 python3 -m reprorl.cli train resources.device=cpu > "$LOGS/train_xeon.log" 2>&1
      echo "default run on the host CPU: exit $?, $((SECONDS - start)) s" | summary
      tail -6 "$LOGS/train_xeon.log" | summary
      cp runs/reprorl/tiny-grpo/determinism.txt runs/reprorl/tiny-grpo/fingerprints.jsonl "$LOGS/" 2>/dev/null
      tail -c 3000 runs/reprorl/tiny-grpo/metrics.jsonl > "$LOGS/metrics_tail.jsonl" 2>/dev/null ;;
    cpubits)
      with_ray || { echo "no .whl: skipping cpubits" | summary; continue; }
      timeout "${CPU_BITS_TIMEOUT:-420}" python3 bench/cpu_bits.py --out "$OUT/cpu_bits.json" ${CPU_BITS_ARGS:-} > "$LOGS/cpu_bits.log" 2>&1
      echo "cpu_bits: exit $?" | summary; tail -2 "$LOGS/cpu_bits.log" | summary ;;
    isa)
      with_ray || echo "no .whl: the golden-digest test skips" | summary
      run_tests test_cpu_isa tests/kernels/test_cpu_isa.py tests/kernels/test_cpu_math.py
      run_tests golden tests/bootstrap/test_default_run.py -k learns ;;
    vllm)
      [ -f /tmp/site/vllm/__init__.py ] || { echo "no vLLM in /tmp/site: run bench/vllm_gpu_wheels.sh install" | summary; continue; }
      export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH
      STEPS_N=${STEPS_N:-2} OUT="$LOGS/vllm" bash bench/vllm_gpu.sh ${VLLM_STEPS:-twice 1vs2 lora} > "$LOGS/vllm_gpu.log" 2>&1
      grep "^\[" "$LOGS/vllm/summary.txt" | summary
      timeout 420 python3 bench/vllm_vs_native.py --gpu > "$LOGS/vllm_vs_native.log" 2>&1
      echo "vllm_vs_native: exit $?" | summary
      grep -A8 "^backend" "$LOGS/vllm_vs_native.log" | summary
      cp bench/results/vllm_vs_native_gpu.json "$LOGS/" 2>/dev/null ;;
    *) echo "unknown step $step" | summary ;;
  esac
  echo "== step $step: $((SECONDS - start)) s" | summary
  # After every step: a call cut short by its time limit still brings back the steps done.
  cp "$LOGS/summary.txt" "$OUT/"
  tar czf "$OUT/session.tgz" -C "$LOGS" .
done
