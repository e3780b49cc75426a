"""Two weighted rule rewards, DAPO's overlong buffer and truncated responses masked out of
the loss, end to end on the tiny model: the run logs each function's mean and the
penalty, and a rerun is the same bits (`reprorl compare`)."""

import json
from pathlib import Path

import pytest

from reprorl.config import load_config
from small_run import run_trainer, small_run_overrides

# One Ray for the module (ray_local); conftest's `assets`: the shared data and tiny policy.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

REWARDS = Path(__file__).parent / "varied_reward.py"
RECIPE = (
    "reward.fn=null",
    f"reward.fns=[{{fn: '{REWARDS}:digit_share', weight: 1.0}}, {{fn: '{REWARDS}:short_answer', weight: 0.5}}]",
    "reward.overlong_buffer={enable: true, len: 4, penalty_factor: 1.0}",
    "actor.mask_truncated=true",
)


def test_weighted_rewards_with_overlong_buffer_rerun_bitwise(assets, tmp_path, assert_bitwise_identical):
    for run in ("first", "again"):
        run_trainer(load_config(None, small_run_overrides(assets, tmp_path / run, *RECIPE)))
    assert_bitwise_identical(tmp_path / "first", tmp_path / "again", 2)
    metrics = [json.loads(line) for line in (tmp_path / "first" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    for m in metrics:
        digits, short = m["reward/digit_share/mean"], m["reward/short_answer/mean"]
        assert 0 <= digits <= 1 and 0 < short <= 1
        assert m["reward/rule_mean"] == pytest.approx(digits + 0.5 * short, abs=1e-6)  # a mean of float32 sums
        # A random policy seldom stops within 8 tokens: most responses end in the buffer.
        assert m["reward/overlong_penalty_mean"] < 0
        assert m["reward/mean"] == pytest.approx(m["reward/rule_mean"] + m["reward/overlong_penalty_mean"], abs=1e-6)
