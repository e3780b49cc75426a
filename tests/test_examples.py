"""Every ready-made config in examples/ resolves: the docs cannot drift from the config."""

from pathlib import Path

import pytest

from reprorl.config import load_config

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))


def test_there_are_examples():
    assert {p.name for p in EXAMPLES} >= {"default.yaml", "ppo_critic.yaml", "remax.yaml", "rloo.yaml", "gsm8k.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_resolves(path):
    cfg = load_config(str(path), [])
    assert cfg.trainer.experiment_name
