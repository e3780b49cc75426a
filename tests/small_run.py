"""The config of the test suite's small end-to-end runs, shared by the modules that train.

Test modules cannot import each other (`--import-mode=importlib`); pyproject.toml puts
tests/ on the path for this module alone.
"""

from pathlib import Path

REWARD_FN = f"{Path(__file__).parent / 'trainer' / 'varied_reward.py'}:digit_share"
"""A rule reward with many values (share of digits in the answer), so advantages are not all zero."""

WITH_KL = ("actor.use_kl_loss=true",)
"""The KL-to-reference loss (the config's default), which `small_run_overrides` turns off: for
the runs that check the reference group or compare with a run that has one (conftest's
three_step_run)."""


def small_run_overrides(assets, run_dir, *extra: str) -> list[str]:
    """`reprorl train` overrides for a 2-step run on `assets` (policy, train, val paths):
    2 prompts x n=2, responses of 8 tokens, one rollout replica, no KL loss, no validation or
    checkpoints, metrics to run_dir/metrics.jsonl; `extra` overrides come last, so they win.

    One replica (the default is 2): a run this small is nearly all start-up, a replica is one
    more process to start, and the bits do not depend on the count. The runs that compare
    counts, or need more, say so (conftest's three_step_run, test_gates, test_faults, test_lora).

    No KL loss (the default has one): then no reference group, one process fewer to start
    (2-3 s of a run's ~10 on 2 cores), and the KL term is the same code whatever a run
    tests. The runs that check the reference or its KL term add `WITH_KL`."""
    return [
        f"model.path={assets['policy']}",
        f"data.train_files=[{assets['train']}]",
        f"data.val_files=[{assets['val']}]",
        f"reward.fn={REWARD_FN}",
        "data.train_batch_size=2", "data.max_response_length=8", "data.max_prompt_length=64",
        "rollout.num_replicas=1", "rollout.n=2", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=2",
        "critic.ppo_mini_batch_size=2", "critic.ppo_micro_batch_size=2",
        "actor.weight_decay=0.0", "critic.weight_decay=0.0", "actor.lr=1e-3", "critic.lr=1e-3",
        "actor.use_kl_loss=false", "trainer.total_steps=2", "trainer.test_freq=0", "trainer.save_freq=0",
        "trainer.val_before_train=false", "trainer.loggers=[jsonl]", f"trainer.run_dir={run_dir}",
        *extra,
    ]


def run_trainer(cfg):
    """Build a `Trainer` from `cfg`, fit it and close it (also when fit raises); returns it."""
    from reprorl.trainer.fit import Trainer

    trainer = Trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return trainer
