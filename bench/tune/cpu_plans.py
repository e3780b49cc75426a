"""How the CPU linear should split its work on this machine: each plan timed, with MKL's time.

`reprorl.kernels.cpu.matmul_rows` (the linear) cuts its work into tasks of row vectors x
columns and K into blocks (its plan); the plan changes speed, never a bit
(tests/kernels/test_invariant_kernels.py::test_cpu_linear_plans_change_no_bit). This times
every plan of a small grid at each CPU bench linear (bench/kernels.py: the width-512
model's and Qwen2.5-0.5B's) at 16, 64 and 256 rows, float32, at the machine's threads, and
prints the default plan's time, the best plan's and MKL's (F.linear). A machine whose best
plans beat the default by much is where the default's rule needs to change.

    python bench/tune/cpu_plans.py [--threads N] [--rows 16 64 256] [--out bench/results/cpu_plans.json]

Prints a table and writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_kernels import cpu_linear_shapes, cpu_times_ms  # bench/kernels.py's (bench_kernels.py beside this file)
from reprorl.kernels import cpu


def plans(k: int, n: int, threads: int) -> list[tuple[int, int, int]]:
    """(kc, vecs, cols): K whole or in blocks of 128-512, tasks of 4..16 row vectors and of
    256 columns up to an even share of N a thread."""
    kcs = sorted({k, *(c for c in (128, 256, 512) if c < k)})
    share = -(-n // threads)
    cols = sorted({share, *(c for c in (256, 512, 1024) if c < share)})
    return list(itertools.product(kcs, (4, 8, 16), cols))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=7, help="timings per plan (the median is kept)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "cpu_plans.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    threads = torch.get_num_threads()
    results = {"machine": platform.processor() or platform.machine(), "threads": threads,
               "torch": torch.__version__, "lanes": cpu.rows_plan(16, 1, 1)["lanes"], "rows": []}
    print(f"{threads} threads, {results['lanes']} lanes", flush=True)
    print(f"{'linear':32s} {'M':>4s} {'MKL ms':>8s} {'default':>8s} {'best':>8s}  best plan (kc, vecs, cols)"
          "   default plan, register block")
    torch.manual_seed(0)
    for name, (k, n) in cpu_linear_shapes().items():
        w = torch.randn(n, k) * 0.02
        for m in args.rows:
            x = torch.randn(m, k)
            default = cpu.rows_plan(m, n, k)
            default_plan = (default["kc"], default["vecs"], default["cols"])
            block = f"{default['block_vecs']}x{default['block_cols']}"
            fns = {p: (lambda p=p: cpu.matmul_rows(x, w, p)) for p in plans(k, n, threads)}
            fns[default_plan] = lambda: cpu.matmul_rows(x, w)
            fns["mkl"] = lambda: F.linear(x, w)
            times = dict(zip(fns, cpu_times_ms(list(fns.values()), args.repeats, min_s=0.05)))
            mkl = times.pop("mkl")
            best = min(times, key=times.get)
            row = {"linear": f"{name} {k}->{n}", "M": m, "mkl_ms": mkl, "default_plan": default_plan,
                   "default_ms": times[default_plan], "best_plan": best, "best_ms": times[best],
                   "register_block": block, "plans": [{"plan": p, "ms": t} for p, t in times.items()]}
            results["rows"].append(row)
            print(f"{row['linear']:32s} {m:4d} {mkl:8.3f} {times[default_plan]:8.3f} {times[best]:8.3f}  "
                  f"{str(best):22s} {default_plan} {block}", flush=True)
    gain = [r["default_ms"] / r["best_ms"] for r in results["rows"]]
    print(f"best plan over the default: {min(gain):.2f}-{max(gain):.2f}x faster "
          f"({time.perf_counter() - start:.0f} s)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
