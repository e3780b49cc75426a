"""DAPO's dynamic sampling (algorithm.filter_groups): which groups a step keeps, by hand;
then end to end on the tiny model, a run that drops groups reruns and resumes bitwise,
also when it is killed in the middle of filling a batch."""

import contextlib
import doctest
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reprorl.compare import compare_runs
from reprorl.config import load_config
from reprorl.protocol import Batch
from reprorl.trainer import dynamic_sampling
from reprorl.trainer.dynamic_sampling import FilterGroupsError, GroupFilter, merge_metrics, metric_values, varied_groups
from reprorl.trainer.generation import TEST_KILL_IN_FILL_ENV
from small_run import run_trainer, small_run_overrides

# --- which groups are kept, by hand ------------------------------------------------------


def test_doctests():
    assert doctest.testmod(dynamic_sampling).failed == 0


def test_varied_groups_by_hand():
    values = torch.tensor([0.5, 0.5, 0.5, 0.0, 0.5, 0.5, -1.0, -1.0, -1.0, 2.0, 3.0, 4.0])  # 4 groups of 3
    assert varied_groups(values, 3).tolist() == [False, True, False, True]


def test_metric_values_by_hand():
    scores = torch.tensor([0.5, 1.5, -1.0])
    rule = torch.tensor([1.0, 0.5, -1.0])
    assert torch.equal(metric_values("seq_reward", scores, rule), scores)
    assert torch.equal(metric_values("score", scores, rule), rule)
    assert metric_values("acc", scores, rule).tolist() == [1.0, 0.0, 0.0]
    assert torch.equal(metric_values("seq_reward", scores, None), scores)
    with pytest.raises(ValueError, match="needs the rule reward"):
        metric_values("acc", scores, None)


def test_merge_metrics_sums_times_and_counts_and_averages_means():
    merged = merge_metrics([{"timing/gen_s": 1.0, "reward/fn_errors": 2.0, "reward/rule_mean": 0.25},
                            {"timing/gen_s": 3.0, "reward/fn_errors": 0.0, "reward/rule_mean": 0.75}])
    assert merged == {"timing/gen_s": 4.0, "reward/fn_errors": 2.0, "reward/rule_mean": 0.5}


def _generation_batch(uids: list[str], n: int, scores: list[float]) -> tuple[Batch, torch.Tensor]:
    """Rows of groups of `n` (a a b b), each row's uid and score."""
    batch = Batch({"responses": torch.arange(len(scores)).unsqueeze(1)},
                  {"uid": [uid for uid in uids for _ in range(n)]})
    return batch, torch.tensor(scores)


def test_group_filter_keeps_the_first_varied_groups_in_generation_order():
    groups = GroupFilter("seq_reward", n=2, num_groups=3, max_gen_batches=0)
    batches = [
        (["a", "b", "c"], [1.0, 1.0, 0.0, 1.0, 0.0, 0.0], {"timing/gen_s": 1.0, "reward/rule_mean": 0.5}),  # b kept
        (["d", "e", "f"], [2.0, 2.0, 2.0, 2.0, 2.0, 2.0], {"timing/gen_s": 2.0, "reward/rule_mean": 2.0}),  # none
        (["g", "h", "i"], [0.0, 1.0, 3.0, 3.0, 5.0, 4.0], {"timing/gen_s": 3.0, "reward/rule_mean": 2.0}),  # g, i
    ]
    for i, (uids, scores, metrics) in enumerate(batches):
        batch, scores = _generation_batch(uids, 2, scores)
        baselines = scores + 10
        assert groups.add(batch, scores, None, baselines, metrics) == (i == 2)
    batch, scores, baselines, metrics = groups.result()
    assert list(batch.non_tensors["uid"]) == ["b", "b", "g", "g", "i", "i"]
    assert scores.tolist() == [0.0, 1.0, 0.0, 1.0, 5.0, 4.0]
    assert baselines.tolist() == [10.0, 11.0, 10.0, 11.0, 15.0, 14.0]
    assert metrics == {"timing/gen_s": 6.0, "reward/rule_mean": 1.5, "train/num_gen_batches": 3.0,
                       "train/groups_kept": 3.0, "train/groups_dropped": 6.0}


def test_group_filter_trims_the_groups_past_the_batch():
    groups = GroupFilter("seq_reward", n=2, num_groups=1, max_gen_batches=1)
    batch, scores = _generation_batch(["a", "b"], 2, [0.0, 1.0, 1.0, 0.0])
    assert groups.add(batch, scores, None, None, {})
    batch, scores, baselines, metrics = groups.result()
    assert list(batch.non_tensors["uid"]) == ["a", "a"] and scores.tolist() == [0.0, 1.0] and baselines is None
    assert metrics["train/groups_kept"] == 2.0 and metrics["train/groups_dropped"] == 0.0


