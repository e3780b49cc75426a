"""What data-parallel worker groups cost on the CPU: update time and peak memory per worker
for 1, 2 and 4 workers, and the fixed-order gradient reduction against plain collectives.

A width-512 model (Qwen2 layout: 2 layers, 8 heads of 64, 2 KV heads, MLP 1536, vocab 128,
float32; about 6.5M parameters), written from a seed into a temp dir. For each N:
  - `WorkerGroup("actor", N)`: one `update` of 32 samples (prompt 32 + response 32 tokens)
    in one mini-batch of micro-batches of 4 (8 micro-batches: N = 1, 2, 4 allowed), after
    one warm-up update; the median of `--repeats` updates; and each worker's peak resident
    memory (VmHWM of its process, read from /proc);
  - the reduction alone, on N gloo processes and a gradient of the model's size, each rank
    holding its 8 / N micro-batch gradients: reprorl's (a copy of each micro-batch gradient,
    as the worker flattens each into a new vector, the tree over them, then
    `fixed_order_reduce_scatter`, then the all-gather of the updated shard) against the
    plain ways (micro-batch gradients added in place in sequence, then `all_reduce`, as
    DDP, which has no shard to gather; or `reduce_scatter_tensor` + `all_gather`, as
    FSDP/ZeRO), the slowest rank's median of `--repeats` (at least 5).
Also checks that every N gave the same weights, bit for bit. Prints a table and writes
bench/results/data_parallel.json. The machine's load is recorded: on a 2-core machine N = 4
cannot be faster than N = 2, and other work on the machine shows in every figure.

    python bench/data_parallel.py                 # N = 1, 2, 4
    python bench/data_parallel.py --quick         # smoke run: one repeat
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

from reprorl.models.arch import ModelArgs
from reprorl.models.hf_io import save_model
from reprorl.models.tiny import init_weights
from reprorl.models.transformer import CausalLM
from reprorl.protocol import Batch
from reprorl.workers.group import WorkerGroup
from reprorl.workers.optim import OptimArgs
from reprorl.workers.policy import PolicyLossArgs

RESULTS = Path(__file__).resolve().parent / "results" / "data_parallel.json"
SAMPLES, PROMPT, RESPONSE, MICRO = 32, 32, 32, 4
MICRO_BATCHES = SAMPLES // MICRO


def width_512_args(layers: int = 2) -> ModelArgs:
    return ModelArgs(model_type="qwen2", vocab_size=128, hidden_size=512, intermediate_size=1536,
                     num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                     max_position_embeddings=2048, tie_word_embeddings=True, qkv_bias=True, torch_dtype="float32",
                     eos_token_id=1, pad_token_id=0)


def make_batch(seed: int = 0, samples: int = SAMPLES) -> Batch:
    """`samples` random rows of PROMPT + RESPONSE tokens (vocab 128), every token real."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 128, (samples, PROMPT), generator=g)
    responses = torch.randint(3, 128, (samples, RESPONSE), generator=g)
    mask = torch.ones(samples, PROMPT + RESPONSE, dtype=torch.long)
    return Batch({
        "prompts": prompts, "responses": responses, "response_mask": torch.ones(samples, RESPONSE, dtype=torch.long),
        "input_ids": torch.cat([prompts, responses], 1), "attention_mask": mask,
        "position_ids": mask.cumsum(1) - 1, "advantages": torch.randn(samples, RESPONSE, generator=g),
    })


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def bench_updates(model_dir: Path, num_workers: int, repeats: int) -> tuple[dict, dict]:
    group = WorkerGroup("actor", num_workers, model_dir, optim=OptimArgs(lr=1e-5), seed=0, full_determinism=True)
    try:
        batch = make_batch()
        batch["old_log_probs"] = group.compute_log_probs(batch, temperature=1.0, micro_batch_size=MICRO)
        step = {"ppo_epochs": 1, "mini_batch_size": SAMPLES, "micro_batch_size": MICRO,
                "max_response_length": RESPONSE, "loss": PolicyLossArgs(), "temperature": 1.0}
        group.update(batch, **step)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            group.update(batch, **step)
            times.append(time.perf_counter() - start)
        figures = {"update_s": statistics.median(times), "update_s_all": times,
                   "peak_rss_mib_per_worker": [peak_rss_mib(group.pids[r]) for r in range(num_workers)]}
        return figures, dict(group.named_weights())
    finally:
        group.shutdown()


