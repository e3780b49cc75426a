"""`reprorl train` on one CUDA GPU (issue 14): bitwise reruns, replica counts, exact log-probs, resume.

Every run is a `reprorl train` process (its own Ray, which finds the GPU) of a short GRPO
run shaped like examples/gpu_arithmetic.yaml (bf16 mixed precision, full determinism, all
parts on the GPU) but on a tiny random policy and 4 steps of 4 prompts x 4 samples:
- run A (2 replicas, checkpoint every step) and its rerun B: `reprorl compare` bitwise;
- run C with 1 replica: identical to A;
- every step's `rollout/log_prob_max_gap` (trainer vs engine log-probs) is exactly 0.0 in run A,
  which recomputes them each step (`actor.log_prob_check_freq=1`); the others take the
  engine's for the loss and check only at their first step, so A = B also shows that the
  check leaves the bits alone;
- a run SIGKILLed after step 2 (TEST_KILL_AT_STEP_ENV) and resumed: identical to A;
- A's determinism report lists every part on cuda, with its CUDA settings, verdict "all agree".
Each of these runs twice: full fine-tuning, and LoRA (adapters alone train, the reference is
the base with them off, no ref workers).
A, B, C and the run to be killed start together and share the GPU (each process's start-up
is most of its time), so the module takes two runs' time, not five; that they agree while
sharing it is part of what is tested.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reprorl.compare import compare_runs
from reprorl.determinism_report import REPORT_FILE
from reprorl.trainer.fit import TEST_KILL_AT_STEP_ENV
from small_run import WITH_KL, small_run_overrides

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STEPS = 4
GPU_RUN = (
    "resources.device=cuda", "model.dtype=bfloat16", "full_determinism=true",
    "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=8",
    "rollout.num_replicas=2", f"trainer.total_steps={STEPS}", "trainer.save_freq=1",
)
MODES = {"full": (), "lora": ("model.lora_rank=8", "model.lora_alpha=16", "actor.lr=1e-3")}


def _start(assets, run_dir: Path, *extra: str, **env: str) -> subprocess.Popen:
    args = small_run_overrides(assets, run_dir, *GPU_RUN, *WITH_KL, *extra)  # the report lists a ref worker
    # stderr to a file, not a pipe: four runs at once, one waited on while the others write.
    log = run_dir.with_name(f"{run_dir.name}.{'resumed' if 'trainer.resume=auto' in extra else 'first'}.stderr")
    with open(log, "w") as err:
        # Its own session: a SIGKILL to the group takes down whatever the driver started.
        proc = subprocess.Popen([sys.executable, "-m", "reprorl.cli", "train", *args], start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, **env})
    proc.log = log
    return proc


def _wait(proc: subprocess.Popen, what: str) -> int:
    returncode = proc.wait(timeout=300)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # what the driver started and left behind, if anything
    assert returncode in (0, -signal.SIGKILL), f"{what}: exit {returncode}\n{proc.log.read_text()[-4000:]}"
    return returncode


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module", params=sorted(MODES))
def runs(assets, request, tmp_path_factory):
    """{name: (run dir, exit code)} of the four runs started together (module doc), and
    "mode": the mode's overrides."""
    root, mode = tmp_path_factory.mktemp(f"gpu_train_{request.param}"), MODES[request.param]
    started = {
        "a": _start(assets, root / "a", *mode, "actor.log_prob_check_freq=1"),
        "b": _start(assets, root / "b", *mode),
        "c": _start(assets, root / "c", *mode, "rollout.num_replicas=1"),
        "killed": _start(assets, root / "killed", *mode, **{TEST_KILL_AT_STEP_ENV: "2"}),
    }
    return {"mode": mode, **{name: (root / name, _wait(proc, f"run {name}")) for name, proc in started.items()}}


def _finished(runs, name: str) -> Path:
    run_dir, returncode = runs[name]
    assert returncode == 0, f"run {name} was killed"
    return run_dir


@pytest.fixture(scope="module")
def run_a(runs):
    return _finished(runs, "a")


def _assert_identical(a: Path, b: Path) -> None:
    result = compare_runs(a, b)
    assert result.identical and result.common_steps == list(range(1, STEPS + 1)), result


def test_rerun_is_bitwise_identical(runs, run_a):
    _assert_identical(run_a, _finished(runs, "b"))


def test_trainer_log_probs_equal_the_engines(run_a):
    gaps = [r["rollout/log_prob_max_gap"] for r in _metrics(run_a)]
    assert len(gaps) == STEPS and all(g == 0.0 for g in gaps), gaps


def test_one_replica_equals_two(runs, run_a):
    _assert_identical(run_a, _finished(runs, "c"))


def test_killed_and_resumed_equals_a_run_never_stopped(assets, runs, run_a):
    run_dir, returncode = runs["killed"]
    assert returncode == -signal.SIGKILL, "the run to be killed at step 2 finished"
    assert [r["step"] for r in _metrics(run_dir)] == [1, 2]
    resumed = _start(assets, run_dir, *runs["mode"], "trainer.resume=auto")
    assert _wait(resumed, "resumed run") == 0, "the resumed run was killed"
    _assert_identical(run_a, run_dir)


def test_determinism_report_lists_the_gpu_parts(runs, run_a):
    report = json.loads((run_a / REPORT_FILE).read_text())
    assert report["verdict"] == "full determinism: on, all parts agree", report["problems"]
    assert report["placement"]["device"] == "cuda"
    gpu_parts = [name for name in report["parts"] if name.startswith(("actor worker", "ref worker", "rollout replica"))]
    ref = [] if runs["mode"] else ["ref worker 0"]  # with LoRA the actor gives the reference log-probs
    assert sorted(gpu_parts) == ["actor worker 0", *ref, "rollout replica 0", "rollout replica 1"]
    for name in gpu_parts:
        info = report["parts"][name]
        assert info["device"].startswith("cuda"), (name, info["device"])
        assert info["dtype"] == "bfloat16" and info["batch_invariant"] is True, name
        assert info["cuda"]["tf32_matmul"] is False and info["cuda"]["cublas_workspace_config"], name
