"""The default run's assets, and the slow gate: `reprorl train` with no arguments learns."""

import doctest
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reprorl.data.rewards import arithmetic_score
from reprorl.data.synthetic import make_arithmetic_rows
from reprorl.bootstrap import default_run
from reprorl.bootstrap.default_run import run_on_pairs


def test_doctests():
    assert doctest.testmod(default_run).failed == 0


def test_run_on_pairs_keep_the_answer_first_and_run_on_at_the_given_rate():
    rows = make_arithmetic_rows(2000, seed=0, split="train")
    pairs = run_on_pairs(rows, 0.7, seed=0)
    assert [messages for messages, _ in pairs] == [row["prompt"] for row in rows]
    run_on = 0
    for (_, target), row in zip(pairs, rows):
        answer, *rest = target.split("\n")
        assert answer == row["reward_model"]["ground_truth"]
        if rest:
            run_on += 1
            (problem,) = rest  # one more problem and its answer, e.g. "12+7=19"
            question, _, result = problem.partition("=")
            assert arithmetic_score("reprorl/arithmetic", result, str(eval(question)))  # noqa: S307 (digits and +/-)
    assert 0.65 < run_on / len(rows) < 0.75  # 2000 Bernoulli(0.7) draws: std 0.01
    # Such a target scores 0 under the task's reward: the policy has to learn to stop.
    assert arithmetic_score("reprorl/arithmetic", "12\n3+4=7", "12") == 0.0


def test_run_on_pairs_are_a_pure_function_of_their_arguments():
    rows = make_arithmetic_rows(64, seed=0, split="train")
    assert run_on_pairs(rows, 0.5, seed=3) == run_on_pairs(rows, 0.5, seed=3)
    assert run_on_pairs(rows, 0.5, seed=3) != run_on_pairs(rows, 0.5, seed=4)
    with pytest.raises(ValueError, match="run_on_fraction=1.5"):
        run_on_pairs(rows, 1.5, seed=0)


def _train(cwd: Path, *overrides: str) -> dict[int, float]:
    """`reprorl train` in `cwd` on the CPU, as a user runs it; its {step: val/accuracy}."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-m", "reprorl.cli", "train", *overrides], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    name = next((o.split("=", 1)[1] for o in overrides if o.startswith("trainer.experiment_name=")), "tiny-grpo")
    lines = [json.loads(line) for line in (cwd / f"runs/reprorl/{name}/metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["val/accuracy"] for line in lines if "val/accuracy" in line}


@pytest.fixture(scope="module")
def default_run_dir(tmp_path_factory):
    """Where the default run trained (its assets, made by it, stay there for the next run)."""
    cwd = tmp_path_factory.mktemp("default-run")
    return cwd, _train(cwd)


@pytest.mark.slow
def test_the_default_run_learns(default_run_dir):
    """The README's main job, as a user runs it: greedy validation accuracy gains >= 0.2.
    On the CPU even where there is a GPU (`resources.device: auto` would take it): the golden
    digests are the CPU run's bits."""
    cwd, accuracy = default_run_dir
    assert sorted(accuracy) == [0, 10, 20, 30]
    assert accuracy[30] >= accuracy[0] + 0.2, accuracy
    check_golden_digests(cwd / "runs/reprorl/tiny-grpo/fingerprints.jsonl")


@pytest.mark.slow
def test_the_default_run_learns_one_step_off(default_run_dir):
    """With trainer.max_staleness=1 (each batch made with the weights of two steps back while
    the step before trains) the default run still gains >= 0.2 in its 30 steps."""
    cwd, _ = default_run_dir
    accuracy = _train(cwd, "trainer.max_staleness=1", "trainer.experiment_name=tiny-grpo-async")
    assert sorted(accuracy) == [0, 10, 20, 30]
    assert accuracy[30] >= accuracy[0] + 0.2, accuracy


@pytest.mark.slow
def test_the_default_run_with_its_optimizer_offloaded_is_the_same_bits(default_run_dir):
    """actor.optimizer_offload=true (master, moments and gradient sums on the host: on the CPU
    the host is the device, so this checks the path and its threads) changes no bit of the
    default run's first 10 steps, a validation included: `reprorl compare` finds every field
    and parameter equal. (Its learning rate is constant, so a 10-step run's steps are the
    30-step run's; the other 20 would take a minute to check the same code again.)"""
    from reprorl.compare import compare_runs

    cwd, accuracy = default_run_dir
    offloaded = _train(cwd, "actor.optimizer_offload=true", "trainer.total_steps=10",
                       "trainer.experiment_name=tiny-grpo-offload")
    assert offloaded == {step: accuracy[step] for step in (0, 10)}
    result = compare_runs(cwd / "runs/reprorl/tiny-grpo", cwd / "runs/reprorl/tiny-grpo-offload")
    # The 30-step run has 20 steps more; the 10 both have are equal digest for digest.
    assert result.divergence is None and result.common_steps == list(range(1, 11)), result
    assert result.only_in_a == list(range(11, 31)) and not result.only_in_b and result.digests_compared > 0, result

GOLDEN = Path(__file__).with_name("golden_default_run.json")
WRITE_GOLDEN_ENV = "REPRORL_WRITE_GOLDEN"


def golden_steps(fingerprints: Path, steps: int = 3) -> dict[str, dict]:
    """The first `steps` steps of a run's fingerprints: each field's digest and the parameters'."""
    out = {}
    for line in fingerprints.read_text().splitlines()[:steps]:
        record = json.loads(line)
        out[str(record["step"])] = {"fields": record["fields"], "params_digest": record["params_digest"]}
    return out


def check_golden_digests(fingerprints: Path) -> None:
    """The default run's first 3 steps have the bits recorded in golden_default_run.json, on
    any x86-64 CPU. A change that moves them on purpose rewrites the file
    (REPRORL_WRITE_GOLDEN=1 and this test) and says why in its commit."""
    steps = golden_steps(fingerprints)
    if os.environ.get(WRITE_GOLDEN_ENV) == "1":
        GOLDEN.write_text(json.dumps({"steps": steps}, indent=1, sort_keys=True) + "\n")
        pytest.fail(f"wrote {GOLDEN.name}: commit it with a message saying why the default run's bits moved")
    golden = json.loads(GOLDEN.read_text())["steps"]
    for step, want in golden.items():
        got = steps[step]
        moved = [name for name in want["fields"] if got["fields"].get(name) != want["fields"][name]]
        assert not moved and got["params_digest"] == want["params_digest"], (
            f"the default run's step {step} moved: fields {moved or 'equal'}, parameters "
            f"{'equal' if got['params_digest'] == want['params_digest'] else 'differ'}; if on purpose, "
            f"rerun this test with {WRITE_GOLDEN_ENV}=1 and say why in the commit"
        )


def test_the_gpu_policy_is_refused_without_a_gpu(tmp_path, monkeypatch):
    import torch

    from reprorl.errors import ConfigError
    from reprorl.bootstrap.default_run import make_gpu_policy

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"model.path=.*made on a GPU"):
        make_gpu_policy(tmp_path / "gpu-policy", tmp_path / "train.parquet")
    assert not (tmp_path / "gpu-policy").exists()
