#!/usr/bin/env bash
# rollout.backend=vllm on the GPU machine, after bench/vllm_gpu_wheels.sh install: short runs of
# examples/gpu_arithmetic.yaml (full determinism, so VLLM_BATCH_INVARIANT=1 in every engine)
# compared with `reprorl compare`. Steps (default: twice 1vs2):
#   twice   two runs with the example's 2 replicas
#   1vs2    a run with 1 replica against the first of `twice`
#   lora    two runs with LoRA (rank 8): the replicas take the merged weights
# STEPS_N: training steps a run (3). Logs and metrics into $OUT; one line a result in $OUT/summary.txt.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results/vllm_gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH
runs=/tmp/vllm-runs
n=${STEPS_N:-3}
common=(examples/gpu_arithmetic.yaml rollout.backend=vllm rollout.vllm_kv_cache_gib=2 rollout.vllm_enforce_eager=true
        trainer.total_steps="$n" trainer.test_freq="$n" trainer.save_freq=0 trainer.resume=never)
summary() { tee -a "$OUT/summary.txt"; }

train() {  # name, overrides...
  local name=$1; shift
  local t=$SECONDS
  python3 -m reprorl.cli train "${common[@]}" trainer.run_dir="$runs/$name" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  cp "$runs/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
  cp "$runs/$name/determinism.json" "$OUT/$name.determinism.json" 2>/dev/null
  echo "[$name] rc=$rc in $((SECONDS - t)) s; $(grep -o '"rollout/log_prob_max_gap": [0-9.e-]*' "$runs/$name/metrics.jsonl" 2>/dev/null | tail -1)" | summary
  [ $rc -eq 0 ] || tail -40 "$OUT/$name.log"
  return $rc
}

compare() {  # a, b
  echo "[compare $1 $2] $(python3 -m reprorl.cli compare "$runs/$1" "$runs/$2" 2>&1 | tail -12 | tr '\n' ' ')" | summary
}

steps=${*:-twice 1vs2}
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())" | summary
for step in $steps; do
  case $step in
    twice) train a2 && train b2 && compare a2 b2 ;;
    1vs2)  train a1 rollout.num_replicas=1 && compare a1 a2 ;;
    lora)  train la model.lora_rank=8 model.lora_alpha=16 && train lb model.lora_rank=8 model.lora_alpha=16 \
             && compare la lb ;;
    *) echo "unknown step $step" | summary ;;
  esac
done
python3 - "$OUT" <<'PY' | summary
import json, sys, glob, os
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.determinism.json"))):
    report = json.load(open(path))
    part = report.get("parts", {}).get("rollout replica 0", {})
    print(os.path.basename(path), report.get("verdict"), {k: part.get(k) for k in ("backend", "batch_invariant", "max_num_seqs")})
PY
