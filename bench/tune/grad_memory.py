"""Peak extra memory of summing a rank's micro-batch gradients: before and after issue 33.

    python3 bench/tune/grad_memory.py --params 100e6 --micro-batches 8 --out bench/results/grad_memory.json
    python3 bench/tune/grad_memory.py --device cuda --params 1e9 --micro-batches 8 --out /tmp/grad_memory_gpu.json

A stack of `--layers` square linear layers holding `--params` parameters in `--dtype`, and
M micro-batches of one row each (activations are negligible: the figures are the
reduction's). Schemes, each in a fresh process:
- "before": as `ShardWorker._step` did until issue 33: per micro-batch, backward into
  `.grad`, `flatten` to a new float32 `[padded]` vector, `tree_reduce` over them, then the
  one-rank reduce-scatter's copy (`fixed_order_reduce_scatter` cloned it).
- "after": `GradTree` (reprorl/workers/grad_tree.py) fed by post-accumulate-grad hooks, as
  `ShardWorker` now does: each parameter's `.grad` folded in and freed during the backward.
- "host1", "host2", "host3" (CUDA only): the same with at most k = 1, 2, 3 whole vectors on
  the device, the sums of 2^k or more micro-batches in pinned host memory
  (`model.gpu_gradient_vectors`). Before 2026-12-04 there was one host scheme, "after_host":
  every pending sum on the host, the device vectors of host1 at twice its PCIe copies.
Extra memory: on CUDA, `max_memory_allocated` above what the model held before the first
micro-batch; on the CPU, the peak resident set (ru_maxrss) above the resident set before
the first micro-batch (glibc's mmap threshold pinned, so freed vectors leave the process).
Every scheme's sum must have the same bits (its sha256 is in the JSON; a mismatch fails).

Measured (2026-12-04; the same bits in every row), peak extra GiB (float32 vectors), seconds:
- H200, 2.0B bf16 (7.45 GiB a vector), M=16: before 41.0 (5.51) 0.69 s; after 31.3 (4.20)
  0.51 s; after_host 9.8 (1.32) 16.3 s.
- H200, 1.0B fp32 (3.73 GiB a vector), M=6: before 18.7 (5.02) 0.21 s; after 11.7 (3.14)
  0.18 s; after_host 5.2 (1.39) 4.6 s.
- CPU (2 shared cores), 100M bf16 (0.37 GiB a vector), M=16: before 2.08 (5.58); after 1.57 (4.20).
"after" holds log2(M) vectors (`grad_tree.max_pending`) where "before" held log2(M) + 1
plus the bf16 `.grad` and the copy; "after_host" held the root only, and paid about one
second of PCIe copies per micro-batch per 7.45 GiB vector.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

GIB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--params", type=float, default=100e6, help="parameters of the model")
    p.add_argument("--layers", type=int, default=8, help="square linear layers holding them")
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches summed (M)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="the model's dtype")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # run one scheme, print its JSON
    return p.parse_args(argv)


def build(args: argparse.Namespace):
    from reprorl.workers.flat import FlatLayout

    width = int(math.sqrt(args.params / args.layers))
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    layers = [torch.nn.Parameter((torch.randn(width, width, generator=g) / width**0.5).to(dtype).to(args.device))
              for _ in range(args.layers)]
    layout = FlatLayout.of([(f"layer{i}", p) for i, p in enumerate(layers)], world_size=1)
    inputs = [torch.randn(1, width, generator=g).to(dtype).to(args.device) for _ in range(args.micro_batches)]
    return layers, layout, inputs


def loss_of(layers, x):
    for w in layers:
        x = torch.tanh(x @ w)
    return x.float().square().sum()


def run_before(layers, layout, inputs):
    from reprorl.workers.flat import flatten, tree_reduce

    def leaf(i: int):
        for p in layers:
            p.grad = None
        loss_of(layers, inputs[i]).backward()
        return flatten([p.grad for p in layers], layout, torch.float32)

    block = tree_reduce(0, len(inputs), leaf)
    for p in layers:
        p.grad = None
    return block.clone()  # the one-rank reduce-scatter's copy, as it was


def run_after(layers, layout, inputs, gpu_vectors: int):
    from reprorl.workers.grad_tree import GradTree, Parts

    tree = GradTree(0, len(inputs), Parts.of(layout), layers[0].device, gpu_vectors=gpu_vectors)
    active = {"on": False}

    def fold(index, param):
        if active["on"]:
            tree.add(index, param.grad)
            param.grad = None

    handles = [p.register_post_accumulate_grad_hook(lambda param, i=i: fold(i, param)) for i, p in enumerate(layers)]
    for x in inputs:
        tree.start_leaf(empty=False)
        active["on"] = True
        loss_of(layers, x).backward()
        active["on"] = False
        tree.finish_leaf()
    for h in handles:
        h.remove()
    return tree.result()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    layers, layout, inputs = build(args)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss_bytes()
    t0 = time.perf_counter()
    result = run_before(layers, layout, inputs) if args.child == "before" else run_after(
        layers, layout, inputs, gpu_vectors=int(args.child[4:]) if args.child.startswith("host") else 0)
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    seconds = time.perf_counter() - t0
    vector = layout.padded * 4
    digest = hashlib.sha256(result.cpu().numpy().tobytes()).hexdigest()
    return {"scheme": args.child, "peak_extra_gib": peak / GIB, "fp32_vectors": peak / vector, "seconds": seconds,
            "sha256": digest, "params": layout.numel, "fp32_vector_gib": vector / GIB}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    schemes = ["before", "after"] + (["host1", "host2", "host3"] if args.device == "cuda" else [])
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # big blocks are mmapped, and unmapped when freed
    record = {"params": args.params, "layers": args.layers, "micro_batches": args.micro_batches,
              "dtype": args.dtype, "device": args.device, "schemes": {}}
    for scheme in schemes:
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", scheme], env=env, check=True,
                             capture_output=True, text=True).stdout
        record["schemes"][scheme] = r = json.loads(out.strip().splitlines()[-1])
        print(f"{scheme:>10}: peak extra {r['peak_extra_gib']:.3f} GiB = {r['fp32_vectors']:.2f} float32 gradient "
              f"vectors of {r['fp32_vector_gib']:.3f} GiB; {r['seconds']:.2f} s", flush=True)
    digests = {r["sha256"] for r in record["schemes"].values()}
    record["same_bits"] = len(digests) == 1
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"same bits: {record['same_bits']}; wrote {args.out}")
    return 0 if record["same_bits"] else 1


if __name__ == "__main__":
    sys.exit(main())
