"""The policy losses users bring from verl (actor.policy_loss: gspo, cispo, clip_cov, kl_cov), and the tool
loop with a user's tool file, end to end on the tiny model: each trains, its engine log-probs stay the
trainer's, and a new run resumed from step 2's checkpoint trains step 3 to the same bits as the run that went
straight through (it starts from that run's checkpoint, as a run stopped after step 2 would from its own: the
checkpoint is written before step 3 either way; two runs, not three, since a run is nearly all start-up)."""

import json
from pathlib import Path

import pytest

from reprorl.compare import compare_runs
from reprorl.config import load_config
from small_run import run_trainer, small_run_overrides

# One Ray for the module (ray_local); conftest's `assets`: the shared data and tiny policy.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

RECIPES = {
    "gspo": ("actor.policy_loss=gspo", "actor.clip_ratio_low=0.0003", "actor.clip_ratio_high=0.0004"),
    "cispo": ("actor.policy_loss=cispo", "actor.clip_ratio_low=0.8", "actor.clip_ratio_high=0.28"),
    # a wide band and share, so the tiny run's small covariances choose tokens every step
    "clip_cov": ("actor.policy_loss=clip_cov", "actor.clip_cov_ratio=0.2", "actor.clip_cov_lb=-100",
                 "actor.clip_cov_ub=100"),
    "kl_cov": ("actor.policy_loss=kl_cov", "actor.kl_cov_ratio=0.2", "actor.ppo_kl_coef=1.0"),
    # the random policy writes <tool_call> by chance: calls with garbage arguments, answered
    # with error messages in tool turns (the turns are checked in test_manager.py)
    "user_tool": ("rollout.agent_loop=tool", f"rollout.tools=[{Path(__file__).with_name('user_tools.py')}]",
                  "data.max_response_length=96", "rollout.n=4"),  # room and samples for turns that call
}




@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_trains_and_resumes_bitwise(assets, tmp_path, recipe):
    def config(run, *extra):
        return load_config(None, small_run_overrides(assets, tmp_path / run, *RECIPES[recipe],
                                                     "trainer.total_steps=3", "trainer.save_freq=1", *extra))

    run_trainer(config("whole", "actor.log_prob_check_freq=1"))  # the resumed run checks its first step only
    run_trainer(config("resumed", f"trainer.resume={tmp_path / 'whole' / 'checkpoints' / 'step_2'}"))
    result = compare_runs(tmp_path / "whole", tmp_path / "resumed")  # the resumed run has step 3 alone
    assert result.divergence is None and result.common_steps == [3] and result.only_in_b == [], result
    metrics = [json.loads(line) for line in (Path(tmp_path / "whole") / "metrics.jsonl").read_text().splitlines()]
    assert all(m["rollout/log_prob_max_gap"] == 0.0 for m in metrics)
    assert all(m["actor/grad_norm"] > 0 for m in metrics)
    if recipe.endswith("_cov"):  # tokens were chosen (dropped, or penalised) in every update
        assert all(m["actor/pg_clipfrac"] > 0 for m in metrics)
    if recipe == "user_tool":  # tool turns ran
        assert any(m["rollout/turns_mean"] > 1 for m in metrics)
