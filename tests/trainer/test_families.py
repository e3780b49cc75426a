"""A short GRPO run with a tiny model of each family (`models/tiny.py`'s TINY_FAMILIES) on
the CPU, full determinism on: run twice, the same bits; the rollout's log-probs equal the
trainer's (gap 0.0). The windowed families' prompts and responses cross their 16-token
window. qwen2, the default run's family, is every other end-to-end test's."""

import json

import pytest

from reprorl.config import load_config
from reprorl.models.tiny import TINY_FAMILIES, make_tiny
from small_run import run_trainer, small_run_overrides


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(set(TINY_FAMILIES) - {"qwen2"}))
def test_a_grpo_run_of_each_family_reruns_bitwise(family, assets, tmp_path, assert_bitwise_identical):
    policy = make_tiny(tmp_path / "policy", kind="policy", seed=3, family=family)
    runs = []
    for name in ("first", "again"):
        run_dir = tmp_path / name
        overrides = small_run_overrides(dict(assets, policy=policy), run_dir, "data.max_response_length=12")
        run_trainer(load_config(None, overrides))
        runs.append(run_dir)
    assert_bitwise_identical(*runs, steps=2)
    records = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "actor/pg_loss" in r]
    assert len(train) == 2 and train[0]["rollout/log_prob_max_gap"] == 0.0  # checked at the first step
