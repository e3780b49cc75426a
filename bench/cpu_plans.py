"""How the CPU linear should split its work on this machine: each plan timed, with MKL's time.

`reprorl.kernels.cpu.matmul_nt` cuts a linear into tasks of rows x register blocks of
columns and K into blocks (its plan); the plan changes speed, never a bit
(tests/kernels/test_invariant_kernels.py::test_cpu_matmul_plans_change_no_bit). This times
every plan of a small grid at each CPU bench linear (bench/kernels.py: the width-512
model's and Qwen2.5-0.5B's) at 16, 64 and 256 rows, float32, at the machine's threads, and
prints the default plan's time, the best plan's and MKL's (F.linear). A machine whose best
plans beat the default by much is where the default's rule needs to change.

    python bench/cpu_plans.py [--threads N] [--rows 16 64 256] [--out bench/results/cpu_plans.json]

Prints a table and writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels import cpu_linear_shapes, cpu_time_ms  # noqa: E402
from reprorl.kernels import cpu  # noqa: E402


def plans(k: int, lanes: int, block_rows: int) -> list[tuple[int, int, int]]:
    """(kc, rows, col_blocks): k blocks of the default's, 256 or 128 floats (L1 or L2 sized
    panels), tasks of 16..64 rows, 1..16 register blocks of columns."""
    default_kc = cpu.nt_plan(1, 1, 1, k)["kc"]
    kcs = sorted({default_kc, *(c for c in (128, 256) if c < default_kc)})
    rows = [r for r in (16, 32, 64) if r % block_rows == 0]
    return [(kc, r, c) for kc, r, c in itertools.product(kcs, rows, (1, 2, 4, 8, 16)) if kc % lanes == 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=7, help="timings per plan (the median is kept)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_plans.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    machine = cpu.nt_plan(1, 1, 1, 1)
    results = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "lanes": machine["lanes"],
               "register_block": [machine["block_rows"], machine["block_cols"]], "rows": []}
    print(f"{torch.get_num_threads()} threads, {machine['lanes']} lanes, register block "
          f"{machine['block_rows']}x{machine['block_cols']}", flush=True)
    print(f"{'linear':32s} {'M':>4s} {'MKL ms':>8s} {'default':>8s} {'best':>8s}  best plan (kc, rows, col blocks)"
          "   default plan")
    torch.manual_seed(0)
    for name, (k, n) in cpu_linear_shapes().items():
        w = torch.randn(1, n, k) * 0.02
        for m in args.rows:
            x = torch.randn(1, m, k)
            default = cpu.nt_plan(1, m, n, k)
            default_plan = (default["kc"], default["rows"], default["col_blocks"])
            times = {p: cpu_time_ms(lambda p=p: cpu.matmul_nt(x, w, p), args.repeats)
                     for p in plans(k, machine["lanes"], machine["block_rows"])}
            times[default_plan] = cpu_time_ms(lambda: cpu.matmul_nt(x, w), args.repeats)
            mkl = cpu_time_ms(lambda: F.linear(x, w[0]), args.repeats)
            best = min(times, key=times.get)
            row = {"linear": f"{name} {k}->{n}", "M": m, "mkl_ms": mkl, "default_plan": default_plan,
                   "default_ms": times[default_plan], "best_plan": best, "best_ms": times[best],
                   "plans": [{"plan": p, "ms": t} for p, t in times.items()]}
            results["rows"].append(row)
            print(f"{row['linear']:32s} {m:4d} {mkl:8.3f} {times[default_plan]:8.3f} {times[best]:8.3f}  "
                  f"{str(best):28s} {default_plan}", flush=True)
    gain = [r["default_ms"] / r["best_ms"] for r in results["rows"]]
    print(f"best plan over the default: {min(gain):.2f}-{max(gain):.2f}x faster "
          f"({time.perf_counter() - start:.0f} s)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
