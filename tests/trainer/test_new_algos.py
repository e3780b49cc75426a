"""The estimators and policy losses of issue 56 end to end on the tiny model: pass@k, OPO and GPG
advantages with the SAPO, GMPO, GPG and DPPO losses, each option in one 3-step run (an estimator and a
loss a run: a run is nearly all start-up), and the first pair rerun and compared bit for bit. GDPO
too, on two named reward functions (its reward terms reach the advantages), rerun alike."""

import json
import math
from pathlib import Path

import pytest

from reprorl.compare import compare_runs
from reprorl.config import load_config
from small_run import run_trainer, small_run_overrides

# One Ray for the module (ray_local); conftest's `assets`: the shared data and tiny policy.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

REWARDS = Path(__file__).parent / "varied_reward.py"
PAIRS = {
    "grpo_passk+sapo": ("algorithm.adv_estimator=grpo_passk", "actor.policy_loss=sapo",
                        "actor.loss_agg_mode=seq-mean-token-mean"),
    "opo+geo_mean": ("algorithm.adv_estimator=opo", "actor.policy_loss=geo_mean", "actor.clip_ratio_low=0.4",
                     "actor.clip_ratio_high=0.4"),
    "gpg+gpg": ("algorithm.adv_estimator=gpg", "actor.policy_loss=gpg"),
    "grpo+dppo": ("algorithm.adv_estimator=grpo", "actor.policy_loss=dppo"),
    "gdpo+vanilla": ("algorithm.adv_estimator=gdpo", "reward.fn=null",
                     f"reward.fns=[{{fn: '{REWARDS}:digit_share', weight: 1.0}}, "
                     f"{{fn: '{REWARDS}:short_answer', weight: 0.5}}]"),
}
RERUN = ("grpo_passk+sapo", "gdpo+vanilla")


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("pair", list(PAIRS))
def test_new_estimator_and_loss_train(assets, tmp_path, pair):
    def config(run):
        return load_config(None, small_run_overrides(assets, tmp_path / run, *PAIRS[pair], "trainer.total_steps=3"))

    run_trainer(config("a"))
    records = metrics(tmp_path / "a")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["actor/pg_loss"]) for r in records)
    assert sum(r["actor/grad_norm"] for r in records) > 0  # some step had a nonzero advantage
    if pair == "gdpo+vanilla":
        assert all("reward/short_answer/mean" in r for r in records)
        # whitened over the batch's tokens: mean 0 up to rounding (grpo's token mean is not)
        assert all(abs(r["advantages/mean"]) < 1e-6 for r in records), [r["advantages/mean"] for r in records]
    if pair in RERUN:
        run_trainer(config("b"))
        result = compare_runs(tmp_path / "a", tmp_path / "b")
        assert result.identical and result.common_steps == [1, 2, 3], result