def test_group_filter_stops_at_max_num_gen_batches_naming_the_key():
    groups = GroupFilter("acc", n=2, num_groups=2, max_gen_batches=2)
    batch, scores = _generation_batch(["a", "b"], 2, [0.0, 1.0, 0.0, 0.0])
    rule = torch.tensor([0.0, 1.0, 0.0, 0.0])  # a: one right, one wrong; b: both wrong
    assert not groups.add(batch, scores, rule, None, {})
    with pytest.raises(FilterGroupsError, match=r"^algorithm.filter_groups.max_num_gen_batches=2: after 2 "
                       r"generation batches, 1 of the data.train_batch_size=2 groups the step needs vary in acc "
                       r"\(in the other 3, all 2 samples had the same\)"):
        groups.add(batch, scores, torch.tensor([1.0, 1.0, 0.0, 0.0]), None, {})  # a: both right
    unlimited = GroupFilter("acc", n=2, num_groups=2, max_gen_batches=0)
    for _ in range(20):
        assert not unlimited.add(batch, scores, torch.zeros(4), None, {})


# --- end to end -----------------------------------------------------------------------------

REWARD_FN = f"{Path(__file__).parent / 'varied_reward.py'}:odd_answers_only"  # even answers' groups never vary
RECIPE = (f"reward.fn={REWARD_FN}", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
          "trainer.save_freq=1")


def _config(assets, run_dir, *extra):
    return load_config(None, small_run_overrides(assets, run_dir, *RECIPE, *extra))


def _metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight_run(assets, tmp_path_factory, ray_local):
    """Three steps of the recipe, never stopped: what the other runs compare with."""
    run_dir = tmp_path_factory.mktemp("dynamic-sampling") / "straight"
    run_trainer(_config(assets, run_dir, "trainer.total_steps=3"))
    return run_dir


@pytest.mark.slow
def test_dynamic_sampling_drops_groups_and_resumes_bitwise(assets, tmp_path, straight_run):
    """2 steps, then a resume to 3, equal a run of 3 (its first 2 steps a rerun of it); the run
    dropped groups and generated more than one batch in a step, and logs how many."""
    run_trainer(_config(assets, tmp_path / "resumed", "trainer.total_steps=2"))
    run_trainer(_config(assets, tmp_path / "resumed", "trainer.total_steps=3"))
    result = compare_runs(straight_run, tmp_path / "resumed")
    assert result.identical and result.common_steps == [1, 2, 3], result
    metrics = _metrics(straight_run)
    assert [m["train/num_gen_batches"] for m in metrics] == [m["rollout/num_generate_calls"] for m in metrics]
    assert sum(m["train/groups_dropped"] for m in metrics) > 0
    assert max(m["train/num_gen_batches"] for m in metrics) > 1
    for m in metrics:
        # every generation batch's groups are counted, and the step's 2 are among those kept
        assert m["train/groups_kept"] + m["train/groups_dropped"] == 2 * m["train/num_gen_batches"]
        assert m["train/groups_kept"] >= 2
    assert metrics[0]["rollout/log_prob_max_gap"] == 0.0  # the first step's check (actor.log_prob_check_freq)


@pytest.mark.slow
def test_a_run_killed_while_filling_a_batch_resumes_bitwise(assets, tmp_path, straight_run):
    """SIGKILL when step 3 is about to draw its third generation batch (TEST_KILL_IN_FILL_ENV),
    then resume: the same bits as the run never stopped. The step-2 checkpoint must hold how
    many prompts steps 1 and 2 drew, or step 3 would start from other prompts."""
    assert _metrics(straight_run)[2]["train/num_gen_batches"] >= 3  # so the kill lands mid-fill
    args = small_run_overrides(assets, tmp_path / "killed", *RECIPE, "trainer.total_steps=3")
    # Its own session: a SIGKILL to the group takes down whatever the driver started.
    killed = subprocess.Popen([sys.executable, "-m", "reprorl.cli", "train", *args], start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, TEST_KILL_IN_FILL_ENV: "3:2"})
    returncode = killed.wait(timeout=600)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(killed.pid, signal.SIGKILL)
    assert returncode == -signal.SIGKILL, killed.stderr.read()
    assert sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir()) == ["latest", "step_1", "step_2"]
    assert [m["step"] for m in _metrics(tmp_path / "killed")] == [1, 2]

    run_trainer(_config(assets, tmp_path / "killed", "trainer.total_steps=3"))
    result = compare_runs(straight_run, tmp_path / "killed")
    assert result.identical and result.common_steps == [1, 2, 3], result


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_a_step_short_of_groups_stops_the_run_naming_the_key(assets, tmp_path):
    """The untrained policy never solves the arithmetic task: every group's acc is 0 on all
    samples, so step 1 gives up after max_num_gen_batches, in one line naming the key."""
    cfg = _config(assets, tmp_path / "run", "reward.fn=null", "algorithm.filter_groups.metric=acc",
                  "algorithm.filter_groups.max_num_gen_batches=2")
    with pytest.raises(FilterGroupsError) as err:
        run_trainer(cfg)
    assert str(err.value) == (
        "step 1: algorithm.filter_groups.max_num_gen_batches=2: after 2 generation batches, 0 of the "
        "data.train_batch_size=2 groups the step needs vary in acc (in the other 4, all 2 samples had the same); is "
        "the data too hard or too easy for the policy? Raise the limit, or 0 for none; the run stopped. No checkpoint "
        "was saved before it.")
