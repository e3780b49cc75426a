"""The code example's path end to end (issue 57): a short GRPO run on the project's code task,
its rewards from programs run in the sandbox, gives the same bits when run again, on 1 or 4
sandbox workers (reward.num_workers), and when a sandbox worker is killed mid-run."""

import logging

import pytest

from reprorl import cli
from reprorl.actors.supervision import KILL_ENV
from reprorl.data.code_tasks import write_code_dataset
from small_run import small_run_overrides

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]


@pytest.fixture(scope="module")
def code_data(tmp_path_factory):
    return write_code_dataset(tmp_path_factory.mktemp("code-data"), seed=0)


def train(assets, code_data, run_dir, *overrides):
    code = (f"data.train_files=[{code_data['train']}]", f"data.val_files=[{code_data['val']}]", "reward.fn=null",
            "data.max_prompt_length=128", "data.max_response_length=24", "rollout.n=4", "actor.ppo_mini_batch_size=2",
            "actor.ppo_micro_batch_size=8")
    assert cli.main(["train", *small_run_overrides(assets, run_dir, *code, *overrides)]) == 0
    return run_dir


def test_code_runs_repeat_bitwise_across_reruns_worker_counts_and_a_killed_worker(
        assets, code_data, tmp_path, assert_bitwise_identical, monkeypatch, caplog):
    base = train(assets, code_data, tmp_path / "base")
    assert_bitwise_identical(base, train(assets, code_data, tmp_path / "again"), 2)
    assert_bitwise_identical(base, train(assets, code_data, tmp_path / "four", "reward.num_workers=4"), 2)
    monkeypatch.setenv(KILL_ENV, "rule-reward worker 1@score#3")  # mid-way through step 1's scoring
    with caplog.at_level(logging.WARNING, logger="reprorl.reward.rule_worker"):
        killed = train(assets, code_data, tmp_path / "killed", "reward.num_workers=2")
    assert any("rule-reward worker 1 died" in r.getMessage() for r in caplog.records)
    assert_bitwise_identical(base, killed, 2)
