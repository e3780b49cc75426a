"""`reprorl train` on one CUDA GPU (issue 14): bitwise reruns, replica counts, exact log-probs, resume.

Every run is a `reprorl train` process (its own Ray, which finds the GPU) of a short GRPO
run shaped like examples/gpu_arithmetic.yaml (bf16 mixed precision, full determinism, all
parts on the GPU) but on a tiny random policy and 4 steps of 4 prompts x 4 samples, so the
module's five runs fit in about three minutes of GPU time:
- run A (2 replicas, checkpoint every step) and its rerun B: `reprorl compare` bitwise;
- run C with 1 replica: identical to A;
- every step's `rollout/log_prob_max_gap` (trainer vs engine log-probs) is exactly 0.0;
- a run SIGKILLed after step 2 (TEST_KILL_AT_STEP_ENV) and resumed: identical to A;
- A's determinism report lists every part on cuda, with its CUDA settings, verdict "all agree".
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
from small_run import small_run_overrides

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


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from reprorl.data.synthetic import write_arithmetic_dataset
    from reprorl.models.tiny import make_tiny

    root = tmp_path_factory.mktemp("gpu_train")
    paths = write_arithmetic_dataset(root / "data", num_train=64, num_val=8, seed=0)
    return {"root": root, "train": paths["train"], "val": paths["val"],
            "policy": make_tiny(root / "policy", kind="policy", seed=0)}


def _start(assets, run_dir: Path, *extra: str, **env: str) -> subprocess.Popen:
    args = small_run_overrides(assets, run_dir, *GPU_RUN, *extra)
    # Its own session: a SIGKILL to the group takes down whatever the driver started.
    return subprocess.Popen([sys.executable, "-m", "reprorl.cli", "train", *args], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})


def _train(assets, run_dir: Path, *extra: str) -> Path:
    proc = _start(assets, run_dir, *extra)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()[-4000:]
    return run_dir


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run_a(assets):
    return _train(assets, assets["root"] / "a")


def _assert_identical(a: Path, b: Path) -> None:
    result = compare_runs(a, b)
    assert result.identical and result.common_steps == list(range(1, STEPS + 1)), result


def test_rerun_is_bitwise_identical(assets, run_a):
    _assert_identical(run_a, _train(assets, assets["root"] / "b"))


def test_trainer_log_probs_equal_the_engines(run_a):
    gaps = [r["rollout/log_prob_max_gap"] for r in _metrics(run_a)]
    assert len(gaps) == STEPS and all(g == 0.0 for g in gaps), gaps


def test_one_replica_equals_two(assets, run_a):
    _assert_identical(run_a, _train(assets, assets["root"] / "c", "rollout.num_replicas=1"))


def test_killed_and_resumed_equals_a_run_never_stopped(assets, run_a):
    run_dir = assets["root"] / "killed"
    killed = _start(assets, run_dir, **{TEST_KILL_AT_STEP_ENV: "2"})
    returncode = killed.wait(timeout=300)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(killed.pid, signal.SIGKILL)  # what the driver started and left behind, if anything
    assert returncode == -signal.SIGKILL, killed.stderr.read()[-4000:]
    assert [r["step"] for r in _metrics(run_dir)] == [1, 2]
    _train(assets, run_dir, "trainer.resume=auto")
    _assert_identical(run_a, run_dir)


def test_determinism_report_lists_the_gpu_parts(run_a):
    report = json.loads((run_a / REPORT_FILE).read_text())
    assert report["verdict"] == "full determinism: on, all parts agree", report["problems"]
    assert report["placement"]["device"] == "cuda"
    gpu_parts = [name for name in report["parts"] if name.startswith(("actor worker", "ref worker", "rollout replica"))]
    assert sorted(gpu_parts) == ["actor worker 0", "ref worker 0", "rollout replica 0", "rollout replica 1"]
    for name in gpu_parts:
        info = report["parts"][name]
        assert info["device"].startswith("cuda"), (name, info["device"])
        assert info["dtype"] == "bfloat16" and info["batch_invariant"] is True, name
        assert info["cuda"]["tf32_matmul"] is False and info["cuda"]["cublas_workspace_config"], name
