"""Start-up time of a run: from `Trainer(cfg)` to its first step, and the first step.

The Trainer starts the actor, reference and critic worker groups, the reward-model pool
and the rollout replicas; each process imports torch (and Triton) and runs the kernels'
batch-invariance check before it answers. This script times, in this one process:

    init_s        `Trainer(cfg)`: Ray started, every part started and ready
    to_step_s     `init_s` + resume + the determinism report: the first step begins here
    step_s        the first step (rollout, reward, log-probs, update, weight push)

    python bench/startup.py                         # the default run, one step
    python bench/startup.py rollout.num_replicas=1  # any `reprorl train` override

One run per call (a fresh Ray each time); call it a few times for a spread. Prints the
figures (and the run's log lines: the parts started, the determinism report) and appends them to `bench/results/startup.json` with the git commit, so runs
before and after a change sit in one file. CPU timings depend on how many cores are free.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "startup.json"
SHORT = ["trainer.total_steps=1", "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.save_freq=0",
         "trainer.loggers=[jsonl]"]


def main(overrides: list[str]) -> dict:
    from reprorl.config import load_config
    from reprorl.determinism import determinism_env
    from reprorl.fingerprint import FingerprintWriter
    from reprorl.trainer.default_run import prepare_default_assets
    from reprorl.trainer.fit import Trainer

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(None, [*SHORT, f"trainer.run_dir={run_dir}", *overrides])
        prepare_default_assets(cfg)
        os.environ.update(determinism_env(cfg.seed, cfg.full_determinism))  # as `train` does
        t0 = time.perf_counter()
        trainer = Trainer(cfg)
        init_s = time.perf_counter() - t0
        try:
            start = trainer.resume()
            trainer.fingerprints = FingerprintWriter(trainer.run_dir)  # the step writes one record
            trainer.report_determinism(start)
            to_step_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            trainer.train_step(1, next(trainer.sampler))
            step_s = time.perf_counter() - t1
        finally:
            trainer.close()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, cwd=Path(__file__).parent).stdout.strip())
    return {"commit": commit + ("+dirty" if dirty else ""), "overrides": overrides, "init_s": round(init_s, 2),
            "to_step_s": round(to_step_s, 2), "step_s": round(step_s, 2), "cpus": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0], "host": platform.node(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                           time.gmtime())}


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    record = main(sys.argv[1:])
    print(json.dumps(record))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    runs = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    RESULTS.write_text(json.dumps([*runs, record], indent=1) + "\n")
