"""What parameters sharded at rest (`model.shard_params`) save and cost on the CPU: per
worker, its resident memory at rest and its peak during an update, and the update's time,
for 1, 2 and 4 workers, with whole parameters (the ZeRO-2 style groups) and sharded ones.

A width-512 model (Qwen2 layout: 8 layers, 8 heads of 64, 2 KV heads, MLP 1536, vocab 128,
float32; about 25M parameters, 100 MB), written from a seed into a temp dir. For each N
and each mode: `WorkerGroup("actor", N)`, one warm-up update, then `--repeats` updates of
16 samples (prompt 32 + response 32 tokens) in one mini-batch of micro-batches of 2 (8
micro-batches). Per worker, read from /proc: the resident set after the warm-up (at rest:
the weights, master, AdamW moments and whatever the allocator kept), and the peak of the
timed updates (VmHWM, reset through /proc/<pid>/clear_refs before them). The workers run
with glibc's mmap threshold fixed at 64 KiB, so that a freed tensor goes back to the system
and the resident set follows what torch holds (`--mmap-threshold-kib 0`: glibc's own
threshold, which rises to the largest block freed, for the times a run sees). Also checks that every run gave the same
weights, bit for bit. Prints a table and writes bench/results/sharded_params.json.

The machine's load is recorded: on a 2-core machine N = 4 cannot be faster than N = 2.

    python bench/sharded_params.py                 # N = 1, 2, 4
    python bench/sharded_params.py --quick         # smoke run: one repeat, N = 1, 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch

from data_parallel import PROMPT, RESPONSE, make_batch, width_512_args  # noqa: E402  (bench/ is on sys.path)
from reprorl.models.hf_io import save_model
from reprorl.models.tiny import init_weights
from reprorl.models.transformer import CausalLM
from reprorl.workers.group import WorkerGroup
from reprorl.workers.optim import OptimArgs
from reprorl.workers.policy import PolicyLossArgs

RESULTS = Path(__file__).resolve().parent / "results" / "sharded_params.json"
LAYERS, SAMPLES, MICRO = 8, 16, 2  # prompts and responses of 32 tokens: data_parallel.py's


def status_mib(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} for pid {pid}")


def bench(model_dir: Path, num_workers: int, sharded: bool, repeats: int) -> tuple[dict, dict]:
    group = WorkerGroup("actor", num_workers, model_dir, optim=OptimArgs(lr=1e-5), seed=0, full_determinism=True,
                        shard_params=sharded)
    try:
        batch = make_batch(samples=SAMPLES)
        batch["old_log_probs"] = group.compute_log_probs(batch, temperature=1.0, micro_batch_size=MICRO)
        step = {"ppo_epochs": 1, "mini_batch_size": SAMPLES, "micro_batch_size": MICRO,
                "max_response_length": RESPONSE, "loss": PolicyLossArgs(), "temperature": 1.0}
        group.update(batch, **step)  # warm-up
        pids = [group.pids[r] for r in range(num_workers)]
        at_rest = [status_mib(pid, "VmRSS") for pid in pids]
        for pid in pids:
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            group.update(batch, **step)
            times.append(time.perf_counter() - start)
        figures = {"update_s": statistics.median(times), "update_s_all": times, "rss_at_rest_mib": at_rest,
                   "peak_rss_mib": [status_mib(pid, "VmHWM") for pid in pids]}
        return figures, dict(group.named_weights())
    finally:
        group.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one repeat, N = 1 and 2: only checks that it runs")
    parser.add_argument("--mmap-threshold-kib", type=int, default=64,
                        help="glibc's mmap threshold in the workers (module doc); 0: glibc's own, which moves")
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    workers = args.workers or ([1, 2] if args.quick else [1, 2, 4])
    if args.mmap_threshold_kib:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold_kib * 1024)  # Ray's workers inherit it
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    model_args = width_512_args(layers=LAYERS)
    rows: dict[str, dict] = {}
    weights = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = CausalLM(model_args)
        init_weights(model, seed=0)
        numel = sum(p.numel() for p in model.parameters())
        model_dir = save_model(model, model_args, Path(tmp) / "width-512")
        for n in workers:
            for sharded in (False, True):
                key = f"{n}-{'sharded' if sharded else 'whole'}"
                load = os.getloadavg()[0]
                rows[key], weights[key] = bench(model_dir, n, sharded, repeats)
                rows[key]["load_avg_1min_before"] = load
                print(f"  {key}: {rows[key]}", flush=True)
    first = next(iter(weights))
    same = all(all(torch.equal(w[k], weights[first][k]) for k in weights[first]) for w in weights.values())
    print(f"width-512 model, {LAYERS} layers, {numel / 1e6:.1f}M parameters ({numel * 4 / 2**20:.0f} MiB float32); "
          f"{SAMPLES} samples x {PROMPT}+{RESPONSE} tokens, {SAMPLES // MICRO} micro-batches of {MICRO}; "
          f"{os.cpu_count()} CPU cores; same weights for every run: {same}")
    print(f"{'N':>2} {'params':>8} {'update s':>9} {'at rest MiB/worker':>22} {'peak MiB/worker':>22} {'load':>5}")
    for key, row in rows.items():
        n, mode = key.split("-")
        rest = "/".join(f"{m:.0f}" for m in row["rss_at_rest_mib"])
        peak = "/".join(f"{m:.0f}" for m in row["peak_rss_mib"])
        print(f"{n:>2} {mode:>8} {row['update_s']:>9.3f} {rest:>22} {peak:>22} {row['load_avg_1min_before']:>5.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    out = RESULTS if args.mmap_threshold_kib == 64 else RESULTS.with_name(
        f"sharded_params_mmap{args.mmap_threshold_kib}.json")
    out.write_text(json.dumps({
        "model_parameters": numel, "layers": LAYERS, "samples": SAMPLES, "tokens": PROMPT + RESPONSE,
        "micro_batches": SAMPLES // MICRO, "cpu_count": os.cpu_count(),
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
        "same_weights_for_every_run": same, "repeats": repeats, "mmap_threshold_kib": args.mmap_threshold_kib,
        "runs": rows,
    }, indent=2) + "\n")
    print(f"wrote {out}")
    ray.shutdown()


if __name__ == "__main__":
    main()
