"""What bounded staleness buys: the same run with `trainer.max_staleness` = 0, 1, 2 side by side.

Runs `reprorl train` (the embedded default run unless overrides say otherwise) once per k
in each round, in turns (k0, k1, k2, k0, ...: `--rounds`), each a fresh process with its
own Ray and run directory, one after another from this process. From each run:
  - loop wall: the sum of `timing/wall_s`, each step's wall time from its start to its
    record (the wait for its batch, the training, the weight publish or push, validation;
    the checkpoint and the start-up left out), and its median per step;
  - the process's wall (start-up and checkpoints in);
  - CPU busy share: the whole machine's (/proc/stat, sampled every 0.2 s while it runs);
    GPU busy share: `torch.cuda.utilization()` sampled alike, where a GPU and pynvml are;
  - the mean `async/wait_s` (the trainer waiting for a batch) per step.
Then each k's loop wall as a ratio to k = 0's (medians over rounds; target for k = 1 on 2
CPU cores: <= 0.75), and, with two rounds or more, whether each k's runs compare bitwise
identical (`reprorl compare`). Prints a table and writes bench/results/async.json.

    python bench/async.py                          # the default run's 30 steps, k = 0, 1, 2
    python bench/async.py --rounds 2 --steps 10    # twice each, 10 steps
    python bench/async.py --quick                  # 3 steps: checks that it works
    python bench/async.py --ks 0 1 -- resources.device=cuda model.path=...   # overrides for every run
    python bench/async.py --shape 0.5b --steps 6 --ks 0 1     # one GPU: the 0.5B shape, 64 x 8, 128 + 256

`--shape S` (a bench/shapes.py entry) trains a random policy of that shape (drawn once, the
char tokenizer beside it, as bench/train_step.py makes it) on the GPU, bf16, on arithmetic
prompts padded with a system message to `--prompt-len` tokens (128), 64 prompts x 8 samples,
256 new tokens (a random policy rarely ends early), micro-batches of 64, one replica, no
validation: the step bench/train_step.py times, here through the whole trainer.
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
import threading
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "async.json"


class BusySampler:
    """The machine's CPU busy share, and the GPU's, sampled while a run goes (`with`)."""

    def __init__(self, period_s: float = 0.2) -> None:
        self.period_s, self.gpu = period_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _cpu_jiffies() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields) - idle, sum(fields)

    def _run(self) -> None:
        gpu = _gpu_utilization()
        while not self._stop.wait(self.period_s):
            if gpu is not None:
                self.gpu.append(gpu())

    def __enter__(self) -> BusySampler:
        self._cpu0 = self._cpu_jiffies()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        busy, total = (b - a for a, b in zip(self._cpu0, self._cpu_jiffies()))
        self.cpu_share = busy / total if total else float("nan")
        self.gpu_share = statistics.mean(self.gpu) / 100 if self.gpu else None


def _gpu_utilization():
    """A function giving the GPU's utilisation in percent, or None without a GPU or pynvml."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        torch.cuda.utilization()  # raises without pynvml
        return torch.cuda.utilization
    except Exception:  # noqa: BLE001 - any failure means: not measured
        return None


def shape_overrides(root: Path, shape: str, prompt_len: int) -> list[str]:
    """Model, data and batch overrides for `--shape` (module doc), made under `root`."""
    from shapes import QUICK, SHAPES  # bench/shapes.py: the script's folder is on sys.path
    from train_step import make_model_dir

    from reprorl.data.dataset import template_ids
    from reprorl.data.synthetic import make_arithmetic_rows, write_rows
    from reprorl.models.hf_io import load_tokenizer

    model = make_model_dir(root, {**SHAPES, "quick": QUICK}[shape], "bfloat16", "cpu")
    tokenizer = load_tokenizer(str(model))
    rows = make_arithmetic_rows(512, seed=0, split="train")
    for row in rows:  # a system message of filler brings each prompt to prompt_len tokens
        for pad in range(prompt_len, -1, -1):
            messages = [{"role": "system", "content": "x" * pad}, *row["prompt"]]
            if len(template_ids(tokenizer, messages)) <= prompt_len:
                row["prompt"] = messages
                break
    train = write_rows(rows, root / "train.parquet")
    return [f"model.path={model}", "model.dtype=bfloat16", "resources.device=cuda", f"data.train_files=[{train}]",
            "data.val_files=[]", "data.train_batch_size=64", "rollout.n=8", f"data.max_prompt_length={prompt_len}",
            "data.max_response_length=256", "actor.ppo_mini_batch_size=64", "actor.ppo_micro_batch_size=64",
            "rollout.num_replicas=1", "rollout.max_num_seqs=512", "trainer.val_before_train=false",
            "trainer.test_freq=0"]