class ReductionBench:
    """One gloo rank timing ways to sum 8 micro-batch gradients over the group (a Ray actor)."""

    def __init__(self, rank: int, world_size: int, numel: int):
        torch.set_num_threads(1)
        self.rank, self.world_size, self.numel = rank, world_size, numel

    def address(self) -> str:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return f"tcp://127.0.0.1:{s.getsockname()[1]}"

    def run(self, address: str, repeats: int) -> dict:
        import torch.distributed as dist

        from reprorl.workers.flat import FlatLayout, all_gather_shards, fixed_order_reduce_scatter, tree_reduce

        dist.init_process_group("gloo", init_method=address, rank=self.rank, world_size=self.world_size)
        group = dist.group.WORLD
        layout = FlatLayout.of([("grad", torch.empty(self.numel))], self.world_size)
        per_rank = MICRO_BATCHES // self.world_size
        g = torch.Generator().manual_seed(self.rank)
        grads = [torch.randn(layout.padded, generator=g) for _ in range(per_rank)]
        flat = torch.empty(layout.padded)

        def fixed():
            block = tree_reduce(0, per_rank, lambda i: grads[i].clone())
            shard = fixed_order_reduce_scatter(block, layout, group)
            all_gather_shards(shard, flat, layout, group)

        def all_reduce():
            total = grads[0].clone()
            for grad in grads[1:]:
                total.add_(grad)
            dist.all_reduce(total, group=group)

        def reduce_scatter():
            total = grads[0].clone()
            for grad in grads[1:]:
                total.add_(grad)
            shard = torch.empty(layout.shard_size)
            dist.reduce_scatter_tensor(shard, total, group=group)
            all_gather_shards(shard, flat, layout, group)

        out = {}
        for name, fn in (("fixed_order", fixed), ("all_reduce", all_reduce), ("reduce_scatter", reduce_scatter)):
            fn()  # warm-up
            times = []
            for _ in range(repeats):
                dist.barrier(group=group)
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            out[name] = statistics.median(times)
        dist.destroy_process_group()
        return out


def bench_reduction(num_workers: int, numel: int, repeats: int) -> dict:
    remote = ray.remote(ReductionBench).options(num_cpus=0)
    ranks = [remote.remote(r, num_workers, numel) for r in range(num_workers)]
    try:
        address = ray.get(ranks[0].address.remote())
        answers = ray.get([r.run.remote(address, repeats) for r in ranks])
    finally:
        for r in ranks:
            ray.kill(r)
    return {name: max(a[name] for a in answers) for name in answers[0]}  # the slowest rank sets the pace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one repeat: only checks that it runs")
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        model = CausalLM(width_512_args())
        init_weights(model, seed=0)
        numel = sum(p.numel() for p in model.parameters())
        model_dir = save_model(model, width_512_args(), Path(tmp) / "width-512")
        rows, weights = {}, {}
        for n in args.workers:
            load = os.getloadavg()[0]
            rows[n], weights[n] = bench_updates(model_dir, n, repeats)
            rows[n]["reduction_s"] = bench_reduction(n, numel, max(repeats, 5))
            rows[n]["load_avg_1min_before"] = load
    first = args.workers[0]
    same = all(all(torch.equal(weights[n][k], weights[first][k]) for k in weights[first]) for n in args.workers)
    print(f"width-512 model, {numel / 1e6:.2f}M parameters; {SAMPLES} samples x {PROMPT}+{RESPONSE} tokens, "
          f"{MICRO_BATCHES} micro-batches of {MICRO}; {os.cpu_count()} CPU cores; same weights for every N: {same}")
    print(f"{'N':>2} {'update s':>9} {'peak RSS MiB/worker':>22} {'fixed-order ms':>15} {'all_reduce ms':>14} "
          f"{'reduce_scatter ms':>18} {'load':>5}")
    for n, row in rows.items():
        red = row["reduction_s"]
        rss = "/".join(f"{m:.0f}" for m in row["peak_rss_mib_per_worker"])
        print(f"{n:>2} {row['update_s']:>9.3f} {rss:>22} {red['fixed_order'] * 1e3:>15.1f} "
              f"{red['all_reduce'] * 1e3:>14.1f} {red['reduce_scatter'] * 1e3:>18.1f} {row['load_avg_1min_before']:>5.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "model_parameters": numel, "samples": SAMPLES, "tokens": PROMPT + RESPONSE, "micro_batches": MICRO_BATCHES,
        "cpu_count": os.cpu_count(), "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__, "same_weights_for_every_n": same, "repeats": repeats,
        "by_num_workers": {str(n): row for n, row in rows.items()},
    }, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    ray.shutdown()


if __name__ == "__main__":
    main()
