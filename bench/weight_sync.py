"""Trainer -> replica weight sync on one GPU: the host path against the device path (CUDA IPC).

    timeout 300 python3 bench/weight_sync.py --out bench/results/weight_sync.json    # one H200, Ray
    python3 bench/weight_sync.py --quick --out /tmp/weight_sync.json                 # CPU smoke run

An actor rank (`WorkerGroup`, bf16 weights, one process) and one built-in replica
(`ReplicaPool`) share the GPU through Ray GPU fractions, as `reprorl train` places them,
on the Qwen2.5-0.5B shape of bench/train_step.py with random weights. Timed (median of
`--repeats`, after one warm-up each), as the fit loop runs them (reprorl/trainer/weight_sync.py):
- host push: `named_weights` (rank 0 -> driver, CPU tensors) + `ReplicaPool.update_weights`;
- device push: `weight_sync.push_weights` to the replica on the actor's GPU (pack on the
  GPU, one IPC share, device-to-device copy, free);
- the fingerprint's digests: on rank 0 (`weight_digests`) and, as before, on the driver
  from `named_weights`;
- the engine's sleep + wake with its weights sent to the host and back, and kept on the GPU.
On the CPU (`--quick`, or no GPU) only the host path and the digests run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import QUICK, QWEN_05B, make_model_dir  # noqa: E402  (also puts the repo on sys.path)

import torch  # noqa: E402


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: allocator, Ray's first calls
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (a smoke run, no timings of worth)")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions of each part (the median is kept)")
    args = p.parse_args(argv)

    import ray

    from reprorl.fingerprint import tensor_digests
    from reprorl.rollout.replica import ReplicaPool
    from reprorl.trainer import weight_sync
    from reprorl.workers.group import WorkerGroup
    from reprorl.workers.optim import OptimArgs

    device = "cpu" if args.quick or not torch.cuda.is_available() else "cuda"
    shape = QUICK if args.quick else QWEN_05B
    gpus = 0.4 if device == "cuda" else 0
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    result: dict = {"device": device, "shape": shape, "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "seconds": {}}
    version = iter(range(1, 10**6))
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = make_model_dir(Path(scratch), shape, "bfloat16")
        actor = WorkerGroup("actor", 1, model_dir, optim=OptimArgs(lr=1e-6), seed=0, full_determinism=True,
                            dtype="bfloat16", device=device, num_gpus=gpus)
        pool = ReplicaPool(model_dir, 1, seed=0, full_determinism=True, max_num_seqs=64,
                           max_model_len=min(512, shape["max_position_embeddings"]), device=device,
                           dtype="bfloat16", num_gpus=gpus,
                           native_options={"gpu_memory_utilization": 0.3} if device == "cuda" else None)
        try:
            on_device = weight_sync.device_replicas(actor, pool)
            result["device_replicas"] = on_device
            result["weight_bytes"] = sum(t.numel() * t.element_size() for _, t in actor.named_weights())
            s = result["seconds"]
            s["host_push"] = timed(lambda: pool.update_weights(actor.named_weights(), version=next(version)),
                                   args.repeats)
            s["digests_on_rank0"] = timed(actor.weight_digests, args.repeats)
            s["digests_on_driver"] = timed(lambda: tensor_digests(actor.named_weights()), args.repeats)
            if on_device:
                s["device_push"] = timed(lambda: weight_sync.push_weights(actor, pool, next(version), on_device),
                                         args.repeats)
                s["sleep_wake_weights_to_host"] = timed(lambda: (pool.sleep(), pool.wake_up()), args.repeats)
                s["sleep_wake_weights_kept"] = timed(lambda: (pool.sleep(keep_weights=True), pool.wake_up()),
                                                     args.repeats)
            else:
                result["device_push"] = "not run: no replica on the actor's GPU"
        finally:
            pool.shutdown()
            actor.shutdown()
            ray.shutdown()
    gib = result["weight_bytes"] / 2**30
    print(f"weight sync on {device}: {gib:.2f} GiB of weights, replicas on the actor's GPU: {on_device}")
    for name, value in result["seconds"].items():
        print(f"  {name:28s} {value * 1e3:9.1f} ms")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