def train(run_dir: Path, k: int, steps: int | None, extra: list[str]) -> dict:
    """One `reprorl train` process; returns its figures (raises with its log if it fails)."""
    overrides = [f"trainer.max_staleness={k}", f"trainer.run_dir={run_dir}", "trainer.save_freq=0", *extra]
    if steps is not None:
        overrides.append(f"trainer.total_steps={steps}")
    start = time.perf_counter()
    with BusySampler() as busy:
        proc = subprocess.run([sys.executable, "-m", "reprorl.cli", "train", *overrides],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"reprorl train {' '.join(overrides)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    done = [r for r in records if r["step"] > 0]
    walls = [r["timing/wall_s"] for r in done]
    return {
        "k": k, "steps": len(done), "loop_wall_s": sum(walls), "step_wall_median_s": statistics.median(walls),
        "process_wall_s": wall, "cpu_busy_share": busy.cpu_share, "gpu_busy_share": busy.gpu_share,
        "wait_mean_s": statistics.mean(r.get("async/wait_s", 0.0) for r in done),
        "train_step_median_s": statistics.median(r["timing/step_s"] for r in done),
        "gen_median_s": statistics.median(r["timing/gen_s"] for r in done),
        "val_accuracy": {r["step"]: r["val/accuracy"] for r in records if "val/accuracy" in r},
        "run_dir": str(run_dir),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default: the config's)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each k, in turns (default 1)")
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2], help="the staleness values (0 first)")
    parser.add_argument("--quick", action="store_true", help="3 steps, 1 round: checks the script works")
    parser.add_argument("--shape", default=None, help="a bench/shapes.py shape on the GPU (module doc), e.g. 0.5b; quick: a tiny one")
    parser.add_argument("--prompt-len", type=int, default=128, help="with --shape: prompt tokens (128)")
    parser.add_argument("--out", default=str(RESULTS), help="where the JSON goes")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args()
    steps = 3 if args.quick else args.steps
    rounds = 1 if args.quick else args.rounds
    if args.ks[0] != 0:
        parser.error("--ks: the first must be 0, the baseline of the ratios")

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from reprorl.compare import compare_runs
    from reprorl.config import load_config
    from reprorl.bootstrap.default_run import prepare_default_assets

    runs = []
    with tempfile.TemporaryDirectory(prefix="reprorl-async-") as tmp:
        if args.shape is not None:
            args.overrides = [*shape_overrides(Path(tmp), args.shape, args.prompt_len), *args.overrides]
        prepare_default_assets(load_config(None, list(args.overrides)))  # made once, before any timed run
        for r in range(rounds):
            for k in args.ks:
                run = train(Path(tmp) / f"k{k}-{r}", k, steps, list(args.overrides))
                runs.append(run)
                gpu = "" if run["gpu_busy_share"] is None else f", GPU busy {run['gpu_busy_share']:.0%}"
                acc = list(run["val_accuracy"].values())
                gpu += f", val/accuracy {acc[0]:.3f} -> {acc[-1]:.3f}" if acc else ""
                print(f"round {r} k={k}: loop {run['loop_wall_s']:7.2f} s ({run['steps']} steps, median step "
                      f"{run['step_wall_median_s']:.3f} s, waits {run['wait_mean_s']:.3f} s a step), process "
                      f"{run['process_wall_s']:.1f} s, CPU busy {run['cpu_busy_share']:.0%}{gpu}", flush=True)
        identical = {k: all(compare_runs(dirs[0], d).identical for d in dirs[1:]) if len(dirs) > 1 else None
                     for k in args.ks for dirs in [[run["run_dir"] for run in runs if run["k"] == k]]}

    loop = {k: statistics.median(run["loop_wall_s"] for run in runs if run["k"] == k) for k in args.ks}
    ratio = {k: loop[k] / loop[0] for k in args.ks}
    print(f"\n{'k':>2} {'loop wall s':>12} {'ratio to k=0':>13} {'CPU busy':>9} {'GPU busy':>9} {'reruns identical':>17}")
    for k in args.ks:
        mine = [run for run in runs if run["k"] == k]
        gpu = [run["gpu_busy_share"] for run in mine if run["gpu_busy_share"] is not None]
        print(f"{k:>2} {loop[k]:12.2f} {ratio[k]:13.3f} {statistics.median(run['cpu_busy_share'] for run in mine):9.0%} "
              f"{f'{statistics.median(gpu):.0%}' if gpu else '-':>9} {str(identical[k]):>17}")
    if 1 in ratio:
        print(f"k=1 takes {ratio[1]:.3f}x the loop wall of k=0 (target on 2 CPU cores: <= 0.75: "
              f"{'met' if ratio[1] <= 0.75 else 'MISSED'})")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for run in runs:
        run.pop("run_dir")
    out.write_text(json.dumps({
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "steps": steps, "rounds": rounds, "overrides": args.overrides,
        "summary": {"loop_wall_s": loop, "ratio_to_k0": {k: round(v, 4) for k, v in ratio.items()},
                    "reruns_bitwise_identical": identical},
        "runs": runs,
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
