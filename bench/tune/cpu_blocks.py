"""Which register blocks the CPU linear should run on this machine: each block timed, with MKL's time.

`reprorl/kernels/csrc/cpu_linear.cpp` holds vectors of rows x columns of accumulators in a register
block (1 x RL1 .. 4 x RL4 columns with AVX-512); the block changes speed, never a bit (every
entry is one running sum over k in order). This builds the extension once per block set given
(`-D RL1=..`, in parallel), checks that each gives the built-in default's bits, and times the
CPU bench linears (bench/kernels.py: the width-512 model's and Qwen2.5-0.5B's) at each row
count, float32, at the machine's threads: the time summed over the linears, against MKL's.

    python bench/tune/cpu_blocks.py [--threads N] [--blocks 8,12,8,6 24,12,8,6 ...] [--out FILE]

Prints a table and writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_kernels import cpu_linear_shapes, cpu_times_ms  # bench/kernels.py's (bench_kernels.py beside this file)
from reprorl.kernels import build as kernel_build
from reprorl.kernels import cpu


def build(blocks: str):
    """cpu_linear.cpp alone with register blocks `blocks`: "RL1,RL2,RL3,RL4" and optionally
    ":R", the most row vectors a block (4 by default)."""
    cols, _, most = blocks.partition(":")
    flags = [f"-DRL{i + 1}={int(c)}" for i, c in enumerate(cols.split(","))] + ([f"-DRL_MAX={int(most)}"] if most else [])
    return kernel_build.build_linear_variant("blocks", flags)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--blocks", nargs="+",
                        default=["8,12,8,6", "12,12,8,6", "8,12,8,6:3", "8,12,8,6:2", "8,12,9,6:3", "8,14,8,6:2"],
                        help="RL1,RL2,RL3,RL4[:R]: the columns of the 1..4-vector blocks (AVX-512), and the most "
                             "vectors a block")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=9, help="timings per linear (the median is kept)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "cpu_blocks.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    with ThreadPoolExecutor(len(args.blocks)) as pool:  # (the compilers run as processes)
        modules = dict(zip(args.blocks, pool.map(build, args.blocks)))
    print(f"built {len(modules)} block sets in {time.perf_counter() - start:.0f} s; "
          f"{torch.get_num_threads()} threads", flush=True)
    torch.manual_seed(0)
    summed = {b: {m: 0.0 for m in args.rows} for b in ["mkl", *args.blocks]}
    rows = []
    for name, (k, n) in cpu_linear_shapes().items():
        w = torch.randn(n, k) * 0.02
        for m in args.rows:
            x = torch.randn(m, k)
            reference = cpu.matmul_rows(x, w)
            for blocks, module in modules.items():
                if not torch.equal(module.mm_rows(x, w, []), reference):
                    raise AssertionError(f"blocks {blocks} changed a bit at {name} M={m}")
            fns = {"mkl": lambda: F.linear(x, w),
                   **{blocks: (lambda module=module: module.mm_rows(x, w, [])) for blocks, module in modules.items()}}
            times = dict(zip(fns, cpu_times_ms(list(fns.values()), args.repeats, min_s=0.1)))
            for b, t in times.items():
                summed[b][m] += t
            rows.append({"linear": f"{name} {k}->{n}", "M": m, "ms": times})
    print(f"{'blocks':12s} " + " ".join(f"{'M=' + str(m):>12s}" for m in args.rows) + "   (summed ms, x MKL)")
    for b, per_m in summed.items():
        print(f"{b:12s} " + " ".join(f"{t:7.2f} {t / summed['mkl'][m]:4.2f}" for m, t in per_m.items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                               "torch": torch.__version__, "summed_ms": summed, "rows": rows}, indent=1))
    print(f"({time.perf_counter() - start:.0f} s) wrote {out}")


if __name__ == "__main__":
    main()
