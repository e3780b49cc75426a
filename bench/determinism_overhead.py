"""What full determinism costs the default run: steps/s with `full_determinism=true` vs false.

Runs `reprorl train` (the embedded default run, as a user would) with the same config
except `full_determinism`, alternating: det, plain, det, plain, ... (`--rounds` pairs), so
a change of machine load hits both modes alike. Each run is a fresh process with its own
Ray and run directory. From each run's metrics.jsonl:
  - steps/s = training steps / sum of `timing/step_s` (rollout, reward, log-probs,
    advantages, updates and the weight push; validation and checkpoints excluded),
  - the median time per phase (`timing/gen_s`, `reward_s`, `old_log_prob_s`, `update_s`),
and the process's wall time (start-up, validation and checkpoints included).

The cost of determinism is `1 - det steps/s / plain steps/s` (target on this CPU: at most
25%), from the medians over rounds. With two rounds or more it also checks, with
`reprorl compare`, that the det runs are bitwise identical to each other. Prints a table
and writes bench/results/determinism_overhead.json. Run it on an otherwise idle machine
(the load average is recorded with each run); `--quick` (3 steps) only checks that it works.

    python bench/determinism_overhead.py                  # the default run's 30 steps, det vs plain
    python bench/determinism_overhead.py --rounds 2       # det, plain, det, plain
    python bench/determinism_overhead.py --quick          # smoke run
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "determinism_overhead.json"
PHASES = ("gen_s", "reward_s", "old_log_prob_s", "update_s", "step_s")


def train(run_dir: Path, full_determinism: bool, steps: int | None, extra: list[str]) -> dict:
    """One `reprorl train` process; returns its figures (raises with its log if it fails)."""
    overrides = [f"full_determinism={str(full_determinism).lower()}", f"trainer.run_dir={run_dir}", *extra]
    if steps is not None:
        overrides.append(f"trainer.total_steps={steps}")
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "reprorl.cli", "train", *overrides],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"reprorl train {' '.join(overrides)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_done = [r for r in records if r["step"] > 0]
    step_time = sum(r["timing/step_s"] for r in steps_done)
    return {
        "mode": "det" if full_determinism else "plain",
        "steps": len(steps_done),
        "steps_per_s": len(steps_done) / step_time,
        "step_time_s": step_time,
        "wall_s": wall,
        "val_s": sum(r.get("timing/val_s", 0.0) for r in records),
        "phase_median_s": {p: statistics.median(r[f"timing/{p}"] for r in steps_done) for p in PHASES},
        "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "run_dir": str(run_dir),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default: the default run's)")
    parser.add_argument("--rounds", type=int, default=1, help="det/plain pairs, alternated (default 1)")
    parser.add_argument("--quick", action="store_true", help="3 steps, 1 round: checks the script works")
    parser.add_argument("--out", default=str(RESULTS), help="where the JSON goes")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for both modes")
    args = parser.parse_args()
    steps = 3 if args.quick else args.steps
    rounds = 1 if args.quick else args.rounds

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from reprorl.compare import compare_runs
    from reprorl.config import load_config
    from reprorl.bootstrap.default_run import prepare_default_assets

    # The default data and warm-started policy are made once, before any timed run.
    prepare_default_assets(load_config(None, list(args.overrides)))
    runs = []
    with tempfile.TemporaryDirectory(prefix="reprorl-det-overhead-") as tmp:
        for r in range(rounds):
            for det in (True, False):
                run = train(Path(tmp) / f"{'det' if det else 'plain'}-{r}", det, steps, list(args.overrides))
                runs.append(run)
                ph = run["phase_median_s"]
                print(f"round {r} {run['mode']:5} {run['steps_per_s']:6.3f} steps/s  step {ph['step_s']:.3f} s "
                      f"(gen {ph['gen_s']:.3f}, reward {ph['reward_s']:.3f}, log-prob {ph['old_log_prob_s']:.3f}, "
                      f"update {ph['update_s']:.3f})  wall {run['wall_s']:.1f} s  load {run['load_avg_1min']}",
                      flush=True)
        det_dirs = [run["run_dir"] for run in runs if run["mode"] == "det"]
        det_identical = (all(compare_runs(det_dirs[0], d).identical for d in det_dirs[1:])
                         if len(det_dirs) > 1 else None)

    by_mode = {m: [run for run in runs if run["mode"] == m] for m in ("det", "plain")}
    sps = {m: statistics.median(run["steps_per_s"] for run in rs) for m, rs in by_mode.items()}
    phases = {m: {p: statistics.median(run["phase_median_s"][p] for run in rs) for p in PHASES}
              for m, rs in by_mode.items()}
    cost = 1 - sps["det"] / sps["plain"]
    summary = {
        "det_steps_per_s": round(sps["det"], 4),
        "plain_steps_per_s": round(sps["plain"], 4),
        "det_vs_plain": round(sps["det"] / sps["plain"], 3),
        "determinism_cost": round(cost, 3),
        "target_cost": 0.25,
        "meets_target": cost <= 0.25,
        "phase_median_s": {m: {p: round(v, 4) for p, v in ph.items()} for m, ph in phases.items()},
        "det_runs_bitwise_identical": det_identical,
    }
    print()
    print(f"{'phase':14} {'det s':>8} {'plain s':>8} {'det/plain':>9}")
    for p in PHASES:
        d, q = phases["det"][p], phases["plain"][p]
        print(f"{p:14} {d:8.3f} {q:8.3f} {d / q if q else float('nan'):9.2f}")
    print(f"\nsteps/s: det {sps['det']:.3f}, plain {sps['plain']:.3f}; determinism costs {cost:.1%} "
          f"(target <= 25%: {'met' if cost <= 0.25 else 'MISSED'})")
    if det_identical is not None:
        print(f"det runs bitwise identical to each other: {det_identical}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for run in runs:
        run.pop("run_dir")
    out.write_text(json.dumps({
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "steps": steps, "rounds": rounds, "overrides": args.overrides,
        "summary": summary, "runs": runs,
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
